"""What one request may ask of the server: every limit a body is checked against before any work is
done for it, and the refusal each one gives (README's table lists them). Checked in the order of their
cost: counts and sizes first, then tokenizing (server/serving.py), then the engine's own validation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from engine import structured_output
from engine.errors import EngineOverloadedError
from engine.params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutputsParams
from server.errors import APIError, as_api_error, bad_param, short
from server.protocol import _SamplingRequest

MAX_N = 128  # samples per prompt
MAX_CHOICES = 256  # prompts x n in one request
MAX_LOGPROBS = 20
MAX_STOP = 64  # stop strings or stop token ids
MAX_STOP_CHARS = 1024  # each stop string: every new token is searched for each of them
# Logprob entries one whole (not streamed) response may hold: prompts x n x max_tokens x (top-N + 1).
MAX_LOGPROB_ENTRIES = 1 << 20
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# apply_chat_template's own parameters: a request's chat_template_kwargs may not set them.
TEMPLATE_CALL_PARAMS = frozenset(
    [
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    ]
)


def template_variables(template: str | None) -> frozenset[str] | None:
    """The variables a chat template reads, or None where jinja cannot parse it without transformers'
    extensions (then every name but TEMPLATE_CALL_PARAMS passes)."""
    import jinja2
    import jinja2.meta

    if template is None:
        return frozenset()
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return None


def structured_outputs(b: _SamplingRequest) -> StructuredOutputsParams | None:
    """A body's constraint: OpenAI's response_format or vLLM's structured_outputs, at most one of them."""
    rf = b.response_format
    if rf is None or rf.type == "text":
        return b.structured_outputs
    if b.structured_outputs is not None:
        raise APIError(400, "set response_format or structured_outputs, not both", "response_format")
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.type != "json_schema":
        raise APIError(
            400,
            f"response_format.type must be 'text', 'json_object' or 'json_schema' (got {short(rf.type)})",
            "response_format",
        )
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise APIError(400, "response_format.json_schema.schema is required", "response_format")
    return StructuredOutputsParams(json=rf.json_schema.schema)


def token_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys, so strings) keyed by int."""
    if logit_bias is None:
        return None
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    try:
        return {int(t): float(b) for t, b in logit_bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from None


def structured_param(b: _SamplingRequest) -> str:
    """The body field a constraint came from, for the error that refuses it."""
    rf = b.response_format
    return "structured_outputs" if rf is None or rf.type == "text" else "response_format"


LARGE_BODY = 64 << 10  # bytes: a request body this large is tokenized on the large lane
SMALL_LANE_BYTES = 16 << 20  # bodies whose work may wait for the small lane at once


class Lane:
    """One worker thread, set up by `start`, and the bytes of the request bodies whose work waits for it or
    runs on it: past `limit` a request is refused (429) before it queues, unless the lane is idle."""

    def __init__(self, name: str, limit: int, start: Callable[[], None] | None = None) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name, initializer=start)
        self.limit, self.pending = limit, 0

    async def run(self, fn: Callable[..., Any], args: tuple, size: int) -> Any:
        if self.pending and self.pending + size > self.limit:
            raise APIError(
                429,
                f"{self.pending} bytes of requests are waiting to be tokenized; retry later",
                type="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )
        self.pending += size
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.pending -= size


class RequestLimits:
    """The checks of one server: its model's context, the engine's room (`check_capacity`), and whether
    requests may bring their own chat template."""

    def __init__(
        self,
        max_model_len: int,
        chat_template: str | None,
        check_capacity: Callable[[int], None],
        trust_request_chat_template: bool = False,
    ) -> None:
        self.max_model_len, self.check_capacity = max_model_len, check_capacity
        self.trust_request_chat_template = trust_request_chat_template
        self.template_variables = template_variables(chat_template)

    def sampling_params(
        self,
        b: _SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        max_tokens_param: str = "max_tokens",
    ) -> SamplingParams:
        n = 1 if b.n is None else b.n
        mt = max_tokens_param
        stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
        stop_ids = list(b.stop_token_ids or [])
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N} (got {n})", "n")
        if not (max_tokens is None or max_tokens >= 1):
            raise APIError(400, f"{mt} must be at least 1 (got {max_tokens})", mt)
        if not (max_tokens is None or max_tokens <= self.max_model_len):
            raise APIError(
                400, f"{mt}={max_tokens} exceeds the model's context of {self.max_model_len} tokens", mt
            )
        if not (logprobs is None or 0 <= logprobs <= MAX_LOGPROBS):
            raise APIError(400, f"logprobs must be between 0 and {MAX_LOGPROBS} (got {logprobs})", "logprobs")
        if not (b.top_k is None or -1 <= b.top_k <= _INT32_MAX):
            raise APIError(400, f"top_k must be -1, 0 or positive (got {b.top_k})", "top_k")
        if not (b.min_tokens is None or 0 <= b.min_tokens <= _INT32_MAX):
            raise APIError(400, f"min_tokens must be non-negative (got {b.min_tokens})", "min_tokens")
        if not (b.seed is None or _INT64_MIN <= b.seed <= _INT64_MAX - MAX_N):
            raise APIError(400, "seed must be a signed 64-bit integer", "seed")
        if not (b.priority is None or _INT64_MIN <= b.priority <= _INT64_MAX):
            raise APIError(400, "priority must be a signed 64-bit integer", "priority")
        if len(stop) > MAX_STOP:
            raise APIError(400, f"at most {MAX_STOP} stop strings are allowed", "stop")
        if not all(len(s) <= MAX_STOP_CHARS for s in stop):
            raise APIError(400, f"a stop string may be at most {MAX_STOP_CHARS} characters long", "stop")
        if len(stop_ids) > MAX_STOP:
            raise APIError(400, f"at most {MAX_STOP} stop token ids are allowed", "stop_token_ids")
        if not all(0 <= t <= _INT32_MAX for t in stop_ids):
            raise APIError(400, "stop_token_ids must be token ids", "stop_token_ids")
        if not (b.prompt_logprobs is None or 0 <= b.prompt_logprobs <= MAX_LOGPROBS):
            raise APIError(
                400,
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS} (got {b.prompt_logprobs})",
                "prompt_logprobs",
            )
        if b.prompt_logprobs is not None and b.stream:
            raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")
        bad_words = list(b.bad_words or [])
        if len(bad_words) > MAX_STOP or not all(len(w) <= MAX_STOP_CHARS for w in bad_words):
            raise APIError(
                400, f"at most {MAX_STOP} bad words of at most {MAX_STOP_CHARS} characters", "bad_words"
            )
        structured = structured_outputs(b)
        try:
            return SamplingParams(
                n=n,
                max_tokens=max_tokens,
                logprobs=logprobs,
                stop=stop,
                stop_token_ids=stop_ids,
                seed=b.seed,
                priority=b.priority or 0,
                temperature=1.0 if b.temperature is None else b.temperature,
                top_p=1.0 if b.top_p is None else b.top_p,
                top_k=b.top_k or 0,
                min_p=b.min_p or 0.0,
                presence_penalty=b.presence_penalty or 0.0,
                frequency_penalty=b.frequency_penalty or 0.0,
                repetition_penalty=1.0 if b.repetition_penalty is None else b.repetition_penalty,
                min_tokens=b.min_tokens or 0,
                ignore_eos=bool(b.ignore_eos),
                include_stop_str_in_output=bool(b.include_stop_str_in_output),
                skip_special_tokens=True if b.skip_special_tokens is None else b.skip_special_tokens,
                structured_outputs=structured,
                logit_bias=token_biases(b.logit_bias),
                allowed_token_ids=b.allowed_token_ids,
                bad_words=bad_words,
                prompt_logprobs=b.prompt_logprobs,
            )
        except ValueError as e:
            raise bad_param(e) from None

    @staticmethod
    def check_structured(params: SamplingParams, param: str) -> None:
        """Compile the constraint's grammar once, without the tokenizer (run off the event loop): a schema
        the grammar library refuses is a 400 here, never an engine error."""
        if params.structured_outputs is not None:
            try:
                structured_output.check(params.structured_outputs)
            except ValueError as e:
                message = str(e)
                source = {"response_format": "response_format.json_schema.schema", "tools": "tools"}
                if param in source:
                    message = message.replace("structured_outputs.json", source[param])
                raise APIError(400, message, param) from None

    def check_size(self, prompts: int, params: SamplingParams, stream: bool) -> None:
        """Refuse, before any tokenizing, a request whose answer would be too large to build, or that
        the engine has no room for (429, before a stream's headers are sent)."""
        if prompts * params.n > MAX_CHOICES:
            raise APIError(
                400, f"prompts x n must be at most {MAX_CHOICES} (got {prompts} x {params.n})", "n"
            )
        if params.logprobs is not None and not stream:
            entries = prompts * params.n * (params.max_tokens or self.max_model_len) * (params.logprobs + 1)
            if entries > MAX_LOGPROB_ENTRIES:
                raise APIError(
                    400,
                    f"prompts x n x max_tokens x (logprobs + 1) = {entries} logprob entries exceeds the "
                    f"{MAX_LOGPROB_ENTRIES} one response may hold: stream it, or ask for fewer",
                    "logprobs",
                )
        if params.prompt_logprobs is not None:  # the echoed prompt's: up to the context per prompt
            entries = prompts * self.max_model_len * (params.prompt_logprobs + 1)
            if entries > MAX_LOGPROB_ENTRIES:
                raise APIError(
                    400,
                    f"prompts x max_model_len x (logprobs + 1) = {entries} prompt logprob entries exceeds "
                    f"the {MAX_LOGPROB_ENTRIES} one response may hold: send fewer prompts",
                    "logprobs",
                )
        try:
            self.check_capacity(prompts * params.n)
        except EngineOverloadedError as e:
            raise as_api_error(e, "") from None

    def template_kwargs(self, given: dict | None) -> dict:
        """A request's chat_template_kwargs, kept to the chat template's own variables: a request sends
        no template of its own (Jinja from anyone is a denial of service) unless the server trusts
        request templates, and sets none of apply_chat_template's parameters. Other names are dropped."""
        given = dict(given or {})
        template = given.pop("chat_template", None)
        if template is not None and not self.trust_request_chat_template:
            raise APIError(
                400,
                "chat_template_kwargs.chat_template: this server renders only its model's chat template "
                "(kiln serve --trust-request-chat-template accepts a request's own)",
                "chat_template_kwargs",
            )
        for name in given:
            if name in TEMPLATE_CALL_PARAMS:
                raise APIError(
                    400,
                    f"chat_template_kwargs may not set {name!r}, a parameter of the call itself",
                    "chat_template_kwargs",
                )
        variables = self.template_variables if template is None else template_variables(template)
        kept = {k: v for k, v in given.items() if variables is None or k in variables}
        return kept if template is None else {**kept, "chat_template": template}

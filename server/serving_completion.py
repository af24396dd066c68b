"""/v1/completions: one or more prompts (text or token ids), n samples each, whole or streamed."""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine.messages import TokenLogprobs
from engine.outputs import CompletionOutput, RequestOutput
from engine.params import SamplingParams
from server import replies
from server.errors import APIError
from server.limits import structured_param
from server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from server.serving import PromptIds, Serving
from server.streaming import ChoiceStream, has_news, usage_options


def _as_token_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def count_prompts(prompt: Any) -> int:
    """How many prompts `prompt` holds, counted before anything is tokenized."""
    if isinstance(prompt, list) and prompt and _as_token_ids(prompt) is None:
        return len(prompt)
    return 1


def parse_prompts(tokenize: Callable[[str], list[int]], prompt: Any, param: str) -> list[PromptIds]:
    """str, list[str], list[int] or list[list[int]]: checked here (a msgspec union has one array type)."""
    if isinstance(prompt, str):
        return [PromptIds(prompt, tokenize(prompt))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [PromptIds(p, tokenize(p)) for p in prompt]
        if (ids := _as_token_ids(prompt)) is not None:
            return [PromptIds(None, ids)]
        lists = [_as_token_ids(p) for p in prompt]
        if all(ids is not None for ids in lists):
            return [PromptIds(None, ids) for ids in lists]  # type: ignore[arg-type]
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, f"{param} must not be empty", param)
    raise APIError(
        400,
        f"{param} must be a string, a list of strings, a list of token ids or a list of "
        f"token-id lists (got {type(prompt).__name__})",
        param,
    )


class Echo(NamedTuple):
    """A streamed choice's echoed prompt: its text, its tokens' logprobs (when asked for) and the text
    offset of the first token after it."""

    text: str
    logprobs: CompletionLogprobs | None
    offset: int


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


class CompletionServing:
    def __init__(self, serving: Serving) -> None:
        self.s = serving

    async def create(self, request: Request) -> Response:
        s = self.s
        b: CompletionRequest = await s.read(request, CompletionRequest)
        max_tokens = 16 if b.max_tokens is msgspec.UNSET else b.max_tokens
        echo_only = bool(b.echo) and max_tokens == 0  # scoring a prompt (lm-eval): nothing generated
        params = s.limits.sampling_params(b, 1 if echo_only else max_tokens, b.logprobs)  # type: ignore[arg-type]
        if b.echo and b.logprobs is not None:  # the echoed prompt comes with its tokens' logprobs
            params = msgspec.structs.replace(params, prompt_logprobs=max(b.logprobs, b.prompt_logprobs or 0))
        s.limits.check_size(count_prompts(b.prompt), params, bool(b.stream))
        await s.offload(s.limits.check_structured, params, structured_param(b))
        prompts = await s.offload(parse_prompts, s.tokenize, b.prompt, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        prepared = [s.prepare(r, p.ids, params, b.cache_salt) for r, p in zip(ids, prompts)]
        gens = s.generate_all(prepared, bool(b.stream))
        body = functools.partial(
            CompletionResponse, id=rid, object="text_completion", created=int(time.time()), model=s.model_name
        )
        if b.stream:
            usage = usage_options(b.stream_options)
            echo, token_ids = bool(b.echo), bool(b.return_token_ids)
            return s.sse(self.chunks(body, prompts, params, gens, echo, echo_only, usage, token_ids))
        finals = await s.until_disconnected(request, s.collect(gens))
        shown = bool(b.echo or b.return_token_ids or b.prompt_logprobs is not None)
        entries = replies.size(finals, params.logprobs, shown)
        return await replies.respond(entries, self.whole, b, body, prompts, finals, params, echo_only)

    def whole(
        self,
        b: CompletionRequest,
        body: Callable[..., CompletionResponse],
        prompts: list[PromptIds],
        finals: list[RequestOutput],
        params: SamplingParams,
        echo_only: bool,
    ) -> CompletionResponse:
        """The reply not streamed (built off the event loop when large: server/replies.py)."""
        s, choices = self.s, []
        for i, (p, final) in enumerate(zip(prompts, finals)):
            prefix = self.echo_text(p) if b.echo else ""
            for c in final.outputs:
                if echo_only:
                    c.text, c.token_ids, c.logprobs = "", [], [] if c.logprobs is not None else None
                logprobs = None
                if params.logprobs is not None:
                    ids, lps = c.token_ids, c.logprobs or []
                    if final.prompt_logprobs is not None:
                        echoed = [e and (e[0], e[1][: params.logprobs]) for e in final.prompt_logprobs]
                        ids, lps = p.ids + ids, echoed + lps
                    logprobs, _ = s.tokens.completion_logprobs(ids, lps, 0)
                choice = CompletionChoice(
                    index=i * params.n + c.index,
                    text=prefix + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                if b.return_token_ids:
                    choice.prompt_token_ids, choice.token_ids = p.ids, c.token_ids
                if b.prompt_logprobs is not None:
                    choice.prompt_logprobs = s.tokens.prompt_logprobs(
                        p.ids, final.prompt_logprobs or [], b.prompt_logprobs
                    )
                choices.append(choice)
        usage = s.usage(prompts, generated=0) if echo_only else s.usage(prompts, finals)
        return body(choices=choices, usage=usage)

    def echo_text(self, p: PromptIds) -> str:
        return p.text if p.text is not None else self.s.llm.tokenizer.decode(p.ids)

    def echo(self, p: PromptIds, prompt_logprobs: list[TokenLogprobs | None] | None) -> Echo:
        text = self.echo_text(p)
        if prompt_logprobs is None:
            return Echo(text, None, len(text))
        return Echo(text, *self.s.tokens.completion_logprobs(p.ids, prompt_logprobs, 0))

    async def chunks(
        self,
        body: Callable[..., CompletionResponse],
        prompts: list[PromptIds],
        params: SamplingParams,
        gens,
        echo: bool,
        echo_only: bool,
        usage: tuple[bool, bool],  # (in a last chunk, in every chunk)
        token_ids: bool,
    ) -> AsyncIterator[CompletionResponse]:
        s = self.s
        include_usage, continuous_usage = usage
        started: set[int] = set()
        offsets: dict[int, int] = {}  # text offset of each choice's next logprob
        echoes: dict[int, Echo] = {}  # prompt index -> its echo, made once its first output is in

        async def echoing(i: int, gen: AsyncIterator[RequestOutput]):
            """The prompt's echo made before its first output goes on, off the event loop when large: with
            logprobs it holds up to max_model_len x (logprobs + 1) entries."""
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                async for out in gen:
                    if i not in echoes:
                        entries = len(prompts[i].ids) * ((params.prompt_logprobs or 0) + 1)
                        echoes[i] = await replies.build(entries, self.echo, prompts[i], out.prompt_logprobs)
                    yield out

        def choice(i: int, index: int, c: CompletionOutput) -> CompletionChoice | None:
            if echo_only:
                c.delta_text, c.delta_token_ids, c.delta_logprobs = "", [], []
            text, first, echoed = c.delta_text, index not in started, None
            if first:
                prefix, echoed, offsets[index] = echoes[i] if echo else ("", None, 0)
                text = prefix + text
            logprobs = None
            if params.logprobs is not None and (c.delta_token_ids or echoed is not None):
                ids, lps = c.delta_token_ids, c.delta_logprobs
                logprobs, offsets[index] = s.tokens.completion_logprobs(ids, lps, offsets[index])
                if echoed is not None:
                    logprobs = _joined(echoed, logprobs)
            if not has_news(c, text, logprobs, token_ids):
                return None  # the echo goes out with the first chunk actually sent
            started.add(index)
            return CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=prompts[i].ids if token_ids and first else msgspec.UNSET,
                token_ids=c.delta_token_ids if token_ids else msgspec.UNSET,
            )

        if echo:
            gens = [echoing(i, g) for i, g in enumerate(gens)]
        stream = ChoiceStream(gens, params.n, choice)

        def usage_now():
            return s.usage(prompts, generated=0 if echo_only else stream.generated)

        async for choices in stream:
            yield body(choices=choices, usage=usage_now() if continuous_usage else None)
        if include_usage:
            yield body(choices=[], usage=usage_now())

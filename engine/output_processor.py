"""The front end's request bookkeeping, shared by LLM and AsyncLLM.

Input side: prompt -> validated token ids and one EngineCoreRequest per sample (n > 1 fans out
into n core requests that share the prompt's cached blocks). Output side: EngineCoreOutputs ->
detokenized RequestOutputs, stop strings applied, and the ids the core must abort because a
stop string ended them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from engine.detokenizer import IncrementalDetokenizer
from engine.params import SamplingParams
from engine.protocol import EngineCoreOutput, EngineCoreRequest, TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # What is new since the previous RequestOutput of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0


class InvalidRequestError(ValueError):
    """Bad input from the caller; names the parameter at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Processor:
    """Tokenize and validate a prompt against the model's limits."""

    def __init__(self, tokenizer, max_model_len: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.extra_stop_ids = eos_token_ids[1:]  # e.g. Llama 3's <|eot_id|> besides <|end_of_text|>
        self.vocab_size = len(tokenizer)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check the prompt fits; return params with max_tokens resolved against the context."""
        if not prompt_ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidRequestError(f"prompt has {len(prompt_ids)} tokens; the model's context is "
                                      f"{self.max_model_len} tokens, leaving none to generate", "prompt")
        if params.min_tokens > room:
            raise InvalidRequestError(f"min_tokens={params.min_tokens} plus the prompt's {len(prompt_ids)} tokens "
                                      f"exceeds the model's context of {self.max_model_len} tokens", "min_tokens")
        if params.max_tokens is None:
            return msgspec.structs.replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise InvalidRequestError(f"max_tokens={params.max_tokens} plus the prompt's {len(prompt_ids)} tokens "
                                      f"exceeds the model's context of {self.max_model_len} tokens", "max_tokens")
        return params

    def core_requests(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      arrival_time: float) -> list[EngineCoreRequest]:
        """One core request per sample; sample i of a seeded request uses seed + i."""
        if self.extra_stop_ids:
            params = msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *self.extra_stop_ids])
        reqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child = msgspec.structs.replace(params, n=1, seed=seed)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            reqs.append(EngineCoreRequest(rid, prompt_ids, child, arrival_time, self.eos_token_id))
        return reqs


class _Sample:
    """One of a request's n samples, i.e. one core request."""

    __slots__ = ("detok", "end_ids", "out")

    def __init__(self, index: int, tokenizer, prompt_ids: list[int], params: SamplingParams, eos: int | None) -> None:
        self.out = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        self.end_ids = set(params.stop_token_ids) | ({eos} if eos is not None and not params.ignore_eos else set())


class _RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], arrival_time: float) -> None:
        self.request_id, self.prompt, self.prompt_ids = request_id, prompt, prompt_ids
        self.samples: dict[str, _Sample] = {}  # core request id -> sample
        self.metrics = RequestMetrics(arrival_time)
        self.num_cached_tokens = 0

    def snapshot(self) -> RequestOutput:
        """The request as it stands; resets the deltas, which the snapshot carries."""
        outs = []
        for sample in self.samples.values():
            o = sample.out
            outs.append(CompletionOutput(o.index, o.text, list(o.token_ids), None if o.logprobs is None else list(o.logprobs),
                                         o.finish_reason, o.stop_reason, o.delta_text, o.delta_token_ids, o.delta_logprobs))
            o.delta_text, o.delta_token_ids, o.delta_logprobs = "", [], []
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, outs, all(o.finished for o in outs),
                             self.metrics, self.num_cached_tokens)


class OutputProcessor:
    """Per-request front-end state, from add_request until the request's last output."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.core_to_request: dict[str, str] = {}  # live core request id -> request id

    def add_request(self, request_id: str, prompt: str | None, core_reqs: list[EngineCoreRequest]) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        first = core_reqs[0]
        state = _RequestState(request_id, prompt, first.prompt_token_ids, first.arrival_time)
        for i, req in enumerate(core_reqs):
            state.samples[req.request_id] = _Sample(i, self.tokenizer, req.prompt_token_ids, req.sampling_params,
                                                     req.eos_token_id)
            self.core_to_request[req.request_id] = request_id
        self.requests[request_id] = state

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply core outputs; return the updated requests and the core ids a stop string ended."""
        now = time.time()
        updated: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for o in outputs:
            rid = self.core_to_request.get(o.request_id)
            if rid is None:
                continue  # aborted or already ended by a stop string
            state = self.requests[rid]
            updated[rid] = state
            m = state.metrics
            if o.scheduled_time is not None and m.scheduled_time is None:
                m.scheduled_time = o.scheduled_time
            if o.new_token_ids and m.first_token_time is None:
                m.first_token_time = now
                state.num_cached_tokens = o.num_cached_tokens
            sample = state.samples[o.request_id]
            out = sample.out
            out.token_ids += o.new_token_ids
            out.delta_token_ids += o.new_token_ids
            if out.logprobs is not None and o.new_logprobs:
                out.logprobs += o.new_logprobs
                out.delta_logprobs += o.new_logprobs
            ended_by_token = o.finish_reason == "stop" and bool(o.new_token_ids) and o.new_token_ids[-1] in sample.end_ids
            if sample.detok.update(o.new_token_ids, skip_last=ended_by_token):
                out.finish_reason, out.stop_reason = "stop", sample.detok.stop_reason
                if not o.finished:
                    to_abort.append(o.request_id)
            elif o.finished:
                out.finish_reason, out.stop_reason = o.finish_reason, o.stop_reason
            visible = sample.detok.text[: sample.detok.emittable(out.finished)]
            out.delta_text += visible[len(out.text):]
            out.text = visible
            if out.finished:
                del self.core_to_request[o.request_id]
        results = []
        for rid, state in updated.items():
            result = state.snapshot()
            if result.finished:
                state.metrics.finished_time = now
                del self.requests[rid]
            results.append(result)
        return results, to_abort

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; return its core ids that are still running (for the core to abort)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        live = [cid for cid in state.samples if cid in self.core_to_request]
        for cid in live:
            del self.core_to_request[cid]
        return live

    def fail_all(self) -> list[str]:
        """Forget every request (the core died); return their ids."""
        ids = list(self.requests)
        self.requests.clear()
        self.core_to_request.clear()
        return ids

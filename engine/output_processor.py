"""EngineCoreOutputs into RequestOutputs, in the front end shared by LLM and AsyncLLM: tokens
detokenized incrementally, stop strings applied, and the core ids a stop string ended (to abort).

What goes wrong while handling one request's outputs (its detokenizing, its stop strings) ends that request
alone: it is reported with its error and forgotten, and the other requests of the step go on.
"""

from __future__ import annotations

import dataclasses
import time

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.input_processor import PreparedRequest
from engine.messages import EngineCoreOutput, TokenLogprobs
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.params import SamplingParams


class _Sample:
    """One of a request's n samples, i.e. one core request."""

    __slots__ = ("detok", "keep_logprobs", "out")

    def __init__(
        self, index: int, tokenizer, prompt_ids: list[int], params: SamplingParams, keep_logprobs: bool
    ) -> None:
        self.out = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        self.keep_logprobs = keep_logprobs


class _RequestState:
    def __init__(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], arrival_time: float
    ) -> None:
        self.request_id, self.prompt, self.prompt_ids = request_id, prompt, prompt_ids
        self.samples: dict[str, _Sample] = {}  # core request id -> sample
        self.metrics = RequestMetrics(arrival_time)
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.embedding: list[float] | None = None
        # The core id of the sample that computes the prompt logprobs, until it first reports: the others'
        # outputs are held till then, so that every sample's first output comes with the prompt's logprobs.
        self.awaited: str | None = None

    def snapshot(self) -> RequestOutput:
        """The request as it stands; resets the deltas, which the snapshot carries."""
        outs = []
        for sample in self.samples.values():
            o = sample.out
            # The lists that grow in place are copied; the deltas are handed over and replaced.
            logprobs = None if o.logprobs is None else list(o.logprobs)
            outs.append(dataclasses.replace(o, token_ids=list(o.token_ids), logprobs=logprobs))
            o.delta_text, o.delta_token_ids, o.delta_logprobs = "", [], []
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_ids,
            outs,
            all(o.finished for o in outs),
            self.metrics,
            self.num_cached_tokens,
            self.prompt_logprobs,
            self.embedding,
        )


class OutputProcessor:
    """Per-request front-end state, from add_request until the request's last output."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.core_to_request: dict[str, str] = {}  # live core request id -> request id

    def add_request(self, request: PreparedRequest, keep_logprobs: bool = True) -> None:
        """Track `request`. `keep_logprobs` False: each output carries only its new logprobs
        (`delta_logprobs`; `logprobs` stays empty), for a reader that streams them on: a long stream keeps
        none it has sent."""
        request_id = request.request_id
        core_ids = [req.request_id for req in request.core_requests]
        # Samples of n > 1 run as "<id>#<i>": a user id may equal another request's sample id.
        if request_id in self.requests or any(rid in self.core_to_request for rid in core_ids):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        first = request.core_requests[0]
        state = _RequestState(request_id, request.prompt, request.prompt_token_ids, first.arrival_time)
        for i, req in enumerate(request.core_requests):
            sample = _Sample(i, self.tokenizer, req.prompt_token_ids, req.sampling_params, keep_logprobs)
            state.samples[req.request_id] = sample
            self.core_to_request[req.request_id] = request_id
        if first.sampling_params.prompt_logprobs is not None and len(core_ids) > 1:
            state.awaited = first.request_id
        self.requests[request_id] = state

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str], dict[str, Exception]]:
        """Apply core outputs; return the updated requests, the core ids to abort (a stop string ended them,
        or their request failed), and the requests whose outputs could not be handled, each with its error
        (they are forgotten here; every other request goes on)."""
        now = time.time()
        updated: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        failed: dict[str, Exception] = {}
        for o in outputs:
            rid = self.core_to_request.get(o.request_id)
            if rid is None:
                continue  # aborted, failed or already ended by a stop string
            state = self.requests[rid]
            if o.request_id == state.awaited:
                state.awaited = None
            if state.awaited is None:
                updated[rid] = state
            try:
                if self._apply(state, o, now):
                    to_abort.append(o.request_id)
            except Exception as e:
                failed[rid] = e
                to_abort += self.abort(rid)
                updated.pop(rid, None)
        results = []
        for rid, state in updated.items():
            try:
                result = state.snapshot()
            except Exception as e:
                failed[rid] = e
                to_abort += self.abort(rid)
                continue
            if result.finished:
                state.metrics.finished_time = now
                del self.requests[rid]
            results.append(result)
        return results, to_abort, failed

    def _apply(self, state: _RequestState, o: EngineCoreOutput, now: float) -> bool:
        """One core output into its request's state; True when a stop string ended a running sample."""
        m = state.metrics
        if o.scheduled_time is not None and m.scheduled_time is None:
            m.scheduled_time = o.scheduled_time
        if o.new_token_ids and m.first_token_time is None:
            m.first_token_time = now
            state.num_cached_tokens = o.num_cached_tokens
        if o.prompt_logprobs is not None:
            state.prompt_logprobs = o.prompt_logprobs
        if o.pooled is not None:
            state.embedding, state.num_cached_tokens = o.pooled, o.num_cached_tokens
        if o.spec_decoding is not None:
            m.num_draft_tokens += o.spec_decoding[0]
            m.num_accepted_tokens += o.spec_decoding[1]
        sample = state.samples[o.request_id]
        out = sample.out
        out.token_ids += o.new_token_ids
        out.delta_token_ids += o.new_token_ids
        if out.logprobs is not None and o.new_logprobs:
            if sample.keep_logprobs:
                out.logprobs += o.new_logprobs
            out.delta_logprobs += o.new_logprobs
        # The core stops a sequence only on a token (EOS or a stop id), its last: kept out of the text.
        ended_by_token = o.finish_reason == "stop" and bool(o.new_token_ids)
        stopped = False
        if sample.detok.update(o.new_token_ids, skip_last=ended_by_token):
            out.finish_reason, out.stop_reason = "stop", sample.detok.stop_reason
            stopped = not o.finished
        elif o.finished:
            out.finish_reason, out.stop_reason = o.finish_reason, o.stop_reason
        visible = sample.detok.text[: sample.detok.emittable(out.finished)]
        out.delta_text += visible[len(out.text) :]
        out.text = visible
        if out.finished:
            del self.core_to_request[o.request_id]
        return stopped

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; return its core ids that are still running (for the core to abort)."""
        state = self.requests.pop(request_id, None)
        live = [cid for cid in (state.samples if state else ()) if cid in self.core_to_request]
        for cid in live:
            del self.core_to_request[cid]
        return live

    def fail_all(self) -> list[str]:
        """Forget every request (the core died); return their ids."""
        ids = list(self.requests)
        self.requests.clear()
        self.core_to_request.clear()
        return ids

"""The streaming Python API: AsyncLLM, the front end for asyncio code and the HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from engine.core_client import AsyncCoreClient
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from engine.front_end import FrontEnd
from engine.input_processor import PreparedRequest, Prompt
from engine.outputs import RequestOutput
from engine.params import SamplingParams

logger = logging.getLogger("kiln")
# Outputs detokenized between two turns of the event loop: with a batch of hundreds of sequences, a step's
# detokenizing would otherwise hold up every other coroutine at once.
OUTPUT_CHUNK = 32


class _Pending:
    """What one request's reader has not taken yet: at most one output, a newer one replacing it with the
    deltas of both, so a reader that falls behind holds one output's memory, not one per step."""

    def __init__(self) -> None:
        self.item: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        old = self.item
        if isinstance(old, BaseException):
            return  # an error is waiting already, and it ends the stream
        if isinstance(old, RequestOutput) and isinstance(item, RequestOutput):
            for prev, new in zip(old.outputs, item.outputs):
                new.delta_text = prev.delta_text + new.delta_text
                new.delta_token_ids = prev.delta_token_ids + new.delta_token_ids
                new.delta_logprobs = prev.delta_logprobs + new.delta_logprobs
        self.item = item
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self.ready.wait()
        item, self.item = self.item, None
        self.ready.clear()
        return item  # type: ignore[return-value]


class RequestStream:
    """One admitted request's outputs, each time they change; the last has `finished` set. Closed, or
    dropped unread, before that, it aborts the request in the engine: an admitted request never
    outlives the one stream that can read it."""

    def __init__(self, llm: AsyncLLM, request_id: str, cost: tuple[int, int, int]) -> None:
        self.llm, self.request_id, self.cost = llm, request_id, cost
        self.pending = llm.queues[request_id] = _Pending()
        self.finished = self.closed = False
        llm.load = [a + b for a, b in zip(llm.load, cost)]

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.closed:
            raise StopAsyncIteration
        try:
            item = await self.pending.get()
        except BaseException:  # cancelled: the reader went away
            self.close()
            raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.finished = item.finished
        if self.finished:
            self.close()
        return item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        llm = self.llm
        llm.queues.pop(self.request_id, None)
        llm.load = [a - b for a, b in zip(llm.load, self.cost)]
        if not self.finished:
            live = llm.output_processor.abort(self.request_id)
            if not llm.client.dead:
                llm.client.abort_requests(live)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the client may be gone already
            self.close()


class AsyncLLM(FrontEnd):
    """Streaming front end for asyncio code: `async for out in llm.generate(...)`."""

    client: AsyncCoreClient

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        # Streams are read as they are generated: defaults favour smooth inter-token latency.
        super().__init__(model, AsyncCoreClient, {"usage": "serving", **engine_args})
        self.queues: dict[str, _Pending] = {}
        self._reader: asyncio.Task | None = None
        # What the open streams hold (samples, their prompt tokens, constraint bytes), against the limits:
        # a request admitted counts until its stream closes, its last output read or abandoned.
        self.load = [0, 0, 0]
        c = self.config
        kv_tokens = self.client.ready.num_kv_blocks * c.block_size * len(self.client.cores)
        shares = self.client.api_servers  # several API servers: each admits its share of the queue
        self.limits = (
            -(-(c.max_num_seqs + c.max_pending_requests) // shares),
            c.max_pending_tokens or max(16 * kv_tokens // shares, 4 * self.max_model_len),
            c.max_pending_constraint_bytes,
        )

    @property
    def dead(self) -> str | None:
        """Why the engine core is gone, or None while it runs (checked now, not only by the reader)."""
        with contextlib.suppress(EngineDeadError):
            self.client.check_alive()
        return self.client.dead

    @property
    def dead_cores(self) -> list[str]:
        """Why each dead data-parallel core died (the others go on serving)."""
        return [core.dead for core in self.client.cores if core.dead]

    def _ensure_reader(self) -> None:
        # One reader per event loop: a task on a loop that no longer runs would deliver nothing.
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done() or self._reader.get_loop() is not loop:
            if self._reader is not None and not self._reader.done():
                self._reader.cancel()
            self._reader = loop.create_task(
                self.client.run_reader(self._on_outputs, self._on_lost, self._on_dead)
            )

    async def _on_outputs(self, outputs) -> None:
        for start in range(0, len(outputs), OUTPUT_CHUNK):
            if start:
                await asyncio.sleep(0)  # let streams and /health run between chunks
            chunk = outputs[start : start + OUTPUT_CHUNK]
            updates, to_abort, failed = self.output_processor.process_outputs(chunk)
            self.client.abort_requests(to_abort)
            for out in updates:
                if (queue := self.queues.get(out.request_id)) is not None:
                    queue.put(out)
            for rid, error in failed.items():  # that request ends with its error; the others go on
                logger.error("handling the outputs of request %s failed; it is aborted", rid, exc_info=error)
                if (queue := self.queues.get(rid)) is not None:
                    queue.put(error)

    def _on_lost(self, message: str, core_ids: list[str]) -> None:
        """A data-parallel core died: end the requests it held; the other cores serve on."""
        for rid in {self.output_processor.core_to_request.get(cid) for cid in core_ids} - {None}:
            self.output_processor.abort(rid)
            if (queue := self.queues.get(rid)) is not None:
                queue.put(EngineDeadError(message))

    def _on_dead(self, message: str) -> None:
        logger.error("engine core died: %s", message)
        self.output_processor.fail_all()
        for queue in self.queues.values():
            queue.put(EngineDeadError(message))

    def add(
        self,
        prompt: Prompt | PreparedRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        keep_logprobs: bool = True,
    ) -> RequestStream:
        """Admit a request (or one `process` validated) and return its stream: a full front end
        (EngineOverloadedError), a bad prompt, an id in use or a dead core fail here, before any reply.
        `keep_logprobs` False: each output carries only the logprobs new since the last one read
        (`delta_logprobs`), for a reader that sends them on; a long stream then holds none it has sent."""
        self._ensure_reader()
        if self.dead:  # the process is checked now: the reader may not have seen it die yet
            raise EngineDeadError(self.dead)
        if not isinstance(prompt, PreparedRequest):
            prompt = self.process(prompt, sampling_params or SamplingParams(), request_id)
        cost = prompt.cost
        self.check_capacity(*cost)
        # A request id in use fails here, touching nothing.
        self.output_processor.add_request(prompt, keep_logprobs)
        stream = RequestStream(self, prompt.request_id, cost)
        try:
            self.client.add_request(prompt.core_request)
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(
        self,
        prompt: Prompt | PreparedRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        keep_logprobs: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's state each time it changes; the last one has `finished` set. Closing the
        generator early (a client went away) aborts the request in the engine. `keep_logprobs`: as `add`."""
        stream = self.add(prompt, sampling_params, request_id, keep_logprobs=keep_logprobs)
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out

    def check_capacity(self, samples: int = 1, tokens: int = 0, constraint_bytes: int = 0) -> None:
        """EngineOverloadedError if admitting this much more would pass what this front end may hold: samples
        (max_num_seqs running + max_pending_requests waiting), their prompt tokens, constraint bytes."""
        asked = (samples, tokens, constraint_bytes)
        names = ("samples", "prompt tokens", "bytes of constraints")
        for name, held, more, limit in zip(names, self.load, asked, self.limits):
            if more > limit:
                message = f"this request alone brings {more} {name}, past the limit of {limit}"
                raise InvalidRequestError(message, "n")
            if more and held + more > limit:
                raise EngineOverloadedError(
                    f"{held} {name} are in flight and this request brings {more}; the limit is {limit}: "
                    "retry later"
                )

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error`; their streams close and abort them in the core."""
        for queue in self.queues.values():
            queue.put(error)

    async def abort(self, request_id: str) -> None:
        self.client.abort_requests(self.output_processor.abort(request_id))
        if (queue := self.queues.get(request_id)) is not None:
            queue.put(asyncio.CancelledError(f"request {request_id} aborted"))

    async def get_stats(self) -> dict:
        self._ensure_reader()
        return self.merge_stats(await self.client.call_utility("stats"))

    async def reset_prefix_cache(self) -> bool:
        self._ensure_reader()
        done = await self.client.call_utility("reset_prefix_cache")
        self.client.coordinator.reset_prefixes(i for i, ok in done.items() if ok)
        return all(done.values())

    def shutdown(self) -> None:
        if getattr(self, "_reader", None) is not None:
            self._reader.cancel()
        super().shutdown()

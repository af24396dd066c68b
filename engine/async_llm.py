"""The streaming Python API: AsyncLLM, the front end for asyncio code and the HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from engine.core_client import AsyncCoreClient
from engine.errors import EngineDeadError, EngineOverloadedError
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

    def __init__(self, llm: AsyncLLM, request_id: str) -> None:
        self.llm, self.request_id = llm, request_id
        self.pending = llm.queues[request_id] = _Pending()
        self.finished = self.closed = False

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
            updates, to_abort = self.output_processor.process_outputs(outputs[start : start + OUTPUT_CHUNK])
            self.client.abort_requests(to_abort)
            for out in updates:
                if (queue := self.queues.get(out.request_id)) is not None:
                    queue.put(out)

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
    ) -> RequestStream:
        """Admit a request (or one `process` validated) and return its stream: a full front end
        (EngineOverloadedError), a bad prompt, an id in use or a dead core fail here, before any reply."""
        self._ensure_reader()
        if self.dead:  # the process is checked now: the reader may not have seen it die yet
            raise EngineDeadError(self.dead)
        if not isinstance(prompt, PreparedRequest):
            prompt = self.process(prompt, sampling_params or SamplingParams(), request_id)
        self.check_capacity()
        self.output_processor.add_request(prompt)  # a request id in use fails here, touching nothing
        stream = RequestStream(self, prompt.request_id)
        try:
            self.client.add_requests(prompt.core_requests)
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(
        self,
        prompt: Prompt | PreparedRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's state each time it changes; the last one has `finished` set. Closing the
        generator early (a client went away) aborts the request in the engine."""
        async with contextlib.aclosing(self.add(prompt, sampling_params, request_id)) as stream:
            async for out in stream:
                yield out

    def check_capacity(self, count: int = 1) -> None:
        """EngineOverloadedError if `count` more requests would exceed what this front end may hold:
        max_num_seqs running and max_pending_requests waiting for a slot."""
        c = self.config
        limit = c.max_num_seqs + c.max_pending_requests
        if len(self.output_processor.requests) + count > limit:
            raise EngineOverloadedError(
                f"{len(self.output_processor.requests)} requests are in flight and the limit is {limit} "
                f"(max_num_seqs {c.max_num_seqs} + max_pending_requests {c.max_pending_requests}); "
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
        self.client.coordinator.reset_prefixes()
        return all((await self.client.call_utility("reset_prefix_cache")).values())

    def shutdown(self) -> None:
        if getattr(self, "_reader", None) is not None:
            self._reader.cancel()
        super().shutdown()

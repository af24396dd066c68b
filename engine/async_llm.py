"""The streaming Python API: AsyncLLM, the front end for asyncio code and the HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from engine.core_client import AsyncCoreClient
from engine.errors import EngineDeadError
from engine.front_end import FrontEnd
from engine.input_processor import PreparedRequest, Prompt
from engine.outputs import RequestOutput
from engine.params import SamplingParams

logger = logging.getLogger("kiln")


class AsyncLLM(FrontEnd):
    """Streaming front end for asyncio code: `async for out in llm.generate(...)`."""

    client: AsyncCoreClient

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        # Streams are read as they are generated: defaults favour smooth inter-token latency.
        super().__init__(model, AsyncCoreClient, {"usage": "serving", **engine_args})
        self.queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    @property
    def dead(self) -> str | None:
        """Why the engine core is gone, or None while it runs (checked now, not only by the reader)."""
        with contextlib.suppress(EngineDeadError):
            self.client.check_alive()
        return self.client.dead

    def _ensure_reader(self) -> None:
        # One reader per event loop: a task on a loop that no longer runs would deliver nothing.
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done() or self._reader.get_loop() is not loop:
            if self._reader is not None and not self._reader.done():
                self._reader.cancel()
            self._reader = loop.create_task(self.client.run_reader(self._on_outputs, self._on_dead))

    def _on_outputs(self, outputs) -> None:
        updates, to_abort = self.output_processor.process_outputs(outputs)
        self.client.abort_requests(to_abort)
        for out in updates:
            queue = self.queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _on_dead(self, message: str) -> None:
        logger.error("engine core died: %s", message)
        self.output_processor.fail_all()
        for queue in self.queues.values():
            queue.put_nowait(EngineDeadError(message))

    async def generate(
        self,
        prompt: Prompt | PreparedRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's state each time it changes; the last one has `finished` set. `prompt` may
        be a request `process` validated already. Closing the generator early (a client went away)
        aborts the request in the engine."""
        self._ensure_reader()
        if self.client.dead:
            raise EngineDeadError(self.client.dead)
        if not isinstance(prompt, PreparedRequest):
            prompt = self.process(prompt, sampling_params or SamplingParams(), request_id)
        rid = prompt.request_id
        self.output_processor.add_request(prompt)  # a request id in use fails here, touching nothing
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        finished = False
        try:
            for req in prompt.core_requests:
                self.client.add_request(req)
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.queues.pop(rid, None)
            if not finished:
                live = self.output_processor.abort(rid)
                if not self.client.dead:
                    self.client.abort_requests(live)

    async def abort(self, request_id: str) -> None:
        self.client.abort_requests(self.output_processor.abort(request_id))
        queue = self.queues.get(request_id)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    async def get_stats(self) -> dict:
        self._ensure_reader()
        return await self.client.call_utility("stats")

    async def reset_prefix_cache(self) -> bool:
        self._ensure_reader()
        return await self.client.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        if getattr(self, "_reader", None) is not None:
            self._reader.cancel()
        super().shutdown()

"""The front end's side of the engine-core IPC: start the core process, send inputs, receive outputs.

Transport: zmq PUSH/PULL over ipc:// sockets. Chosen over multiprocessing connections because
pyzmq has native asyncio sockets (the server's client needs no thread), queues in both directions
without blocking the busy loop, and carries raw msgpack frames, so nothing is ever pickled.
The core runs as a fresh `python -m engine.core` process (not a fork); it dies with its parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine import messages as m
from engine.config import EngineConfig
from engine.errors import EngineDeadError

logger = logging.getLogger("kiln")
POLL_MS = 200  # how often a waiting client checks that the core process is alive


class CoreClient:
    """Starts the core process and owns the two sockets; subclasses add sync or async receiving."""

    def __init__(self) -> None:
        """Start the core process and return at once: it imports torch while we get the model ready.
        Then `start` sends it the model and `wait_ready` waits for its warm-up."""
        self.ipc_dir = tempfile.mkdtemp(prefix="kiln-")
        in_addr, out_addr = f"ipc://{self.ipc_dir}/in", f"ipc://{self.ipc_dir}/out"
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # closing never waits for unsent messages
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(in_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(out_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(m.CoreOutput)
        self.dead: str | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.core", in_addr, out_addr, str(os.getpid())],
            stdin=subprocess.DEVNULL,
        )
        self.ready: m.CoreReady | None = None
        self._call_ids = itertools.count()
        # Runs on shutdown, when the client is collected, or at interpreter exit, whichever comes first:
        # a script that falls off its end with the engine alive still exits.
        self._finalizer = weakref.finalize(self, _release, self.proc, self.ctx, self.ipc_dir)

    def start(self, config: EngineConfig, model_dir: str, gguf_file: str | None = None) -> None:
        self.send(m.StartCore(config, model_dir, gguf_file))

    def send(self, msg) -> None:
        """Queue `msg` for the core. A PUSH socket blocks while no core is connected, so wait for room
        only while the core process lives: a core that exited (or never connected) is an error here."""
        self.check_alive()
        frame = self.encoder.encode(msg)
        while not self.input.poll(POLL_MS, zmq.POLLOUT):
            self.check_alive()
        self.input.send(frame, copy=False, flags=zmq.NOBLOCK)

    def wait_ready(self, timeout: float = 1800.0) -> m.CoreReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.output.poll(POLL_MS):
                msg = self.decoder.decode(self.output.recv())
                if isinstance(msg, m.CoreReady):
                    self.ready = msg
                    return msg
                if isinstance(msg, m.CoreFailed):
                    self._mark_dead(msg.message)
            self.check_alive()
        self.shutdown()
        raise EngineDeadError(f"engine core did not become ready within {timeout:.0f} s")

    def check_alive(self) -> None:
        if self.dead is None and self.proc.poll() is not None:
            self._mark_dead(f"engine core process exited unexpectedly (exit code {self.proc.returncode})")
        if self.dead:
            raise EngineDeadError(self.dead)

    def _mark_dead(self, message: str) -> None:
        self.dead = message
        self.shutdown()

    def add_request(self, request: m.EngineCoreRequest) -> None:
        self.send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead:
            self.send(m.AbortRequests(list(request_ids)))

    def _utility_call(self, method: str, args: tuple) -> m.UtilityCall:
        return m.UtilityCall(next(self._call_ids), method, list(args))

    def shutdown(self) -> None:
        """Stop the core process and release the sockets; safe to call more than once."""
        if self.proc.poll() is None and self.ready is None:  # still starting: nothing to finish cleanly
            self.proc.kill()
            self.proc.wait()
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError, subprocess.TimeoutExpired):
                self.input.send(self.encoder.encode(m.Shutdown()), flags=zmq.NOBLOCK)
                self.proc.wait(timeout=5)
        self._finalizer()
        if self.dead is None:
            self.dead = "engine core was shut down"


def _release(proc: subprocess.Popen, ctx: zmq.Context, ipc_dir: str) -> None:
    """Stop the core process if it still runs (a clean stop is `shutdown`'s) and close every socket
    without lingering."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if not ctx.closed:
        ctx.destroy(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)


class SyncCoreClient(CoreClient):
    """Blocking receive, for LLM."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[m.EngineCoreOutput] = []
        self._results: dict[int, m.UtilityResult] = {}

    def get_outputs(self, timeout: float | None = None) -> list[m.EngineCoreOutput]:
        """Outputs that arrived, waiting up to `timeout` s for some (None: until some arrive)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            self.check_alive()
            if self.output.poll(POLL_MS):
                self._receive(self.decoder.decode(self.output.recv()))
            elif deadline is not None and time.monotonic() >= deadline:
                break
        out, self._pending = self._pending, []
        return out

    def _receive(self, msg) -> None:
        if isinstance(msg, m.EngineCoreOutputs):
            self._pending.extend(msg.outputs)
        elif isinstance(msg, m.UtilityResult):
            self._results[msg.call_id] = msg
        elif isinstance(msg, m.CoreFailed):
            self._mark_dead(msg.message)

    def call_utility(self, method: str, *args) -> Any:
        call = self._utility_call(method, args)
        self.send(call)
        while call.call_id not in self._results:
            self.check_alive()
            if self.output.poll(POLL_MS):
                self._receive(self.decoder.decode(self.output.recv()))
        result = self._results.pop(call.call_id)
        if result.error:
            raise RuntimeError(result.error)
        return result.result


class AsyncCoreClient(CoreClient):
    """asyncio receive, for the server: one reader task hands outputs to `on_outputs`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aoutput = zmq.asyncio.Socket.from_socket(self.output)
        self._futures: dict[int, asyncio.Future] = {}

    async def run_reader(self, on_outputs, on_dead) -> None:
        """Deliver outputs until the core dies or shuts down; then call on_dead(message) once."""
        try:
            while True:
                if await self.aoutput.poll(POLL_MS):
                    msg = self.decoder.decode(await self.aoutput.recv())
                    if isinstance(msg, m.EngineCoreOutputs):
                        await on_outputs(msg.outputs)
                    elif isinstance(msg, m.UtilityResult):
                        future = self._futures.pop(msg.call_id, None)
                        if future is not None and not future.done():
                            future.set_result(msg)
                    elif isinstance(msg, m.CoreFailed):
                        self._mark_dead(msg.message)
                self.check_alive()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the core died, or handling its outputs failed: no request can finish
            if not isinstance(e, EngineDeadError | zmq.ZMQError):
                logger.exception("handling the engine core's outputs failed")
                self._mark_dead(f"handling the engine core's outputs failed: {type(e).__name__}: {e}")
            message = self.dead or str(e)
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(EngineDeadError(message))
            on_dead(message)

    async def call_utility(self, method: str, *args) -> Any:
        call = self._utility_call(method, args)
        future = asyncio.get_running_loop().create_future()
        self._futures[call.call_id] = future
        self.send(call)
        result = await future
        if result.error:
            raise RuntimeError(result.error)
        return result.result

"""The front end's side of the engine-core IPC: start the core processes, send inputs, receive outputs.

Transport: zmq PUSH/PULL over ipc:// (tcp:// to headless cores on other hosts), not multiprocessing
connections: pyzmq has native asyncio sockets (the server's client needs no thread), queues both ways without
blocking the busy loop, and carries raw msgpack frames, so nothing is ever pickled. Connections to other
hosts are the cluster's only (engine/cluster.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine import cluster
from engine import messages as m
from engine.config import EngineConfig
from engine.coordinator import Coordinator
from engine.core_procs import CoreProcess, RemoteCore, SharedCore, release
from engine.errors import EngineDeadError
from engine.executor import preparation

logger = logging.getLogger("kiln")
POLL_MS = 200  # how often a waiting client checks that the core process is alive
_LOAD = msgspec.msgpack.Decoder(m.CoreLoad)


class CoreClient:
    """Starts the engine cores (one per data-parallel rank) and owns their sockets: one input socket per
    core, one output socket they all send to. Subclasses add sync or async receiving."""

    # Whether one core's death ends the whole engine. LLM: a batch missing some outputs is of no use.
    fail_together = True

    def __init__(self, config: EngineConfig) -> None:
        """Start the cores (or connect to headless ones) and return at once: they import torch while we get
        the model ready; `start` then sends them the model and `wait_ready` waits for their warm-up."""
        self.ipc_dir = tempfile.mkdtemp(prefix="kiln-")
        out_addr = f"ipc://{self.ipc_dir}/out"
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # closing never waits for unsent messages
        remote = bool(config.engine_core_addresses)
        shared = config.api_server.rsplit(":", 2) if config.api_server else None
        self.client_index = int(shared[1]) if shared else 0  # which of several API servers (0: launcher)
        self.api_servers = int(shared[2]) - 1 if shared else 1
        self.view: zmq.Socket | None = None  # the DP coordinator's, for an API server
        launched: list[subprocess.Popen] = []
        # Headless cores route their outputs to the front end that started them: this one's session.
        self.session = f"kiln-{uuid.uuid4().hex}".encode()
        self.output = self.ctx.socket(zmq.DEALER if remote else zmq.PULL)
        if remote:
            self.output.setsockopt(zmq.ROUTING_ID, self.session)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(m.CoreOutput)
        self.dead: str | None = None
        self.heartbeats: cluster.Heartbeats | None = None
        if remote:
            addresses = config.engine_core_addresses.split(",")
            key = cluster.load_key(config.cluster_key_file)
            self.cores = [RemoteCore(self.ctx, i, address, key) for i, address in enumerate(addresses)]
            for core in self.cores:
                cluster.connect(self.output, core.output_address, key)
            heartbeat = self.encoder.encode(m.Heartbeat(self.session))
            self.heartbeats = cluster.Heartbeats(self.ctx, addresses, key, heartbeat)
        elif shared:  # engine/api_clients.py: the launcher starts the cores and the DP coordinator
            directory, n, clients = shared[0], config.data_parallel_size, int(shared[2])
            self.output.bind(f"ipc://{directory}/out{self.client_index}")
            starts = clients if self.client_index == 0 else None
            self.cores = [SharedCore(self.ctx, i, directory, starts, preparation(config)) for i in range(n)]
            if starts:
                cmd = [sys.executable, "-m", "engine.coordinator", directory, str(n), str(os.getpid())]
                launched.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
            else:
                self.view = self.ctx.socket(zmq.SUB)
                self.view.setsockopt(zmq.RCVHWM, 0)
                self.view.setsockopt(zmq.SUBSCRIBE, b"")
                self.view.connect(f"ipc://{directory}/view")
        else:
            self.output.bind(out_addr)
            n = config.data_parallel_size
            inputs, prepare = [f"ipc://{self.ipc_dir}/in{i}" for i in range(n)], preparation(config)
            self.cores = [CoreProcess(self.ctx, i, inputs[i], out_addr, prepare) for i in range(n)]
        self.ready: m.CoreReady | None = None  # the first core's; every core's budgets are the same
        self.coordinator: Coordinator | None = None
        self.lost: list[tuple[str, list[str]]] = []  # a dead core's message and requests, to fail
        self._call_ids = itertools.count()
        # Runs on shutdown, when the client is collected, or at interpreter exit, whichever comes first:
        # a script that falls off its end with the engine alive still exits.
        procs = [core.proc for core in self.cores if core.proc is not None] + launched
        self._finalizer = weakref.finalize(self, release, procs, self.heartbeats, self.ctx, self.ipc_dir)

    def start(self, config: EngineConfig, model_dir: str, gguf_file: str | None = None) -> None:
        if self.view is not None:  # an API server: the launcher started the cores
            for core in self.cores:
                self.send(core, m.Hello(self.client_index))
            return
        for core in self.cores:
            # A headless core has its host to itself; local ones share this one.
            rank = 0 if isinstance(core, RemoteCore) else core.index
            rank_config = msgspec.structs.replace(config, data_parallel_rank=rank)
            kv_events = len(self.cores) > 1
            start = m.StartCore(rank_config, model_dir, gguf_file, core.index, kv_events, self.session)
            if isinstance(core, RemoteCore):
                core.start_frame = self.encoder.encode(start)
            self.send(core, start)

    def send(self, core: CoreProcess, msg) -> None:
        """Queue `msg` for `core`. A PUSH socket blocks while no core is connected, so wait for room
        only while the core process lives: a core that exited (or never connected) is an error here."""
        frame = self.encoder.encode(msg)
        while True:
            self.check_alive()
            if core.dead:
                raise EngineDeadError(core.dead)
            if core.input.poll(POLL_MS, zmq.POLLOUT):
                break
        core.input.send(frame, copy=False, flags=zmq.NOBLOCK)

    def wait_ready(self, timeout: float = 1800.0) -> m.CoreReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.output.poll(POLL_MS):
                msg = self._decode(self.output.recv())
                if isinstance(msg, m.CoreReady):
                    self.cores[msg.engine_index].ready = msg
                elif isinstance(msg, m.CoreFailed):
                    self._core_died(self.cores[msg.engine_index], self._named(msg.engine_index, msg.message))
            self.check_alive()
            if all(core.ready for core in self.cores):
                self.ready = ready = self.cores[0].ready
                c = ready.config
                self.coordinator = Coordinator(len(self.cores), c.block_size, c.max_num_seqs)
                return ready
        self.shutdown()
        raise EngineDeadError(f"engine core did not become ready within {timeout:.0f} s")

    def check_alive(self) -> None:
        """EngineDeadError once the engine can serve nothing; a core found dead is taken out of service."""
        for core in self.cores:
            if core.dead is None and (why := core.gone()):
                self._core_died(core, self._named(core.index, why))
        if self.dead:
            raise EngineDeadError(self.dead)

    def _named(self, index: int, message: str) -> str:
        message = message.removeprefix("engine core ")
        return f"engine core {index} {message}" if len(self.cores) > 1 else f"engine core {message}"

    def _core_died(self, core: CoreProcess, message: str) -> None:
        core.dead = message
        if self.coordinator is None or self.fail_together or all(c.dead for c in self.cores):
            self._mark_dead(message)
            return
        logger.error("%s; the other engine cores go on serving", message)
        core.kill()
        self.lost.append((message, self.coordinator.core_died(core.index)))

    def _mark_dead(self, message: str) -> None:
        for core in self.cores:
            core.dead = core.dead or message  # a core stopped from here is not found dead again later
        self.dead = message
        self.shutdown()

    def add_request(self, request: m.EngineCoreRequest) -> None:
        """Send one prompt (with its n samples) to the core the coordinator picks for it."""
        self.check_alive()
        self.read_view()
        ids, request.client = request.sample_ids(), self.client_index
        self.send(
            self.cores[self.coordinator.route(request.prompt_token_ids, request.cache_salt, ids)], request
        )

    def read_view(self) -> None:
        """Apply what the DP coordinator passed on since the last call (an API server's)."""
        while self.view is not None and self.view.poll(0):
            with contextlib.suppress(msgspec.MsgspecError):
                self.coordinator.apply_load(_LOAD.decode(self.view.recv()))

    def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead:
            return
        for index, ids in self.coordinator.release(request_ids).items():
            if not self.cores[index].dead:
                self.send(self.cores[index], m.AbortRequests(ids))

    def _decode(self, frame: bytes):
        """A core's message, or None for a frame that is not one (logged and dropped)."""
        try:
            return self.decoder.decode(frame)
        except msgspec.MsgspecError as e:
            logger.warning("dropped a malformed frame from an engine core (%d bytes): %s", len(frame), e)
            return None

    def _apply(self, msg) -> list[m.EngineCoreOutput]:
        """Book a message from a core; return the request outputs it carries."""
        if isinstance(msg, m.EngineCoreOutputs):
            self.coordinator.release(o.request_id for o in msg.outputs if o.finished)
            self.coordinator.kv_usage[msg.engine_index] = msg.kv_cache_usage
            if msg.kv_events is not None:
                self.coordinator.apply_events(msg.engine_index, msg.kv_events)
            return msg.outputs
        if isinstance(msg, m.CoreFailed):
            core = self.cores[msg.engine_index]
            if core.dead is None:
                self._core_died(core, self._named(core.index, msg.message))
        return []

    def _send_utility(self, method: str, args: tuple) -> dict[int, int]:
        """Ask every live core to run `method`; return the call ids and the core each went to."""
        calls = {}
        for core in self.cores:
            if not core.dead:
                call = m.UtilityCall(next(self._call_ids), method, list(args), self.client_index)
                self.send(core, call)
                calls[call.call_id] = core.index
        return calls

    @staticmethod
    def _result(result: m.UtilityResult) -> Any:
        if result.error:
            raise RuntimeError(result.error)
        return result.result

    def shutdown(self) -> None:
        """Stop the core processes and release the sockets; safe to call more than once."""
        stopping = []
        for core in self.cores:
            if isinstance(core, SharedCore) and core.proc is None:  # the launcher's to stop
                continue
            if not core.gone() and core.ready is None:  # still starting: nothing to finish cleanly
                core.kill()
            elif not core.gone():
                with contextlib.suppress(zmq.ZMQError):
                    core.input.send(self.encoder.encode(m.Shutdown()), flags=zmq.NOBLOCK)
                    stopping.append(core)
        deadline = time.monotonic() + 5
        for core in stopping:
            while not core.gone() and time.monotonic() < deadline:
                time.sleep(0.01)
        self._finalizer()
        if self.dead is None:
            self.dead = "engine core was shut down"


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
                self._receive(self._decode(self.output.recv()))
            elif deadline is not None and time.monotonic() >= deadline:
                break
        out, self._pending = self._pending, []
        return out

    def _receive(self, msg) -> None:
        if isinstance(msg, m.UtilityResult):
            self._results[msg.call_id] = msg
        else:
            self._pending.extend(self._apply(msg))

    def call_utility(self, method: str, *args) -> dict[int, Any]:
        """Run `method` on every core; return each core's result by its index."""
        calls = self._send_utility(method, args)
        while not calls.keys() <= self._results.keys():
            self.check_alive()
            if self.output.poll(POLL_MS):
                self._receive(self._decode(self.output.recv()))
        return {index: self._result(self._results.pop(call_id)) for call_id, index in calls.items()}


class AsyncCoreClient(CoreClient):
    """asyncio receive, for the server: one reader task hands outputs to `on_outputs`. One core's death
    fails only the requests it held (`on_lost`); the engine is dead once every core is. Sends never wait
    on the event loop: what a core's full inbox cannot take yet waits, in order, in its outbox."""

    fail_together = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aoutput = zmq.asyncio.Socket.from_socket(self.output)
        self._calls: dict[int, tuple[int, asyncio.Future]] = {}  # call id -> core index, its result
        self._outboxes: dict[int, collections.deque[bytes]] = {}  # core index -> frames not yet taken
        self._flushers: dict[int, asyncio.Task] = {}  # core index -> the task sending its outbox

    def send(self, core: CoreProcess, msg) -> None:
        """Queue `msg` for `core` at once: waiting for room in a busy core's full inbox would freeze every
        stream on this loop, so the frame waits, in order, in its outbox for a task to send it. Until the
        cores are ready (the start, which waits for them on this thread) this waits for room."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self.ready is None:
            return super().send(core, msg)
        self.check_alive()
        if core.dead:
            raise EngineDeadError(core.dead)
        frame, outbox = self.encoder.encode(msg), self._outboxes.get(core.index)
        if outbox is None:
            try:
                core.input.send(frame, copy=False, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                outbox = self._outboxes[core.index] = collections.deque()
        outbox.append(frame)
        flusher = self._flushers.get(core.index)  # one on this loop: a loop that stopped runs none
        if flusher is None or flusher.done() or flusher.get_loop() is not loop:
            self._flushers[core.index] = loop.create_task(self._flush(core, outbox))

    async def _flush(self, core: CoreProcess, outbox: collections.deque[bytes]) -> None:
        """Send the outbox's frames as `core` takes them; a dead core's are dropped (the reader fails its
        requests), as are all at shutdown, when the socket closes."""
        sock = zmq.asyncio.Socket.from_socket(core.input)
        with contextlib.suppress(zmq.ZMQError, EngineDeadError):
            while outbox and not core.dead:
                if not await sock.poll(POLL_MS, zmq.POLLOUT):
                    self.check_alive()
                    continue
                with contextlib.suppress(zmq.Again):
                    core.input.send(outbox[0], copy=False, flags=zmq.NOBLOCK)
                    outbox.popleft()
        if self._outboxes.get(core.index) is outbox and (core.dead or not outbox):
            del self._outboxes[core.index]

    async def run_reader(self, on_outputs, on_lost, on_dead) -> None:
        """Deliver outputs until every core has died or the engine shuts down; hand each dead core's
        requests to on_lost(message, core request ids), then call on_dead(message) once at the end."""
        try:
            while True:
                if await self.aoutput.poll(POLL_MS):
                    msg = self._decode(await self.aoutput.recv())
                    if isinstance(msg, m.UtilityResult):
                        call = self._calls.pop(msg.call_id, None)
                        if call is not None and not call[1].done():
                            call[1].set_result(msg)
                    elif outputs := self._apply(msg):
                        await on_outputs(outputs)
                self.read_view()
                self.check_alive()
                while self.lost:
                    on_lost(*self.lost.pop(0))
        except Exception as e:  # the core died, or handling its outputs failed: no request can finish
            if not isinstance(e, EngineDeadError | zmq.ZMQError):
                logger.exception("handling the engine core's outputs failed")
                self._mark_dead(f"handling the engine core's outputs failed: {type(e).__name__}: {e}")
            message = self.dead or str(e)
            for _, future in self._calls.values():
                if not future.done():
                    future.set_exception(EngineDeadError(message))
            on_dead(message)

    def _core_died(self, core: CoreProcess, message: str) -> None:
        super()._core_died(core, message)
        for call_id, (index, future) in list(self._calls.items()):
            if index == core.index:
                del self._calls[call_id]
                if not future.done():
                    future.set_exception(EngineDeadError(message))

    async def call_utility(self, method: str, *args) -> dict[int, Any]:
        """Run `method` on every live core; each one's result by its index (less any that die meanwhile)."""
        loop = asyncio.get_running_loop()
        calls = {cid: (i, loop.create_future()) for cid, i in self._send_utility(method, args).items()}
        self._calls.update(calls)
        results = {}
        for index, future in calls.values():
            try:
                result = await future
            except EngineDeadError:
                if self.dead:
                    raise
                continue
            results[index] = self._result(result)
        return results

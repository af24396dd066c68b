"""The engine core: a busy loop in its own process that owns the scheduler and the KV cache.

Each iteration: drain new requests and aborts → Scheduler.schedule() → Executor.execute_model() →
Scheduler.update_from_output() → send outputs; with nothing to do it blocks on its input socket. A front end
starts it (`python -m engine.core IN OUT PID`, a fresh interpreter, never a fork) or connects to it headless
on another host (`kiln serve --headless`); either way StartCore comes first, and every message is msgpack.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time

import msgspec
import zmq

from engine import cluster
from engine.api_clients import ApiClients
from engine.config import EngineConfig
from engine.executor import StepResult, make_executor, prepare_worker
from engine.headless import HOST_FAILED
from engine.messages import (
    AbortRequests,
    CoreFailed,
    CoreInput,
    CoreLoad,
    CoreReady,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Heartbeat,
    Hello,
    KVCacheEvents,
    Shutdown,
    StartCore,
    UtilityCall,
    UtilityResult,
)
from engine.processes import die_with_parent, end_process
from engine.proposer import make_proposer
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.stat_logger import StatLogger
from engine.step import SchedulerOutput
from engine.structured_output import StructuredOutputManager

logger = logging.getLogger("kiln.core")

POLL_MS = 200  # how often a headless core waiting for input checks that its front end is still there
FRONT_END_SILENCE_S = 10.0
# Prompts that arrive together (clients that started together come back together) are prefilled in full
# steps while the streams they started are in their first tokens: a pause or two early in each of those
# streams instead of a capped step beside them until the last prompt of the burst is in.
SETTLING_TOKENS = 3
IDLE_WAIT_S = 0.005  # how long an empty step waits for a compiling grammar before looking for input again


class EngineCore:
    """Scheduler + executor, stepping together; no I/O (EngineCoreProc adds that)."""

    UTILITIES = ("stats", "reset_prefix_cache")

    def __init__(self, config: EngineConfig, model_dir: str, gguf_file: str | None = None) -> None:
        logger.info("engine config: %s", msgspec.json.encode(config).decode())
        self.executor = make_executor(config, model_dir, gguf_file)
        self.config = c = self.executor.config
        start = time.perf_counter()
        self.num_blocks = self.executor.initialize()
        self.structured = StructuredOutputManager(
            model_dir, self.executor.vocab_size, parallel_masks=self.executor.device != "cpu"
        )
        logger.info("engine ready in %.1f s after loading weights", time.perf_counter() - start)
        self.scheduler = Scheduler(
            SchedulerConfig.of(c, self.executor.max_model_len, self.num_blocks, SETTLING_TOKENS),
            structured=self.structured,
            proposer=make_proposer(c.speculative_config),
        )
        self.scheduled_time: dict[str, float] = {}
        # Steps sent and not yet answered, oldest first: up to one per pipeline stage, and one more for
        # overlapped scheduling (the next step sent before the last one's tokens are taken).
        self.in_flight: collections.deque[tuple[SchedulerOutput, StepResult]] = collections.deque()
        self.depth = c.pipeline_parallel_size + c.async_scheduling
        self.stat_logger = StatLogger()

    def ready_message(self, engine_index: int) -> CoreReady:
        e = self.executor
        return CoreReady(
            self.config, self.num_blocks, e.max_model_len, e.dtype, e.device, e.vocab_size, engine_index
        )

    def add_request(self, req: EngineCoreRequest) -> list[EngineCoreOutput]:
        """Queue a request's samples; one that can never run is finished at once ("abort", why in
        stop_reason). The samples share the prompt's token list and the constraint's compiled grammar."""
        samples, so = req.samples(), req.sampling_params.structured_outputs
        grammars = (
            self.structured.grammars(so, req.eos_token_id, len(samples)) if so else [None] * len(samples)
        )
        rejected = []
        for i, (sample, grammar) in enumerate(zip(samples, grammars)):
            request = Request(
                sample.request_id,
                req.prompt_token_ids,
                sample.sampling_params,
                req.eos_token_id,
                req.arrival_time,
                req.cache_salt,
                grammar,
                req.request_id,
                i,
            )
            try:
                self.scheduler.add_request(request)
            except ValueError as e:
                rejected.append(
                    EngineCoreOutput(sample.request_id, [], finish_reason="abort", stop_reason=str(e))
                )
        return rejected

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        for rid in request_ids:
            self.scheduled_time.pop(rid, None)
        return self.scheduler.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.in_flight)

    def step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        failed = self.scheduler.take_failed()
        if so.is_empty and not self.in_flight:
            self.executor.execute_model(so)  # still drops the state of requests finished since the last step
            self.structured.wait(IDLE_WAIT_S)  # a grammar still compiling: don't spin on an empty step
            return failed
        now = time.time()
        for new in so.new_reqs:
            self.scheduled_time.setdefault(new.req_id, now)
        if self.depth > 1:
            # Queue this step behind the ones in flight (an empty one only for the state it drops), then,
            # with as many in flight as the pipeline holds or nothing new to send, take the oldest's tokens
            # (the workers answer in order: an empty step's answer is taken in its turn, not left behind).
            if not so.is_empty or so.finished_req_ids:
                self.in_flight.append((so, self.executor.execute_model_async(so)))
            if len(self.in_flight) < self.depth and not so.is_empty:
                return failed
            so, launched = self.in_flight.popleft()
            runner_output = launched.result()
        else:
            start = time.perf_counter()
            runner_output = self.executor.execute_model(so)
            if (budget := self.scheduler.step_budget) is not None:
                budget.observe_step(so, time.perf_counter() - start, self.scheduler.requests)
        outputs = failed + self.scheduler.update_from_output(so, runner_output)
        for out in outputs:
            out.scheduled_time = self.scheduled_time.pop(out.request_id, None)  # only on the first output
        self.stat_logger.record(so.num_prompt_tokens, sum(len(out.new_token_ids) for out in outputs))
        self.stat_logger.maybe_log(self.stats)
        return outputs

    def stats(self) -> dict:
        return dataclasses.asdict(self.scheduler.stats())

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()


class EngineCoreProc:
    """EngineCore behind two zmq sockets: PULL for inputs, PUSH for outputs. A local core connects to its
    front end's sockets. A headless one (`listen`) binds its own, for its cluster's peers only
    (engine/cluster.py), its outputs a ROUTER that sends only to the front end whose StartCore it took
    (its session); it stops once that front end has been silent for FRONT_END_SILENCE_S, or when
    another front end's StartCore comes, for its host to start a fresh core."""

    def __init__(
        self,
        input_addr: str,
        output_addr: str,
        listen: bool = False,
        key_file: str | None = None,
        clients: tuple[str, int] | None = None,
        prepare: str = "compile",
    ) -> None:
        """`clients`: the launcher's directory and the number of clients, for a core started for several API
        servers (engine/api_clients.py), which binds its input there; `prepare`: engine/executor.py's."""
        self.ctx = zmq.Context(io_threads=1)
        self.input = self.ctx.socket(zmq.PULL)
        self.output = None if clients else self.ctx.socket(zmq.ROUTER if listen else zmq.PUSH)
        self.listen, self.key_file, self.auth, self.refused = listen, key_file, None, []
        self.prepare = prepare
        self.session: bytes | None = None
        self.clients = ApiClients(self.ctx, *clients) if clients else None
        if clients:
            self.input.bind(input_addr)
        elif listen:
            key = cluster.load_key(key_file)
            self.auth = cluster.authenticator(self.ctx, key)  # before the first peer can connect
            self.refused = [cluster.RefusedConnections(self.input, input_addr)]
            self.refused.append(cluster.RefusedConnections(self.output, output_addr))
            cluster.listen(self.input, input_addr, key)
            cluster.listen(self.output, output_addr, key)
        else:
            self.input.connect(input_addr)
            self.output.connect(output_addr)
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.core: EngineCore | None = None
        self.engine_index = 0
        self.last_heard = time.monotonic()

    def send(self, msg, client: int | None = None) -> None:
        """`msg` to the front end (`client`: to that API server; None: to every one)."""
        frame = self.encoder.encode(msg)
        if self.clients is not None:
            self.clients.send(frame, client)
        elif not self.listen:
            self.output.send(frame, copy=False)
        elif self.session is not None:  # a ROUTER drops what its front end, gone, cannot take
            self.output.send_multipart([self.session, frame], copy=False)

    def run(self) -> None:
        try:
            prepare_worker(self.prepare)
            start = self._receive()
            while not isinstance(start, StartCore):  # heartbeats, or what a core before this one missed
                if isinstance(start, Hello) and self.clients is not None:
                    self.clients.greeted.add(start.client)
                elif not isinstance(start, Heartbeat | None):
                    logger.warning("dropped %s: StartCore comes first", type(start).__name__)
                start = self._receive()
            self.engine_index, self.session = start.engine_index, start.session
            config = start.config
            if self.listen:  # this host's key, not the front end's path to its own
                config = msgspec.structs.replace(config, cluster_key_file=self.key_file)
            self.core = EngineCore(config, start.model_dir, start.gguf_file)
            if start.publish_kv_events or self.clients is not None:
                self.core.scheduler.kv_cache_manager.block_pool.record_events()
        except Exception as e:
            logger.exception("engine core failed to start")
            self.send(CoreFailed(f"engine core failed to start: {type(e).__name__}: {e}", self.engine_index))
            raise
        self.send(self.core.ready_message(self.engine_index))
        try:
            while True:
                # Idle: block until something arrives. Busy: take only what is already queued.
                if not self._drain_inputs(block=not self.core.has_work()):
                    return
                if self.clients is not None and (gone := self.clients.gone()):
                    # Their API server is gone: nobody reads them (the coordinator hears of the load).
                    self._send_outputs(self.core.abort_requests(gone))
                if outputs := self.core.step():
                    self._send_outputs(outputs)
        except Exception as e:
            logger.exception("engine core failed")
            self.send(CoreFailed(f"engine core failed: {type(e).__name__}: {e}", self.engine_index))
            raise
        finally:
            self.core.executor.shutdown()
            if self.auth is not None:
                self.auth.stop()

    def _receive(self, flags: int = 0):
        """The next input (zmq.Again if NOBLOCK finds none); None for a frame that is not one, which is
        logged and dropped."""
        frame = self.input.recv(flags)
        try:
            msg = self.decoder.decode(frame)
        except msgspec.MsgspecError as e:
            logger.warning("dropped a malformed input frame (%d bytes): %s", len(frame), e)
            return None
        if not isinstance(msg, Heartbeat) or msg.session == self.session:
            self.last_heard = time.monotonic()
        return msg

    def _front_end_left(self) -> bool:
        """A headless core's front end is gone once it has been silent for FRONT_END_SILENCE_S (it sends a
        heartbeat every second, and its host or process may vanish without closing anything)."""
        for refused in self.refused:
            refused.log()
        silent = time.monotonic() - self.last_heard
        if self.listen and silent > FRONT_END_SILENCE_S:
            logger.info("the front end has been silent for %.0f s: stopping", silent)
            return True
        return False

    def _drain_inputs(self, block: bool) -> bool:
        """Apply every pending input; False once asked to shut down or the front end has left."""
        outputs: list[EngineCoreOutput] = []
        while block and not self.input.poll(POLL_MS):
            if self._front_end_left():
                return False
        flags = 0 if block else zmq.NOBLOCK
        while True:
            try:
                msg = self._receive(flags)
            except zmq.Again:
                break
            flags = zmq.NOBLOCK
            if isinstance(msg, EngineCoreRequest):
                if self.clients is not None and msg.client not in self.clients.greeted:
                    continue  # sent by an API server since gone
                if self.clients is not None:
                    self.clients.owner.update(dict.fromkeys(msg.sample_ids(), msg.client))
                outputs.extend(self.core.add_request(msg))
            elif isinstance(msg, AbortRequests):
                outputs.extend(self.core.abort_requests(msg.request_ids))
            elif isinstance(msg, UtilityCall):
                self.send(self._utility(msg), msg.client)
            elif isinstance(msg, Hello) and self.clients is not None:
                self.clients.greeted.add(msg.client)
                self.send(self.core.ready_message(self.engine_index), msg.client)
            elif isinstance(msg, Shutdown):
                return False
            elif isinstance(msg, StartCore) and msg.session != self.session:  # engine/core_procs.py
                logger.warning("another front end connected: stopping, for a fresh engine core to serve it")
                return False
        if outputs:
            self._send_outputs(outputs)
        # Checked once the queue is drained: a step longer than the silence left heartbeats waiting in it.
        return block or not self._front_end_left()

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        pool = self.core.scheduler.kv_cache_manager.block_pool
        events = pool.take_kv_events()
        events = KVCacheEvents(*events) if events is not None else None
        if self.clients is None:
            self.send(EngineCoreOutputs(outputs, self.engine_index, pool.usage, events))
            return
        for client, outs in self.clients.by_client(outputs).items():
            self.send(EngineCoreOutputs(outs, self.engine_index, pool.usage), client)
        s = self.core.scheduler
        load = CoreLoad(self.engine_index, len(s.running), len(s.waiting), pool.usage, events)
        with contextlib.suppress(zmq.Again):  # the coordinator gone: routing goes on without its view
            self.clients.coordinator.send(self.encoder.encode(load), copy=False, flags=zmq.NOBLOCK)

    def _utility(self, call: UtilityCall) -> UtilityResult:
        result, error = None, f"unknown utility {call.method!r}"
        if call.method in EngineCore.UTILITIES:
            try:
                result, error = getattr(self.core, call.method)(*call.args), None
            except Exception as e:  # a failed utility call must not take the engine down
                error = f"{type(e).__name__}: {e}"
        return UtilityResult(call.call_id, result, error, self.engine_index)


def main() -> None:
    """`python -m engine.core IN OUT PREPARE PARENT_PID`, started by a front end; `--shared DIR INDEX CLIENTS
    PREPARE PARENT_PID`, by the launcher of several API servers (PREPARE: engine/executor.py's); or
    `--listen tcp://HOST:PORT HOST_PID [--cluster-key-file FILE]`, headless: waiting there (and on PORT+1)
    for a front end, until it leaves."""
    logging.basicConfig(
        level=os.environ.get("KILN_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format="%(levelname)s %(asctime)s [core] %(message)s",
        datefmt="%H:%M:%S",
    )
    if sys.argv[1] == "--listen":
        host, port = sys.argv[2].removeprefix("tcp://").rsplit(":", 1)
        key_file = sys.argv[5] if len(sys.argv) > 5 else None
        die_with_parent(int(sys.argv[3]))  # `kiln serve --headless`, which restarts it for the next front end
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            proc = EngineCoreProc(
                sys.argv[2], f"tcp://{host}:{int(port) + 1}", listen=True, key_file=key_file
            )
            prepare_worker("compile")  # for the front ends to come, whose configs it cannot know
        except Exception:
            logger.exception("the headless engine core cannot start")
            sys.exit(HOST_FAILED)
        proc.run()
        return
    parent = int(sys.argv[-1])
    die_with_parent(parent)

    def on_sigterm(*_: object) -> None:
        # A SIGTERM to the whole process group (a supervisor stopping it) reaches us too: while the front
        # end lives it drains its requests and then stops us itself.
        if os.getppid() != parent:
            sys.exit(0)
        logger.info("SIGTERM: the front end will stop the engine once it has drained")

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    if sys.argv[1] == "--shared":  # DIR INDEX CLIENTS: started for several API servers
        directory, index, clients, prepare = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
        shared = (directory, clients)
        EngineCoreProc(f"ipc://{directory}/in{index}", "", clients=shared, prepare=prepare).run()
    else:
        EngineCoreProc(sys.argv[1], sys.argv[2], prepare=sys.argv[3]).run()


if __name__ == "__main__":
    main()
    end_process()

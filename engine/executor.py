"""The engine core's handle on its workers, found by name: the core's code never imports the worker's.

`Executor` keeps the one worker in the engine-core process (one rank); `MultiprocExecutor` starts one worker
process per rank (tensor-parallel ranks × pipeline stages) and reaches them over zmq. Either way everything
that crosses is the step contract (engine/step.py) or a plain value, msgspec-encoded between processes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import msgspec
import zmq

from engine import cluster
from engine import messages as m
from engine.config import EngineConfig, pipeline_partition, tensor_parallel_error
from engine.processes import WORKER_TOPIC, free_port, worker_sockets
from engine.step import ModelRunnerOutput, SchedulerOutput

WORKER_CLASS = "compiled.worker.Worker"
POLL_MS = 200  # how often a wait for workers checks that they all live

logger = logging.getLogger("kiln.core")


def worker_class() -> type:
    """The worker class; importing its module (torch, Dynamo, Inductor) takes seconds."""
    module, _, name = WORKER_CLASS.rpartition(".")
    return getattr(importlib.import_module(module), name)


def in_process(config: EngineConfig) -> bool:
    """Whether the engine core's own process runs the model: one rank, no workers elsewhere."""
    return config.tensor_parallel_size * config.pipeline_parallel_size == 1 and not config.worker_address


def preparation(config: EngineConfig) -> str:
    """What an engine core prepares while it waits for its config (`prepare_worker`): `compile` where its
    own process compiles the model, `eager` where it runs it eagerly, `none` where workers run it."""
    if not in_process(config):
        return "none"
    return "eager" if config.enforce_eager else "compile"


def prepare_worker(how: str) -> None:
    """Seconds of imports that overlap the front end's own start, as `preparation` chose them: the worker's
    module, and where it compiles, what a compile needs first (an eager process imports no Inductor)."""
    if how != "none":
        worker = worker_class()
        if how == "compile":
            worker.prepare()


def make_executor(config: EngineConfig, model_dir: str, gguf_file: str | None = None) -> Executor:
    if in_process(config):
        return Executor(config, model_dir, gguf_file)
    return MultiprocExecutor(config, model_dir, gguf_file)


class Executor:
    """The worker in this process. Subclasses keep its interface: the properties, then these calls."""

    def __init__(self, config: EngineConfig, model_dir: str, gguf_file: str | None = None) -> None:
        self.worker = worker_class()(config, model_dir, gguf_file)
        self.config: EngineConfig = self.worker.config  # budgets resolved for the device
        self.max_model_len: int = self.worker.max_model_len
        self.dtype: str = self.worker.dtype
        self.device: str = self.worker.device
        self.vocab_size: int = self.worker.vocab_size
        # Overlapped scheduling runs the worker on a thread of its own, every call from then on (CUDA
        # graphs replay on the thread that captured them); torch's kernels leave the GIL to the scheduler.
        self.thread = ThreadPoolExecutor(1, "kiln-worker") if self.config.async_scheduling else None

    def initialize(self) -> int:
        """Size and allocate the KV cache, then compile and warm up; returns the number of KV blocks."""
        num_blocks = min(self._call("determine_num_blocks"))  # every rank's cache holds them
        bs = self.config.block_size
        held = (num_blocks - 1) * bs  # block 0 is the null block
        if held < self.max_model_len:
            # Refused here, not per request: a prompt the cache can never hold would never finish.
            raise ValueError(
                f"the KV cache holds {held} tokens ({num_blocks - 1} blocks of {bs}), fewer than one "
                f"sequence of max_model_len={self.max_model_len}: give it more memory (kv_cache_memory, "
                "num_kv_blocks) or lower max_model_len"
            )
        self._call("initialize_kv_cache", num_blocks)
        self._call("warm_up")
        return num_blocks

    def _call(self, method: str, *args: Any) -> list:
        """`method`'s answer from every worker, in rank order."""
        call = getattr(self.worker, method)
        return [call(*args) if self.thread is None else self.thread.submit(call, *args).result()]

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(so)

    def execute_model_async(self, so: SchedulerOutput) -> StepResult:
        """Queue a step behind the ones in flight (async_scheduling); its `result()` waits for it."""
        return self.thread.submit(self.worker.execute_model, so)

    def shutdown(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=True, cancel_futures=True)


class StepResult(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class _NextStepOutput:
    """The answer to the oldest step the workers have not answered yet."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self.executor = executor

    def result(self) -> ModelRunnerOutput:
        return self.executor._wait(m.WorkerStepOutput, 1)[0].output


class MultiprocExecutor(Executor):
    """One worker process per rank, each sent every call; a call's answer is every rank's, a step's is the
    tokens of the last pipeline stage's first rank. Steps are answered in the order sent, several in
    flight under pipeline parallelism. A worker that fails or exits fails the engine core (RuntimeError),
    which takes the other workers with it: each dies with the core."""

    def __init__(self, config: EngineConfig, model_dir: str, gguf_file: str | None = None) -> None:
        tp = config.tensor_parallel_size
        self.size = size = tp * config.pipeline_parallel_size
        hf_config = Path(model_dir) / "config.json"
        if hf_config.exists():  # a GGUF's first start has none yet: its workers check after converting
            c = json.loads(hf_config.read_text())
            heads = c.get("num_attention_heads", 0)
            kv_heads = c.get("num_key_value_heads") or heads
            if error := tensor_parallel_error(heads, kv_heads, c.get("intermediate_size", 0), tp):
                raise ValueError(f"{model_dir} cannot run tensor-parallel: {error}")
            if config.pipeline_parallel_size > 1:  # ValueError where the layers do not split so
                layers = c.get("num_hidden_layers", 0)
                pipeline_partition(layers, config.pipeline_parallel_size, config.pipeline_layer_partition)
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        # Every call goes to every rank alike: one XPUB socket. Each worker subscribes to its own name
        # too, which XPUB reports (VERBOSER: every one) as it joins and as its connection ends, so that
        # nothing is sent before all of them listen and a worker gone is known by name.
        self.inputs = self.ctx.socket(zmq.XPUB)
        self.inputs.setsockopt(zmq.XPUB_VERBOSER, 1)
        self.replies = self.ctx.socket(zmq.PULL)
        self.ipc_dir, self.procs, self.auth, self.refused = None, [], None, []
        if config.worker_address:  # workers started elsewhere (torchrun) connect to these
            in_addr, out_addr = worker_sockets(config.worker_address)
            self.inputs.setsockopt(zmq.LINGER, 2000)  # the last Shutdown still reaches them as we stop
            key = cluster.load_key(config.cluster_key_file)
            self.auth = cluster.authenticator(self.ctx, key)  # before the first peer can connect
            self.refused = [
                cluster.RefusedConnections(s, a)
                for s, a in ((self.inputs, in_addr), (self.replies, out_addr))
            ]
            cluster.listen(self.inputs, in_addr, key)
            cluster.listen(self.replies, out_addr, key)
        else:
            self.ipc_dir = tempfile.mkdtemp(prefix="kiln-workers-")
            in_addr, out_addr = f"ipc://{self.ipc_dir}/in", f"ipc://{self.ipc_dir}/out"
            self.inputs.bind(in_addr)
            self.replies.bind(out_addr)
        self.workers: dict[bytes, bool] = {}  # each worker's name: whether it is still connected
        self.encoder = msgspec.msgpack.Encoder(enc_hook=m.encode_array)
        self.decoder = msgspec.msgpack.Decoder(m.WorkerOutput)
        if not config.worker_address:
            # torch.distributed's rendezvous: as the environment gives it, else a free port here.
            env = {"MASTER_ADDR": "127.0.0.1", **os.environ}
            env.setdefault("MASTER_PORT", str(free_port(env["MASTER_ADDR"])))
            cmd = [sys.executable, "-m", "compiled.worker", in_addr, out_addr, "--parent", str(os.getpid())]
            self.procs = [
                subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdin=subprocess.DEVNULL)
                for r in range(size)
            ]
        try:
            self._wait_subscribed(size, config.worker_address)
            self._send(m.StartWorker(config, model_dir, gguf_file))
            ready = self._wait(m.WorkerReady, size)[0]
        except BaseException:
            self.shutdown()
            raise
        self.config, self.max_model_len, self.vocab_size = ready.config, ready.max_model_len, ready.vocab_size
        self.dtype, self.device = ready.dtype, ready.device

    def _wait_subscribed(self, size: int, addr: str | None) -> None:
        if addr:
            logger.info(
                "waiting for %d workers at %s (python -m compiled.worker --connect %s)", size, addr, addr
            )
        while len(self.workers) < size:
            self.inputs.poll(POLL_MS)
            self._check_alive()
            for refused in self.refused:  # a worker with another key waits here: say why
                refused.log()

    def _send(self, msg: m.WorkerInput) -> None:
        self.inputs.send(self.encoder.encode(msg), copy=False)

    def _check_alive(self, but: int | None = None) -> None:
        """RuntimeError for a worker started here that exited, or any whose connection ended (its host
        gone, or it stopped answering heartbeats: engine/cluster.py)."""
        for rank, proc in enumerate(self.procs):
            if rank != but and proc.poll() is not None:
                raise RuntimeError(f"worker {rank} exited unexpectedly (exit code {proc.returncode})")
        while self.inputs.poll(0):
            event = self.inputs.recv()
            name = event[1:]  # the catch-all subscription that comes with each name is not one
            if name.startswith(WORKER_TOPIC) and name[len(WORKER_TOPIC) :].split(b" ")[0].isdigit():
                self.workers[name] = event[:1] == b"\x01"
        for name, joined in self.workers.items():
            if not joined and int(name.split()[2]) != but:
                raise RuntimeError(f"{name.decode()} went away (its connection dropped or stopped answering)")

    def _wait(self, kind: type, count: int) -> list:
        """The next `count` answers of type `kind`, in rank order where they carry one; a worker's error or
        exit is a RuntimeError."""
        got = []
        while len(got) < count:
            if not self.replies.poll(POLL_MS):
                self._check_alive()
                continue
            frame = self.replies.recv()
            try:
                msg = self.decoder.decode(frame)
            except msgspec.MsgspecError as e:
                logger.warning("dropped a malformed frame from a worker (%d bytes): %s", len(frame), e)
                continue
            if isinstance(msg, m.WorkerReply) and msg.error is not None:
                # A collective fails on every rank when one rank dies: name the dead one, if that is it.
                deadline = time.monotonic() + 1.0
                while time.monotonic() < deadline:
                    self._check_alive(but=msg.rank)
                    time.sleep(0.05)
                raise RuntimeError(f"worker {msg.rank} failed: {msg.error}")
            if not isinstance(msg, kind):
                raise RuntimeError(f"expected {kind.__name__} from the workers, got {type(msg).__name__}")
            got.append(msg)
        return sorted(got, key=lambda r: getattr(r, "rank", 0))

    def _call(self, method: str, *args: Any) -> list:
        self._send(m.WorkerCall(method, list(args)))
        return [r.result for r in self._wait(m.WorkerReply, self.size)]

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(so).result()

    def execute_model_async(self, so: SchedulerOutput) -> StepResult:
        # The workers run steps in the order sent and answer in that order: results are read in turn.
        self._send(m.ExecuteModel(so))
        return _NextStepOutput(self)

    def shutdown(self) -> None:
        """Ask every worker to stop, then make sure those started here have; safe to call more than once."""
        with contextlib.suppress(zmq.ZMQError):
            self._send(m.Shutdown())
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy()
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

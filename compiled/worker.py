"""The worker: one device's model runner, from the weights on disk to a compiled, warmed-up forward.

The engine core reaches it through its executor (engine/executor.py) and speaks to it only in the step
contract (engine/step.py) and plain values, so nothing torch crosses into the engine's code.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

import msgspec
import torch

from compiled import compile_policy, parallel
from compiled.cpu_threads import CpuThreads
from compiled.gguf import convert_gguf
from compiled.host_memory import available_ram, keep_freed_memory
from compiled.loader import resolve_dtype, resolve_quantization
from compiled.model_runner import ModelRunner
from engine.config import EngineConfig
from engine.processes import end_process
from engine.step import ModelRunnerOutput, SchedulerOutput


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class Worker:
    """Owns the device: its threads, the weights (its part of them, under tensor parallelism), the KV
    cache and the model runner."""

    def __init__(
        self, config: EngineConfig, model_dir: str, gguf_file: str | None = None, rank: int = 0
    ) -> None:
        device = resolve_device(config.device)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        size = tp * pp
        # The rank that answers each step: the last pipeline stage's first, whose tokens they are.
        self.replies = rank == (pp - 1) * tp
        # This host's workers, over every data-parallel engine core, share its devices or cores.
        share, shares = config.data_parallel_rank * size + rank, config.data_parallel_size * size
        self.threads: CpuThreads | None = None  # follows the load unless the count was given
        if device.type == "cuda" and shares > 1:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", share)))  # torchrun: per host
            torch.cuda.set_device(device)
        elif device.type == "cpu" and shares > 1:
            torch.set_num_threads(_share_cores(share, shares, config.num_threads))
        elif device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif device.type == "cpu":
            self.threads = CpuThreads()
        if size > 1:
            parallel.init(rank, tp, pp, device)
        weights = os.path.join(model_dir, "model.safetensors")
        if rank == 0 and gguf_file is not None and not os.path.exists(weights):
            convert_gguf(gguf_file, model_dir)
        if size > 1:
            parallel.barrier()  # the other ranks read what rank 0 converted
        if device.type == "cpu":
            keep_freed_memory()
        gguf_path = config.model if config.model and config.model.endswith(".gguf") else None
        quantization = resolve_quantization(config.quantization, config.dtype, gguf_path, device, size)
        resolved = config.resolved(device.type == "cuda")
        self.config = msgspec.structs.replace(resolved, model=model_dir, quantization=quantization)
        self.runner = ModelRunner(self.config, device, resolve_dtype(config.dtype, device), gguf_path, rank)

    @staticmethod
    def prepare() -> None:
        """What a compile needs before its config is known, started while the engine core waits for it:
        the imports torch.compile makes on first use and, on a CPU host, the vector-ISA probe."""
        import torch._inductor.compile_fx

        if not torch.cuda.is_available():
            compile_policy.probe_vector_isa()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def dtype(self) -> str:
        return str(self.runner.dtype).removeprefix("torch.")

    @property
    def device(self) -> str:
        return str(self.runner.device)

    def determine_num_blocks(self) -> int:
        """Blocks that fit the KV-cache budget, never more than max_num_seqs full-length sequences need."""
        c, r = self.config, self.runner
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory is not None:
            budget = c.kv_cache_memory
        elif r.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            # Every rank of every engine core on a CPU allocates its cache from the same RAM.
            shares = c.tensor_parallel_size * c.pipeline_parallel_size * c.data_parallel_size
            budget = int(available_ram() * c.cpu_kv_cache_fraction) // shares
        useful = c.max_num_seqs * r.max_blocks_per_seq + 1
        num_blocks = min(budget // r.kv_bytes_per_block(), useful)
        if num_blocks < 2:
            raise ValueError(
                f"KV-cache budget of {budget} bytes holds no block ({r.kv_bytes_per_block()} bytes each)"
            )
        return int(num_blocks)

    def _cuda_kv_budget(self) -> int:
        """Device memory left after weights and the peak activations of the largest step."""
        r = self.runner
        torch.cuda.reset_peak_memory_stats(r.device)
        r.initialize_kv_cache(2)
        r.dummy_step(num_single=0, chunk_lens=[min(self.config.max_num_batched_tokens, r.max_model_len - 1)])
        peak = torch.cuda.max_memory_allocated(r.device)
        total = torch.cuda.get_device_properties(r.device).total_memory
        return int(total * self.config.gpu_memory_utilization) - peak

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def warm_up(self) -> None:
        self.runner.warmup()
        if self.threads is not None:
            self.threads.restart()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.threads is not None:
            self.threads.update()
        return self.runner.execute_model(so)


def _share_cores(share: int, shares: int, num_threads: int | None) -> int:
    """Share `share`'s threads: an equal part of the allowed cores (or of `num_threads`), pinned to cores
    of its own where there are enough, so that no two shares' threads take turns on one core."""
    cores = sorted(os.sched_getaffinity(0))
    threads = max(1, (num_threads or len(cores)) // shares)
    if len(cores) >= shares * threads:
        os.sched_setaffinity(0, cores[share * threads : (share + 1) * threads])
    return threads


def _exit_when_gone(monitor, stopping: threading.Event, rank: int) -> None:
    """Exit the process once `monitor` sees the core's connection end, unless it asked us to stop: its
    last Shutdown can arrive together with its disconnect."""
    import zmq.utils.monitor

    import engine.cluster as cluster

    event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
    if not stopping.wait(2.0):
        why = "refused this worker's key" if event & cluster.HANDSHAKE_FAILED else "went away"
        print(f"worker {rank}: the engine core {why}", file=sys.stderr, flush=True)
        os._exit(1)


def main() -> None:
    """A tensor-parallel rank's process, which runs the executor's calls (engine/executor.py) until told
    to stop: started by the engine core (`INPUT OUTPUT --rank R --parent PID`), or elsewhere by torchrun
    (`--connect tcp://HOST:PORT`, the core's --worker-address; the rank from torchrun's RANK)."""
    import argparse
    import logging

    import zmq

    import engine.cluster as cluster
    import engine.messages as m
    from engine.processes import WORKER_TOPIC, die_with_parent, worker_sockets

    parser = argparse.ArgumentParser(prog="python -m compiled.worker")
    parser.add_argument("inputs", nargs="?")
    parser.add_argument("outputs", nargs="?")
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--parent", type=int, default=None)
    parser.add_argument("--connect", default=None, help="the engine core's --worker-address")
    parser.add_argument(
        "--cluster-key-file", default=None, help="the cluster's key (default: $KILN_CLUSTER_KEY)"
    )
    args = parser.parse_args()
    if args.connect:
        args.inputs, args.outputs = worker_sockets(args.connect)
    rank = int(os.environ["RANK"]) if args.rank is None else args.rank
    if args.parent is not None:
        die_with_parent(args.parent)
    logging.basicConfig(
        level=os.environ.get("KILN_LOG_LEVEL", "INFO") if rank == 0 else "WARNING",
        stream=sys.stderr,
        format=f"%(levelname)s %(asctime)s [worker {rank}] %(message)s",
        datefmt="%H:%M:%S",
    )
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    key = cluster.load_key(args.cluster_key_file) if args.connect else None
    inputs.setsockopt(zmq.SUBSCRIBE, b"")
    inputs.setsockopt(zmq.SUBSCRIBE, WORKER_TOPIC + f"{rank} on {socket.gethostname()}".encode())
    stopping = threading.Event()
    # The core gone (however it ends, or its host silent) ends this worker, even inside a collective.
    gone = inputs.get_monitor_socket(zmq.EVENT_DISCONNECTED | cluster.HANDSHAKE_FAILED)
    threading.Thread(target=_exit_when_gone, args=(gone, stopping, rank), daemon=True).start()
    cluster.connect(inputs, args.inputs, key)
    cluster.connect(outputs, args.outputs, key)
    decoder = msgspec.msgpack.Decoder(m.WorkerInput, dec_hook=m.decode_array)
    encoder = msgspec.msgpack.Encoder()
    log = logging.getLogger("kiln.worker")
    worker: Worker | None = None
    try:
        while True:
            frame = inputs.recv()
            try:
                msg = decoder.decode(frame)
            except msgspec.MsgspecError as e:
                log.warning("dropped a malformed frame (%d bytes): %s", len(frame), e)
                continue
            if isinstance(msg, m.Shutdown):
                stopping.set()
                break
            if isinstance(msg, m.ExecuteModel):
                out = worker.execute_model(msg.scheduler_output)
                if worker.replies:
                    outputs.send(encoder.encode(m.WorkerStepOutput(out)))
            elif isinstance(msg, m.WorkerCall):
                result = getattr(worker, msg.method)(*msg.args)
                outputs.send(encoder.encode(m.WorkerReply(rank, result)))
            else:
                worker = Worker(msg.config, msg.model_dir, msg.gguf_file, rank)
                info = (worker.config, worker.max_model_len, worker.dtype, worker.device, worker.vocab_size)
                outputs.send(encoder.encode(m.WorkerReady(rank, *info)))
    except Exception as e:
        log.exception("worker %d failed", rank)
        outputs.send(encoder.encode(m.WorkerReply(rank, error=f"{type(e).__name__}: {e}")))
        sys.exit(1)
    parallel.shutdown()


if __name__ == "__main__":
    main()
    end_process()

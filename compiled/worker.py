"""The worker: one device's model runner, from the weights on disk to a compiled, warmed-up forward.

The engine core reaches it through its executor (engine/executor.py) and speaks to it only in the step
contract (engine/step.py) and plain values, so nothing torch crosses into the engine's code.
"""

from __future__ import annotations

import os

import msgspec
import torch
import torch._inductor.compile_fx  # what torch.compile imports on first use: loaded with this module

from compiled.cpu_threads import CpuThreads
from compiled.loader import convert_gguf, resolve_dtype
from compiled.model_runner import ModelRunner
from compiled.quant import keep_freed_memory
from engine.config import EngineConfig
from engine.step import ModelRunnerOutput, SchedulerOutput


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Worker:
    """Owns the device: its threads, the weights, the KV cache and the model runner."""

    def __init__(self, config: EngineConfig, model_dir: str, gguf_file: str | None = None) -> None:
        device = resolve_device(config.device)
        self.threads: CpuThreads | None = None  # follows the load unless the count was given
        if device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif device.type == "cpu":
            self.threads = CpuThreads()
        if gguf_file is not None and not os.path.exists(os.path.join(model_dir, "model.safetensors")):
            convert_gguf(gguf_file, model_dir)
        if device.type == "cpu" and config.quantization != "none":
            keep_freed_memory()
        gguf_path = config.model if config.model and config.model.endswith(".gguf") else None
        self.config = msgspec.structs.replace(config.resolved(device.type == "cuda"), model=model_dir)
        self.runner = ModelRunner(self.config, device, resolve_dtype(config.dtype, device), gguf_path)

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
            budget = int(_available_ram() * c.cpu_kv_cache_fraction)
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

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.threads is not None:
            self.threads.update()
        return self.runner.execute_model(so)


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")

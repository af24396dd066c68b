"""The engine core's handle on its worker, found by name: the core's code never imports the worker's.

One worker in the engine-core process (tensor parallelism would put one per device behind the same
calls). Everything that crosses is the step contract (engine/step.py) or a plain value.
"""

from __future__ import annotations

import importlib

from engine.config import EngineConfig
from engine.step import ModelRunnerOutput, SchedulerOutput

WORKER_CLASS = "compiled.worker.Worker"


def import_worker_module() -> None:
    """Import the worker's module (torch, Dynamo, Inductor): seconds that can overlap other start-up work."""
    importlib.import_module(WORKER_CLASS.rpartition(".")[0])


class Executor:
    def __init__(self, config: EngineConfig, model_dir: str, gguf_file: str | None = None) -> None:
        module, _, name = WORKER_CLASS.rpartition(".")
        self.worker = getattr(importlib.import_module(module), name)(config, model_dir, gguf_file)
        self.config: EngineConfig = self.worker.config  # budgets resolved for the device
        self.max_model_len: int = self.worker.max_model_len
        self.dtype: str = self.worker.dtype
        self.device: str = self.worker.device
        self.vocab_size: int = self.worker.vocab_size

    def initialize(self) -> int:
        """Size and allocate the KV cache, then compile and warm up; returns the number of KV blocks."""
        num_blocks = self.worker.determine_num_blocks()
        bs = self.config.block_size
        held = (num_blocks - 1) * bs  # block 0 is the null block
        if held < self.max_model_len:
            # Refused here, not per request: a prompt the cache can never hold would never finish.
            raise ValueError(
                f"the KV cache holds {held} tokens ({num_blocks - 1} blocks of {bs}), fewer than one "
                f"sequence of max_model_len={self.max_model_len}: give it more memory (kv_cache_memory, "
                "num_kv_blocks) or lower max_model_len"
            )
        self.worker.initialize_kv_cache(num_blocks)
        self.worker.warm_up()
        return num_blocks

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(so)

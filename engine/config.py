"""Engine arguments, shared by the front end, the engine core and the model runner."""

from __future__ import annotations

import msgspec


class EngineConfig(msgspec.Struct, kw_only=True):
    """Names follow vLLM's engine arguments where they exist."""

    model: str | None = None  # HF directory, .gguf file, or None for the embedded default
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 64
    # Tokens one step may compute. None: picked by `usage` and device. Serving on CPU: 128, since a step
    # computes ~500 tokens/s and a longer prefill chunk stalls every running stream's next token (16
    # streams: inter-token p99 9.8x its median at 1024, 2.4x at 128); offline on CPU: 1024, where
    # larger prefill chunks beside the decodes finish the batch sooner (73 vs 46 output tok/s).
    # CUDA: 2048 serving, 8192 offline. Without chunked prefill: 8192 (a prompt must fit one step).
    # Never fewer than max_num_seqs. Figures: BENCHMARKS.md.
    max_num_batched_tokens: int | None = None
    usage: str = "offline"  # offline (LLM) | serving (AsyncLLM, kiln serve): which defaults apply
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: sized from the device
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory kiln may use
    cpu_kv_cache_fraction: float = 0.25  # CPU: fraction of available RAM for the KV cache
    num_kv_blocks: int | None = None  # exact pool size (tests); overrides the memory-based sizing
    enforce_eager: bool = False
    num_threads: int | None = None  # torch threads of the process that runs the model (None: all cores)
    tensor_parallel_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            serving = self.usage == "serving"
            budget = 8192 if not self.enable_chunked_prefill else (2048 if serving else 8192) if self.on_cuda() \
                else (128 if serving else 1024)
            self.max_num_batched_tokens = max(budget, self.max_num_seqs)  # room for every sequence's decode
        checks = [
            (self.block_size in (8, 16, 32, 64, 128), "block_size", "must be one of 8, 16, 32, 64, 128"),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1"),
            (self.usage in ("offline", "serving"), "usage", "must be offline or serving"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be at least 1"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be at least 2"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]"),
            (0.0 < self.cpu_kv_cache_fraction < 1.0, "cpu_kv_cache_fraction", "must be in (0, 1)"),
            (self.tensor_parallel_size == 1, "tensor_parallel_size", "must be 1: tensor parallelism is not implemented yet"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device", "must be auto, cpu or cuda"),
        ]
        for ok, field, message in checks:
            if not ok:
                raise ValueError(f"{field} {message} (got {getattr(self, field)!r})")

    def on_cuda(self) -> bool:
        if self.device == "auto":
            import torch

            return torch.cuda.is_available()
        return self.device.startswith("cuda")

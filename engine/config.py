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
    # Tokens one step may compute. None: 1024 on CPU (a step computes ~500 tokens/s), 8192 on CUDA;
    # without chunked prefill 8192 (a prompt must fit one step); never fewer than max_num_seqs.
    max_num_batched_tokens: int | None = None
    # ... and a step that carries decodes. None: for serving on CPU 64, so a new prompt holds running
    # streams' next tokens for a fraction of a second (16 streams: inter-token p99 9.8x its median at
    # 1024; since decode steps got faster, 3.4-3.6x at 128, 3.0x at 96, 1.3x at 64, BENCHMARKS.md),
    # while a lone prompt still prefills in 1024-token steps; 2048 for serving on CUDA; offline no
    # extra limit (larger chunks beside decodes finish a batch sooner).
    max_num_batched_tokens_decoding: int | None = None
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
            budget = 1024 if self.enable_chunked_prefill and not self.on_cuda() else 8192
            self.max_num_batched_tokens = max(budget, self.max_num_seqs)  # room for every sequence's decode
        if self.max_num_batched_tokens_decoding is None:
            serving = self.usage == "serving" and self.enable_chunked_prefill
            self.max_num_batched_tokens_decoding = (2048 if self.on_cuda() else 64) if serving else 0
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

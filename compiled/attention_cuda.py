"""CUDA attention: the KV cache in device memory; each chunk alone through SDPA's fused kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from compiled.attention import AttentionBackend


class CudaAttention(AttentionBackend):
    vector_bytes = 64  # as AVX-512's: a choice not measured on a GPU

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.zeros(shape, device=self.device, dtype=dtype)

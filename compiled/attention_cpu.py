"""CPU attention: the KV cache in memory committed as blocks are first used, and a step's fresh prompts
tiled together (compiled/attention.py: `_fresh_prompts`)."""

from __future__ import annotations

import contextlib
import math
import mmap

import torch
from torch import Tensor

from compiled.attention import AttentionBackend


class CpuAttention(AttentionBackend):
    # Inductor's CPU kernels use 32-byte vectors on AVX2 and 64-byte ones on AVX-512.
    vector_bytes = 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32
    # Batched tile by tile, fresh prompts beat SDPA called prompt by prompt (see `_fresh_prompts`).
    tile_fresh_prompts = True

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return _lazy_zeros(shape, dtype)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A zero CPU tensor in a private anonymous mapping of its own: pages read as zero until written and
    are committed as blocks are first used, where zeroing a large cache at start took seconds. Small pages,
    not transparent huge ones: where the host backs a VM's memory as it is first touched, committing a fresh
    2 MiB page took an order of magnitude longer than 2 MiB of 4 KiB pages, and an engine touches every page
    it serves from."""
    count = math.prod(shape)
    nbytes = -(-max(count, 1) * dtype.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # a kernel without transparent huge pages
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)  # keeps the mapping alive

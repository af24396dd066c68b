"""Where a CPU engine's memory lives: weights in one block on huge pages, a step's temporaries in memory
kept from step to step.

A batch-1 decode step streams every weight once. Allocated tensor by tensor, weights under 2 MiB lie on
4 KiB pages (the allocator asks for huge pages only for larger blocks, and only when told to): the stream
then walks a page table entry every 4 KiB. In one block advised for 2 MiB pages, a one-row product of
a quantized layer weight runs faster. Where the kernel gives no huge pages (`never` in
/sys/kernel/mm/transparent_hugepage/enabled) the weights still lie side by side.

A step's large temporaries (activations of a 4096-token prefill, a batch's logits) are tens of MB. glibc
serves blocks that large with fresh mappings, or trims the heap's top, and hands the pages back when they
are freed, so every step faults its temporaries in and clears them again. Kept, a prefill step's page faults
are little more than its KV pages' first touch, and it runs faster.
"""

from __future__ import annotations

import ctypes
import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line, as the allocator would start it
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Process-wide: serve every allocation from the heap and never hand its top back to the kernel, so a
    step reuses the pages earlier ones touched; resident memory stays at the largest step's high-water
    mark. mallopt takes a C int: a larger threshold would wrap (to 0, trimming on every free). False
    where the C library is not glibc (nothing changes)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def move_weights(model: nn.Module) -> None:
    """Every CPU parameter of `model` (a tied one once) copied into one huge-page block, which then backs
    it; the block lives as long as any of them (torch.frombuffer holds it)."""
    params = list({p.data_ptr(): p for p in model.parameters() if p.device.type == "cpu"}.values())
    if not params:
        return
    sizes = [-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in params]
    block = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        block.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(block, dtype=torch.uint8)
    offset = -memory.data_ptr() % HUGE_PAGE  # huge pages cover 2 MiB-aligned ranges only
    for p, size in zip(params, sizes):
        n = p.numel() * p.element_size()
        home = memory[offset : offset + n]
        home.copy_(p.data.contiguous().view(-1).view(torch.uint8))  # bytes as they are (NaN patterns too)
        p.data = home.view(p.dtype).view(p.shape)
        offset += size


def available_ram() -> int:
    """Bytes of RAM the kernel can give without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")

"""Tensor-parallel collectives through shared memory, for ranks on one CPU host.

gloo's all-reduce of one hidden state between two processes on one host is slow, and a decode step
makes two per layer; writing each rank's tensor to a shared-memory slot and waiting for the others' is
many times faster. One primitive serves all three collectives a step needs: every rank publishes
its tensor and reads everyone's (an all-gather), then sums them, joins them or takes rank 0's.

Layout: a header of per-rank sequence numbers, then two banks of one slot per rank. A call bumps the
rank's sequence, writes its slot in bank `seq % 2`, publishes the sequence and waits until every rank
has published it. Invariant: a rank writes a bank only after every rank has published the call after
that bank's last use, so no slot is overwritten while someone still reads it. Stores and loads stay in
program order on x86 (TSO), which the flags rely on: other machines keep gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import time

import numpy as np
import torch
from torch import Tensor

SLOT_BYTES = 4 << 20  # larger tensors (long prefill chunks, many rows of prompt logits) go through gloo
HEADER = 4096
SPINS_BEFORE_YIELD = 64  # past this a waiting rank yields its core: more ranks than cores must all run
TIMEOUT_S = 600.0
MAX_VIEWS = 512


def supported() -> bool:
    """x86 with /dev/shm, unless KILN_SHM_COLLECTIVES=0 asks for gloo."""
    wanted = os.environ.get("KILN_SHM_COLLECTIVES", "1") != "0"
    return wanted and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def file_bytes(size: int) -> int:
    return HEADER + 2 * size * SLOT_BYTES


def create(path: str, size: int) -> None:
    """The exchange file of `size` ranks: a new file (never one someone placed at that name) that only this
    user can open from its first moment, since every request's hidden states pass through it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, file_bytes(size))
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


class ShmExchange:
    def __init__(self, rank: int, size: int, path: str) -> None:
        self.rank, self.size, self.seq = rank, size, 0
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, file_bytes(size))
        finally:
            os.close(fd)
        self.flags = np.frombuffer(self.map, dtype=np.int64, count=size)
        self.banks = torch.frombuffer(self.map, dtype=torch.uint8, offset=HEADER, count=2 * size * SLOT_BYTES)
        self.banks = self.banks.view(2, size, SLOT_BYTES)
        self.views: dict[tuple, tuple[Tensor, Tensor]] = {}

    def fits(self, x: Tensor) -> bool:
        return x.numel() * x.element_size() <= SLOT_BYTES

    def all_gather(self, x: Tensor) -> Tensor:
        """[size, *x.shape]: every rank's `x`, a view of shared memory valid until this rank's next call."""
        self.seq += 1
        mine, parts = self._slots(x)
        mine.copy_(x)
        self.flags[self.rank] = self.seq
        if self.flags.min() < self.seq:
            self._wait()
        return parts

    def all_reduce(self, x: Tensor) -> Tensor:
        # Every rank adds the same parts in the same order: equal sums. Half-precision parts are added in
        # float32 and rounded once.
        return self.all_gather(x).sum(0)

    def _slots(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's slot and all ranks' slots of the current bank, typed and shaped as `x`: made once
        per shape, since a call's few tensor operations are most of its cost (a decode step makes dozens)."""
        key = (self.seq % 2, x.shape, x.dtype)
        slots = self.views.get(key)
        if slots is None:
            if len(self.views) >= MAX_VIEWS:  # prefill chunks come in many lengths
                self.views.clear()
            n = x.numel() * x.element_size()
            parts = self.banks[self.seq % 2, :, :n].view(x.dtype).view(self.size, *x.shape)
            slots = self.views[key] = (parts[self.rank], parts)
        return slots

    def _wait(self) -> None:
        spins, deadline = 0, time.monotonic() + TIMEOUT_S
        while self.flags.min() < self.seq:
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                os.sched_yield()
                if spins % 4096 == 0 and time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel peers did not arrive within {TIMEOUT_S:.0f} s")

"""How many CPU threads a step gets: the allowed cores less those other processes keep busy.

A step's parallel regions end at a barrier, so one thread on a core another process holds slows every
thread, and spinning waiters take time from it; with one of two cores taken, two threads decode far
slower than one thread does. Compiled kernels read the count when they run, whatever it was at compile
time (compile_policy.py), so a change costs no recompile.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

SAMPLE_S = 0.5  # how often the load is read; a busy core costs at most this long at the wrong count
DROP_AT = 0.4  # cores kept busy by others that take a thread away
RAISE_BELOW = 0.2  # and the load under which it comes back, lower so a load near the edge cannot flap
# A window counts only if this process kept this many cores busy in it: one spent mostly waiting for work
# says nothing of what a step would meet (a load that ran while the engine idled has often gone).
STEPPED_CORES = 0.5

logger = logging.getLogger("kiln.worker")

Sample = tuple[int, int, int]  # (ticks of the allowed cores, of those busy, of this process)


def read_sample(cores: frozenset[int], count_niced: bool = False) -> Sample:
    """Clock ticks from /proc: the allowed cores' total and busy (steal counts as busy; niced work only
    with `count_niced`), this process's."""
    total = busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                ticks = [int(t) for t in fields[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4] - (0 if count_niced else ticks[1])
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return total, busy, int(fields[11]) + int(fields[12])  # utime, stime


def threads_for(others: float, current: int, cores: int) -> int:
    """The thread count for `others` cores' worth of other processes' load, moving up only past the margin."""
    down = max(1, cores - int(others + 1 - DROP_AT))
    up = max(1, cores - int(others + 1 - RAISE_BELOW))
    return down if down < current else max(up, current)


class CpuThreads:
    """Keeps torch's thread count at the cores other processes leave free, read every SAMPLE_S over the
    windows in which this process stepped."""

    def __init__(self, reader: Callable[[frozenset[int]], Sample] | None = None) -> None:
        self.cores = frozenset(os.sched_getaffinity(0))
        # Niced itself, this process competes with niced work as an equal.
        niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
        self.reader = reader or (lambda cores: read_sample(cores, niced))
        self.threads = len(self.cores)
        torch.set_num_threads(self.threads)
        self.restart()

    def restart(self) -> None:
        """Opens a fresh window: the load so far (the warm-up's compiler processes) says nothing of the
        steps to come."""
        self.last, self.at = self.reader(self.cores), time.monotonic()

    def update(self) -> int:
        """Called before each step; returns the thread count it runs with."""
        now = time.monotonic()
        if now - self.at < SAMPLE_S:
            return self.threads
        sample = self.reader(self.cores)
        total, busy, own = (a - b for a, b in zip(sample, self.last))
        self.last, self.at = sample, now
        if total > 0 and own * len(self.cores) >= STEPPED_CORES * total:
            others = max(0, busy - own) * len(self.cores) / total
            threads = threads_for(others, self.threads, len(self.cores))
            if threads != self.threads:
                logger.info("torch threads %d -> %d: others use %.2f cores", self.threads, threads, others)
                torch.set_num_threads(threads)
                self.threads = threads
        return self.threads

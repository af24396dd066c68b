"""The engine core's CPU thread count follows the cores other processes leave free."""

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from compiled import cpu_threads
from compiled.cpu_threads import CpuThreads, read_sample, threads_for
from compiled.worker import Worker
from engine.config import EngineConfig


@pytest.mark.parametrize(
    "others, current, cores, expected",
    [
        (0.0, 2, 2, 2),
        (0.3, 2, 2, 2),  # below the drop margin: keep both
        (0.5, 2, 2, 1),  # half a core taken: one thread fewer
        (1.0, 2, 2, 1),
        (3.0, 2, 2, 1),  # never below one
        (0.3, 1, 2, 1),  # between the margins: stay down, no flapping
        (0.1, 1, 2, 2),
        (2.6, 16, 16, 13),
        (2.9, 13, 16, 13),
        (1.9, 13, 16, 14),  # comes back one core at a time as the load goes
    ],
)
def test_threads_for_the_load(others, current, cores, expected):
    assert threads_for(others, current, cores) == expected


def fake_reader(samples):
    it = iter(samples)
    return lambda cores: next(it)


@pytest.fixture
def two_cores(monkeypatch):
    """Two allowed cores, the load read at every update; torch's thread count put back after."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cpu_threads, "SAMPLE_S", 0.0)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_count_follows_other_processes_not_this_one(two_cores):
    # (ticks of both cores, busy ticks, this process's ticks), cumulative: 100 ticks per core a window.
    threads = CpuThreads(
        fake_reader([(0, 0, 0), (200, 200, 200), (400, 400, 300), (600, 600, 400), (800, 700, 500)])
    )
    assert threads.threads == 2 == torch.get_num_threads()
    assert threads.update() == 2  # all the busy time was this process's own
    assert threads.update() == 1 == torch.get_num_threads()  # another process took 1.0 cores
    assert threads.update() == 1  # 1.0 cores still
    assert threads.update() == 2 == torch.get_num_threads()  # others down to 0.0 cores


def test_a_load_met_only_while_waiting_for_work_takes_no_thread(two_cores):
    # Another process kept both cores busy while this one used a tenth of a core, then the same load
    # again while this one stepped on one core.
    threads = CpuThreads(fake_reader([(0, 0, 0), (200, 200, 10), (400, 400, 110)]))
    assert threads.update() == 2 == torch.get_num_threads()
    assert threads.update() == 1 == torch.get_num_threads()


def test_a_restart_leaves_the_load_before_it_out(two_cores):
    # The warm-up: this process on one core, its compiler processes on the other; then steps alone.
    threads = CpuThreads(fake_reader([(0, 0, 0), (200, 200, 100), (400, 400, 300)]))
    threads.restart()
    assert threads.update() == 2 == torch.get_num_threads()


def _step_for(seconds: float) -> None:
    """Keeps one core busy in this process, as a step does."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@contextlib.contextmanager
def _spinning(*prefix: str) -> Iterator[int]:
    """Another process spinning on a core (run under `prefix`, e.g. nice) while the block runs; yields the
    core count, and puts torch's thread count back after."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("needs two cores: one thread is the floor")
    before = torch.get_num_threads()
    busy = subprocess.Popen([*prefix, sys.executable, "-c", "while True: pass"])
    try:
        yield cores
    finally:
        busy.kill()
        busy.wait()
        torch.set_num_threads(before)


def test_a_busy_process_takes_a_thread_away_and_gives_it_back():
    threads = CpuThreads()
    with _spinning() as cores:
        _step_for(cpu_threads.SAMPLE_S * 3)
        assert threads.update() == cores - 1 == torch.get_num_threads()
    deadline = time.monotonic() + 30  # the shared machine may be busy for a while: wait for a quiet window
    while threads.update() < cores and time.monotonic() < deadline:
        _step_for(cpu_threads.SAMPLE_S)
    assert threads.threads == cores


def test_a_niced_process_takes_no_thread():
    """Work at a lower priority yields its core to the step's threads, so it leaves the count alone."""
    threads = CpuThreads()
    with _spinning("nice", "-n", "19") as cores:
        for _ in range(3):
            _step_for(cpu_threads.SAMPLE_S)
            assert threads.update() == cores


def test_read_sample_counts_this_process():
    cores = frozenset(os.sched_getaffinity(0))
    total0, busy0, own0 = read_sample(cores)
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    total1, busy1, own1 = read_sample(cores)
    assert own1 - own0 >= 20  # ticks of 10 ms: 0.3 s of work
    # /proc/stat and /proc/self/stat count ticks apart: the cores' busy time may trail this one's a little.
    assert total1 > total0 and busy1 - busy0 >= own1 - own0 - 5


def test_the_worker_follows_the_load_unless_given_a_count(tiny_llama):
    before = torch.get_num_threads()
    try:
        worker = Worker(EngineConfig(model=tiny_llama, dtype="float32", enforce_eager=True), tiny_llama)
        assert isinstance(worker.threads, CpuThreads)
        restarts = []
        worker.threads.restart = lambda: restarts.append(True)
        worker.warm_up()
        assert restarts == [True]  # the warm-up's compile load is left out of the first window
        fixed = Worker(EngineConfig(model=tiny_llama, enforce_eager=True, num_threads=1), tiny_llama)
        assert fixed.threads is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)

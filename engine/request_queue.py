"""The scheduler's waiting queue, ordered by its scheduling policy (``SchedulerConfig.scheduling_policy``).

Invariant: the queue hands out its live requests (``peek``, ``pop``, iteration) in increasing
``(key, place)``, where the key is the policy's and the place records how a request went in:

- ``key`` is ``(priority, sample_index, arrival_time)`` under "priority" (lower first) and
  ``(0, sample_index, 0.0)`` under "fcfs": a request's sample i waits behind every other request's
  sample i - 1, so that one request's many samples cannot hold back the others' first ones;
- ``add`` (a new request) places it behind every queued request of an equal key, ``prepend`` (a
  preempted request, or one skipped this step) ahead of them all.

So fcfs is a deque for each sample index: new requests at the back, preempted ones at the front. Under
"priority" a preempted request goes back in at its own priority and arrival: ahead of every later arrival
of its priority, and behind every more urgent request (a lower priority value). ``pop_into`` keeps the
scheduler's running requests in the same key order, so that the last of them is the one to preempt.
``num_first`` counts the live first samples (sample_index 0; a preempted one too), ``first_tokens`` their
tokens as they were queued, and ``short_tokens`` those of the ones no longer than ``long`` tokens whose
grammar (if any) had compiled as they were queued (``shortest`` the fewest of them), which go in as soon as
a step lets them. Under sustained overload (a first sample always waiting) a request's further samples
wait until first samples stop arriving: the admission limits bound that queue.

A queued request that finishes (an abort) is not searched for: ``note_finished`` counts it, and it is
dropped when it reaches the front, or with every other finished one once they make up over half the
queue; an abort costs O(1), amortised.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import sys
from collections.abc import Callable, Iterator

from engine.request import Request

Key = tuple[int, int, float]


def _by_priority(req: Request) -> Key:
    return req.priority, req.sample_index, req.arrival_time


def _by_sample(req: Request) -> Key:
    return 0, req.sample_index, 0.0


class RequestQueue:
    """Waiting requests, the next to admit first, in the order the module's docstring states."""

    def __init__(self, policy: str = "fcfs", long: int = sys.maxsize) -> None:
        self.key: Callable[[Request], Key] = _by_priority if policy == "priority" else _by_sample
        self._heap: list[tuple[int, int, float, int, Request]] = []  # (*key, place, request)
        self._back = itertools.count()  # places behind every queued request, in insertion order
        self._front = itertools.count(-1, -1)  # places ahead of them, the latest first
        self.num_stale = 0  # finished requests still in the heap
        # Live first samples -> their tokens when queued (a sample preempted with a step in flight may
        # still gain its token while it waits).
        self._first: dict[str, int] = {}
        self._short: dict[str, int] = {}  # those of them no longer than `long`, with no grammar compiling
        self.first_tokens = self.short_tokens = 0
        self.long = long

    @property
    def num_first(self) -> int:
        return len(self._first)

    @property
    def shortest(self) -> int:
        """The tokens of the shortest first sample that `short_tokens` counts (sys.maxsize: none)."""
        return min(self._short.values(), default=sys.maxsize)

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (*self.key(req), next(self._back), req))
        self._count(req)

    def prepend(self, req: Request) -> None:
        heapq.heappush(self._heap, (*self.key(req), next(self._front), req))
        self._count(req)

    def _count(self, req: Request) -> None:
        if req.sample_index == 0:
            self._first[req.request_id] = n = req.num_tokens
            self.first_tokens += n
            if n <= self.long and (req.grammar is None or req.grammar.ready):
                self._short[req.request_id] = n
                self.short_tokens += n

    def _uncount(self, req: Request) -> None:
        self.first_tokens -= self._first.pop(req.request_id, 0)
        self.short_tokens -= self._short.pop(req.request_id, 0)

    def prepend_all(self, reqs: list[Request]) -> None:
        """Put back requests popped in this order; they come out in it again."""
        for req in reversed(reqs):
            self.prepend(req)

    def peek(self) -> Request:
        """The next live request; the queue must hold one."""
        while (req := self._heap[0][-1]).status.finished:
            heapq.heappop(self._heap)
            self.num_stale -= 1
        return req

    def pop(self) -> Request:
        req = self.peek()
        heapq.heappop(self._heap)
        self._uncount(req)
        return req

    def pop_into(self, running: list[Request]) -> Request:
        """Pop the next request into ``running``, kept in key order (fcfs: admission order) so that its
        last request is the one to preempt: the lowest priority, latest arrival, latest admission."""
        req = self.pop()
        bisect.insort(running, req, key=self.key)
        return req

    def note_finished(self, reqs: list[Request]) -> None:
        """These queued requests have finished."""
        self.num_stale += len(reqs)
        for req in reqs:
            self._uncount(req)
        if self.num_stale > len(self._heap) // 2:
            self._heap = [entry for entry in self._heap if not entry[-1].status.finished]
            heapq.heapify(self._heap)
            self.num_stale = 0

    def __len__(self) -> int:
        return len(self._heap) - self.num_stale

    def __iter__(self) -> Iterator[Request]:
        """The live requests, next first (a sorted copy: for inspection, not for the scheduler's loop)."""
        return (entry[-1] for entry in sorted(self._heap) if not entry[-1].status.finished)

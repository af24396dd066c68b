"""The data-parallel coordinator, in the front end: which engine core a new request goes to.

Load is what the front end knows without asking: the requests it sent a core that have not finished
(that core's waiting + running), plus the core's KV-cache usage as of its last output, a full cache
weighing as much as a full batch. Prefix affinity: for each core, the prompts routed to it lately, as
the chained block hashes its prefix cache keys blocks by, in an LRU no larger than that cache. A prompt
goes to the core holding its longest prefix unless that core's load exceeds the least by more than
AFFINITY_SLACK of a batch; otherwise, and with nothing cached anywhere, to the least loaded core.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from engine.kv_cache_manager import extend_block_hashes

AFFINITY_SLACK = 0.25  # of max_num_seqs: how much busier a core holding the prefix may be and still win


class Coordinator:
    """Invariant: `owner` maps every core request id the front end has sent and not seen finish (or
    aborted) to its core, and `in_flight[i]` holds exactly the ids owned by core i."""

    def __init__(self, num_cores: int, block_size: int, max_num_seqs: int, num_blocks: list[int]) -> None:
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.in_flight: list[set[str]] = [set() for _ in range(num_cores)]
        self.owner: dict[str, int] = {}
        self.kv_usage = [0.0] * num_cores
        self.live = [True] * num_cores
        self.prefixes: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_cores)]
        self.capacity = num_blocks

    def load(self, core: int) -> float:
        return len(self.in_flight[core]) + self.kv_usage[core] * self.max_num_seqs

    def route(self, token_ids: Sequence[int], cache_salt: str | None, request_ids: list[str]) -> int:
        """Pick a live core for a prompt (and its n samples, `request_ids`, which share it) and record
        them as its; None of the cores live is the caller's to check first."""
        live = [i for i, ok in enumerate(self.live) if ok]
        hashes: list[bytes] = []
        extend_block_hashes(hashes, token_ids, self.block_size, cache_salt)
        least = min(live, key=self.load)
        limit = self.load(least) + AFFINITY_SLACK * self.max_num_seqs
        core, longest = least, 0
        for i in live:
            cached = self._cached_blocks(i, hashes)
            if cached > longest and self.load(i) <= limit:
                core, longest = i, cached
        lru = self.prefixes[core]
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity[core]:
            lru.popitem(last=False)
        for rid in request_ids:
            self.owner[rid] = core
            self.in_flight[core].add(rid)
        return core

    def release(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Forget requests that finished or are being aborted; return the live ones by core."""
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            core = self.owner.pop(rid, None)
            if core is not None:
                self.in_flight[core].discard(rid)
                by_core.setdefault(core, []).append(rid)
        return by_core

    def core_died(self, core: int) -> list[str]:
        """Take a core out of routing; return the request ids it held (they can no longer finish)."""
        self.live[core] = False
        held = list(self.in_flight[core])
        self.release(held)
        self.prefixes[core].clear()
        return held

    def reset_prefixes(self) -> None:
        for lru in self.prefixes:
            lru.clear()

    def _cached_blocks(self, core: int, hashes: list[bytes]) -> int:
        lru = self.prefixes[core]
        return next((n for n, h in enumerate(hashes) if h not in lru), len(hashes))

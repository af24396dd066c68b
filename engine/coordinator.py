"""The data-parallel coordinator: which engine core a new request goes to, decided in each front end, and,
under `kiln serve --api-server-count`, the process that gives every API server the cores' own view.

Load is what the front end knows without asking: the requests it sent a core that have not finished
(that core's waiting + running; with several API servers, the core's own count of every server's, as
last reported, where that is more), plus the core's KV-cache usage as of its last output, a full cache
weighing as much as a full batch. Prefix affinity: what each core's prefix cache holds, as the chained
block hashes it keys blocks by, from the events its KV-cache manager publishes (blocks stored, evicted,
the cache reset), plus the prompts of the requests it was sent and has not finished, which it will store
as it computes them. A prompt goes to the core holding its longest prefix unless that core's load
exceeds the least by more than AFFINITY_SLACK of a batch; otherwise, and with nothing cached anywhere, to
the least loaded core.
"""

from __future__ import annotations

import signal
import sys
from collections import Counter
from collections.abc import Iterable, Sequence

import msgspec
import zmq

from engine.kv_cache_manager import extend_block_hashes
from engine.messages import CoreLoad, KVCacheEvents
from engine.processes import die_with_parent

AFFINITY_SLACK = 0.25  # of max_num_seqs: how much busier a core holding the prefix may be and still win


class Coordinator:
    """Invariants: `owner` maps every core request id the front end has sent and not seen finish (or
    aborted) to its core, and `in_flight[i]` holds exactly the ids owned by core i; `pending[i]` counts,
    for each block hash, the prompts of core i's in-flight requests that have it; `cached[i]` is core i's
    prefix cache as of the last events it sent."""

    def __init__(self, num_cores: int, block_size: int, max_num_seqs: int) -> None:
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.in_flight: list[set[str]] = [set() for _ in range(num_cores)]
        self.owner: dict[str, int] = {}
        self.kv_usage = [0.0] * num_cores
        self.queued = [0] * num_cores  # each core's running + waiting as it last reported (API servers)
        self.live = [True] * num_cores
        self.cached: list[set[bytes]] = [set() for _ in range(num_cores)]
        self.pending: list[Counter[bytes]] = [Counter() for _ in range(num_cores)]
        self.prompts: dict[str, list[bytes]] = {}  # in-flight request id -> its prompt's block hashes

    def load(self, core: int) -> float:
        return max(len(self.in_flight[core]), self.queued[core]) + self.kv_usage[core] * self.max_num_seqs

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
            cached = self.cached_blocks(i, hashes)
            if cached > longest and self.load(i) <= limit:
                core, longest = i, cached
        for rid in request_ids:
            self.owner[rid] = core
            self.in_flight[core].add(rid)
            self.prompts[rid] = hashes
            self.pending[core].update(hashes)
        return core

    def release(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Forget requests that finished or are being aborted; return the live ones by core."""
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            core = self.owner.pop(rid, None)
            if core is not None:
                self.in_flight[core].discard(rid)
                pending = self.pending[core]
                for h in self.prompts.pop(rid):
                    pending[h] -= 1
                    if not pending[h]:  # no hash outlives the requests that have it
                        del pending[h]
                by_core.setdefault(core, []).append(rid)
        return by_core

    def apply_events(self, core: int, events: KVCacheEvents) -> None:
        """A core's prefix-cache changes since its last events, in order: reset, then evicted, then stored
        (a block evicted and stored again within one step is cached)."""
        cached = self.cached[core]
        if events.reset:
            cached.clear()
        cached.difference_update(events.removed)
        cached.update(events.stored)

    def apply_load(self, load: CoreLoad) -> None:
        """A core's report through the DP coordinator process (API servers)."""
        i = load.engine_index
        self.queued[i], self.kv_usage[i] = load.num_running + load.num_waiting, load.kv_cache_usage
        if load.kv_events is not None:
            self.apply_events(i, load.kv_events)

    def core_died(self, core: int) -> list[str]:
        """Take a core out of routing; return the request ids it held (they can no longer finish)."""
        self.live[core] = False
        held = list(self.in_flight[core])
        self.release(held)
        self.cached[core].clear()
        return held

    def reset_prefixes(self, cores: Iterable[int]) -> None:
        """These cores' prefix caches were reset (their events will say so too, with their next outputs)."""
        for core in cores:
            self.cached[core].clear()

    def cached_blocks(self, core: int, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt (its block `hashes`) `core` holds or is computing."""
        cached, pending = self.cached[core], self.pending[core]
        return next((n for n, h in enumerate(hashes) if h not in cached and h not in pending), len(hashes))


def serve(directory: str, num_cores: int) -> None:
    """The DP coordinator process: each core's CoreLoad (engine/api_clients.py) as it comes, passed on to
    every API server, and each core's whole cache as one reset-and-store to every new subscriber (so a
    server that starts late routes on what is cached already)."""
    ctx = zmq.Context()
    cores, view = ctx.socket(zmq.PULL), ctx.socket(zmq.XPUB)
    view.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, for a snapshot each
    view.setsockopt(zmq.SNDHWM, 0)  # nothing dropped: a server's view stays whole however late it reads
    cores.bind(f"ipc://{directory}/coordinator")
    view.bind(f"ipc://{directory}/view")
    decoder, encoder = msgspec.msgpack.Decoder(CoreLoad), msgspec.msgpack.Encoder()
    mirror = Coordinator(num_cores, 0, 0)  # the cores' loads and caches, not routing
    poller = zmq.Poller()
    poller.register(cores, zmq.POLLIN)
    poller.register(view, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if view in ready and view.recv()[:1] == b"\x01":
            for i in range(num_cores):
                cached = KVCacheEvents(True, [], sorted(mirror.cached[i]))
                view.send(encoder.encode(CoreLoad(i, mirror.queued[i], 0, mirror.kv_usage[i], cached)))
        if cores in ready:
            frame = cores.recv()
            try:
                mirror.apply_load(decoder.decode(frame))
            except (msgspec.MsgspecError, IndexError):
                continue
            view.send(frame)


if __name__ == "__main__":  # python -m engine.coordinator DIR NUM_CORES PARENT_PID
    die_with_parent(int(sys.argv[3]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's, which stops us
    serve(sys.argv[1], int(sys.argv[2]))

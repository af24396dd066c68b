"""The data-parallel coordinator's routing: least load, prefix affinity within a slack, and the
bookkeeping that a finished, aborted or orphaned request leaves behind."""

from __future__ import annotations

from engine.coordinator import AFFINITY_SLACK, Coordinator
from engine.kv_cache_manager import extend_block_hashes
from engine.messages import KVCacheEvents

BS = 4


def make(cores: int = 2, seqs: int = 8) -> Coordinator:
    return Coordinator(cores, BS, seqs)


def test_least_loaded_core_takes_unrelated_prompts():
    c = make(3)
    cores = [c.route([i] * 3, None, [f"r{i}"]) for i in range(6)]  # under one block: no affinity
    assert sorted(cores) == [0, 0, 1, 1, 2, 2]
    c.release(["r0", "r3"])  # both on core 0
    assert c.route([9] * 3, None, ["x"]) == 0
    c.kv_usage[0] = 0.9  # a nearly full cache weighs like most of a batch
    assert c.route([8] * 3, None, ["y"]) != 0


def test_a_shared_prefix_goes_to_the_core_that_holds_it_until_that_core_is_too_busy():
    c = make(2, seqs=8)
    system = list(range(3 * BS))
    first = c.route([*system, 100], None, ["a"])
    slack = int(AFFINITY_SLACK * 8)
    followers = [c.route([*system, 101 + i], None, [f"f{i}"]) for i in range(slack + 1)]
    assert followers[:slack] == [first] * slack  # within the slack: the cached prefix wins
    assert followers[slack] != first  # past it: the least loaded core
    other = c.route(list(range(500, 500 + 3 * BS)), None, ["u"])
    assert other != first or c.load(1 - first) > c.load(first)


def test_a_cache_salt_keeps_prefixes_apart():
    c = make(2)
    system = list(range(2 * BS))
    salted = c.route(system, "tenant-a", ["a"])
    c.route([7] * 3, None, ["pad"])  # even out the load
    assert c.route(system, "tenant-a", ["a2"]) == salted  # the same salt finds its prefix
    assert c.route(system, "tenant-b", ["b"]) != salted  # another salt's is not its: least load decides


def test_samples_of_one_prompt_stay_together_and_are_released_by_id():
    c = make(2)
    core = c.route([1, 2, 3, 4, 5], None, ["p-0", "p-1", "p-2"])
    assert c.in_flight[core] == {"p-0", "p-1", "p-2"} and c.owner["p-1"] == core
    assert c.release(["p-0", "unknown"]) == {core: ["p-0"]}
    assert c.release(["p-0"]) == {}  # an abort after the finish costs nothing
    assert c.in_flight[core] == {"p-1", "p-2"}


def test_a_dead_core_hands_back_its_requests_and_gets_no_more():
    c = make(2)
    held = [c.route([i] * 2, None, [f"r{i}"]) for i in range(4)]
    lost = c.core_died(1)
    assert sorted(lost) == sorted(f"r{i}" for i, core in enumerate(held) if core == 1)
    assert all(c.owner[r] == 0 for r in c.owner) and not c.in_flight[1]
    assert {c.route([50 + i] * 9, None, [f"n{i}"]) for i in range(5)} == {0}


def hashes(tokens: list[int], salt: str | None = None) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BS, salt)
    return out


def test_affinity_follows_what_each_core_reports_it_caches():
    c = make(2)
    system = list(range(3 * BS))
    c.apply_events(1, KVCacheEvents(False, [], hashes(system)))  # core 1 cached it for someone else
    assert c.route([*system, 1], None, ["a"]) == 1
    c.release(["a"])
    c.apply_events(1, KVCacheEvents(False, hashes(system)[1:], []))  # evicted but its first block
    c.apply_events(0, KVCacheEvents(False, [], hashes(system)[:2]))
    assert c.route([*system, 2], None, ["b"]) == 0  # two blocks beat one
    c.release(["b"])
    c.apply_events(0, KVCacheEvents(True, [], []))  # core 0's cache reset
    assert c.cached_blocks(0, hashes(system)) == 0 and c.cached_blocks(1, hashes(system)) == 1
    c.reset_prefixes([1])  # a reset that core 1 did (core 0 refused: it held blocks) clears only its view
    c.apply_events(0, KVCacheEvents(False, [], hashes(system)))
    assert c.cached_blocks(0, hashes(system)) == 3 and c.cached_blocks(1, hashes(system)) == 0


def test_a_prompt_in_flight_counts_as_cached_until_it_finishes_and_leaves_nothing_behind():
    c = make(2)
    system = list(range(2 * BS))
    first = c.route([*system, 1], None, ["a-0", "a-1"])
    c.route([7], None, ["pad"])  # even out the load
    assert c.route([*system, 2], None, ["b"]) == first  # not reported cached yet: it is being computed
    c.release(["a-0", "a-1", "b", "pad"])
    assert c.pending == [{}, {}] and not c.prompts  # never stored: nothing is remembered
    assert c.cached_blocks(first, hashes(system)) == 0

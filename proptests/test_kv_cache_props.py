"""BlockPool + KVCacheManager against a shadow model of what each block's KV holds.

The test plays the scheduler and the model runner: it admits requests (prefix-cache lookup, then
allocation), computes chunks, appends sampled tokens, frees, aborts, preempts, forces evictions and
resets the cache. "Computing" position p of a request writes (salt, tokens[:p+1]) into the shadow of
the slot p lands in: the KV of a token depends on every token before it. A cache hit must return
blocks whose shadow equals the request's own prefix.
"""

from collections import Counter

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.kv_cache_manager import KVCacheManager
from engine.params import SamplingParams
from engine.request import Request

PREFIXES = [(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 9, 9, 9, 9), (7,) * 6]
prompts = st.builds(
    lambda prefix, suffix: list(prefix) + suffix,
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 3), min_size=1, max_size=6),
)


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(2, 20))
    def setup(self, block_size: int, num_blocks: int) -> None:
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size)
        self.pool = self.kv.block_pool
        self.pool.record_events()
        self.mirror: set[bytes] = set()  # the cache as a coordinator sees it from the events
        self.requests: dict[str, Request] = {}  # live: waiting or holding blocks
        self.tables: dict[str, list[int]] = {}  # block tables of the requests holding blocks
        self.shadow: dict[int, list] = {b: [None] * block_size for b in range(num_blocks)}
        self.hash_prefix: dict[bytes, tuple] = {}  # every hash ever seen -> (salt, prefix tokens)
        self.next_id = 0
        self.prev_cache = {}
        self.reused: set[int] = set()  # blocks popped for reuse since the last invariant check
        self.was_reset = False
        self.history: list[tuple[list[int], str | None]] = []

    # ---- helpers -------------------------------------------------------------------------------

    def compute(self, r: Request, start: int, end: int) -> None:
        """The runner writes KV for positions [start, end) into the request's table."""
        table = self.tables[r.request_id]
        for p in range(start, end):
            self.shadow[table[p // self.bs]][p % self.bs] = (r.cache_salt, tuple(r.all_token_ids[: p + 1]))
        r.num_computed_tokens = end
        for i, h in enumerate(r.block_hashes):  # equal hashes must mean equal prefixes
            key = (r.cache_salt, tuple(r.all_token_ids[: (i + 1) * self.bs]))
            assert self.hash_prefix.setdefault(h, key) == key

    def after_allocate(self, r: Request, new_blocks) -> None:
        rid = r.request_id
        table = self.kv.get_block_ids(rid)
        old = self.tables.get(rid, [])
        assert table[: len(old)] == old, "block tables only grow"
        assert [b.block_id for b in new_blocks] == table[len(table) - len(new_blocks) :]
        self.reused.update(b.block_id for b in new_blocks)
        self.tables[rid] = table

    def pick(self, data, ids) -> Request | None:
        # No preconditions: a rule with nothing to act on is a no-op, which keeps every rule enabled.
        ids = sorted(ids)
        return self.requests[data.draw(st.sampled_from(ids))] if ids else None

    def waiting_ids(self):
        return [rid for rid in self.requests if rid not in self.tables]

    def computable_ids(self):
        return [
            rid
            for rid in self.tables
            if self.requests[rid].num_computed_tokens < self.requests[rid].num_tokens
        ]

    def decodable_ids(self):
        return [
            rid
            for rid in self.tables
            if self.requests[rid].num_computed_tokens == self.requests[rid].num_tokens
        ]

    # ---- rules ---------------------------------------------------------------------------------

    def new_request(self, prompt: list[int], salt: str | None, data) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.requests[rid] = r = Request(rid, prompt, SamplingParams(), cache_salt=salt)
        self.history.append((prompt, salt))
        self.try_admit(r, data)  # most arrivals are admitted at once; the rest wait for `admit`

    @rule(prompt=prompts, salt=st.sampled_from([None, None, "s"]), data=st.data())
    def add(self, prompt, salt, data) -> None:
        self.new_request(prompt, salt, data)

    @rule(data=st.data())
    def add_again(self, data) -> None:
        """A prefix of an earlier request's tokens (outputs included), plus a few more: likely hits."""
        if not self.history:
            return
        tokens, salt = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(1, len(tokens)))
        self.new_request(tokens[:cut] + data.draw(st.lists(st.integers(0, 3), max_size=3)), salt, data)

    @rule(data=st.data())
    def admit(self, data) -> None:
        r = self.pick(data, self.waiting_ids())
        if r is not None:
            self.try_admit(r, data)

    def try_admit(self, r: Request, data) -> None:
        blocks, hit = self.kv.get_computed_blocks(r)
        assert hit == len(blocks) * self.bs and hit < r.num_tokens, "never the whole sequence"
        for i, b in enumerate(blocks):
            assert b.block_hash == r.block_hashes[i]
            for j in range(self.bs):
                p = i * self.bs + j
                assert self.shadow[b.block_id][j] == (r.cache_salt, tuple(r.all_token_ids[: p + 1]))
        n = data.draw(st.integers(1, r.num_tokens - hit))
        free_before = self.pool.get_num_free_blocks()
        new_blocks = self.kv.allocate_slots(r, n, blocks, hit)
        event("admit: prefix hit" if hit else "admit: no hit")
        if new_blocks is None:
            event("admit: no room")
            assert self.kv.get_block_ids(r.request_id) == []
            assert self.pool.get_num_free_blocks() == free_before
            return
        self.after_allocate(r, new_blocks)
        r.num_computed_tokens = hit
        self.compute(r, hit, hit + n)

    @rule(data=st.data())
    def extend(self, data) -> None:
        r = self.pick(data, self.computable_ids())
        if r is None:
            return
        n = data.draw(st.integers(1, r.num_tokens - r.num_computed_tokens))
        new_blocks = self.kv.allocate_slots(r, n)
        if new_blocks is not None:
            self.after_allocate(r, new_blocks)
            self.compute(r, r.num_computed_tokens, r.num_computed_tokens + n)

    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token) -> None:
        r = self.pick(data, self.decodable_ids())
        if r is None:
            return
        r.append_output_token(token)  # sampled; its KV is computed next, if a block can be had
        new_blocks = self.kv.allocate_slots(r, 1)
        if new_blocks is not None:
            self.after_allocate(r, new_blocks)
            self.compute(r, r.num_computed_tokens, r.num_tokens)

    def release(self, r: Request) -> None:
        rid = r.request_id
        self.history.append((list(r.all_token_ids), r.cache_salt))
        table = self.tables.pop(rid, [])
        blocks = self.pool.blocks
        became_free = [bid for bid in reversed(table) if blocks[bid].ref_cnt == 1]
        self.kv.free(r)
        self.kv.free(r)  # idempotent
        queue = [b.block_id for b in self.pool.free_block_queue]
        assert queue[len(queue) - len(became_free) :] == became_free, "tail-first freeing"

    @rule(data=st.data())
    def finish(self, data) -> None:
        r = self.pick(data, self.tables)
        if r is None:
            return
        self.release(r)
        del self.requests[r.request_id]

    @rule(data=st.data())
    def abort(self, data) -> None:
        r = self.pick(data, self.requests)
        if r is None:
            return
        self.release(r)
        del self.requests[r.request_id]

    @rule(data=st.data())
    def preempt(self, data) -> None:
        r = self.pick(data, self.tables)
        if r is None:
            return
        self.release(r)
        r.num_computed_tokens = 0  # keeps prompt and outputs; recomputed after a new admit

    @rule(data=st.data())
    def evict(self, data) -> None:
        """Someone else takes k blocks: they must be the head of the free queue (LRU), in id order."""
        k = data.draw(st.integers(0, self.pool.get_num_free_blocks()))
        expected = sorted([b.block_id for b in self.pool.free_block_queue][:k])
        if any(self.pool.blocks[bid].block_hash for bid in expected):
            event("evict: a cached block")
        blocks = self.pool.get_new_blocks(k)
        assert [b.block_id for b in blocks] == expected
        for b in blocks:
            assert b.block_hash is None
            self.shadow[b.block_id] = [("garbage",)] * self.bs
        self.reused.update(expected)
        self.pool.free_blocks(blocks)

    @rule()
    def reset(self) -> None:
        ok = self.kv.reset_prefix_cache()
        assert ok == (not self.tables)
        if ok:
            assert self.pool.cached_block_hash_to_block == {}
            self.was_reset = True

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def blocks_are_free_xor_held(self) -> None:
        pool = self.pool
        held = Counter(bid for table in self.tables.values() for bid in table)
        assert 0 not in held and pool.null_block.ref_cnt == 0 and pool.null_block.block_hash is None
        for rid, table in self.tables.items():
            assert table == self.kv.get_block_ids(rid)
        queue = [b.block_id for b in pool.free_block_queue]
        assert len(queue) == len(set(queue)) == pool.get_num_free_blocks()
        for b in pool.blocks[1:]:
            assert b.ref_cnt == held[b.block_id]
            assert (b.block_id in queue) == (b.ref_cnt == 0)
        assert len(queue) + len(held) == pool.num_blocks - 1
        for bid, n in held.items():  # shared only through the cache: same position, same prefix
            if n > 1:
                b = pool.blocks[bid]
                assert b.block_hash is not None
                positions = {table.index(bid) for table in self.tables.values() if bid in table}
                assert len(positions) == 1

    @invariant()
    def hashed_blocks_are_findable_until_evicted(self) -> None:
        cache = self.pool.cached_block_hash_to_block
        for h, b in cache.items():
            assert b.block_hash == h and b.block_id != 0
            salt, prefix = self.hash_prefix[h]
            start = len(prefix) - self.bs
            assert self.shadow[b.block_id] == [(salt, prefix[: p + 1]) for p in range(start, len(prefix))]
        assert all(cache.get(b.block_hash) is b for b in self.pool.blocks if b.block_hash is not None)
        now = {h: b.block_id for h, b in cache.items()}
        if not self.was_reset:
            for h, bid in self.prev_cache.items():
                if now.get(h) != bid:
                    assert bid in self.reused, f"hash of block {bid} vanished without eviction"
        self.prev_cache, self.reused, self.was_reset = now, set(), False

    @invariant()
    def events_give_the_cache(self) -> None:
        if (events := self.pool.take_kv_events()) is not None:
            reset, removed, stored = events
            assert not set(removed) & set(stored)
            if reset:
                self.mirror.clear()
            self.mirror.difference_update(removed)
            self.mirror.update(stored)
        assert self.mirror == set(self.pool.cached_block_hash_to_block)

    @invariant()
    def computed_tokens_bounded(self) -> None:
        for rid, r in self.requests.items():
            assert 0 <= r.num_computed_tokens <= r.num_tokens
            if rid in self.tables:
                assert len(self.tables[rid]) * self.bs >= r.num_computed_tokens

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for r in list(self.requests.values()):
            self.kv.free(r)
        assert self.pool.get_num_free_blocks() == self.pool.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)
        assert self.kv.usage == 0.0
        assert self.kv.reset_prefix_cache()


TestKVCache = KVCacheMachine.TestCase

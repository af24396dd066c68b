from engine.kv_cache_manager import KVCacheManager, hash_block_tokens
from engine.params import SamplingParams
from engine.request import Request

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def admit(kv: KVCacheManager, r: Request, num_tokens: int | None = None) -> int:
    """Prefix-cache lookup plus allocation, as the scheduler does; returns the hit tokens."""
    blocks, hit = kv.get_computed_blocks(r)
    n = (r.num_tokens - hit) if num_tokens is None else num_tokens
    assert kv.allocate_slots(r, n, blocks, hit) is not None
    r.num_computed_tokens = hit + n
    return hit


def test_hash_is_a_deterministic_chain():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4]) and len(h1) == 32
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h1 != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(hash_block_tokens(None, [0]), [5, 6])


def test_block_hashes_cover_full_blocks_only_and_grow_incrementally():
    kv = KVCacheManager(10, BS)
    r = req("a", list(range(9)))
    kv.update_block_hashes(r)
    assert len(r.block_hashes) == 2
    first = list(r.block_hashes)
    for t in (9, 10, 11):
        r.append_output_token(t)
    kv.update_block_hashes(r)
    assert r.block_hashes[:2] == first and len(r.block_hashes) == 3
    assert r.block_hashes[2] == hash_block_tokens(first[1], [8, 9, 10, 11])


def test_never_the_whole_prompt():
    kv = KVCacheManager(10, BS)
    a = req("a", list(range(8)))  # exactly two full blocks
    admit(kv, a)
    b = req("b", list(range(8)))
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 4 and len(blocks) == 1  # the last block is recomputed for its logits
    c = req("c", list(range(9)))  # one more token: both blocks hit
    blocks, hit = kv.get_computed_blocks(c)
    assert hit == 8 and [x.block_id for x in blocks] == kv.get_block_ids("a")


def test_shared_prefix_ref_counts():
    kv = KVCacheManager(10, BS)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    assert admit(kv, b) == 8
    ids_a, ids_b = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert ids_a[:2] == ids_b[:2] and ids_a[2] != ids_b[2]
    blocks = kv.block_pool.blocks
    assert [blocks[i].ref_cnt for i in ids_a] == [2, 2, 1]
    kv.free(a)
    assert [blocks[i].ref_cnt for i in ids_b] == [1, 1, 1]
    assert blocks[ids_a[2]].ref_cnt == 0
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == 9
    assert kv.usage == 0.0


def test_free_is_tail_first_so_last_blocks_are_evicted_first():
    kv = KVCacheManager(6, BS)
    a = req("a", list(range(12)))
    admit(kv, a)
    ids = kv.get_block_ids("a")
    kv.free(a)
    assert [b.block_id for b in kv.block_pool.free_block_queue] == [4, 5, *reversed(ids)]
    # Reusing 3 blocks evicts the two never-used ones and then a's last block; its prefix survives.
    kv.block_pool.get_new_blocks(3)
    b = req("b", list(range(13)))
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8 and [x.block_id for x in blocks] == ids[:2]


def test_allocate_returns_none_without_half_allocating():
    kv = KVCacheManager(4, BS)  # 3 usable blocks
    a = req("a", list(range(8)))
    admit(kv, a)
    b = req("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids("b") == [] and kv.block_pool.get_num_free_blocks() == 1
    assert kv.allocate_slots(b, 4) is not None


def test_touching_free_computed_blocks_counts_against_free_blocks():
    kv = KVCacheManager(4, BS)  # 3 usable blocks
    a = req("a", list(range(9)))
    admit(kv, a)
    kv.free(a)  # all 3 free; two of them cached
    b = req("b", [*range(9), 50, 51, 52, 53, 54])  # hits 8 tokens, needs 2 more blocks
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    # 3 blocks are free, but 2 of them are the hit itself: 1 left for the 2 new blocks needed.
    assert kv.allocate_slots(b, b.num_tokens - hit, blocks, hit) is None
    assert kv.block_pool.get_num_free_blocks() == 3 and all(x.ref_cnt == 0 for x in blocks)
    c = req("c", [*range(9), 60])  # needs 1 more
    blocks, hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - hit, blocks, hit) is not None
    assert kv.block_pool.get_num_free_blocks() == 0


def test_generated_tokens_are_cached_once_their_block_is_full():
    kv = KVCacheManager(10, BS)
    a = req("a", [1, 2, 3])
    admit(kv, a)
    assert a.block_hashes == []
    a.append_output_token(4)  # decode: compute the sampled token's KV
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    assert len(a.block_hashes) == 1
    assert kv.block_pool.get_cached_block(a.block_hashes[0]).block_id == kv.get_block_ids("a")[0]


def test_only_known_tokens_are_cached():
    kv = KVCacheManager(10, BS)
    a = req("a", [1, 2, 3])
    # Asking for more slots than tokens (e.g. lookahead) must not hash an incomplete block.
    assert len(kv.allocate_slots(a, 6)) == 2
    assert a.block_hashes == [] and kv.block_pool.cached_block_hash_to_block == {}


def test_resumed_request_hits_its_prompt_and_outputs():
    kv = KVCacheManager(10, BS)
    a = req("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    for t in (6, 7, 8, 9):
        a.append_output_token(t)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    kv.free(a)  # preempted
    a.num_computed_tokens = 0
    _, hit = kv.get_computed_blocks(a)
    assert hit == 8  # prompt + generated tokens, minus the last (incomplete) block


def test_cache_salt_separates_prefixes():
    kv = KVCacheManager(10, BS)
    admit(kv, req("a", list(range(9)), salt="alice"))
    assert kv.get_computed_blocks(req("b", list(range(9)), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(req("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(req("d", list(range(9)), salt="alice"))[1] == 8


def test_prefix_cache_counters_are_in_tokens():
    kv = KVCacheManager(10, BS)
    admit(kv, req("a", list(range(9))))
    kv.get_computed_blocks(req("b", list(range(10))))
    assert kv.prefix_cache_queries == 19 and kv.prefix_cache_hits == 8


def test_caching_disabled():
    kv = KVCacheManager(10, BS, enable_caching=False)
    admit(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9)))) == ([], 0)
    assert kv.block_pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache():
    kv = KVCacheManager(10, BS)
    a = req("a", list(range(9)))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0

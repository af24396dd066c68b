import pytest

from engine.block_pool import BlockPool


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_not_enough_blocks_raises_without_taking_any():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3


def test_lru_order_least_recently_freed_first():
    pool = BlockPool(6)
    _, b2, _, b4, b5 = pool.get_new_blocks(5)
    pool.free_blocks([b4, b2])
    pool.free_blocks([b5])
    assert free_ids(pool) == [4, 2, 5]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 4]  # the two least recently freed
    assert free_ids(pool) == [5]


def test_tail_first_freeing_evicts_last_blocks_first():
    pool = BlockPool(5)
    table = pool.get_new_blocks(4)
    pool.free_blocks(reversed(table))
    assert free_ids(pool) == [4, 3, 2, 1]


def test_a_run_freed_tail_first_comes_back_in_ascending_order():
    pool = BlockPool(9)
    first, second = pool.get_new_blocks(4), pool.get_new_blocks(4)
    pool.free_blocks(reversed(second))
    pool.free_blocks(reversed(first))
    assert [b.block_id for b in pool.get_new_blocks(6)] == [3, 4, 5, 6, 7, 8]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]


def test_touch_removes_free_block_from_the_middle():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks)
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1
    assert free_ids(pool) == [1, 3, 4]
    pool.touch([blocks[1]])  # a held block: only the count changes
    assert blocks[1].ref_cnt == 2
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks([blocks[1]])
    assert free_ids(pool) == [1, 3, 4]
    pool.free_blocks([blocks[1]])
    assert free_ids(pool) == [1, 3, 4, 2]


def test_cached_block_findable_while_free_and_evicted_lazily_on_reuse():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"], 0, 1)  # only a is full
    assert a.block_hash == b"ha" and b.block_hash is None
    pool.free_blocks([b, a])
    assert pool.get_cached_block(b"ha") is a  # still findable while free
    (first,) = pool.get_new_blocks(1)
    assert first is b and pool.get_cached_block(b"ha") is a
    (second,) = pool.get_new_blocks(1)
    assert second is a
    assert a.block_hash is None and pool.get_cached_block(b"ha") is None


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    pool.cache_full_blocks([b], [b"h"], 0, 1)
    assert pool.get_cached_block(b"h") is a and b.block_hash is None
    pool.free_blocks([a, b])
    pool.get_new_blocks(2)  # evicting a must not disturb anything else
    assert pool.cached_block_hash_to_block == {}


def test_caching_disabled_never_hashes():
    pool = BlockPool(3, enable_caching=False)
    a, _ = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    assert a.block_hash is None and pool.get_cached_block(b"h") is None


def test_usage_counts_non_null_blocks():
    pool = BlockPool(5)
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.5)
    pool.free_blocks(blocks)
    assert pool.usage == 0.0


def test_reset_prefix_cache_only_when_nothing_held():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"], 0, 2)
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"ha") is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert a.block_hash is None and b.block_hash is None
    assert pool.get_num_free_blocks() == 3

"""The pool of KV-cache blocks: ref counts, the LRU free queue and the prefix-hash map.

Invariants (the property tests in proptests/test_kv_cache_props.py hold them):

- Block 0 is the null block: a padding target for block tables. It is never handed out, never
  freed, never in the free queue and never hashed.
- Every other block is either free (``ref_cnt == 0``, in the free queue exactly once) or held
  (``ref_cnt`` = the number of live requests whose block table holds it, not in the free queue).
  So ``free + held == num_blocks - 1`` at all times.
- The free queue is in eviction order: the block at its head is reused first. Freed blocks go to
  the tail, so the least recently freed block is evicted first; callers free a request's blocks
  tail-first, which puts a sequence's last blocks (least likely to be shared) ahead of its first.
- A block with a hash is in ``cached_block_hash_to_block`` under that hash, and vice versa. It stays
  findable while it is free (a prefix-cache hit takes it out of the free queue again, "touch")
  and loses its hash only when it is popped for reuse (lazy eviction) or the whole cache is reset.
- At most one block per hash: if two requests fill blocks with equal content, the second block
  stays unhashed and is simply freed for reuse later.
- Recording events (``record_events``), ``kv_events`` maps each hash whose cache entry changed since the
  last ``take_kv_events`` to whether it is now cached, and ``kv_reset`` says whether the whole map was
  cleared first: applied to the cache as of the last take, they give the cache now.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVCacheBlock:
    """One page of KV memory; ``prev_free``/``next_free`` are free-queue links (None when held)."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with head/tail sentinels: a prefix-cache hit on a free block
    must leave it in O(1), which a deque cannot do, and the sentinels spare the empty-list cases."""

    __slots__ = ("head", "num_free", "tail")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


class BlockPool:
    """All KV blocks of one cache; knows nothing about requests or block sizes. The prefix-cache counters
    (the KV-cache manager records them) are in tokens: ``prefix_cache_queries`` looked up,
    ``prefix_cache_hits`` found. They only ever grow, even across ``reset_prefix_cache()``, so they can
    feed monotonic metrics."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.kv_events: dict[bytes, bool] | None = None
        self.kv_reset = False

    def record_events(self) -> None:
        """Keep the prefix cache's changes for `take_kv_events` (a data-parallel coordinator's view)."""
        self.kv_events = {}

    def take_kv_events(self) -> tuple[bool, list[bytes], list[bytes]] | None:
        """Whether the cache was reset, then the hashes evicted and those stored since the last take;
        None when nothing changed (or nothing is recorded)."""
        if not self.kv_events and not self.kv_reset:
            return None
        events, reset = self.kv_events, self.kv_reset
        self.kv_events, self.kv_reset = {}, False
        return reset, [h for h, cached in events.items() if not cached], [h for h, c in events.items() if c]

    def get_num_free_blocks(self) -> int:
        """Free blocks, including cached ones that would be evicted on reuse."""
        return self.free_block_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by some request."""
        return 1.0 - self.free_block_queue.num_free / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks off the free queue's head, each with ref_cnt 1, in ascending id order:
        a sequence's pages then lie in ascending memory, which CPU decode attention streams fastest (a
        freed run comes back tail-first). A popped block that still carries a hash is evicted from the
        prefix cache here."""
        queue, table = self.free_block_queue, self.cached_block_hash_to_block
        if num_blocks > queue.num_free:
            raise ValueError(f"cannot get {num_blocks} blocks: only {queue.num_free} free")
        blocks = sorted((queue.popleft() for _ in range(num_blocks)), key=lambda b: b.block_id)
        for block in blocks:
            if table.get(block.block_hash) is block:  # an unhashed block's None is no key
                del table[block.block_hash]
                if self.kv_events is not None:
                    self.kv_events[block.block_hash] = False
            block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); a free one leaves the queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the queue tail in the given order,
        so pass the first-to-evict block first."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[bytes], num_cached: int, num_full: int
    ) -> None:
        """Register ``blocks[num_cached:num_full]`` (now full) under ``block_hashes[i]``."""
        if not self.enable_caching:
            return
        table = self.cached_block_hash_to_block
        for i in range(num_cached, num_full):
            block = blocks[i]
            if block.block_hash is not None:  # came from the cache already
                continue
            block_hash = block_hashes[i]
            if block_hash not in table:  # else an equal block is cached: keep that one
                block.block_hash = block_hash
                table[block_hash] = block
                if self.kv_events is not None:
                    self.kv_events[block_hash] = True

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is held: a running request's blocks
        would silently lose their cache entries, and callers expect a clean slate."""
        if self.free_block_queue.num_free != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events, self.kv_reset = {}, True
        return True

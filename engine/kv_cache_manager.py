"""Per-request block tables over a BlockPool, and the prefix cache's hashing.

A request's block table covers its first ``len(table) * block_size`` token slots. Block hashes
form a chain: block i's hash covers block i's tokens and, through the parent hash, every token
before it, so equal hashes mean equal prefixes (and equal cache salts).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from engine.block_pool import BlockPool, KVCacheBlock
from engine.request import Request

_encode = msgspec.msgpack.Encoder().encode


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """sha256 over the msgpack encoding of (parent hash, token ids, extra keys): one byte string per
    value, so unlike Python's salted ``hash()`` it is stable across processes and runs."""
    return hashlib.sha256(_encode((parent_hash, token_ids, extra_keys))).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> None:
    """Append to `hashes` the chained hash of every full block of `token_ids` past the ones it has."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else None
        # The salt keys the first block only; the chain carries it into every later one.
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each table are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.block_pool.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.block_pool.prefix_cache_hits

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of ``request.all_token_ids``; incremental,
        so a decode step costs one length comparison, and one sha256 when a block fills."""
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached run of full blocks from the start of ``request.all_token_ids``, never the
        whole sequence: computing its last token is what yields the next token's logits. Every call
        counts in the prefix-cache counters, so a request retried while memory is short counts again."""
        # Prompt logprobs and mean pooling need every position computed: a hit would skip some.
        if not self.enable_caching or request.sampling_params.every_position:
            return [], 0
        self.update_block_hashes(request)
        pool = self.block_pool
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit = len(blocks) * self.block_size
        pool.prefix_cache_queries += request.num_tokens
        pool.prefix_cache_hits += num_hit
        return blocks, num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow the table to cover ``num_computed_tokens + num_new_computed_tokens + num_new_tokens``.

        ``new_computed_blocks`` (a prefix-cache hit from get_computed_blocks) are only valid for a
        request holding no blocks yet. Returns the newly allocated blocks, or None, with nothing
        changed, when the pool cannot serve them all. Blocks that become full are registered in the
        prefix cache right away, before the step computes their KV: this assumes the runner writes a
        step's KV into its pages before any attention of that step reads them.
        """
        rid = request.request_id
        is_new = rid not in self.req_to_blocks
        req_blocks = self.req_to_blocks.get(rid, [])
        if new_computed_blocks and not is_new:
            raise ValueError(f"request {rid} already holds blocks; cache hits are for new requests only")
        pool = self.block_pool
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = -(-num_total // self.block_size) - len(req_blocks) - len(new_computed_blocks)
        if num_new_blocks > 0 or new_computed_blocks:  # a decode step within its last block skips this
            # Touching a free cached block takes it out of the free count.
            num_free = pool.get_num_free_blocks() - sum(b.ref_cnt == 0 for b in new_computed_blocks)
            if num_new_blocks > num_free:
                return None
        if is_new:
            self.req_to_blocks[rid] = req_blocks
            # Blocks from a hit are registered already.
            self.num_cached_blocks[rid] = len(new_computed_blocks)
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            # Only blocks whose tokens are all known can be hashed.
            num_full = min(num_total, len(request.all_token_ids)) // self.block_size
            num_cached = self.num_cached_blocks[rid]
            if num_full > num_cached:
                self.update_block_hashes(request)
                pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full)
                self.num_cached_blocks[rid] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first so it is evicted first. Full blocks keep
        their hashes and stay findable until reused. Idempotent."""
        rid = request.request_id
        self.num_cached_blocks.pop(rid, None)
        self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(rid, [])))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

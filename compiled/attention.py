"""Paged KV cache writes and paged attention in plain PyTorch, for Inductor to turn into kernels.

Layout: one K and one V tensor per layer; a token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size` of its layer's cache. Each page holds
its heads one after the other, and each head in slices `c` floats wide, one vector register
(`kv_lanes`): K is `[num_blocks, n_kv_heads, block_size / c, head_dim, c]`, V is
`[num_blocks, n_kv_heads, head_dim / c, block_size, c]`, so every inner loop of the decode kernels
walks contiguous memory (the score reduction with a page's positions in the vector lanes, the P·V
reduction with head_dim in the lanes). Layouts and formulations compared: BENCHMARKS.md.
Block 0 is the null block: padding tokens write there and padded block-table entries point there.
The cache starts zero and is never cleared again: a freed block keeps its last sequence's K/V, so
every read masks the slots a sequence has not written.

A packed step is split by shape, not by phase: the first `Bd` tokens are sequences with exactly
one query (decodes, and a prefill whose last token is all that is left), the rest are the query
tokens of `P` multi-token chunks (fresh prefills, or chunks continuing after cached context).

- Single-query rows: a gather + reduction formulation when compiled (`decode_attention_reduction`):
  Inductor fuses the indirect loads into the reductions, and each query head of a GQA group is its
  own reduction over the same loads, so a K or V slice is loaded once for the whole group; matmuls
  over gathered K/V eagerly (`decode_attention_matmul`). The step's plan names one.
- Multi-token chunks attend with matmuls over their sequence's K/V (context and the chunk itself,
  already written): prefill is compute-bound and matmuls beat any reduction there. On CPU
  (`prefill_attention_chunks`) a step's fresh prompts run together tile by tile, a lone one and each
  chunk after context alone through SDPA; elsewhere the chunks are one padded [P, L] SDPA batch with a
  mask.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor import inductor_prims


class AttentionMetadata(NamedTuple):
    """Where each token of a packed step reads and writes KV. All int64 tensors on the model's device."""

    slot_mapping: Tensor  # [T] cache slot each token's K/V is written to
    decode_block_tables: Tensor  # [Bd, Wd] for the first Bd tokens (one query each)
    decode_seq_lens: Tensor  # [Bd] keys each single-query row attends to (its position + 1)
    prefill_block_tables: Tensor  # [P, Wp]
    prefill_query_index: Tensor  # [P, Qp] step-token index of each chunk's queries (padding: any valid index)
    prefill_query_pos: Tensor  # [P, Qp] position of each query (padding: 0)
    prefill_out_index: Tensor  # [T - Bd] row of each chunk token in the flattened [P * Qp] output
    prefill_chunks: Tensor  # [P, 2] first position and query count of each chunk (on CPU P >= 2: a
    # lone one gets an empty second on the null row, so that no graph is specialised to one chunk)

    @property
    def decode_only(self) -> bool:
        """Every token is its sequence's single query (no multi-token chunk): a decode batch."""
        return self.prefill_block_tables.shape[0] == 0


def kv_lanes(device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int) -> int:
    """Width `c` of the slices the cache stores pages in: one vector register of `dtype`.

    Inductor's CPU kernels use 32-byte vectors on AVX2 and 64-byte ones on AVX-512. CUDA takes 64 bytes
    as well, a choice not measured there. Slices never outgrow a page or a head.
    """
    vector_bytes = 32 if device.type == "cpu" and torch.backends.cpu.get_cpu_capability() != "AVX512" else 64
    return math.gcd(vector_bytes // dtype.itemsize, block_size, head_dim)


def new_kv_cache(
    num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """One layer's K [blocks, n_kv_heads, block_size / c, head_dim, c] and
    V [blocks, n_kv_heads, head_dim / c, block_size, c], zeroed: float math on slots nobody wrote (the
    warm-up's throw-away rows read the null block) stays free of NaN and denormals."""
    c = kv_lanes(device, dtype, block_size, head_dim)
    shapes = (
        (num_blocks, n_kv_heads, block_size // c, head_dim, c),
        (num_blocks, n_kv_heads, head_dim // c, block_size, c),
    )
    if device.type == "cpu":
        return _lazy_zeros(shapes[0], dtype), _lazy_zeros(shapes[1], dtype)
    k, v = (torch.zeros(s, device=device, dtype=dtype) for s in shapes)
    return k, v


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A zero CPU tensor in a private anonymous mapping of its own: pages read as zero until written and
    are committed as blocks are first used (zeroing a 5.8 GiB cache at start took 3.8 s). Small pages, not
    transparent huge ones: where the host backs a VM's memory as it is first touched, committing a fresh
    2 MiB page took 18-23 ms against ~1.2 ms for 2 MiB of 4 KiB pages, and an engine touches every page it
    serves from (BENCHMARKS.md)."""
    count = math.prod(shape)
    nbytes = -(-max(count, 1) * dtype.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # a kernel without transparent huge pages
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)  # keeps the mapping alive


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store this step's K/V [T, n_kv_heads, head_dim] in place; nothing copies the cache."""
    bs, c = v_cache.shape[3], v_cache.shape[4]
    block, offset = slot_mapping // bs, slot_mapping % bs
    k_cache[block, :, offset // c, :, offset % c] = k
    v_cache[block, :, :, offset] = v.view(v.shape[0], v.shape[1], -1, c)


def _gather_keys(k_cache: Tensor, block_tables: Tensor) -> Tensor:
    """[B, W] block ids -> [B, n_kv_heads, W * block_size, head_dim] keys in position order."""
    B, W = block_tables.shape
    _, Hkv, n, D, c = k_cache.shape
    return k_cache[block_tables].permute(0, 2, 1, 3, 5, 4).reshape(B, Hkv, W * n * c, D)


def _gather_values(v_cache: Tensor, block_tables: Tensor) -> Tensor:
    """[B, W] block ids -> [B, n_kv_heads, W * block_size, head_dim] values in position order."""
    B, W = block_tables.shape
    _, Hkv, n, bs, c = v_cache.shape
    return v_cache[block_tables].permute(0, 2, 1, 4, 3, 5).reshape(B, Hkv, W * bs, n * c)


def _decode_setup(q: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor):
    B, H, D = q.shape
    W, (Hkv, bs) = block_tables.shape[1], v_cache.shape[1:4:2]
    valid = (torch.arange(W * bs, device=q.device)[None, :] < seq_lens[:, None]).view(B, W, bs)
    return q.view(B, Hkv, H // Hkv, D), valid  # the GQA group folded next to its KV head


def decode_attention_reduction(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """One query per row, q [B, H, D] -> [B, H, D], as reductions over the pages in place: compiled,
    Inductor fuses the indirect loads into them and never materialises the gathered K/V (eagerly this
    would build a [B, W, Hkv, bs, D] product)."""
    B, H, D = q.shape
    # q in a buffer of its own: Inductor would otherwise inline its producer (RoPE over the projection's
    # transposed output) into the score loop and compute it again for every page.
    q = inductor_prims.force_stride_order(q, (H * D, D, 1))
    q, valid = _decode_setup(q, v_cache, block_tables, seq_lens)
    Hkv, G, bs = q.shape[1], q.shape[2], v_cache.shape[3]
    W = block_tables.shape[1]
    k = k_cache[block_tables].float()  # [B, W, Hkv, bs/c, D, c]
    v = v_cache[block_tables]  # [B, W, Hkv, D/c, bs, c]
    v = torch.where(valid[:, :, None, None, :, None], v, 0.0).float()  # unwritten slots may hold NaN
    qf = q.float()
    scores = torch.stack([(qf[:, None, :, g, None, :, None] * k).sum(4) for g in range(G)], 3) * scale
    scores = scores.view(B, W, Hkv, G, bs).masked_fill(~valid[:, :, None, None, :], float("-inf"))
    e = (scores - scores.amax(dim=(1, 4), keepdim=True)).exp()  # [B, W, Hkv, G, bs]
    out = torch.stack(
        [(e[:, :, :, g, None, :, None] * v).sum(dim=(1, 4)) for g in range(G)], 2
    )  # [B, Hkv, G, D/c, c]
    out = out.view(B, Hkv, G, D) / e.sum(dim=(1, 4))[..., None]
    return out.to(q.dtype).reshape(B, H, D)


def decode_attention_matmul(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """The same as `decode_attention_reduction`, over gathered K/V with matmuls: the eager formulation."""
    B, H, D = q.shape
    q, valid = _decode_setup(q, v_cache, block_tables, seq_lens)
    k = _gather_keys(k_cache, block_tables)  # [B, Hkv, L, D]
    v = _gather_values(v_cache, block_tables).masked_fill_(~valid.view(B, 1, -1, 1), 0.0)  # a fresh copy
    scores = torch.einsum("bhgd,bhld->bhgl", q.float(), k.float()) * scale
    scores = scores.masked_fill(~valid.view(B, 1, 1, -1), float("-inf"))
    out = torch.einsum("bhgl,bhld->bhgd", scores.softmax(dim=-1), v.float())
    return out.to(q.dtype).reshape(B, H, D)


DECODE_ATTENTION = {"reduction": decode_attention_reduction, "matmul": decode_attention_matmul}


def prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    expand_kv: bool | None = None,
) -> Tensor:
    """Multi-token chunks: q [T, H, D] (the whole step) -> [T - Bd, H, D] for the chunk tokens.

    `expand_kv` (default: on CUDA) repeats each KV head for its query heads: CUDA's fused SDPA kernels take
    a mask but no GQA, and SDPA's math fallback would materialise every score. CPU's take both."""
    k = _gather_keys(k_cache, meta.prefill_block_tables)  # [P, Hkv, L, D]
    v = _gather_values(v_cache, meta.prefill_block_tables)
    qp = q[meta.prefill_query_index].transpose(1, 2)  # [P, H, Qp, D]
    key_pos = torch.arange(k.shape[2], device=q.device)
    mask = key_pos[None, None, None, :] <= meta.prefill_query_pos[:, None, :, None]  # [P, 1, Qp, L]
    # Unwritten slots may hold anything, NaN included: a masked score still meets them.
    written = (key_pos[None, :] <= meta.prefill_query_pos.amax(1)[:, None])[:, None, :, None]  # [P, 1, L, 1]
    k, v = torch.where(written, k, 0.0), torch.where(written, v, 0.0)
    expand = q.device.type == "cuda" if expand_kv is None else expand_kv
    if expand:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=not expand)
    P, H, Qp, D = out.shape
    return out.transpose(1, 2).reshape(P * Qp, H, D)[meta.prefill_out_index]


def prefill_attention_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    chunks: Tensor,
    scale: float,
) -> Tensor:
    """Multi-token chunks: q [N, H, D] holds their queries chunk after chunk and k, v [N, Hkv, D] their keys
    and values, `chunks` [P, 2] each one's first position and query count (`block_tables` [P, W]);
    -> [N, H, D]. No chunk pays for another's length, as each would in one padded batch (several times
    the work for prompts of mixed lengths): a step's fresh prompts run together tile by tile
    (`_fresh_prompts`) on the step's own K/V; a lone one, and every chunk after context, alone through
    SDPA over its pages."""
    bs = v_cache.shape[3]
    spans = chunks.tolist()
    firsts = [0, *itertools.accumulate(n for _, n in spans)]
    # The empty chunk a step with one carries (compiled/input_batch.py) has nothing to compute.
    fresh = sorted((i for i, (start, n) in enumerate(spans) if start == 0 and n), key=lambda i: -spans[i][1])
    together = fresh if len(fresh) > 1 else []
    if together:
        out = _fresh_prompts(q, k, v, [firsts[i] for i in together], [spans[i][1] for i in together], scale)
    else:
        out = torch.empty_like(q)
    for i, (start, n) in enumerate(spans):
        if n == 0 or i in together:
            continue
        end = start + n
        table = block_tables[i : i + 1, : -(-end // bs)]
        k = _gather_keys(k_cache, table)[:, :, :end]  # [1, Hkv, end, D]: every slot written
        v = _gather_values(v_cache, table)[:, :, :end]
        qi = q[firsts[i] : firsts[i] + n].transpose(0, 1)[None]  # [1, H, n, D]
        if start == 0:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = torch.arange(end, device=q.device) <= torch.arange(start, end, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[firsts[i] : firsts[i] + n] = o[0].transpose(0, 1)
    return out


# Query rows of each prompt a batched product may take at once, and what a score costs at that size
# against 64-row tiles: smaller products run less efficiently, but pad a prompt's last tile less.
CAUSAL_TILES = {16: 1.3, 32: 1.12, 64: 1.0}


def causal_tile(lens: list[int]) -> int:
    """The tile size of `CAUSAL_TILES` whose scores, padding included, cost least for fresh prompts of
    these lengths (longest first). Prompt b fills m_b = ceil(lens[b] / T) tiles, tile j against
    (j + 1)·T keys, the longest prompts' last one against the longest prompt's length."""

    def cost(t: int) -> float:
        last = -(-lens[0] // t)
        keys = 0
        for length in lens:
            m = -(-length // t)
            keys += t * m * (m + 1) // 2 - (last * t - lens[0] if m == last else 0)
        return keys * t * CAUSAL_TILES[t]

    return min(CAUSAL_TILES, key=cost)


def _fresh_prompts(
    q: Tensor, k: Tensor, v: Tensor, starts: list[int], lens: list[int], scale: float
) -> Tensor:
    """Fresh prompts, longest first: prompt b's queries, keys and values are rows
    [starts[b], starts[b] + lens[b]) of q [N, H, D] and k, v [N, Hkv, D] -> [N, H, D], whose rows outside
    these prompts are left for the caller.

    Tile t holds query rows [t * T, (t + 1) * T) (T = `causal_tile(lens)`) of every prompt that long, against
    their keys up to the tile's last row: one batch of matmuls over those prompts and their KV heads, the
    causal half mostly skipped. A prompt's last tile is padded with copies of its last row: the queries'
    results are dropped, and the keys lie past every kept query, so the causal mask hides them. On CPU this
    beats SDPA called prompt by prompt, whose flash kernel spends more on its softmax than on its products
    for heads this small (BENCHMARKS.md). Scores stay in float32, as SDPA keeps them; the probabilities
    meet V in V's dtype, as in SDPA. Each operand is read, and the results written, by one gather."""
    B, longest = len(lens), lens[0]
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    G, T = H // Hkv, causal_tile(lens)
    padded = -(-longest // T) * T
    step = torch.arange(padded, device=q.device)
    starts_t, lens_t = (torch.tensor(x, device=q.device)[:, None] for x in (starts, lens))
    source = (torch.minimum(step, lens_t - 1) + starts_t).view(-1)  # the step row of each padded row
    # Queries as [B, Hkv, padded, G, D] and keys as [B, Hkv, D, padded], in float32: a tile's rows of a
    # KV head are one matrix, against its keys' columns.
    queries = torch.empty(B, Hkv, padded, G, D, device=q.device)
    queries.copy_(q[source].view(B, padded, Hkv, G, D).transpose(1, 2))
    keys_t = torch.empty(B, Hkv, D, padded, device=q.device)
    keys_t.copy_(k[source].view(B, padded, Hkv, D).permute(0, 2, 3, 1))
    keys_t = keys_t.view(B * Hkv, D, padded)
    values = v[source].view(B, padded, Hkv, D).transpose(1, 2).reshape(B * Hkv, padded, D)
    out = q.new_empty(B, padded, H, D)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu_(1)
    for a in range(0, padded, T):
        n = sum(length > a for length in lens)  # the prompts this tile has rows of: the first n
        e = min(a + T, longest)  # keys past every prompt's end need not be read
        bias = torch.zeros(T, e, device=q.device)
        bias[:, a:].masked_fill_(causal[:, : e - a], float("-inf"))
        bias = bias[:, None].expand(T, G, e).reshape(T * G, e)
        tile = queries[:n, :, a : a + T].reshape(n * Hkv, T * G, D)  # a view: (query, head of the group)
        scores = torch.baddbmm(bias, tile, keys_t[: n * Hkv, :, :e], alpha=scale)
        probs = torch.softmax(scores, -1).to(v.dtype)
        o = torch.bmm(probs, values[: n * Hkv, :e])  # [n * Hkv, T * G, D]
        out[:n, a : a + T] = o.view(n, Hkv, T, G, D).transpose(1, 2).reshape(n, T, H, D)
    real = (step < lens_t).view(-1)
    rows = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)  # the padded row of each step row
    rows[source[real]] = torch.arange(B * padded, device=q.device)[real]
    return out.view(B * padded, H, D)[rows]


# An op of its own, run eagerly inside the compiled layers: its loop follows the chunks' values.
_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define(
    "prefill_attention_chunks(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, "
    "Tensor block_tables, Tensor chunks, float scale) -> Tensor"
)
_lib.impl("prefill_attention_chunks", prefill_attention_chunks, "CPU")


@torch.library.register_fake("kiln::prefill_attention_chunks")
def _(q: Tensor, *operands: object) -> Tensor:
    return torch.empty_like(q)


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode: str = "matmul",
) -> Tensor:
    """Attention for a packed step, after its K/V [T, Hkv, D] were written: q [T, H, D] -> [T, H, D];
    its single-query rows through `DECODE_ATTENTION[decode]`."""
    Bd = meta.decode_block_tables.shape[0]
    parts = []
    if Bd > 0:
        attend = DECODE_ATTENTION[decode]
        parts.append(attend(q[:Bd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale))
    if meta.prefill_block_tables.shape[0] > 0 and q.device.type == "cpu":
        chunks = torch.ops.kiln.prefill_attention_chunks(
            q[Bd:], k[Bd:], v[Bd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_chunks, scale
        )
        parts.append(chunks)
    elif meta.prefill_block_tables.shape[0] > 0:
        parts.append(prefill_attention(q, k_cache, v_cache, meta, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)

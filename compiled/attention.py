"""Paged attention in plain PyTorch, for Inductor to turn into kernels: what every device shares, and the
interface each device's backend fills (`AttentionBackend`: compiled/attention_cpu.py, attention_cuda.py).

Layout: one K and one V tensor per layer; a token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size` of its layer's cache. Each page holds
its heads one after the other, and each head in slices `c` floats wide, one vector register
(`AttentionBackend.kv_lanes`): K is `[num_blocks, n_kv_heads, block_size / c, head_dim, c]`, V is
`[num_blocks, n_kv_heads, head_dim / c, block_size, c]`, so every inner loop of the decode kernels
walks contiguous memory (the score reduction with a page's positions in the vector lanes, the P·V
reduction with head_dim in the lanes).
Block 0 is the null block: padding tokens write there and padded block-table entries point there.
The cache starts zero and is never cleared again: a freed block keeps its last sequence's K/V, so
every read masks the slots a sequence has not written.

A packed step is split by shape, not by phase: the first `Bd` tokens are sequences with exactly
one query (decodes, and a prefill whose last token is all that is left), the rest are the query
tokens of `P` multi-token chunks (fresh prefills, or chunks continuing after cached context).

- Single-query rows, on every device: a gather + reduction formulation when compiled
  (`decode_attention_reduction`): Inductor fuses the indirect loads into the reductions, and each query
  head of a GQA group is its own reduction over the same loads, so a K or V slice is loaded once for the
  whole group; on CPU page by page over each row's own pages (`AttentionBackend.decode`), where over a
  table as wide as the longest row one long context would make every row pay for its length. Matmuls
  over gathered K/V eagerly (`decode_attention_matmul`). The step's plan names one.
- Multi-token chunks attend with matmuls over their sequence's K/V (context and the chunk itself,
  already written): prefill is compute-bound and matmuls beat any reduction there. One op runs them
  (`prefill_attention_chunks`), eagerly inside the compiled layers; the backend says whether a step's
  fresh prompts are batched tile by tile.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from compiled.plan import force_stride_order


class Scoring(NamedTuple):
    """How one layer's attention scores are made: q·k times `scale`, soft-capped into (-softcap, softcap)
    as softcap · tanh(s / softcap) (0: not), and masked to the `window` keys up to each query's own (0: to
    every key before it)."""

    scale: float
    window: int = 0
    softcap: float = 0.0


def softcapped(scores: Tensor, cap: float) -> Tensor:
    return cap * torch.tanh(scores / cap) if cap else scores


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scoring: Scoring) -> Tensor:
    """q [B, H, Q, D] against k, v [B, Hkv, L, D] where `mask` [B or 1, 1, Q, L] holds: SDPA, or SDPA's
    math where the scores are soft-capped, which SDPA cannot do."""
    if not scoring.softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scoring.scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = softcapped(q.float() @ k.float().transpose(-1, -2) * scoring.scale, scoring.softcap)
    return (s.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype) @ v).to(q.dtype)


class AttentionMetadata(NamedTuple):
    """Where each token of a packed step reads and writes KV. All int64 tensors on the model's device."""

    slot_mapping: Tensor  # [T] cache slot each token's K/V is written to
    decode_block_tables: Tensor  # [Bd, Wd] for the first Bd tokens (one query each)
    decode_seq_lens: Tensor  # [Bd] keys each single-query row attends to (its position + 1)
    # [Np] each single-query row's own pages, row by row, as row * Wd + its column of the table (Np >= 2),
    # for CPU's decode attention (compiled/attention_cpu.py); empty elsewhere.
    decode_pages: Tensor
    prefill_block_tables: Tensor  # [P, Wp]
    prefill_chunks: Tensor  # [P, 2] first position and query count of each chunk (P >= 2: a lone one
    # gets an empty second on the null row, so that no graph is specialised to one chunk)

    @property
    def decode_only(self) -> bool:
        """Every token is its sequence's single query (no multi-token chunk): a decode batch."""
        return self.prefill_block_tables.shape[0] == 0


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store this step's K/V [T, n_kv_heads, head_dim] in place; nothing copies the cache."""
    bs, c = v_cache.shape[3], v_cache.shape[4]
    block, offset = slot_mapping // bs, slot_mapping % bs
    k_cache[block, :, offset // c, :, offset % c] = k
    v_cache[block, :, :, offset] = v.view(v.shape[0], v.shape[1], -1, c)


def gather_keys(k_cache: Tensor, block_tables: Tensor) -> Tensor:
    """[B, W] block ids -> [B, n_kv_heads, W * block_size, head_dim] keys in position order."""
    B, W = block_tables.shape
    _, Hkv, n, D, c = k_cache.shape
    return k_cache[block_tables].permute(0, 2, 1, 3, 5, 4).reshape(B, Hkv, W * n * c, D)


def gather_values(v_cache: Tensor, block_tables: Tensor) -> Tensor:
    """[B, W] block ids -> [B, n_kv_heads, W * block_size, head_dim] values in position order."""
    B, W = block_tables.shape
    _, Hkv, n, bs, c = v_cache.shape
    return v_cache[block_tables].permute(0, 2, 1, 4, 3, 5).reshape(B, Hkv, W * bs, n * c)


def _decode_setup(q: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, window: int):
    B, H, D = q.shape
    W, (Hkv, bs) = block_tables.shape[1], v_cache.shape[1:4:2]
    pos = torch.arange(W * bs, device=q.device)[None, :]
    valid = pos < seq_lens[:, None]
    if window:
        valid &= pos >= seq_lens[:, None] - window
    return q.view(B, Hkv, H // Hkv, D), valid.view(B, W, bs)  # the GQA group folded next to its KV head


def decode_attention_reduction(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scoring: Scoring
) -> Tensor:
    """One query per row, q [B, H, D] -> [B, H, D], as reductions over the pages in place: compiled,
    Inductor fuses the indirect loads into them and never materialises the gathered K/V (eagerly this
    would build a [B, W, Hkv, bs, D] product). Every row runs over the whole table, as wide as the
    longest row: one shape a CUDA graph."""
    B, H, D = q.shape
    block_tables = meta.decode_block_tables
    # q in a buffer of its own: Inductor would otherwise inline its producer (RoPE over the projection's
    # transposed output) into the score loop and compute it again for every page.
    q = force_stride_order(q, (H * D, D, 1))
    q, valid = _decode_setup(q, v_cache, block_tables, meta.decode_seq_lens, scoring.window)
    Hkv, G, bs = q.shape[1], q.shape[2], v_cache.shape[3]
    W = block_tables.shape[1]
    k = k_cache[block_tables].float()  # [B, W, Hkv, bs/c, D, c]
    v = v_cache[block_tables]  # [B, W, Hkv, D/c, bs, c]
    v = torch.where(valid[:, :, None, None, :, None], v, 0.0).float()  # unwritten slots may hold NaN
    qf = q.float()
    scores = torch.stack([(qf[:, None, :, g, None, :, None] * k).sum(4) for g in range(G)], 3)
    scores = (
        softcapped(scores * scoring.scale, scoring.softcap)
        .view(B, W, Hkv, G, bs)
        .masked_fill(~valid[:, :, None, None, :], float("-inf"))
    )
    e = (scores - scores.amax(dim=(1, 4), keepdim=True)).exp()  # [B, W, Hkv, G, bs]
    out = torch.stack(
        [(e[:, :, :, g, None, :, None] * v).sum(dim=(1, 4)) for g in range(G)], 2
    )  # [B, Hkv, G, D/c, c]
    out = out.view(B, Hkv, G, D) / e.sum(dim=(1, 4))[..., None]
    return out.to(q.dtype).reshape(B, H, D)


def decode_attention_matmul(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scoring: Scoring
) -> Tensor:
    """The same as `decode_attention_reduction`, over gathered K/V with matmuls: the eager formulation."""
    B, H, D = q.shape
    tables = meta.decode_block_tables
    q, valid = _decode_setup(q, v_cache, tables, meta.decode_seq_lens, scoring.window)
    k = gather_keys(k_cache, tables)  # [B, Hkv, L, D]
    v = gather_values(v_cache, tables).masked_fill_(~valid.view(B, 1, -1, 1), 0.0)  # a fresh copy
    scores = softcapped(
        torch.einsum("bhgd,bhld->bhgl", q.float(), k.float()) * scoring.scale, scoring.softcap
    )
    scores = scores.masked_fill(~valid.view(B, 1, 1, -1), float("-inf"))
    out = torch.einsum("bhgl,bhld->bhgd", scores.softmax(dim=-1), v.float())
    return out.to(q.dtype).reshape(B, H, D)


def prefill_attention_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    chunks: Tensor,
    tiles: bool,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Multi-token chunks: q [N, H, D] holds their queries chunk after chunk and k, v [N, Hkv, D] their keys
    and values, `chunks` [P, 2] each one's first position and query count (`block_tables` [P, W]);
    -> [N, H, D], scored as `Scoring(scale, window, softcap)` says.
    No chunk pays for another's length, as each would in one padded batch (several times the work for
    prompts of mixed lengths): a step's fresh prompts run together tile by tile (`_fresh_prompts`) on the
    step's own K/V where `tiles` (the CPU's choice), else each alone; a lone one, and every chunk after
    context, alone through SDPA over its pages."""
    bs = v_cache.shape[3]
    spans = chunks.tolist()
    firsts = [0, *itertools.accumulate(n for _, n in spans)]
    # The empty chunk a step with one carries (compiled/input_batch.py) has nothing to compute.
    fresh = sorted((i for i, (start, n) in enumerate(spans) if start == 0 and n), key=lambda i: -spans[i][1])
    # A lone prompt runs through SDPA's flash kernel, unless it needs a window or a soft-cap, which SDPA
    # would take as a full mask or as its math, every score materialised.
    together = fresh if (tiles and len(fresh) > 1) or window or softcap else []
    if together:
        starts, lens = [firsts[i] for i in together], [spans[i][1] for i in together]
        out = _fresh_prompts(q, k, v, starts, lens, Scoring(scale, window, softcap))
    else:
        out = torch.empty_like(q)
    for i, (start, n) in enumerate(spans):
        if n == 0 or i in together:
            continue
        end = start + n
        table = block_tables[i : i + 1, : -(-end // bs)]
        k = gather_keys(k_cache, table)[:, :, :end]  # [1, Hkv, end, D]: every slot written
        v = gather_values(v_cache, table)[:, :, :end]
        qi = q[firsts[i] : firsts[i] + n].transpose(0, 1)[None]  # [1, H, n, D]
        if start == 0 and not window and not softcap:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = _visible(torch.arange(start, end, device=q.device), end, window)
            o = attend(qi, k, v, mask, Scoring(scale, window, softcap))
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


def _visible(query_pos: Tensor, keys: int, window: int) -> Tensor:
    """[Q, keys]: which of the first `keys` positions each query position attends to."""
    key_pos = torch.arange(keys, device=query_pos.device)
    visible = key_pos <= query_pos[:, None]
    return visible & (key_pos > query_pos[:, None] - window) if window else visible


def _fresh_prompts(
    q: Tensor, k: Tensor, v: Tensor, starts: list[int], lens: list[int], scoring: Scoring
) -> Tensor:
    """Fresh prompts, longest first: prompt b's queries, keys and values are rows
    [starts[b], starts[b] + lens[b]) of q [N, H, D] and k, v [N, Hkv, D] -> [N, H, D], whose rows outside
    these prompts are left for the caller.

    Tile t holds query rows [t * T, (t + 1) * T) (T = `causal_tile(lens)`) of every prompt that long, against
    their keys up to the tile's last row: one batch of matmuls over those prompts and their KV heads, the
    causal half mostly skipped. A prompt's last tile is padded with copies of its last row: the queries'
    results are dropped, and the keys lie past every kept query, so the causal mask hides them. On CPU this
    beats SDPA called prompt by prompt, whose flash kernel spends more on its softmax than on its products
    for heads this small. Scores stay in float32, as SDPA keeps them; the probabilities
    meet V in V's dtype, as in SDPA. Each operand is read, and the results written, by one gather."""
    B, longest, (scale, window, _) = len(lens), lens[0], scoring
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
    for a in range(0, padded, T):
        n = sum(length > a for length in lens)  # the prompts this tile has rows of: the first n
        e = min(a + T, longest)  # keys past every prompt's end need not be read
        s = max(0, a + 1 - window) if window else 0  # nor keys before the tile's first window
        rows = torch.arange(a, a + T, device=q.device)
        bias = torch.zeros(T, e - s, device=q.device)
        bias.masked_fill_(~_visible(rows, e, window)[:, s:], float("-inf"))
        bias = bias[:, None].expand(T, G, e - s).reshape(T * G, e - s)
        tile = queries[:n, :, a : a + T].reshape(n * Hkv, T * G, D)  # a view: (query, head of the group)
        if scoring.softcap:
            scores = torch.bmm(tile, keys_t[: n * Hkv, :, s:e]) * scale
            scores = softcapped(scores, scoring.softcap) + bias
        else:
            scores = torch.baddbmm(bias, tile, keys_t[: n * Hkv, :, s:e], alpha=scale)
        probs = torch.softmax(scores, -1).to(v.dtype)
        o = torch.bmm(probs, values[: n * Hkv, s:e])  # [n * Hkv, T * G, D]
        out[:n, a : a + T] = o.view(n, Hkv, T, G, D).transpose(1, 2).reshape(n, T, H, D)
    real = (step < lens_t).view(-1)
    rows = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)  # the padded row of each step row
    rows[source[real]] = torch.arange(B * padded, device=q.device)[real]
    return out.view(B * padded, H, D)[rows]


# An op of its own, run eagerly inside the compiled layers: its loop follows the chunks' values.
_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define(
    "prefill_attention_chunks(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, "
    "Tensor block_tables, Tensor chunks, bool tiles, float scale, int window=0, float softcap=0) -> Tensor"
)
_lib.impl("prefill_attention_chunks", prefill_attention_chunks, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::prefill_attention_chunks")
def _(q: Tensor, *operands: object) -> Tensor:
    return torch.empty_like(q)


class AttentionBackend:
    """One device's attention: the KV cache's memory and slice width, and how a step's multi-token chunks
    attend. Chosen once at start (`backend_for`) and held by the model's attention layers."""

    vector_bytes = 64  # the width of the device's vector loads: the cache's slices are one wide
    decode = staticmethod(decode_attention_reduction)  # single-query rows, compiled
    tile_fresh_prompts = False  # a step's fresh prompts together, tile by tile (`_fresh_prompts`)

    def kv_lanes(self, dtype: torch.dtype, block_size: int, head_dim: int) -> int:
        """Width `c` of the slices the cache stores pages in: one vector of `dtype`, never more than a
        page or a head."""
        return math.gcd(self.vector_bytes // dtype.itemsize, block_size, head_dim)

    def new_kv_cache(
        self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """One layer's K [blocks, n_kv_heads, block_size / c, head_dim, c] and
        V [blocks, n_kv_heads, head_dim / c, block_size, c], zeroed: float math on slots nobody wrote (the
        warm-up's throw-away rows read the null block) stays free of NaN and denormals."""
        c = self.kv_lanes(dtype, block_size, head_dim)
        k = self.zeros((num_blocks, n_kv_heads, block_size // c, head_dim, c), dtype)
        return k, self.zeros((num_blocks, n_kv_heads, head_dim // c, block_size, c), dtype)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def choose_paths(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> str | None:
        """Paths decided by timing them at start, where the device has a choice; a line for the log."""
        return None

    def prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scoring: Scoring,
    ) -> Tensor:
        """The step's multi-token chunks, after their K/V [T, Hkv, D] were written: q [T, H, D] (the whole
        step) -> [T - Bd, H, D]."""
        Bd, tables, chunks = meta.decode_block_tables.shape[0], meta.prefill_block_tables, meta.prefill_chunks
        return torch.ops.kiln.prefill_attention_chunks(
            q[Bd:], k[Bd:], v[Bd:], k_cache, v_cache, tables, chunks, self.tile_fresh_prompts, *scoring
        )


def backend_for(device: torch.device) -> AttentionBackend:
    if device.type == "cpu":
        from compiled.attention_cpu import CpuAttention

        return CpuAttention()
    from compiled.attention_cuda import CudaAttention

    return CudaAttention(device)


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scoring: Scoring,
    backend: AttentionBackend,
    decode: str = "matmul",
) -> Tensor:
    """Attention for a packed step, after its K/V [T, Hkv, D] were written: q [T, H, D] -> [T, H, D];
    its single-query rows through the backend's reduction or (`decode` "matmul") the eager matmuls, its
    chunks through the backend."""
    Bd = meta.decode_block_tables.shape[0]
    parts = []
    if Bd > 0:
        rows = backend.decode if decode == "reduction" else decode_attention_matmul
        parts.append(rows(q[:Bd], k_cache, v_cache, meta, scoring))
    if meta.prefill_block_tables.shape[0] > 0:
        parts.append(backend.prefill(q, k, v, k_cache, v_cache, meta, scoring))
    return parts[0] if len(parts) == 1 else torch.cat(parts)

"""CPU attention: the KV cache in memory committed as blocks are first used, and a step's multi-token
chunks batched by what each costs: a step's fresh prompts together tile by tile (their own K/V, no
pages read), a lone one and every chunk after context alone through SDPA over its pages."""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap

import torch
import torch.nn.functional as F
from torch import Tensor

from compiled.attention import (
    AttentionBackend,
    AttentionMetadata,
    Scoring,
    attend,
    gather_keys,
    gather_values,
    softcapped,
)


class CpuAttention(AttentionBackend):
    # Inductor's CPU kernels use 32-byte vectors on AVX2 and 64-byte ones on AVX-512.
    vector_bytes = 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return _lazy_zeros(shape, dtype)

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
        Bd, tables, chunks = meta.decode_block_tables.shape[0], meta.prefill_block_tables, meta.prefill_chunks
        return torch.ops.kiln.prefill_attention_chunks(
            q[Bd:], k[Bd:], v[Bd:], k_cache, v_cache, tables, chunks, *scoring
        )


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A zero CPU tensor in a private anonymous mapping of its own: pages read as zero until written and
    are committed as blocks are first used, where zeroing a large cache at start took seconds. Small pages,
    not transparent huge ones: where the host backs a VM's memory as it is first touched, committing a fresh
    2 MiB page took an order of magnitude longer than 2 MiB of 4 KiB pages, and an engine touches every page
    it serves from."""
    count = math.prod(shape)
    nbytes = -(-max(count, 1) * dtype.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # a kernel without transparent huge pages
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)  # keeps the mapping alive


def prefill_attention_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    chunks: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Multi-token chunks: q [N, H, D] holds their queries chunk after chunk and k, v [N, Hkv, D] their keys
    and values, `chunks` [P, 2] each one's first position and query count (`block_tables` [P, W]);
    -> [N, H, D], scored as `Scoring(scale, window, softcap)` says.
    No chunk pays for another's length, as each would in one padded batch (several times the work for
    prompts of mixed lengths): a step's fresh prompts run together tile by tile (`_fresh_prompts`) on the
    step's own K/V; a lone one, and every chunk after context, alone through SDPA over its pages."""
    bs = v_cache.shape[3]
    spans = chunks.tolist()
    firsts = [0, *itertools.accumulate(n for _, n in spans)]
    # The empty chunk a step with one carries (compiled/input_batch.py) has nothing to compute.
    fresh = sorted((i for i, (start, n) in enumerate(spans) if start == 0 and n), key=lambda i: -spans[i][1])
    # A lone prompt runs through SDPA's flash kernel, unless it needs a window or a soft-cap, which SDPA
    # would take as a full mask or as its math, every score materialised.
    together = fresh if len(fresh) > 1 or window or softcap else []
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
    "Tensor block_tables, Tensor chunks, float scale, int window=0, float softcap=0) -> Tensor"
)
_lib.impl("prefill_attention_chunks", prefill_attention_chunks, "CPU")


@torch.library.register_fake("kiln::prefill_attention_chunks")
def _(q: Tensor, *operands: object) -> Tensor:
    return torch.empty_like(q)

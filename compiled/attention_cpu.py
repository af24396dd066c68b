"""CPU attention: the KV cache in memory committed as blocks are first used, single-query rows over each
row's own pages, and a step's fresh prompts tiled together (compiled/attention.py: `_fresh_prompts`) or
through SDPA one by one, whichever ran sooner on this CPU at start."""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import time

import torch
from torch import Tensor

from compiled.attention import (
    AttentionBackend,
    AttentionMetadata,
    Scoring,
    prefill_attention_chunks,
    softcapped,
    write_kv,
)
from compiled.plan import force_stride_order

# The fresh prompts a start-up timing runs: a prefill step's worth of the lengths a chat server meets.
TIMED_PROMPTS = (384, 320, 256, 256, 192, 128)
_timings: dict[tuple, tuple[float, float]] = {}  # (heads, kv_heads, head_dim, dtype) -> seconds: timed once


def decode_attention_pages(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scoring: Scoring
) -> Tensor:
    """`decode_attention_reduction` page by page over each row's own pages (`meta.decode_pages`): each
    page's scores' maximum, their exponentials' sum and the values they weigh, then each row's pages
    combined. A row reads only its own pages, however long the step's longest row."""
    B, H, D = q.shape
    tables, seq_lens, pages = meta.decode_block_tables, meta.decode_seq_lens, meta.decode_pages
    (W, P), (Hkv, bs) = (tables.shape[1], pages.shape[0]), v_cache.shape[1:4:2]
    G = H // Hkv
    # Each page's row, first position, block and keys in buffers of their own: inlined, their division
    # and indirect loads would run again in every inner iteration of the loops below.
    rows = force_stride_order(pages // W, (1,))
    first = force_stride_order(pages % W * bs, (1,))
    # q in a buffer of its own: Inductor would otherwise inline its producer (RoPE over the projection's
    # transposed output) into the score loop and compute it again for every page.
    qf = force_stride_order(q, (H * D, D, 1)).view(B, Hkv, G, D).float()[rows]  # [P, Hkv, G, D]
    pos = first[:, None] + torch.arange(bs, device=q.device)  # [P, bs]
    keys = force_stride_order(seq_lens[rows], (1,))[:, None]
    valid = (pos < keys) & (pos >= keys - scoring.window) if scoring.window else pos < keys
    blocks = force_stride_order(tables.reshape(-1)[pages], (1,))
    k = k_cache[blocks].float()  # [P, Hkv, bs/c, D, c]
    v = torch.where(valid[:, None, None, :, None], v_cache[blocks], 0.0).float()  # unwritten slots: NaN
    scores = torch.stack([(qf[:, :, g, None, :, None] * k).sum(3) for g in range(G)], 2)
    scores = softcapped(scores.view(P, Hkv, G, bs) * scoring.scale, scoring.softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    # A page wholly outside a window weighs nothing: its maximum is finite, its exponentials zero.
    top = scores.amax(-1).clamp_min(-1e30)  # [P, Hkv, G]
    e = (scores - top[..., None]).exp()
    part = torch.stack([(e[:, :, g, None, :, None] * v).sum(3) for g in range(G)], 2).view(P, Hkv, G, D)
    # Row b's pages as [B, W] indices into them after an empty page 0, which fills each row past its last.
    where = torch.zeros(B * W, dtype=pages.dtype, device=q.device)
    where = where.index_put((pages,), torch.arange(1, P + 1, device=q.device)).view(B, W)
    top = torch.cat([top.new_full((1, Hkv, G), -1e30), top])[where]  # [B, W, Hkv, G]
    weight = (top - top.amax(1, keepdim=True)).exp()
    total = (torch.cat([e.new_zeros(1, Hkv, G), e.sum(-1)])[where] * weight).sum(1)
    out = (torch.cat([part.new_zeros(1, Hkv, G, D), part])[where] * weight[..., None]).sum(1)
    return (out / total[..., None]).to(q.dtype).reshape(B, H, D)


class CpuAttention(AttentionBackend):
    # Inductor's CPU kernels use 32-byte vectors on AVX2 and 64-byte ones on AVX-512.
    vector_bytes = 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32
    decode = staticmethod(decode_attention_pages)
    # Batched tile by tile, fresh prompts beat SDPA called prompt by prompt on AVX-512 without AMX (see
    # `_fresh_prompts`); SDPA's flash kernel won by far on AMX. `choose_paths` times both.
    tile_fresh_prompts = True

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return _lazy_zeros(shape, dtype)

    def choose_paths(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
        """Tiles or SDPA for a step's fresh prompts, whichever ran `TIMED_PROMPTS` sooner here (best of
        three each, once a process for each shape); a line for the log."""
        shape = (heads, kv_heads, head_dim, dtype)
        if shape not in _timings:
            _timings[shape] = _time_fresh_prompts(*shape)
        tiled, alone = _timings[shape]
        self.tile_fresh_prompts = tiled < alone
        path = "tiled together" if self.tile_fresh_prompts else "through SDPA one by one"
        return f"fresh prompts {path} (tiles {tiled * 1e3:.1f} ms, SDPA {alone * 1e3:.1f} ms)"


def fresh_prompt_pages(lens: list[int], block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Fresh prompts of `lens` tokens on blocks of their own, 1, 2, ... in turn (block 0 is the null block),
    for a step run outside the scheduler: block tables [P, W] (a prompt of 0 tokens: the null row), each
    token's slot [sum(lens)] and the chunks [P, 2]. Blocks 0 .. table.max() must exist."""
    counts = [-(-n // block_size) for n in lens]
    firsts = list(itertools.accumulate([1, *counts]))
    tables = torch.zeros(len(lens), max(max(counts), 1), dtype=torch.int64)
    for row, (first, count) in enumerate(zip(firsts, counts)):
        tables[row, :count] = torch.arange(first, first + count)
    slots = torch.cat([first * block_size + torch.arange(n) for first, n in zip(firsts, lens)])
    return tables, slots, torch.tensor([[0, n] for n in lens])


def _time_fresh_prompts(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds the tiles and SDPA took over `TIMED_PROMPTS`, the best of three runs each."""
    bs = 64
    tables, slots, chunks = fresh_prompt_pages(list(TIMED_PROMPTS), bs)
    g = torch.Generator().manual_seed(0)  # the process's own random state stays untouched
    q, k, v = (
        torch.randn(len(slots), h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads)
    )
    k_cache, v_cache = CpuAttention().new_kv_cache(int(tables.max()) + 1, bs, kv_heads, head_dim, dtype)
    write_kv(k_cache, v_cache, k, v, slots)

    def seconds(tiles: bool) -> float:
        runs = []
        for _ in range(4):  # the first warms up
            start = time.perf_counter()
            prefill_attention_chunks(q, k, v, k_cache, v_cache, tables, chunks, tiles, head_dim**-0.5)
            runs.append(time.perf_counter() - start)
        return min(runs[1:])

    return seconds(True), seconds(False)


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

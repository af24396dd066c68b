import functools
import os
import time

import pytest
import torch

from compiled import attention
from compiled.attention import (
    AttentionMetadata,
    Scoring,
    decode_attention_matmul,
    decode_attention_reduction,
    gather_keys,
    gather_values,
    write_kv,
)
from compiled.attention_cpu import CpuAttention, decode_attention_pages
from compiled.input_batch import decode_pages

B, H, HKV, D, BS = 3, 6, 2, 32, 16


def paged_sequences(lanes: int, monkeypatch) -> tuple:
    """Three sequences of different lengths written through write_kv into caches with slices `lanes` wide,
    every slot nobody wrote holding NaN, and their K/V in position order for reference."""
    monkeypatch.setattr(CpuAttention, "vector_bytes", lanes * 4)  # float32 slices `lanes` wide
    torch.manual_seed(lanes)
    k_cache, v_cache = CpuAttention().new_kv_cache(16, BS, HKV, D, torch.float32)
    assert k_cache.shape[-1] == v_cache.shape[-1] == lanes
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    lens = [5, 37, 16]
    tables = torch.tensor([[3, 0, 0], [7, 1, 12], [9, 0, 0]])  # padding entries point at block 0
    ks = [torch.randn(n, HKV, D) for n in lens]
    vs = [torch.randn(n, HKV, D) for n in lens]
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        write_kv(k_cache, v_cache, ks[b], vs[b], tables[b, pos // BS] * BS + pos % BS)
    return k_cache, v_cache, tables, torch.tensor(lens), ks, vs


# Plain scores; and a window of 7 keys with scores soft-capped at 0.8, low enough to bend them.
SCORINGS = [Scoring(D**-0.5), Scoring(D**-0.5, window=7, softcap=0.8)]


def capped(scores: torch.Tensor, scoring: Scoring) -> torch.Tensor:
    return scoring.softcap * torch.tanh(scores / scoring.softcap) if scoring.softcap else scores


def reference(q: torch.Tensor, ks: list, vs: list, scoring: Scoring) -> torch.Tensor:
    """Each row's one query after its sequence's keys, as a plain softmax over the keys it may see."""
    out = []
    for b in range(len(ks)):
        seen = slice(max(0, len(ks[b]) - scoring.window) if scoring.window else 0, None)
        k = ks[b][seen].double().repeat_interleave(H // HKV, 1)
        v = vs[b][seen].double().repeat_interleave(H // HKV, 1)
        p = capped(torch.einsum("hd,lhd->hl", q[b].double(), k) * scoring.scale, scoring).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out).float()


@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_gathers_read_back_what_write_kv_stored(lanes, monkeypatch):
    k_cache, v_cache, tables, lens, ks, vs = paged_sequences(lanes, monkeypatch)
    keys, values = gather_keys(k_cache, tables), gather_values(v_cache, tables)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(keys[b, :, :n], ks[b].transpose(0, 1))
        assert torch.equal(values[b, :, :n], vs[b].transpose(0, 1))


def decode_meta(
    tables: torch.Tensor, lens: torch.Tensor, pages: list[int] | None = None
) -> AttentionMetadata:
    """The single-query rows' metadata, each row's own pages unless `pages` lists others."""
    listed = decode_pages(lens.tolist(), tables.shape[1], BS) if pages is None else pages
    empty = torch.zeros(0, dtype=torch.int64)
    return AttentionMetadata(empty, tables, lens, torch.tensor(listed), empty.view(0, 2), empty.view(0, 2))


@pytest.mark.parametrize("scoring", SCORINGS, ids=["plain", "window-softcap"])
@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_decode_attention_matches_a_plain_softmax_whatever_the_slice_width(lanes, scoring, monkeypatch):
    """The reduction over the whole table (CUDA's; compiled at CUDA's float32 slice width), the one over
    each row's own pages (CPU's, eager and compiled) and the eager matmuls against a plain softmax;
    unwritten slots hold NaN and a row's pages lie out of order. The pages are also given as every column
    of the table, so that some are wholly masked: past a row's keys, and with a window of 7 before it. The
    CPU's reduction compiles with dynamic shapes, as the engine's layers do, and runs at another page
    count without recompiling."""
    k_cache, v_cache, tables, lens, ks, vs = paged_sequences(lanes, monkeypatch)
    q = torch.randn(B, H, D)
    expected = reference(q, ks, vs, scoring)
    own, every = decode_meta(tables, lens), decode_meta(tables, lens, list(range(tables.numel())))
    assert own.decode_pages.tolist() == [0, 3, 4, 5, 6]
    close = functools.partial(torch.testing.assert_close, expected=expected, rtol=1e-5, atol=1e-5)
    close(decode_attention_matmul(q, k_cache, v_cache, own, scoring))
    close(decode_attention_reduction(q, k_cache, v_cache, own, scoring))
    if lanes == 16:  # CUDA's slice width (64-byte vectors of float32)
        close(torch.compile(decode_attention_reduction, dynamic=False)(q, k_cache, v_cache, own, scoring))
    pages = torch.compile(decode_attention_pages, dynamic=True)
    for meta in (own, every):
        close(decode_attention_pages(q, k_cache, v_cache, meta, scoring))
        with torch._dynamo.config.patch(error_on_recompile=meta is every):
            close(pages(q, k_cache, v_cache, meta, scoring))


def test_a_lone_page_is_read_twice_not_specialised():
    assert decode_pages([10], 2, BS).tolist() == [0, 0]
    assert decode_pages([40, 1], 3, BS).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "starts, n",
    [
        ([0, 20, 0], [5, 17, 16]),  # one continues after 20 positions
        ([0, 0, 0], [5, 37, 16]),  # fresh prompts of three lengths
        ([0, 0, 0], [5, 5, 5]),
        ([0, 20, 0], [2, 17, 1]),  # a one-row prompt beside a shorter tile
    ],
)
@pytest.mark.parametrize("tiles", [True, False], ids=["tiled", "alone"])
@pytest.mark.parametrize("scoring", SCORINGS, ids=["plain", "window-softcap"])
def test_prefill_attention_is_a_causal_softmax_below_its_context(starts, n, tiles, scoring, monkeypatch):
    """Chunks, fresh prompts together tile by tile (the CPU's choice) or each alone through SDPA (CUDA's),
    compute a causal softmax over each one's context and itself."""
    k_cache, v_cache, tables, _, ks, vs = paged_sequences(4, monkeypatch)
    monkeypatch.setattr(attention, "CAUSAL_TILES", {2: 1.0})  # several tiles, the last one short
    firsts = [sum(n[:i]) for i in range(len(n))]
    q = torch.randn(sum(n), H, D)
    # The step's own K/V of each chunk: its positions of the sequence's.
    k, v = (torch.cat([x[b][s : s + m] for b, (s, m) in enumerate(zip(starts, n))]) for x in (ks, vs))
    chunks = torch.tensor(list(zip(starts, n)))
    out = torch.ops.kiln.prefill_attention_chunks(q, k, v, k_cache, v_cache, tables, chunks, tiles, *scoring)
    for b, (f, s, m) in enumerate(zip(firsts, starts, n)):
        k, v = (x[: s + m].double().repeat_interleave(H // HKV, 1) for x in (ks[b], vs[b]))
        scores = capped(torch.einsum("qhd,lhd->hql", q[f : f + m].double(), k) * scoring.scale, scoring)
        hidden = torch.ones(m, s + m, dtype=torch.bool).triu(s + 1)  # keys after the query
        if scoring.window:  # and keys before its window
            hidden |= torch.ones(m, s + m, dtype=torch.bool).tril(s - scoring.window)
        scores = scores.masked_fill(hidden, float("-inf"))
        expected = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v).float()
        torch.testing.assert_close(out[f : f + m], expected, rtol=1e-5, atol=1e-5)


def test_short_or_ragged_prompts_take_smaller_causal_tiles():
    """A tile size is chosen for the padding it costs: a prompt one row into its last tile pads it."""
    assert attention.causal_tile([256] * 16) == 64  # no padding at all
    assert attention.causal_tile([40] * 48) < 64  # padded to 64 rows, over half is padding
    assert attention.causal_tile([257] * 16) < 64  # a 64-row tile of 1 row each


def mapping_of(address: int) -> dict[str, str]:
    """The kernel's entry (/proc/self/smaps) for the mapping that holds `address` in this process."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                if entry is not None:
                    break
                entry = {} if lo <= address < hi else None
            elif entry is not None:
                entry[head.rstrip(":")] = rest.strip()
    assert entry is not None, f"no mapping holds {address:#x}"
    return entry


def test_the_cpu_kv_cache_is_zero_and_committed_on_small_pages_as_blocks_are_written():
    k, v = CpuAttention().new_kv_cache(256, 64, 3, 64, torch.bfloat16)  # 6 MiB each, 24 KiB a block
    has_thp = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    for cache in (k, v):
        assert ("nh" in mapping_of(cache.data_ptr())["VmFlags"].split()) == has_thp  # MADV_NOHUGEPAGE
        assert cache.count_nonzero() == 0
    k[5].fill_(1.0)  # writable, and its own memory
    assert k.count_nonzero() == k[5].numel() and v.count_nonzero() == 0
    resident_kib = int(mapping_of(k.data_ptr())["Rss"].split()[0])
    assert resident_kib <= 64, resident_kib  # the written block's pages, not the cache's 6 MiB


@pytest.mark.parametrize("slower", [True, False], ids=["tiles-slower", "sdpa-slower"])
def test_the_cpu_takes_the_fresh_prompt_path_that_ran_sooner(slower, monkeypatch):
    from compiled import attention_cpu

    real = attention_cpu.prefill_attention_chunks

    def timed(*args):
        time.sleep(0.01 if args[7] == slower else 0)  # args[7]: tiles
        return real(*args)

    monkeypatch.setattr(attention_cpu, "prefill_attention_chunks", timed)
    monkeypatch.setattr(attention_cpu, "_timings", {})
    backend = attention_cpu.CpuAttention()
    line = backend.choose_paths(4, 2, 16, torch.float32)
    assert backend.tile_fresh_prompts is not slower
    assert ("tiled together" in line) is not slower and "SDPA" in line

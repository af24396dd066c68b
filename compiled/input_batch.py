"""The runner's persistent per-request state and how a step's inputs are laid out for the model.

A step is packed by shape: first the sequences with one query each (decodes, padded to a bucket), then
the multi-token chunks. Inputs are written in place into persistent buffers (`StepInputs`), so a step
allocates nothing for them and, on CUDA, copies them from pinned memory without blocking.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from compiled.attention import AttentionMetadata
from compiled.sampler import SamplingMetadata
from engine.params import SamplingParams
from engine.step import SchedulerOutput


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a single-query batch is padded to: 1, 2, 4, 8, 16, 24, 32, 48, 64, then steps of 32."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 32)
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


def _pow2(n: int, cap: int) -> int:
    return min(1 << max(n - 1, 0).bit_length(), cap)


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt, then every token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    row: int  # row of the persistent block table
    num_blocks: int
    num_computed_tokens: int
    eos_token_id: int | None = None
    pooled_sum: Tensor | None = None  # mean pooling: the hidden states of the prompt computed so far


@dataclass
class StepBatch:
    """One packed step's model inputs, and which rows of its hidden states are sampled for whom."""

    token_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    logits_index: list[int]
    sampled: list[CachedRequestState]
    drafts: list[list[int]]  # the tokens each sampled request verifies after its last known one
    # (request, first hidden row, first position, rows) whose logits score the next prompt token.
    prompt_rows: list[tuple[CachedRequestState, int, int, int]]
    # (request, first hidden row, first position, rows) of the pooling requests' chunks.
    pool_rows: list[tuple[CachedRequestState, int, int, int]]


class StepInputs:
    """The persistent buffers a step's inputs are written into, in place: one int64 host tensor per input,
    filled through its numpy view; on CUDA the host tensor is pinned and copied, without blocking, into
    a device tensor of the same size. A buffer grows (doubling) only when a step needs more than it holds.
    Invariants: an input is valid until the next `put` of its name; on CUDA a host buffer is rewritten
    only after the copy out of it has completed (an event per buffer).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, tuple[np.ndarray, Tensor, Tensor, torch.cuda.Event | None]] = {}

    def put(self, name: str, values: np.ndarray | list) -> Tensor:
        values = np.asarray(values, dtype=np.int64)
        n = values.size
        buffer = self.buffers.get(name)
        if buffer is None or buffer[0].size < n:
            buffer = self._grow(name, max(n, 2 * buffer[0].size if buffer else 0))
        host_np, host, dev, copied = buffer
        if copied is not None:
            copied.synchronize()
        host_np[:n] = values.reshape(-1)
        if copied is not None:
            dev[:n].copy_(host[:n], non_blocking=True)
            copied.record()
        return dev[:n].view(values.shape)

    def _grow(self, name: str, size: int) -> tuple[np.ndarray, Tensor, Tensor, torch.cuda.Event | None]:
        cuda = self.device.type == "cuda"
        host = torch.zeros(max(size, 64), dtype=torch.int64, pin_memory=cuda)
        dev = torch.zeros_like(host, device=self.device) if cuda else host
        self.buffers[name] = (host.numpy(), host, dev, torch.cuda.Event() if cuda else None)
        return self.buffers[name]


class InputBatch:
    """Live requests' state and block-table rows, and the packing of a step into model inputs.

    Invariants: every live request holds one row of `block_table`, whose first `num_blocks` entries are
    its blocks and the rest 0 (the null block); the last row (`null_row`) is all zeros, for padding.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        max_drafts: int = 0,
    ) -> None:
        """`max_drafts`: the drafted tokens a sequence may verify in a step, each a single-query row too."""
        self.block_size, self.device = block_size, device
        self.buckets = decode_buckets(max_num_seqs * (1 + max_drafts))
        if max_drafts:  # a few sequences verifying every draft: their exact rows, not the next power of two
            verify = {n * (1 + max_drafts) for n in (1, 2, 4) if n <= max_num_seqs}
            self.buckets = sorted(set(self.buckets) | verify)
        self.table_width = max(max_blocks_per_seq, 2)
        self.block_table = torch.zeros(max_num_seqs + 1, self.table_width, dtype=torch.int64)
        self.null_row = max_num_seqs
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}
        self.inputs = StepInputs(device)

    def update(self, so: SchedulerOutput) -> None:
        """Forget finished requests, add new ones, append new blocks (and tokens) to the cached ones."""
        for rid in so.finished_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                self.block_table[state.row].zero_()
                self.free_rows.append(state.row)
        for new in so.new_reqs:
            row = self.free_rows.pop()
            self.block_table[row, : len(new.block_ids)] = torch.tensor(new.block_ids, dtype=torch.int64)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                list(new.token_ids),
                new.num_prompt_tokens,
                new.sampling_params,
                new.seed,
                row,
                len(new.block_ids),
                new.num_computed_tokens,
                new.eos_token_id,
            )
        for cached in so.cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                n, ids = state.num_blocks, torch.tensor(cached.new_block_ids, dtype=torch.int64)
                self.block_table[state.row, n : n + len(ids)] = ids
                state.num_blocks += len(ids)
            state.num_computed_tokens = cached.num_computed_tokens
            state.token_ids.extend(cached.new_token_ids)

    def decode_rows(self, num_singles: int) -> int:
        """Rows a step's single-query part is padded to: its bucket."""
        return next(b for b in self.buckets if b >= num_singles) if num_singles else 0

    def decode_width(self, max_seq_len: int) -> int:
        """Block-table columns of a step's single-query rows: exact on CPU, where the width is a dynamic size
        (and each row reads its own pages); a power of two on CUDA (or the whole table), where each width is
        a CUDA graph and every column is computed."""
        width = max(cdiv(max_seq_len, self.block_size), 2)
        return _pow2(width, self.table_width) if self.device.type == "cuda" else width

    def decode_widths(self) -> list[int]:
        """Every width `decode_width` can return on CUDA: the width classes each bucket is captured at."""
        return sorted({_pow2(w, self.table_width) for w in range(2, self.table_width + 1)})

    def split(
        self, num_scheduled: dict[str, int], drafts: dict[str, list[int]]
    ) -> tuple[list[CachedRequestState], list[CachedRequestState]]:
        """The scheduled requests of single-query rows (one token, or one and its drafts, in schedule order),
        then those with a multi-token chunk."""
        states = [self.requests[rid] for rid in num_scheduled]
        singles = [s for s in states if num_scheduled[s.req_id] == 1 or s.req_id in drafts]
        return singles, [s for s in states if not (num_scheduled[s.req_id] == 1 or s.req_id in drafts)]

    def prepare(
        self,
        singles: list[CachedRequestState],
        chunks: list[CachedRequestState],
        num_scheduled: dict[str, int],
        drafts: dict[str, list[int]] | None = None,
    ) -> StepBatch:
        """The step's inputs: a row per single query, a drafted token's included (its own query after the
        ones before it, all sampled), then the chunks' rows."""
        bs, drafts = self.block_size, drafts or {}
        num_single = len(singles) + sum(map(len, drafts.values()))
        # Dynamo specialises sizes 0 and 1, so a step with chunks carries at least two decode rows
        # (padding rows cost a short attention each): chunk-only and mixed steps then share graphs.
        n_dec = self.decode_rows(num_single)
        n_pad = (max(n_dec, 2) if chunks else n_dec) - num_single
        rows: list[int] = []
        positions: list[int] = []
        token_ids: list[int] = []
        logits_index: list[int] = []
        sampled: list[CachedRequestState] = []
        step_drafts: list[list[int]] = []
        prompt_rows: list[tuple[CachedRequestState, int, int, int]] = []
        pool_rows: list[tuple[CachedRequestState, int, int, int]] = []

        # Rows for tokens start .. start + n - 1 of `s` and the drafts after them, noting those that score
        # prompt tokens and whether the last known one (and every draft) is sampled.
        def add(s: CachedRequestState, start: int, n: int, draft: list[int] = ()) -> None:
            k = min(start + n, s.num_prompt_tokens - 1) - start  # positions followed by a prompt token
            if k > 0 and s.sampling_params.prompt_logprobs is not None:
                prompt_rows.append((s, len(token_ids), start, k))
            rows.extend([s.row] * (n + len(draft)))
            positions.extend(range(start, start + n + len(draft)))
            token_ids.extend(s.token_ids[start : start + n])
            token_ids.extend(draft)
            if s.sampling_params.pooling is not None:
                pool_rows.append((s, len(token_ids) - n, start, n))
            elif start + n == len(s.token_ids):
                logits_index.extend(range(len(token_ids) - 1 - len(draft), len(token_ids)))
                sampled.append(s)
                step_drafts.append(list(draft))

        for s in singles:
            add(s, s.num_computed_tokens, 1, drafts.get(s.req_id, []))
        rows += [self.null_row] * n_pad
        positions += [0] * n_pad
        token_ids += [0] * n_pad
        num_dec = len(rows)
        seq_lens = [p + 1 for p in positions]
        dec_width = self.decode_width(max(seq_lens, default=1))

        pre_width = 2
        for s in chunks:
            add(s, s.num_computed_tokens, num_scheduled[s.req_id])
            pre_width = max(pre_width, cdiv(s.num_computed_tokens + num_scheduled[s.req_id], bs))
        chunk_rows = [s.row for s in chunks]
        chunk_spans = [(s.num_computed_tokens, num_scheduled[s.req_id]) for s in chunks]
        if len(chunks) == 1:  # likewise two chunks at least, whose attention skips an empty one
            chunk_rows.append(self.null_row)
            chunk_spans.append((0, 0))

        rows_a, pos_a, on_cpu = np.array(rows), np.array(positions), self.device.type == "cpu"
        table, put = self.block_table.numpy(), self.inputs.put
        meta = AttentionMetadata(
            slot_mapping=put("slot_mapping", table[rows_a, pos_a // bs] * bs + pos_a % bs),
            decode_block_tables=put("decode_block_tables", table[rows_a[:num_dec], :dec_width]),
            decode_seq_lens=put("decode_seq_lens", seq_lens),
            decode_pages=put("decode_pages", decode_pages(seq_lens, dec_width, bs) if on_cpu else []),
            prefill_block_tables=put("prefill_block_tables", table[chunk_rows, :pre_width]),
            prefill_chunks=put("prefill_chunks", np.array(chunk_spans).reshape(-1, 2)),
        )
        ids = put("token_ids", token_ids)
        positions_t = put("positions", pos_a)
        return StepBatch(ids, positions_t, meta, logits_index, sampled, step_drafts, prompt_rows, pool_rows)


def decode_pages(seq_lens: list[int], width: int, block_size: int) -> np.ndarray:
    """`AttentionMetadata.decode_pages` of rows attending to `seq_lens` keys through a table `width` wide.
    A lone page is repeated: Dynamo would specialise a size of 1, and the copy's results are the same."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    counts = -(-lens // block_size)
    rows = np.repeat(np.arange(len(lens)), counts)
    pages = rows * width + np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.append(pages, pages[-1]) if len(pages) == 1 else pages


def sampling_inputs(
    states: list[CachedRequestState],
    vocab_size: int,
    device: torch.device,
    drafts: list[list[int]] | None = None,
) -> SamplingMetadata:
    """The sampler's per-row parameters for the sampled requests of a step: a row per request, or one per
    position where it verifies drafts (`drafts[i]`), each as if the drafts before it had been sampled."""
    rows = [(s, d[:i]) for s, d in zip(states, drafts or [[]] * len(states)) for i in range(len(d) + 1)]
    params = [s.sampling_params for s, _ in rows]
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    if all(p.greedy for p in params):  # the sampler reads no per-row parameter: six tensors spared
        none = torch.empty(0, device=device)
        m = SamplingMetadata(none, none, none, none, none, none, True, False, False, False)
    else:
        m = SamplingMetadata(
            temperature=f32([0.0 if p.greedy else p.temperature for p in params]),
            top_k=i64([p.top_k for p in params]),
            top_p=f32([p.top_p for p in params]),
            min_p=f32([p.min_p for p in params]),
            seeds=i64([s.seed for s, _ in rows]),
            steps=i64([len(s.token_ids) + len(d) - s.num_prompt_tokens for s, d in rows]),
            all_greedy=False,
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )
    if any(p.logprobs is not None for p in params):
        m.max_num_logprobs = max(p.logprobs or 0 for p in params)
    if any(p.has_penalties for p in params):
        m.presence = f32([p.presence_penalty for p in params])
        m.frequency = f32([p.frequency_penalty for p in params])
        m.repetition = f32([p.repetition_penalty for p in params])
        counts = torch.zeros(len(rows), vocab_size, dtype=torch.int32)
        output = _row_tokens([s.token_ids[s.num_prompt_tokens :] + d for s, d in rows])
        counts.index_put_(output, torch.ones(len(output[0]), dtype=torch.int32), accumulate=True)
        seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
        seen[_row_tokens([s.token_ids + d for s, d in rows])] = True
        m.output_counts, m.seen_mask = counts.to(device), seen.to(device)
    if any(s.sampling_params.banned_or_biased(len(s.token_ids) - s.num_prompt_tokens) for s in states):
        m.logit_bias = logit_bias(rows, vocab_size).to(device)
    return m


def _row_tokens(lists: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Each token of each row's list as (row, token) index tensors: one indexed write for a whole step,
    where a write per row cost more than the sampling."""
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    tokens = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(lens.sum()))
    return torch.from_numpy(np.repeat(np.arange(len(lists)), lens)), torch.from_numpy(tokens)


def banned_tokens(s: CachedRequestState, output: list[int]) -> set[int]:
    """What `s` may not sample after `output`: its stop tokens before min_tokens, and the last token of
    each bad word whose other tokens end the output."""
    p = s.sampling_params
    banned = {ids[-1] for ids in p.bad_words_token_ids if ids[:-1] == output[len(output) + 1 - len(ids) :]}
    if len(output) < p.min_tokens:
        banned.update(p.stop_token_ids)
        if s.eos_token_id is not None and not p.ignore_eos:
            banned.add(s.eos_token_id)
    return banned


def logit_bias(rows: list[tuple[CachedRequestState, list[int]]], vocab_size: int) -> Tensor:
    """[rows, V] float32 added to the logits: each request's logit_bias, and -inf on the tokens it may not
    sample (outside allowed_token_ids, or banned after its output so far)."""
    bias = torch.zeros(len(rows), vocab_size)
    for i, (s, d) in enumerate(rows):
        p = s.sampling_params
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.int64)
            bias[i] = float("-inf")
            bias[i, allowed] = 0.0
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            bias[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        # Stop ids past the logits (the tokenizer's, or a client's) cannot be sampled anyway.
        banned = [t for t in banned_tokens(s, s.token_ids[s.num_prompt_tokens :] + d) if t < vocab_size]
        if banned:
            bias[i, torch.tensor(banned, dtype=torch.int64)] = float("-inf")
    return bias

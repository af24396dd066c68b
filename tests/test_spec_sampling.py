"""Verification keeps the sampled distribution: tokens sampled with drafts are distributed as without.

A tiny Markov "model" over a small vocabulary (each token's logits depend on the one before it) is sampled
two tokens deep, without drafts and with drafts verified in one pass (the sampler's rows for each draft
position see the drafts before it, penalties included), over many seeds; a chi-square test compares the
joint distributions of the two tokens. A verification that draws a rejected position's token afresh,
without removing the draft, fails the same test.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency

from compiled.input_batch import CachedRequestState, sampling_inputs
from compiled.sampler import sample, verify
from engine.params import SamplingParams

V, N, PROMPT = 6, 6000, [1, 2, 3, 1]
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 1.5
ALPHA = 1e-4


def logits_after(tokens: list[int]) -> torch.Tensor:
    return TABLE[tokens[-1]]


def states(params: SamplingParams, seeds: range) -> list[CachedRequestState]:
    return [CachedRequestState(str(s), list(PROMPT), len(PROMPT), params, s, 0, 0, 0) for s in seeds]


def step(batch: list[CachedRequestState]) -> None:
    """One plain decode step: each state samples its next token."""
    logits = torch.stack([logits_after(s.token_ids) for s in batch])
    for s, t in zip(batch, sample(logits, sampling_inputs(batch, V, torch.device("cpu"))).token_ids.tolist()):
        s.token_ids.append(t)


def two_tokens(params: SamplingParams, seeds: range, drafts: list[int] | None, broken: bool = False) -> list:
    """The first two sampled tokens of each seed's sequence: plain steps, or one step verifying `drafts`
    (then plain steps for sequences it gave fewer than two tokens)."""
    batch = states(params, seeds)
    if drafts is not None:
        rows = [s.token_ids + drafts[:i] for s in batch for i in range(len(drafts) + 1)]
        logits = torch.stack([logits_after(r) for r in rows])
        meta = sampling_inputs(batch, V, torch.device("cpu"), [drafts] * len(batch))
        targets = sample(logits, meta).token_ids.tolist()
        if broken:  # a rejected position's token drawn afresh from the whole distribution
            meta.seeds = meta.seeds + 7919
            fresh = sample(logits, meta).token_ids.tolist()
        k = len(drafts) + 1
        for j, s in enumerate(batch):
            emitted = verify(drafts, targets[j * k : (j + 1) * k])
            if broken:
                emitted[-1] = fresh[j * k + len(emitted) - 1]
            s.token_ids += emitted
    while short := [s for s in batch if len(s.token_ids) < len(PROMPT) + 2]:
        step(short)
    return [tuple(s.token_ids[len(PROMPT) : len(PROMPT) + 2]) for s in batch]


def p_value(a: list, b: list) -> float:
    """Chi-square test of two samples of (token, token) pairs having one distribution."""
    cells = sorted(set(a) | set(b))
    table = np.array([[x.count(c) for c in cells] for x in (a, b)])
    table = table[:, table.sum(0) >= 10]  # rare cells merged away: the test's approximation holds
    return chi2_contingency(table)[1] if table.shape[1] > 1 else 1.0


params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.5, 1.0, 1.5]),
    top_k=st.sampled_from([0, 3]),
    top_p=st.sampled_from([1.0, 0.8]),
    min_p=st.sampled_from([0.0, 0.1]),
    presence_penalty=st.sampled_from([0.0, 1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(params=params, drafts=st.lists(st.integers(0, V - 1), min_size=1, max_size=3))
def test_drafted_tokens_are_distributed_as_without_drafts(params, drafts):
    plain = two_tokens(params, range(N), None)
    drafted = two_tokens(params, range(N, 2 * N), drafts)
    assert p_value(plain, drafted) > ALPHA
    # Seed for seed, the very same tokens: each emitted token is the draw decoding would have made.
    assert two_tokens(params, range(N, 2 * N), None) == drafted


@pytest.mark.parametrize("drafts", [[0], [2, 4]])
def test_a_wrong_residual_distribution_fails_the_test(drafts):
    params = SamplingParams(temperature=1.0, repetition_penalty=1.3)
    plain = two_tokens(params, range(N), None)
    assert p_value(plain, two_tokens(params, range(N, 2 * N), drafts, broken=True)) < ALPHA

import math

import pytest
import torch

from compiled.input_batch import CachedRequestState, sampling_inputs
from compiled.sampler import SamplingMetadata, apply_penalties, filter_probs, sample, uniform_noise
from engine.params import SamplingParams


def meta(rows: int, **kw) -> SamplingMetadata:
    def col(name, default, dtype=torch.float32):
        v = kw.pop(name, default)
        return torch.tensor(v if isinstance(v, list) else [v] * rows, dtype=dtype)

    m = SamplingMetadata(
        temperature=col("temperature", 1.0),
        top_k=col("top_k", 0, torch.int64),
        top_p=col("top_p", 1.0),
        min_p=col("min_p", 0.0),
        seeds=col("seeds", 0, torch.int64),
        steps=col("steps", 0, torch.int64),
        all_greedy=False,
        any_top_k=False,
        any_top_p=False,
        any_min_p=False,
    )
    m.any_top_k, m.any_top_p, m.any_min_p = (
        bool((m.top_k > 0).any()),
        bool((m.top_p < 1).any()),
        bool((m.min_p > 0).any()),
    )
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def test_top_k_never_leaves_the_top_k():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    m = meta(8, top_k=[1, 2, 3, 5, 8, 13, 21, 34], seeds=list(range(8)))
    top = [set(logits[i].topk(k).indices.tolist()) for i, k in enumerate(m.top_k.tolist())]
    for step in range(50):
        m.steps = torch.full((8,), step)
        tokens = sample(logits, m).token_ids.tolist()
        assert all(t in top[i] for i, t in enumerate(tokens))
    kept = filter_probs(logits.softmax(-1), m)
    assert ((kept > 0).sum(-1) == m.top_k).all()


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5], [0.4, 0.3, 0.2, 0.1]])
    kept = filter_probs(probs, meta(3, top_p=[0.7, 0.85, 0.95]))
    assert (kept > 0).tolist() == [
        [True, True, False, False],
        [False, True, True, True],
        [True, True, True, True],
    ]


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = torch.tensor([[0.5, 0.3, 0.11, 0.09]])
    assert (filter_probs(probs, meta(1, min_p=0.2)) > 0).tolist() == [[True, True, True, False]]


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    counts = torch.tensor([[2, 0, 1, 0, 0]])  # output tokens
    seen = torch.tensor([[True, True, True, False, False]])  # prompt has token 1 too
    m = meta(
        1,
        presence=torch.tensor([0.5]),
        frequency=torch.tensor([0.25]),
        repetition=torch.tensor([2.0]),
        output_counts=counts,
        seen_mask=seen,
    )
    out = apply_penalties(logits.clone(), m)
    expected = [2.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2, 0.5 / 2 - 0.25 - 0.5, 3.0, -2.0]
    assert torch.allclose(out, torch.tensor([expected]))


def test_a_rows_penalty_counts_are_its_output_and_the_drafts_before_it():
    params = SamplingParams(temperature=1.0, presence_penalty=0.5)
    a = CachedRequestState("a", [1, 2, 3, 3, 4], 3, params, 0, 0, 0, 0)  # prompt 1 2 3, output 3 4
    b = CachedRequestState("b", [5], 1, params, 1, 0, 0, 0)  # no output yet
    m = sampling_inputs([a, b], 8, torch.device("cpu"), [[4, 6], []])  # rows: a, a 4, a 4 6, b
    assert m.output_counts.tolist() == [
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 2, 0, 0, 0],
        [0, 0, 0, 1, 2, 0, 1, 0],
        [0] * 8,
    ]
    seen = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4, 6], [5]]
    assert m.seen_mask.tolist() == [[t in row for t in range(8)] for row in seen]


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    out = sample(logits, meta(4, temperature=[0.0, 1.0, 0.0, 1.0], seeds=[1, 2, 3, 4]))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_greedy_ties_go_to_the_lowest_token_id():
    logits = torch.zeros(3, 49152)
    logits[0, [7, 40000]] = 5.0
    logits[1, [30000, 30001, 2]] = 1.0
    m = meta(3, temperature=0.0)
    m.all_greedy = True
    assert sample(logits, m).token_ids.tolist() == [7, 2, 0]


def test_seeded_draws_do_not_depend_on_the_batch():
    torch.manual_seed(2)
    row = torch.randn(1, 200)
    alone = [int(sample(row, meta(1, seeds=99, steps=s)).token_ids[0]) for s in range(20)]
    batch = torch.cat([torch.randn(3, 200), row, torch.randn(2, 200)])
    mixed = [
        int(sample(batch, meta(6, seeds=[5, 6, 7, 99, 8, 9], steps=[s] * 6)).token_ids[3]) for s in range(20)
    ]
    assert alone == mixed
    assert len(set(alone)) > 1  # the step counter advances the draws
    other_seed = [int(sample(row, meta(1, seeds=100, steps=s)).token_ids[0]) for s in range(20)]
    assert other_seed != alone


def test_empirical_frequencies_match_softmax():
    """Chi-square goodness of fit at temperature 1 over 20 000 draws (critical value at p=0.001, 9 dof)."""
    logits = torch.linspace(-2.0, 1.0, 10)[None]
    n = 20_000
    m = meta(n, seeds=list(range(n)))
    counts = torch.bincount(sample(logits.expand(n, -1), m).token_ids, minlength=10).float()
    expected = logits.softmax(-1)[0] * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.88, f"chi-square {chi2:.1f}"


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    n = 5000
    hot = sample(logits.expand(n, -1), meta(n, temperature=2.0, seeds=list(range(n)))).token_ids
    cold = sample(logits.expand(n, -1), meta(n, temperature=0.25, seeds=list(range(n)))).token_ids
    assert (cold == 0).float().mean() > 0.95 > (hot == 0).float().mean()


def test_uniform_noise_is_uniform_and_in_the_open_interval():
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002


def test_no_draw_reaches_one():
    """Every 23-bit value maps below 1 (at 24 bits, k + 0.5 rounds up to 2^24 in float32 for the top k)."""
    top = torch.tensor([(1 << 23) - 1], dtype=torch.int64)
    assert float((top.float() + 0.5) * (1.0 / (1 << 23))) < 1.0
    u = uniform_noise(torch.arange(8), torch.zeros(8, dtype=torch.int64), 1 << 20)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0


def test_a_token_bitmask_is_never_left():
    from compiled.sampler import allowed_tokens

    rows, vocab = 512, 49152
    bitmask = torch.zeros(rows, vocab // 32, dtype=torch.int32)
    bitmask[:, 0] = (1 << 7) | (1 << 9)
    m = meta(rows, seeds=list(range(rows)), token_bitmask=bitmask)
    out = sample(torch.randn(rows, vocab), m)
    assert set(out.token_ids.tolist()) <= {7, 9}
    assert allowed_tokens(bitmask, vocab)[0].nonzero().flatten().tolist() == [7, 9]


@pytest.mark.parametrize("n", [0, 3])
def test_logprobs_are_the_raw_distribution(n):
    logits = torch.randn(2, 30)
    m = meta(2, temperature=0.0, max_num_logprobs=n)
    m.all_greedy = True
    out = sample(logits, m)
    raw = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, raw.gather(-1, out.token_ids[:, None])[:, 0])
    if n:
        assert torch.allclose(out.topk_logprobs, raw.topk(n).values)
        assert math.isclose(float(out.topk_logprobs[0, 0]), float(out.logprobs[0]), rel_tol=1e-6)


def _state(params, prompt=(1, 2, 3), output=(), eos=9):
    from compiled.input_batch import CachedRequestState

    return CachedRequestState("r", [*prompt, *output], len(prompt), params, 0, 0, 1, 0, eos)


def test_logit_bias_and_allowed_tokens_shape_the_logits_but_not_the_logprobs():
    from compiled.input_batch import sampling_inputs
    from engine.params import SamplingParams

    logits = torch.zeros(3, 12)
    logits[:, 4] = 5.0  # greedy picks 4 unless a bias or a ban moves it
    states = [
        _state(SamplingParams(temperature=0, logit_bias={4: -100.0})),
        _state(SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=1)),
        _state(SamplingParams(temperature=0, allowed_token_ids=[2, 6])),
    ]
    m = sampling_inputs(states, 12, torch.device("cpu"))
    out = sample(logits, m)
    assert out.token_ids[1] == 7 and out.token_ids[2] in (2, 6) and out.token_ids[0] != 4
    assert torch.allclose(out.logprobs[1], logits.log_softmax(-1)[1, 7])  # the model's, unbiased
    # Sampled rows keep to the allowed set whatever the draw.
    params = SamplingParams(temperature=1.0, allowed_token_ids=[3, 5, 11])
    for seed in range(30):
        m = sampling_inputs([_state(params)], 12, torch.device("cpu"))
        m.seeds = torch.tensor([seed])
        assert sample(logits[:1], m).token_ids.item() in (3, 5, 11)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    from compiled.input_batch import banned_tokens
    from engine.params import SamplingParams

    p = SamplingParams(min_tokens=3, stop_token_ids=[5])
    assert banned_tokens(_state(p), [1, 1]) == {5, 9}
    assert banned_tokens(_state(p), [1, 1, 1]) == set()
    assert banned_tokens(_state(SamplingParams(min_tokens=3, ignore_eos=True)), []) == set()


def test_bad_words_ban_a_last_token_only_after_the_rest():
    from compiled.input_batch import banned_tokens, sampling_inputs
    from engine.params import SamplingParams

    p = SamplingParams(bad_words=["x"], bad_words_token_ids=[[4], [6, 7, 8]])
    assert banned_tokens(_state(p), []) == {4}
    assert banned_tokens(_state(p), [6]) == {4}
    assert banned_tokens(_state(p), [1, 6, 7]) == {4, 8}
    assert banned_tokens(_state(p), [6, 7, 1]) == {4}
    # A draft's row sees the drafts before it: position 2 of drafts [6, 7] must ban 8.
    s = _state(p, output=(1,))
    m = sampling_inputs([s], 12, torch.device("cpu"), [[6, 7]])
    assert m.logit_bias[:, 8].isinf().tolist() == [False, False, True]
    assert m.logit_bias[:, 4].isinf().all()
    # min_tokens counts the drafts before a row: the stop id is banned at output index 1 only.
    s = _state(SamplingParams(min_tokens=2, stop_token_ids=[5]), output=(1,))
    m = sampling_inputs([s], 12, torch.device("cpu"), [[3, 3]])
    assert m.logit_bias[:, 5].isinf().tolist() == m.logit_bias[:, 9].isinf().tolist() == [True, False, False]


def test_biases_compose_with_a_grammar_and_penalties():
    from compiled.input_batch import sampling_inputs
    from engine.params import SamplingParams

    logits = torch.zeros(1, 12)
    logits[0, 4] = 3.0
    params = SamplingParams(temperature=0, logit_bias={4: -100.0, 7: 100.0}, presence_penalty=1.0)
    m = sampling_inputs([_state(params, output=(3,))], 12, torch.device("cpu"))
    allowed = (1 << 2) | (1 << 3) | (1 << 4)  # the grammar allows 2, 3, 4: the +100 on 7 cannot win
    m.token_bitmask = torch.tensor([[allowed]], dtype=torch.int32)
    logits[0, 3] = 0.5  # 3 beats 2 unless the penalty on the output's 3 applies after the bias
    assert sample(logits, m).token_ids.item() == 2

"""The serving step budget that follows measured step times (engine/step_budget.py)."""

import itertools
import time

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from engine.step_budget import StepBudget, query_key_pairs


def steps(per_token: float, with_decode_only: bool) -> list[tuple[int, int, int, float]]:
    """Steps of a machine whose step takes 10 ms + 2 ms a row + 1 µs a token of the rows' context +
    `per_token` a chunk token; the rows' context varies apart from their number."""
    shapes = [(rows, tokens) for rows in (0, 4, 9, 16, 25, 40, 64) for tokens in (0, 48, 150, 300)]
    shapes = [(r, t) for r, t in shapes if (r or t) and (t or with_decode_only)]
    return [
        (r, r * (100 + 50 * k), t, 0.010 + 0.002 * r + 1e-6 * r * (100 + 50 * k) + per_token * t)
        for k, (r, t) in enumerate(shapes)
    ]


def test_a_chunk_may_stretch_a_step_to_the_ratio_of_a_decode_step():
    b = StepBudget(stretch=4.0, floor=64, cap=1024)
    assert b.tokens(16) == 64  # nothing measured yet
    b.observe(16, 1600, 0, 0.0436)
    assert b.tokens(16) == 64  # a chunk's cost not yet known
    for step in steps(0.001, with_decode_only=True):
        b.observe(*step)
    fixed, per_row, per_context, per_distinct, per_token, *_ = b.costs()
    assert abs(fixed - 0.010) < 1e-3 and abs(per_row - 0.002) < 1e-4 and abs(per_token - 0.001) < 1e-5
    assert abs(per_context + per_distinct - 1e-6) < 1e-7  # every row its own request: one cost
    # 3 x (10 + 32) ms of room at 1 ms a token beside the 16 decodes; 3 x 2 ms more over 2,000 tokens.
    assert abs(b.tokens(16) - (16 + 126)) <= 1
    assert abs(b.tokens(16, context=2000) - (16 + 132)) <= 1
    assert b.tokens(2000) == 1024  # never past the step's own budget


def test_the_fit_needs_no_decode_only_step_and_follows_the_machine():
    """Under a steady queue every step carries a chunk; a machine twice as fast per prompt token gets
    twice the room."""
    slow, fast = StepBudget(4.0, 64, 4096), StepBudget(4.0, 64, 4096)
    for step in steps(0.001, with_decode_only=False):
        slow.observe(*step)
    for step in steps(0.0005, with_decode_only=False):
        fast.observe(*step)
    assert abs(slow.tokens(64) - (64 + 414)) <= 3
    assert abs(fast.tokens(64) - (64 + 828)) <= 6


def test_a_lone_requests_step_is_a_few_fixed_costs_and_half_a_second_at_least():
    """10 ms fixed: 7 x 10 ms of chunk tokens at 1 ms (70) fall short of half a second's worth (500); at
    8 ms a token, 62. Within a second of a step that served other clients, a tenth of a second: 100 and 12
    tokens, whatever a step's fixed cost."""
    for per_token, lone in ((0.001, 500), (0.008, 62)):
        b = StepBudget(stretch=4.0, floor=64, cap=1024)
        for step in steps(per_token, with_decode_only=True):
            b.observe(*step)
        assert abs(b.lone_tokens() - lone) <= 1
        b.shared_at = time.monotonic()  # other clients were served a moment ago: a tenth of a second
        assert abs(b.lone_tokens() - 0.1 / per_token) <= 1
    assert (StepBudget.LONE_SECONDS, StepBudget.RECENT_LONE_SECONDS, StepBudget.RECENT_S) == (0.5, 0.1, 1.0)
    # A step's fixed cost of 100 ms: 7 x 100 ms alone, a tenth of a second still while others come and go.
    b = StepBudget(stretch=4.0, floor=64, cap=1024)
    for rows, context, tokens, seconds in steps(0.001, with_decode_only=True):
        b.observe(rows, context, tokens, seconds + 0.090)
    assert abs(b.lone_tokens() - 700) <= 3
    b.shared_at = time.monotonic()
    assert abs(b.lone_tokens() - 100) <= 1


def test_a_fit_that_explains_chunks_by_their_pairs_alone_still_prices_them():
    """A machine whose chunks cost only their query-key pairs: the fit gives a chunk token nothing, yet a
    lone request's step is no whole budget and chunks are priced, not counted a token each."""
    b = StepBudget(stretch=4.0, floor=64, cap=2048)
    for rows, t, start in itertools.product((0, 2, 4), (0, 16, 44, 128), (0, 500)):
        if rows or t:
            pairs = query_key_pairs(start, t) if t else 0
            b.observe(rows, rows * 100, t, 0.01 + 0.002 * rows + 2e-6 * rows * 100 + 4e-6 * pairs, pairs)
    assert b.costs()[4] < 1e-9 and b.costs()[5] > 0  # nothing, at a chunk token's scale (seconds)
    assert b.lone_tokens() < 2048 and b.price(0, 128) > 128 and b.most(0, 200) < 200


def test_waiting_requests_widen_the_room_for_chunks():
    """Each waiting request widens the room beside the decodes as two running ones would (as many waiting
    as running triples it); none waiting keeps it."""
    b = StepBudget(stretch=4.0, floor=64, cap=4096)
    for step in steps(0.001, with_decode_only=True):
        b.observe(*step)
    room = b.tokens(16) - 16
    assert b.tokens(16, waiting=0) - 16 == room
    assert abs((b.tokens(16, waiting=16) - 16) - 3 * room) <= 3
    assert b.tokens(16, waiting=8) < b.tokens(16, waiting=16) < b.tokens(16, waiting=32) <= 4096
    assert b.tokens(16, waiting=10_000) == 4096


def test_a_requests_samples_read_its_prompt_once_a_step():
    """A decode costs 2 ms + 0.5 µs a context token + 5 µs a token no other row of the step reads: a
    request's samples read its 4,000-token prompt's pages once between them. The fit tells the two costs
    apart; a further sample beside its lead is priced by its own 100 tokens, the lead by all 4,100."""
    b = StepBudget(stretch=4.0, floor=64, cap=4096)
    assert b.distinct([4100, 4105, 4103], 4000) == 4105 + 100 + 103
    assert StepBudget(4.0, 64, 4096, shared_prompts=False).distinct([4100, 4105], 4000) == 8205
    for samples, good, tokens in itertools.product((0, 1, 4, 16), (1, 4, 8), (0, 64)):
        rows, context = good + samples, good * 100 + samples * 4100
        distinct = good * 100 + (4000 + samples * 100 if samples else 0)
        seconds = 0.010 + 0.002 * rows + 5e-7 * context + 5e-6 * distinct + 0.001 * tokens
        b.observe(rows, context, tokens, seconds, distinct=distinct)
    _, _, per_context, per_distinct, *_ = b.costs()
    assert abs(per_context - 5e-7) < 1e-8 and abs(per_distinct - 5e-6) < 1e-8
    assert b.price(4099) == 25 and b.price(4099, shared=4000) == 5  # 2 + 2.05 + 20.5 ms; 2 + 2.05 + 0.5
    b.shared_prompts = False  # samples that compute their own prompts: each reads its own pages
    assert b.price(4099, shared=4000) == 25


def test_a_further_sample_is_priced_by_the_context_its_decode_reads():
    """At 1 ms a chunk token, a decode is 2 ms plus 1 µs a context token: 3 tokens over 1,000, 102 over
    100,000; one token at least, and one before anything was measured."""
    b = StepBudget(stretch=4.0, floor=64, cap=4096)
    assert b.price(100_000) == 1
    for step in steps(0.001, with_decode_only=True):
        b.observe(*step)
    assert b.price(1000) == 3 and abs(b.price(100_000) - 102) <= 1
    assert b.price(0) == 2


@given(
    st.lists(
        st.tuples(st.integers(0, 256), st.integers(0, 4096), st.floats(0.0, 10.0)), min_size=1, max_size=50
    ),
    st.integers(0, 512),
    st.integers(0, 512),
)
def test_the_budget_stays_between_its_floor_and_cap(steps, running, waiting):
    b = StepBudget(stretch=4.0, floor=64, cap=1024)
    for rows, chunk, seconds in steps:
        b.observe(rows, rows * 300, chunk, seconds, pairs=chunk * 1000)
        assert 64 <= b.tokens(running, 300 * running, waiting) <= max(1024, 64)
        assert b.tokens(running, 300 * running, waiting) >= min(running, 1024)
        assert b.tokens(running, 300 * running, waiting) >= b.tokens(running, 300 * running)
        assert b.price(300) >= 1
        # Whatever the fit, a chunk token costs one more per DEPTH tokens of depth at most.
        assert 50 <= b.price(3000, 50) <= 50 + query_key_pairs(3000, 50) / StepBudget.DEPTH + 1
        assert 1 <= b.lone_tokens() <= 1024


def deep_steps() -> list[tuple[int, int, int, float, int]]:
    """Steps of a machine whose step takes 10 ms + 2 ms a row + 1 µs a token of the rows' context + 1 ms a
    chunk token + 0.5 µs a query-key pair of the chunks' attention, chunks at several depths."""
    out = []
    for k, (rows, tokens, start) in enumerate(itertools.product((0, 4, 16), (0, 48, 300), (0, 1000, 3000))):
        context, pairs = rows * (100 + 50 * k), query_key_pairs(start, tokens) if tokens else 0
        if rows or tokens:
            out.append(
                (
                    rows,
                    context,
                    tokens,
                    0.010 + 0.002 * rows + 1e-6 * context + 0.001 * tokens + 5e-7 * pairs,
                    pairs,
                )
            )
    return out


def test_a_chunk_is_priced_by_its_depth_in_its_prompt():
    """100 tokens from the start cost 100 chunk tokens and 5,050 pairs (2.5 ms): 103; from position 4,000,
    405,050 pairs (203 ms) more: 303. `most` inverts `price`."""
    b = StepBudget(stretch=4.0, floor=64, cap=4096)
    assert b.price(4000, 100) == 100 and b.most(4000, 37) == 37  # nothing measured: a token each
    for step in deep_steps():
        b.observe(*step[:4], pairs=step[4])
    assert abs(b.costs()[5] - 5e-7) < 1e-9 and abs(b.costs()[4] - 0.001) < 1e-5
    assert b.price(0, 100) == 103 and b.price(4000, 100) == 303
    assert b.most(0, 103) == 100 and b.most(4000, 303) == 100 and b.most(4000, 302) == 99
    assert b.most(0, 0) == 0 and b.price(4000) == 6  # a decode over 4,001 tokens: 2 + 4 ms


@given(st.integers(0, 8192), st.integers(0, 5000))
def test_the_most_tokens_a_room_holds_are_priced_within_it(start, room):
    b = StepBudget(stretch=4.0, floor=64, cap=4096)
    for step in deep_steps():
        b.observe(*step[:4], pairs=step[4])
    n = b.most(start, room)
    assert n == 0 or b.price(start, n) <= room
    assert b.price(start, n + 1) > room  # one more would not fit


def test_a_steps_room_and_the_prices_of_its_work_count_in_the_same_unit():
    """Where the context's cost sets the unit prices count in (DEPTH), the room a step leaves is counted in
    it too: the chunk that fills the room beside four streams stretches their step by 2 at most."""
    b = StepBudget(stretch=2.0, floor=1, cap=4096)
    b.fit = (0.010, 0.001, 1e-4, 0.0, 0.001, 1e-6, 0.0)  # fixed, a row, a context token, a token, a pair
    decode = 0.010 + 4 * 0.001 + 240 * 1e-4
    n = b.most(3000, b.tokens(4, 240) - 4)
    assert n >= 2 and 0.001 * n + 1e-6 * query_key_pairs(3000, n) <= decode


def test_a_chunk_after_context_pays_for_its_depth_whatever_its_length():
    """A chunk from position p also costs 30 µs a token of p (it gathers its context): the fit finds it;
    12 tokens from 3,000 cost 12 + 18 (their pairs) + 90 (the depth) tokens, and `most` leaves the depth
    out of the room, down to a lone query, which runs as a decode row does."""
    b = StepBudget(stretch=4.0, floor=64, cap=4096)
    for rows, tokens, start in itertools.product((0, 4, 16), (0, 12, 64, 256), (0, 1000, 3000)):
        context, pairs = rows * 200, query_key_pairs(start, tokens) if tokens else 0
        depth = start if tokens else 0
        seconds = 0.010 + 0.002 * rows + 1e-6 * context + 0.001 * tokens + 5e-7 * pairs + 3e-5 * depth
        if rows or tokens:
            b.observe(rows, context, tokens, seconds, pairs, depth=depth)
    assert abs(b.costs()[6] - 3e-5) < 1e-8 and b.depth_price(3000) == 90 and b.depth_price(0) == 0
    assert b.price(3000, 12) == 12 + 18 + 90 and b.price(0, 12) == 12
    assert b.most(3000, 120) == 12 and b.most(3000, 100) == 4
    assert b.most(3000, 94) == 1 and b.most(3000, b.price(3000) - 1) == 0


@given(
    st.lists(
        st.tuples(
            st.integers(0, 64),
            st.integers(0, 50_000),
            st.integers(0, 2048),
            st.floats(0.001, 2.0),
            st.integers(0, 4_000_000),
            st.integers(0, 8192),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_the_fit_is_the_best_non_negative_one_after_every_step(observed):
    """Tried first on the last fit's positive costs, the fit is never worse than the best over every
    subset of them (its squared error, less a constant, in x's scales), and never negative."""
    b = StepBudget(stretch=4.0, floor=64, cap=1024)
    for rows, context, chunk, seconds, pairs, depth in observed:
        b.observe(rows, context, chunk, seconds, pairs, depth=depth)
        if b.costs() is not None:
            xx = b.xx + b.RIDGE
            fit, best = np.array(b.costs()) * b.SCALES, b._best_subset(xx)
            loss, least = (float(x @ xx @ x - 2 * x @ b.xt) for x in (fit, best))
            assert min(fit) >= 0 and loss <= least + 1e-9 * (1 + abs(least))

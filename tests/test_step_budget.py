"""The serving step budget that follows measured step times (engine/step_budget.py)."""

from hypothesis import given
from hypothesis import strategies as st

from engine.step_budget import StepBudget


def test_a_chunk_may_stretch_a_step_to_the_ratio_of_a_decode_step():
    b = StepBudget(stretch=4.0, floor=64, cap=1024)
    assert b.tokens(16) == 64  # nothing measured yet
    b.observe(16, 0, 0.050)  # 16 streams decode in 50 ms
    assert b.tokens(16) == 64  # a chunk's cost not yet known
    b.observe(16, 48, 0.098)  # 48 prompt tokens added 48 ms: 1 ms each
    # 3 x 50 ms of room at 1 ms a token, beside the 16 decodes.
    assert b.tokens(16) == 16 + 150
    # A machine twice as fast per prompt token gets twice the room.
    for _ in range(60):
        b.observe(16, 0, 0.050)
        b.observe(16, 100, 0.100)
    assert abs(b.tokens(16) - (16 + 300)) <= 2
    assert b.tokens(2000) == 1024  # never past the step's own budget


@given(
    st.lists(
        st.tuples(st.integers(0, 256), st.integers(0, 4096), st.floats(0.0, 10.0)), min_size=1, max_size=50
    ),
    st.integers(0, 512),
)
def test_the_budget_stays_between_its_floor_and_cap(steps, running):
    b = StepBudget(stretch=4.0, floor=64, cap=1024)
    for rows, chunk, seconds in steps:
        b.observe(rows, chunk, seconds)
        assert 64 <= b.tokens(running) <= max(1024, 64)
        assert b.tokens(running) >= min(running, 1024)

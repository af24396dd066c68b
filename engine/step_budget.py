"""The token budget of a serving step that carries decodes, from what steps measurably cost.

A prompt chunk in a step delays every running stream's next token by the chunk's compute. A fixed
budget is right for one machine and model only; this one keeps a step with a chunk within `stretch`
times the time of a decode-only step of the same streams, whatever the machine computes per token.

While prompts wait, their clients wait for a first token as the running ones wait for a next one: the
room for chunks grows with the ratio of waiting to running requests. However the prompts are cut into
steps, the running streams pay for the same prompt compute in all; larger steps only gather it into
fewer pauses, and let the waiting prompts in sooner.
"""

from __future__ import annotations

import numpy as np


class StepBudget:
    """A step's time as fixed + per single-query row + per chunk token, fitted by least squares over
    recent steps (older ones weigh less). Under a steady queue every step carries a chunk, so the fit
    cannot wait for decode-only steps: it takes all of them.

    Invariant: `tokens(n, w)` lies in [max(floor, n), cap] when n <= cap, grows with w, and equals
    max(floor, n) until the fit has seen steps with rows and steps with chunks.
    """

    DECAY = 0.95  # weight of a step one step older: about the last twenty steps count
    RIDGE = 1e-6  # keeps the fit defined before the steps tell every cost apart

    def __init__(self, stretch: float, floor: int, cap: int) -> None:
        self.stretch, self.floor, self.cap = stretch, floor, cap
        self.xx = np.zeros((3, 3))  # weighted sums of x xᵀ, x = (1, rows, tokens)
        self.xt = np.zeros(3)  # weighted sums of x · seconds
        self.seen_rows = self.seen_tokens = False

    def observe(self, decode_rows: int, chunk_tokens: int, seconds: float) -> None:
        """One step's composition (single-query rows, tokens of multi-token chunks) and its time."""
        x = np.array([1.0, decode_rows, chunk_tokens])
        self.xx = self.DECAY * self.xx + np.outer(x, x)
        self.xt = self.DECAY * self.xt + x * seconds
        self.seen_rows |= decode_rows > 0
        self.seen_tokens |= chunk_tokens > 0

    def costs(self) -> tuple[float, float, float] | None:
        """Seconds of a step: fixed, per row, per chunk token; None until both kinds of work were seen."""
        if not (self.seen_rows and self.seen_tokens):
            return None
        fixed, per_row, per_token = np.linalg.solve(self.xx + self.RIDGE * np.eye(3), self.xt)
        return float(fixed), float(per_row), float(per_token)

    def tokens(self, running: int, waiting: int = 0) -> int:
        """Tokens of a step that carries `running` streams' decodes while `waiting` requests wait."""
        low = max(self.floor, running)
        fixed, per_row, per_token = self.costs() or (0.0, 0.0, 0.0)
        decode_step = fixed + per_row * running
        if per_token <= 0 or decode_step <= 0:  # no fit yet, or one that prices nothing
            return min(low, self.cap)
        room = (self.stretch - 1.0) * (1.0 + waiting / max(running, 1)) * decode_step / per_token
        return int(min(self.cap, max(low, running + room)))

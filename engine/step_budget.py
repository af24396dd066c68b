"""The token budget of a serving step that carries decodes, from what steps measurably cost.

A prompt chunk in a step delays every running stream's next token by the chunk's compute. A fixed
budget is right for one machine and model only; this one keeps a step with a chunk within `stretch`
times the time of a decode-only step of the same streams, whatever the machine computes per token.
"""

from __future__ import annotations


class StepBudget:
    """Running estimates of a decode-only step's time and of one prompt token's time within a step.

    Invariant: `tokens(n)` lies in [floor, cap] (at least n, one token per running stream), and equals
    `floor` until both a decode-only step and a step with a chunk have been measured.
    """

    SMOOTHING = 0.2  # weight of the newest measurement in each running estimate

    def __init__(self, stretch: float, floor: int, cap: int) -> None:
        self.stretch, self.floor, self.cap = stretch, floor, cap
        self.decode_s: float | None = None  # a decode-only step
        self.token_s: float | None = None  # one prompt token more in a step

    def observe(self, decode_rows: int, chunk_tokens: int, seconds: float) -> None:
        """One step's composition (single-query rows, tokens of multi-token chunks) and its time."""
        if chunk_tokens == 0:
            self.decode_s = self._mix(self.decode_s, seconds)
        elif self.decode_s is not None or decode_rows == 0:
            extra = seconds - (self.decode_s or 0.0) if decode_rows else seconds
            self.token_s = self._mix(self.token_s, max(extra, 0.0) / chunk_tokens)

    def tokens(self, running: int) -> int:
        if self.decode_s is None or not self.token_s:
            return max(self.floor, running)
        room = (self.stretch - 1.0) * self.decode_s / self.token_s
        return int(min(self.cap, max(self.floor, running + room, running)))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)

"""The token budget of a serving step that carries decodes, from what steps measurably cost.

A prompt chunk in a step delays every running stream's next token by the chunk's compute. A fixed
budget is right for one machine and model only; this one keeps a step with a chunk within `stretch`
times the time of a decode-only step of the same streams, whatever the machine computes per token.

While prompts wait, their clients wait for a first token as the running ones wait for a next one: the
room for chunks grows with the ratio of waiting to running requests. However the prompts are cut into
steps, the running streams pay for the same prompt compute in all; larger steps only gather it into
fewer pauses, and let the waiting prompts in sooner.

Beside other clients' streams, bulk work stretches their step by BULK_STRETCH (or to the decoding floor's
tokens) at most, waiting prompts or not: the chunks of a fresh prompt longer than a step may take
(max_num_batched_tokens, or long_prefill_token_threshold where lower), which goes in at that pace while
shorter ones go past it, and a request's further samples (n > 1), each of whose decodes the scheduler
prices in chunk tokens of the same cost (`price`), which grows with the context its attention reads. So
one request's many samples, or a prompt too long for one step, cannot stretch every step for all the
others; and while such a prompt waits, further samples leave it half of the bulk room.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.request import Request
    from engine.step import SchedulerOutput


class StepBudget:
    """A step's time as fixed + per single-query row + per context token those rows read + per chunk
    token, fitted by least squares over recent steps (older ones weigh less), no cost below zero. Under a
    steady queue every step carries a chunk, so the fit cannot wait for decode-only steps: it takes all of
    them; and where the steps hardly vary (their rows and context grow together), the non-negative fit
    gives a cost to what explains the time rather than trading a negative one against another.

    Invariant: `tokens(n, c, w)` lies in [max(floor, n), cap] when n <= cap, grows with w, and equals
    max(floor, n) until the fit has seen steps with rows and steps with chunks; `price(c) >= 1`.
    """

    DECAY = 0.95  # weight of a step one step older: about the last twenty steps count
    RIDGE = 1e-6  # keeps the fit defined before the steps tell every cost apart

    def __init__(self, stretch: float, floor: int, cap: int) -> None:
        self.stretch, self.floor, self.cap = stretch, floor, cap
        self.xx = np.zeros((4, 4))  # weighted sums of x xᵀ, x = (1, rows, context / 1024, tokens)
        self.xt = np.zeros(4)  # weighted sums of x · seconds
        self.seen_rows = self.seen_tokens = False
        self.fit: tuple[float, float, float, float] | None = None  # costs(), solved once a step

    @classmethod
    def of(cls, cfg: SchedulerConfig) -> StepBudget | None:
        if not cfg.step_stretch:
            return None
        return cls(cfg.step_stretch, cfg.max_num_batched_tokens_decoding, cfg.max_num_batched_tokens)

    def observe_step(self, so: SchedulerOutput, requests: dict[str, Request], seconds: float) -> None:
        """A step's time, with its composition read from its plan and its (unfinished) requests."""
        rows = [requests[r] for r, n in so.num_scheduled_tokens.items() if n == 1 and r in requests]
        prompt = so.num_prompt_tokens
        context = sum(r.num_computed_tokens for r in rows)
        self.observe(so.total_num_scheduled_tokens - prompt, context, prompt, seconds)

    def observe(self, decode_rows: int, context: int, chunk_tokens: int, seconds: float) -> None:
        """One step's composition (single-query rows, the context tokens they read, tokens of multi-token
        chunks) and its time."""
        x = np.array([1.0, decode_rows, context / 1024, chunk_tokens])  # scaled alike for the solve
        self.xx = self.DECAY * self.xx + np.outer(x, x)
        self.xt = self.DECAY * self.xt + x * seconds
        self.seen_rows |= decode_rows > 0
        self.seen_tokens |= chunk_tokens > 0
        if self.seen_rows and self.seen_tokens:
            self.fit = self._solve()

    def _solve(self) -> tuple[float, float, float, float]:
        """Non-negative least squares over 4 costs: the best of the fits on each subset of them whose
        costs all come out non-negative (the others zero)."""
        xx, best, best_loss = self.xx + self.RIDGE * np.eye(4), np.zeros(4), 0.0
        for subset in itertools.product((False, True), repeat=4):
            keep = np.flatnonzero(subset)
            if not len(keep):
                continue
            beta = np.zeros(4)
            beta[keep] = np.linalg.solve(xx[np.ix_(keep, keep)], self.xt[keep])
            loss = beta @ xx @ beta - 2 * beta @ self.xt  # the squared error, less a constant
            if (beta >= 0).all() and loss < best_loss:
                best, best_loss = beta, loss
        fixed, per_row, per_kilo, per_token = best
        return float(fixed), float(per_row), float(per_kilo) / 1024, float(per_token)

    def costs(self) -> tuple[float, float, float, float] | None:
        """Seconds of a step: fixed, per row, per context token, per chunk token; None until both kinds of
        work were seen."""
        return self.fit

    def tokens(self, running: int, context: int = 0, waiting: int = 0, stretch: float | None = None) -> int:
        """Tokens of a step that carries `running` streams' decodes over `context` tokens in all while
        `waiting` requests wait, stretched by `stretch` (default: the budget's)."""
        low = max(self.floor, running)
        fixed, per_row, per_context, per_token = self.costs() or (0.0, 0.0, 0.0, 0.0)
        decode_step = fixed + per_row * running + per_context * context
        if per_token <= 0 or decode_step <= 0:  # no fit yet, or one that prices nothing
            return min(low, self.cap)
        stretch = self.stretch if stretch is None else stretch
        room = (stretch - 1.0) * (1.0 + waiting / max(running, 1)) * decode_step / per_token
        return int(min(self.cap, max(low, running + room)))

    def price(self, context: int) -> int:
        """Chunk tokens that cost what one more decode over `context` tokens does (1 without a fit)."""
        _, per_row, per_context, per_token = self.costs() or (0.0, 0.0, 0.0, 0.0)
        if per_token <= 0:
            return 1
        return max(1, round((per_row + per_context * context) / per_token))


# How far bulk work may stretch the running streams' step: the inter-token latency it may cost them.
BULK_STRETCH = 1.5


class StepRoom(NamedTuple):
    """A step's token budget; the price in its tokens of a further sample's decode at a context length
    (None: one token); and the tokens bulk work may take in all (unbounded where nothing is measured, a
    lone request's samples share the step, or nothing decodes)."""

    budget: int
    price: Callable[[int], int] | None = None
    bulk: int = sys.maxsize


def step_tokens(
    cfg: SchedulerConfig,
    running: list[Request],
    leads: dict[str, Request],
    first_waiting: int,
    measured: StepBudget | None,
) -> StepRoom:
    """A step that carries decodes has the decoding budget, measured or fixed, with room for every running
    request's decode at least, or, where other requests' streams share the step or wait for it, for each
    request's lead (its first running sample; `leads` by request). A measured step stretches as far as
    the budget's stretch for prompts, further while they wait; bulk work stretches the leads' step by
    BULK_STRETCH at most, even while a burst's streams settle (full steps, for its prompts)."""
    if not cfg.max_num_batched_tokens_decoding:
        return StepRoom(cfg.max_num_batched_tokens)
    decoding = [r for r in running if r.num_computed_tokens >= r.num_prompt_tokens]
    settling = not any(r.num_output_tokens >= cfg.settling_tokens for r in decoding)  # a burst's streams
    alone = len(leads) == 1 and not first_waiting  # one request's samples, no other client's
    if measured is None or not decoding or (settling and alone):
        if settling:
            return StepRoom(cfg.max_num_batched_tokens)
        return StepRoom(
            min(cfg.max_num_batched_tokens, max(cfg.max_num_batched_tokens_decoding, len(running)))
        )
    context = sum(r.num_tokens for r in leads.values())
    budget = measured.tokens(len(leads), context, first_waiting)
    if alone:
        return StepRoom(min(cfg.max_num_batched_tokens, max(budget, len(running))))
    budget = (
        cfg.max_num_batched_tokens if settling else min(cfg.max_num_batched_tokens, max(budget, len(leads)))
    )
    stretch = min(measured.stretch, BULK_STRETCH)
    bulk = max(1, min(budget, measured.tokens(len(leads), context, stretch=stretch)) - len(leads))
    return StepRoom(budget, measured.price, bulk)

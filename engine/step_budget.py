"""The token budget of a serving step that carries decodes, from what steps measurably cost.

A prompt chunk in a step delays every running stream's next token by the chunk's compute. A fixed
budget is right for one machine and model only; this one keeps a step with a chunk within `stretch`
times the time of a decode-only step of the same streams, whatever the machine computes per token.

While prompts wait, their clients wait for a first token as the running ones wait for a next one: the
room for chunks grows with the ratio of waiting to running requests, each waiting one counted twice.
However the prompts are cut into steps, the running streams pay for the same prompt compute in all;
larger steps only gather it into fewer pauses, and let the waiting prompts in sooner.

Beside other clients' streams the scheduler prices work in chunk tokens at the start of a prompt
(`price`): a decode by the context it reads, a chunk by its depth in its prompt, whose attention grows
with it. And bulk work stretches their step by BULK_STRETCH at most (a piece of it at least; none in one
step of PROBE, nor, every other step at most, in one that lets other clients' prompts in): the chunks of a
fresh prompt longer than a step may take (max_num_batched_tokens, or long_prefill_token_threshold where
lower), which goes in at that pace while shorter ones go past it, and all the work of a request's further
samples (n > 1): their prompts and decodes. So one request's many samples, or a prompt too long for one
step, cannot stretch every step for all the others; and while such a prompt waits, further samples leave
it half of the bulk room.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.request import Request
    from engine.request_queue import RequestQueue
    from engine.step import SchedulerOutput


class StepBudget:
    """A step's time as fixed + per single-query row + per context token those rows read + per distinct
    context token (a request's samples read its prompt's pages once a step between them) + per chunk token +
    per query-key pair of the chunks' attention (which grows with a chunk's depth in its prompt) + per token
    of a chunk's depth (the context it gathers, whatever its length), fitted by least squares over recent
    steps (older ones weigh less), no cost below zero. Under a steady queue every step carries a chunk, so the
    fit cannot wait for decode-only steps: it takes all of them; and where the steps hardly vary (their rows
    and context grow together), the non-negative fit gives a cost to what explains the time rather than
    trading a negative one against another.

    Invariant: `tokens(n, c, w)` lies in [max(floor, n), cap] when n <= cap, grows with w, and equals
    max(floor, n) until the fit has seen steps with rows and steps with chunks; `price(s, n) >= n`, and
    `price(s, most(s, room)) <= room` where `most(s, room) >= 1`.
    """

    DECAY = 0.99  # weight of a step one step older: about the last hundred steps count
    # Keeps the fit defined before the steps tell every cost apart; until they tell a distinct context
    # token from any other, it is any other's: no discount for the samples that share a prompt.
    RIDGE = np.diag([1e-6, 1e-6, 1e-6, 1e-3, 1e-6, 1e-6, 1e-6])
    # One step in PROBE that carries streams' decodes beside bulk work carries none of it: steps that
    # always carry some cannot tell the streams' own step from a fixed cost, and the room for bulk work
    # is its share.
    PROBE = 8
    LONE = 8  # a lone request's step: its fixed cost and LONE - 1 times that of work, or LONE_SECONDS' work
    LONE_SECONDS = 0.5  # where that is more: another client's request that comes meanwhile waits as long
    # A tenth of a second within a second of serving several client requests: others are likely back soon.
    RECENT_LONE_SECONDS, RECENT_S = 0.1, 1.0
    # A waiting request counts as this many running ones in the room for chunks: a burst's last first
    # token waits for every prompt before it, a stream's next token for one step.
    WAITING = 2
    DEPTH = 64  # a token deeper in its sequence costs one more chunk token per DEPTH tokens at most
    # Costs: fixed, per row, per kilo context token, per kilo distinct one, per chunk token, per kilo pair,
    # per kilo token of depth.
    N, SCALES = 7, (1, 1, 1024, 1024, 1, 1024, 1024)
    SUBSETS = np.array(list(itertools.product((False, True), repeat=N))[1:])  # the costs each fit may use

    def __init__(self, stretch: float, floor: int, cap: int, shared_prompts: bool = True) -> None:
        self.stretch, self.floor, self.cap = stretch, floor, cap
        self.shared_prompts = shared_prompts  # a request's samples decode over one copy of its prompt
        self.xx = np.zeros((self.N, self.N))  # weighted sums of x xᵀ, x = (1, rows, context / 1024, ...)
        self.xt = np.zeros(self.N)  # weighted sums of x · seconds
        self.seen_rows = self.seen_tokens = False
        self.steps = 0  # observed
        self.shared_at = -math.inf  # when a step last served several client requests (time.monotonic())
        self.aside_at = -2  # the observed steps' count when bulk work last stood aside for prompts
        self.fit: tuple[float, ...] | None = None  # costs(), solved once a step
        self.support = np.zeros(self.N, dtype=bool)  # the costs the last fit made positive

    @classmethod
    def of(cls, cfg: SchedulerConfig) -> StepBudget | None:
        if not cfg.step_stretch or not cfg.enable_chunked_prefill:  # its room cuts prompts into chunks
            return None
        floor, cap = cfg.max_num_batched_tokens_decoding, cfg.max_num_batched_tokens
        return cls(cfg.step_stretch, floor, cap, cfg.enable_prefix_caching)

    def observe_step(self, so: SchedulerOutput, seconds: float, requests: Mapping[str, Request]) -> None:
        """A step's time, with its composition read from its plan: each request's tokens and where they
        start (its prompt's cached or computed part), and which client request each sample is of."""
        starts = {r.req_id: r.num_computed_tokens for r in itertools.chain(so.new_reqs, so.cached_reqs)}
        rows = context = chunk = pairs = depth = 0
        reads: dict[str, tuple[int, list[int]]] = {}  # by client request: its prompt, each decode's context
        for rid, n in so.num_scheduled_tokens.items():
            if rid in so.spec_tokens:  # a verification: its rows count, not its context
                rows += n
            elif n == 1:
                rows, context = rows + 1, context + starts[rid] + 1
                req = requests.get(rid)
                parent, prompt = (req.parent_id, req.num_prompt_tokens) if req else (rid, 0)
                reads.setdefault(parent, (prompt, []))[1].append(starts[rid] + 1)
            else:
                chunk, pairs, depth = chunk + n, pairs + query_key_pairs(starts[rid], n), depth + starts[rid]
        distinct = sum(self.distinct(contexts, prompt) for prompt, contexts in reads.values())
        clients = {req.parent_id if (req := requests.get(rid)) else rid for rid in so.num_scheduled_tokens}
        if len(clients) > 1:
            self.shared_at = time.monotonic()
        self.observe(rows, context, chunk, seconds, pairs, distinct, depth)

    def distinct(self, contexts: list[int], prompt: int) -> int:
        """Context tokens that one request's decodes over `contexts` read between them: its prompt once
        where its samples share its pages."""
        if not self.shared_prompts:
            return sum(contexts)
        return min(prompt, max(contexts)) + sum(max(0, c - prompt) for c in contexts)

    def observe(
        self,
        decode_rows: int,
        context: int,
        chunk_tokens: int,
        seconds: float,
        pairs: int = 0,
        distinct: int | None = None,
        depth: int = 0,
    ) -> None:
        """One step's composition (single-query rows, the context tokens they read, the distinct ones
        among them (default: all), tokens of multi-token chunks, the query-key pairs of the chunks'
        attention, the chunks' depths in all) and its time."""
        distinct = context if distinct is None else distinct
        x = np.array([1.0, decode_rows, context, distinct, chunk_tokens, pairs, depth]) / self.SCALES  # alike
        self.xx = self.DECAY * self.xx + np.outer(x, x)
        self.xt = self.DECAY * self.xt + x * seconds
        self.steps += 1
        self.seen_rows |= decode_rows > 0
        self.seen_tokens |= chunk_tokens > 0
        if self.seen_rows and self.seen_tokens:
            self.fit = self._solve()

    def _solve(self) -> tuple[float, ...]:
        """Non-negative least squares over the costs (a convex problem: one optimum). Step after step the
        costs that come out positive rarely change, so the last fit's are tried first (`_on_support`);
        else every subset of them (`_best_subset`)."""
        xx = self.xx + self.RIDGE
        best = self._on_support(xx)
        best = self._best_subset(xx) if best is None else best
        self.support = best > 0
        return tuple(float(c) / scale for c, scale in zip(best, self.SCALES))  # x's scales undone

    def _best_subset(self, xx: np.ndarray) -> np.ndarray:
        """The best of the fits on each subset of the costs whose costs all come out non-negative (the
        others zero), all subsets solved at once."""
        keep = self.SUBSETS
        systems = np.where(keep[:, :, None] & keep[:, None, :], xx, np.eye(self.N))  # the rest solve to 0
        beta = np.linalg.solve(systems, np.where(keep, self.xt, 0.0)[..., None])[..., 0]
        loss = np.einsum("si,ij,sj->s", beta, xx, beta) - 2 * beta @ self.xt  # squared error, less a constant
        loss[(beta < 0).any(axis=1)] = 0.0
        return beta[loss.argmin()] if loss.min() < 0 else np.zeros(self.N)

    def _on_support(self, xx: np.ndarray) -> np.ndarray | None:
        """The fit on the last fit's positive costs, if it is the optimum: those costs positive again, and
        none of the others would lower the squared error by growing from zero."""
        keep, beta = self.support, np.zeros(self.N)
        if keep.any():
            beta[keep] = np.linalg.solve(xx[np.ix_(keep, keep)], self.xt[keep])
        if (beta[keep] <= 0).any() or (self.xt - xx @ beta)[~keep].max(initial=0.0) > 0:
            return None
        return beta

    def probing(self) -> bool:
        """Whether the next step that carries streams' decodes carries no bulk work (every step that does
        is observed, so the count moves on)."""
        return self.steps % self.PROBE == self.PROBE - 1

    def stand_aside(self) -> bool:
        """Whether bulk work stands aside in the next step for other clients' prompts, which it may do every
        other step only: prompts that keep coming, or that wait for blocks the bulk work holds, cannot stop
        it. Asked again before the step is observed, the answer stays."""
        if self.aside_at == self.steps - 1:
            return False
        self.aside_at = self.steps
        return True

    def costs(self) -> tuple[float, ...] | None:
        """Seconds of a step: fixed, per row, per context token, per distinct context token, per chunk
        token, per query-key pair of a chunk, per token of a chunk's depth; None until both kinds of work
        were seen."""
        return self.fit

    def tokens(self, running: int, context: int = 0, waiting: int = 0, stretch: float | None = None) -> int:
        """Tokens of a step that carries `running` streams' decodes over `context` tokens in all while
        `waiting` requests wait, stretched by `stretch` (default: the budget's)."""
        low, room = max(self.floor, running), self.room(running, context, waiting, stretch)
        return min(low, self.cap) if room is None else int(min(self.cap, max(low, running + room)))

    def room(
        self, running: int, context: int = 0, waiting: int = 0, stretch: float | None = None
    ) -> float | None:
        """Chunk tokens, as priced, that stretch the decodes of `running` streams over `context` tokens by
        `stretch` (more while `waiting` requests wait); None without a fit that prices them."""
        fixed, per_row, per_context, per_distinct, *_ = self.costs() or (0.0,) * self.N
        decode_step = fixed + per_row * running + (per_context + per_distinct) * context  # each its own
        if (unit := self._unit()) <= 0 or decode_step <= 0:  # no fit yet, or one that prices nothing
            return None
        stretch = self.stretch if stretch is None else stretch
        return (stretch - 1.0) * (1.0 + self.WAITING * waiting / max(running, 1)) * decode_step / unit

    def lone_tokens(self) -> int:
        """Tokens of a step that carries a lone request's work: LONE - 1 times what a step costs that
        computes nothing, so that its fixed cost stays a small share, and LONE_SECONDS' worth at least (a
        prompt's chunks are priced by their depth: a step of fixed tokens would shrink as it goes deeper);
        a request that comes meanwhile waits no longer than that. Within RECENT_S of a step that served
        several client requests, RECENT_LONE_SECONDS' worth alone. Cap until measured."""
        fixed, *_ = self.costs() or (0.0,) * self.N
        if (unit := self._unit()) <= 0:
            return self.cap
        if time.monotonic() - self.shared_at < self.RECENT_S:  # other clients are likely back soon
            return int(min(self.cap, max(1, self.RECENT_LONE_SECONDS / unit)))
        return int(min(self.cap, max(1, self.LONE_SECONDS / unit, (self.LONE - 1) * fixed / unit)))

    def _unit(self) -> float:
        """Seconds of a chunk token, as prices count it: at least what DEPTH query-key pairs or context
        tokens cost. A fit that gives chunk tokens next to nothing (few chunks among many decodes) would
        otherwise price every chunk and decode out of any step; one that gives them none (chunks of one
        length explained by their pairs) prices them all the same. 0: nothing priced yet."""
        _, _, per_context, per_distinct, per_token, per_pair, _ = self.costs() or (0.0,) * self.N
        return max(per_token, self.DEPTH * max(per_pair, per_context + per_distinct))

    def price(self, start: int, n: int = 1, shared: int = 0) -> int:
        """Chunk tokens at the start of a prompt that cost what `n` query tokens from position `start` do:
        a single query (a decode) reads `start + 1` tokens' keys and values, of which `shared` another row
        of the step reads too; a chunk's attention grows with its depth, and gathers it. `n` without a fit."""
        _, per_row, per_context, per_distinct, _, per_pair, _ = self.costs() or (0.0,) * self.N
        if (unit := self._unit()) <= 0:
            return n
        if n == 1:
            own = start + 1 - min(start, shared * self.shared_prompts)  # of its context, read by no other row
            read = per_context * (start + 1) + per_distinct * own
            return max(1, round((per_row + read) / unit))
        return n + round(per_pair * query_key_pairs(start, n) / unit) + self.depth_price(start)

    def depth_price(self, start: int) -> int:
        """Chunk tokens that a chunk from position `start` costs whatever its length: gathering its depth."""
        per_depth, unit = (self.costs() or (0.0,) * self.N)[-1], self._unit()
        return round(per_depth * start / unit) if unit > 0 else 0

    def most(self, start: int, room: int) -> int:
        """The most query tokens from position `start` whose price is within `room` tokens (0: none)."""
        per_pair, unit = (self.costs() or (0.0,) * self.N)[5], self._unit()
        k = per_pair / unit if unit > 0 else 0.0
        left = room - self.depth_price(start)
        # price(start, n) ~ n + k n (start + (n + 1) / 2) + its depth's: the positive root of price = room.
        b = 1 + k * (start + 0.5)
        n = max(0, int(left if k <= 0 else (math.sqrt(max(0.0, b * b + 2 * k * left)) - b) / k))
        while self.price(start, n + 1) <= room:  # the root is rounded; `price` rounds the pairs' share
            n += 1
        while n > 0 and self.price(start, n) > room:
            n -= 1
        return n


def query_key_pairs(start: int, n: int) -> int:
    """Query-key pairs of causal attention for `n` queries from position `start`."""
    return n * start + n * (n + 1) // 2


# How far bulk work may stretch the running streams' step: the inter-token latency it may cost them.
BULK_STRETCH = 1.5


class StepRoom(NamedTuple):
    """A step's token budget; the measured costs that price work in its tokens (None: a token each); and
    the tokens bulk work may take: the chunks of prompts that cost more than a step, and further samples'
    work (both unbounded where nothing is measured)."""

    budget: int
    priced: StepBudget | None = None
    chunks: int = sys.maxsize
    samples: int = sys.maxsize

    def long(self, req: Request, hit: int, whole: int) -> bool:
        """Whether `req` is a fresh prompt whose rest from `hit` costs more than a step of `whole` tokens:
        bulk work to its end."""
        n = req.num_prompt_tokens - hit
        return not req.num_output_tokens and (n if self.priced is None else self.priced.price(hit, n)) > whole

    def take(self, start: int, n: int, room: int, whole: int, shared: int = 0) -> tuple[int, int]:
        """Of `n` query tokens from position `start`, the most whose price fits `room` (none if either is
        0, one at least otherwise) and their price (a decode's less the `shared` context another row reads),
        counted as `whole` at most: work that no room holds runs alone in a whole one."""
        if room <= 0 or n <= 0:
            return 0, 0
        if self.priced is None:
            return min(n, room), min(n, room)
        n = max(1, min(n, self.priced.most(start, room)))  # one query runs as a decode does, its depth read
        return n, min(self.priced.price(start, n, shared), whole)


def prompt_caps(cfg: SchedulerConfig) -> tuple[int, int]:
    """The most tokens of a prompt one chunk may take (long_prefill_token_threshold, with chunked prefill
    only; 0: no cap), and the longest prompt that goes in at once: longer ones are bulk work."""
    cap = (cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else 0) or sys.maxsize
    return cap, min(cfg.max_num_batched_tokens, cap)


def step_tokens(
    cfg: SchedulerConfig,
    running: list[Request],
    leads: dict[str, Request],
    waiting: RequestQueue,
    measured: StepBudget | None,
) -> StepRoom:
    """Unmeasured, a step that carries decodes has the decoding budget with room for every running request's
    decode (full steps while a burst's streams settle). Measured, one request's work alone (its samples,
    no other client's) goes in a lone request's steps, all of it priced: a request that comes meanwhile
    waits no longer. Beside other clients, a step has room for each request's lead (its first running
    sample; `leads` by request) and stretches as far as the budget's stretch for prompts, further while
    they wait; bulk work stretches the leads' step by BULK_STRETCH at most, even while a burst's streams
    settle (full steps, for its prompts), and takes none of a probing step (StepBudget.PROBE) nor of a step
    that lets waiting prompts no longer than a step in beside the streams (their first tokens and the
    streams' next ones wait for no bulk work); with no stream decoding, it takes a lone request's step, or
    a token of a step that lets such prompts in (it keeps moving while they wait for blocks it holds);
    further samples and a prompt longer than a step, both at once, get half of that room each.
    """
    first_waiting = waiting.num_first
    if not cfg.max_num_batched_tokens_decoding:
        return StepRoom(cfg.max_num_batched_tokens)
    decoding = [r for r in running if r.num_computed_tokens >= r.num_prompt_tokens]
    settling = not any(r.num_output_tokens >= cfg.settling_tokens for r in decoding)  # a burst's streams
    if measured is not None and len(leads) + first_waiting <= 1:  # one request's work, no other client's
        lone = measured.lone_tokens()
        bulk = max(1, lone - len(leads))  # beside its lead's decode, which the budget holds
        return StepRoom(lone, measured, bulk, bulk)
    if measured is None:
        if settling:
            return StepRoom(cfg.max_num_batched_tokens)
        return StepRoom(
            min(cfg.max_num_batched_tokens, max(cfg.max_num_batched_tokens_decoding, len(running)))
        )
    # What the leads' decodes read: a lead still computing its prompt decodes nothing yet.
    context = sum(r.num_tokens for r in leads.values() if r.num_computed_tokens >= r.num_prompt_tokens)
    budget = measured.tokens(len(leads), context, first_waiting)
    budget = (
        cfg.max_num_batched_tokens if settling else min(cfg.max_num_batched_tokens, max(budget, len(leads)))
    )
    # Bulk work's room is the stretch's alone: the decoding floor's tokens may cost several decode steps.
    stretched = measured.room(len(leads), context, stretch=min(measured.stretch, BULK_STRETCH))
    most = measured.tokens(len(leads), context) if stretched is None else len(leads) + int(stretched)
    bulk = max(1, min(budget, most) - len(leads))
    whole = prompt_caps(cfg)[1]
    # Other clients' prompts go in: ones that cost no more than a step, with a seat free for them.
    starting = waiting.short_tokens and len(running) < cfg.max_num_seqs
    starting = starting and measured.price(0, waiting.shortest) <= whole and measured.stand_aside()
    if not decoding:  # no stream to hold back: a lone prompt's step, a token while others' prompts go in
        bulk = 1 if starting else max(bulk, min(budget, measured.lone_tokens()))
    elif measured.probing() or starting:
        bulk = 0  # the fit's look at the streams' own step; or other clients' prompts go in beside them
    room = StepRoom(budget, measured, bulk, bulk)
    prompts = [r for r in leads.values() if r.num_computed_tokens < r.num_prompt_tokens]
    long = any(room.long(r, max(r.num_cached_tokens, 0), whole) for r in prompts)
    if len(leads) < len(running) and (long or waiting.first_tokens > whole) and bulk > 1:
        return room._replace(chunks=bulk // 2, samples=bulk - bulk // 2)
    return room

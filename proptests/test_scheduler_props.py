"""The Scheduler driven by a fake model runner, under tiny pools and budgets that force chunking,
preemption and prefix hits, with step budgets measured from random step times, and with n-gram drafts
that the fake runner accepts or rejects at random, under either scheduling policy (requests of a few
priorities, arriving out of order too), and with the steps of several pipeline stages in flight.

The fake runner keeps its own per-request state from SchedulerOutputs alone (tokens, block table,
computed count), as the real one does, so the test also checks that the messages are sufficient:
its view must always match the scheduler's.
"""

import collections
import itertools
import random
from dataclasses import dataclass

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.config import SpeculativeConfig
from engine.params import SamplingParams
from engine.proposer import NgramProposer
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step import ModelRunnerOutput

EOS = 0
STOP_IDS = [3, 4]
prompts = st.builds(
    lambda prefix, suffix: list(prefix) + suffix,
    st.sampled_from([(), (5, 6, 7, 8), (5, 6, 7, 8, 9, 9, 9, 9), (1,) * 7]),
    st.lists(st.integers(1, 9), min_size=1, max_size=8),
)


@dataclass
class RunnerState:
    tokens: list[int]
    block_ids: list[int]
    computed: int


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 4]),
        num_blocks=st.integers(2, 16),
        budget=st.integers(1, 24),
        max_seqs=st.integers(1, 4),
        max_model_len=st.integers(2, 48),
        chunked=st.booleans(),
        caching=st.booleans(),
        threshold=st.sampled_from([0, 0, 1, 3]),
        decoding_cap=st.sampled_from([0, 0, 1, 5]),
        stretch=st.sampled_from([0.0, 0.0, 2.0]),
        settling=st.sampled_from([0, 1, 3]),
        drafts=st.sampled_from([0, 0, 1, 3]),
        policy=st.sampled_from(["fcfs", "priority"]),
        stages=st.sampled_from([1, 1, 2, 3]),
        seed=st.integers(0, 2**16),
    )
    def setup(
        self,
        block_size,
        num_blocks,
        budget,
        max_seqs,
        max_model_len,
        chunked,
        caching,
        threshold,
        decoding_cap,
        stretch,
        settling,
        drafts,
        policy,
        stages,
        seed,
    ):
        self.cfg = SchedulerConfig(
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            block_size=block_size,
            enable_prefix_caching=caching,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold,
            max_num_batched_tokens_decoding=decoding_cap,
            step_stretch=stretch,
            settling_tokens=settling,
            scheduling_policy=policy,
            pipeline_parallel_size=stages,
        )
        spec = drafts and SpeculativeConfig(
            num_speculative_tokens=drafts, prompt_lookup_min=1, prompt_lookup_max=2
        )
        self.sched = Scheduler(self.cfg, eos_token_id=EOS, proposer=NgramProposer(spec) if drafts else None)
        self.rng, self.drafts = random.Random(seed), drafts
        self.runner: dict[str, RunnerState] = {}
        # Pipeline stages: steps the fake runner has computed whose outputs the scheduler has not had yet.
        self.in_flight: collections.deque = collections.deque()
        self.finished: dict[str, str] = {}  # request id -> finish reason
        self.emitted: dict[str, list[int]] = {}  # request id -> tokens streamed in outputs
        self.next_id = 0
        self.admitted: dict[str, int] = {}  # request id -> its latest admission's number
        self.admissions = itertools.count()

    # ---- the fake runner and one engine step ---------------------------------------------------

    def step(self) -> None:
        cfg, sched = self.cfg, self.sched
        out = sched.schedule()
        sched_tokens = out.num_scheduled_tokens
        if sched.step_budget is not None:  # measured steps: times at random, so any fit prices the work
            seconds = self.rng.uniform(0.001, 0.1) * (1 + len(sched_tokens))
            sched.step_budget.observe_step(out, seconds, sched.requests)
        # A step that preempts admits no one: every request running now was running when the victims went.
        for victim in [sched.requests[rid] for rid in out.finished_req_ids if rid in sched.requests]:
            assert victim.status == RequestStatus.PREEMPTED
            assert all(self.preemption_rank(r) < self.preemption_rank(victim) for r in sched.running)
            event(f"preempted ({self.cfg.scheduling_policy})")
        assert out.total_num_scheduled_tokens == sum(sched_tokens.values()) <= cfg.max_num_batched_tokens
        assert len(sched_tokens) <= cfg.max_num_seqs
        assert all(n > 0 for n in sched_tokens.values())
        for rid in out.finished_req_ids:
            self.runner.pop(rid, None)
        for new in out.new_reqs:
            assert new.req_id not in self.runner
            req = sched.requests[new.req_id]
            assert new.seed == req.seed and new.num_prompt_tokens == req.num_prompt_tokens
            if new.num_computed_tokens:
                event("prefix-cache hit")
            self.admitted[new.req_id] = next(self.admissions)
            self.runner[new.req_id] = RunnerState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in out.cached_reqs:
            state = self.runner[cached.req_id]
            assert cached.num_computed_tokens == state.computed
            state.block_ids.extend(cached.new_block_ids)
            state.tokens.extend(cached.new_token_ids)
            if cfg.pipeline_parallel_size > 1:  # scheduled with no token in flight, and sent every one
                assert state.tokens == sched.requests[cached.req_id].all_token_ids
            else:
                assert not cached.new_token_ids
        assert {n.req_id for n in out.new_reqs} | {c.req_id for c in out.cached_reqs} == set(sched_tokens)

        req_ids, sampled = [], []
        for rid, n in sched_tokens.items():
            state = self.runner[rid]
            assert state.block_ids == sched.kv_cache_manager.get_block_ids(rid)
            drafts = out.spec_tokens.get(rid, [])
            end = state.computed + n
            assert end <= len(state.tokens) + len(drafts), "computing tokens that are not known yet"
            assert end <= len(state.block_ids) * cfg.block_size, "a scheduled token without a slot"
            assert 0 not in state.block_ids
            if drafts:
                assert n == 1 + len(drafts) and state.computed + 1 == len(state.tokens)
                event("verify")
            state.computed = end
            req_ids.append(rid)
            if end - len(drafts) == len(state.tokens):
                # Each position's token: the draft (accepted) or any token; the first differing one ends it.
                emitted = []
                for d in [*drafts, None]:
                    emitted.append(d if d is not None and self.rng.random() < 0.6 else self.token())
                    if emitted[-1] != d:
                        break
                state.computed -= len(drafts) + 1 - len(emitted)  # rejected drafts' KV is computed again
                if cfg.pipeline_parallel_size == 1:  # else the scheduler sends them with the next step
                    state.tokens.extend(emitted)
                sampled.append(emitted)
            else:
                sampled.append([])
        # As the engine core: up to a step per stage in flight, the oldest answered first.
        self.in_flight.append((out, ModelRunnerOutput(req_ids, sampled)))
        if len(self.in_flight) < cfg.pipeline_parallel_size and not out.is_empty:
            return
        outputs = sched.update_from_output(*self.in_flight.popleft())

        for o in outputs:
            self.emitted.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.check_finish(o.request_id, o.finish_reason, o.stop_reason)
        for rid, state in self.runner.items():
            if rid in sched.requests and cfg.pipeline_parallel_size == 1:
                assert sched.requests[rid].all_token_ids == state.tokens

    def token(self) -> int:
        r = self.rng.random()
        return EOS if r < 0.08 else self.rng.choice(STOP_IDS) if r < 0.16 else self.rng.randint(1, 9)

    def check_finish(self, rid: str, reason: str, stop_reason) -> None:
        req = self.requests_by_id[rid]
        sp, outs = req.sampling_params, req.output_token_ids
        assert rid not in self.sched.requests and rid not in self.finished
        assert self.emitted.get(rid, []) == outs
        self.finished[rid] = reason
        event(f"finish: {reason}")
        if reason == "abort":
            return
        assert req.num_output_tokens >= 1
        for i, t in enumerate(outs[:-1]):  # nothing before the last token should have stopped it
            if i + 1 >= sp.min_tokens:
                assert t not in sp.stop_token_ids and (sp.ignore_eos or t != EOS)
        assert len(outs) <= (sp.max_tokens or 10**9) and req.num_tokens <= self.sched.max_len
        if reason == "length":
            assert len(outs) == sp.max_tokens or req.num_tokens == self.sched.max_len
        else:
            assert reason == "stop" and len(outs) >= sp.min_tokens
            if stop_reason is None:
                assert outs[-1] == EOS and not sp.ignore_eos
            else:
                assert outs[-1] == stop_reason in sp.stop_token_ids

    # ---- rules ---------------------------------------------------------------------------------

    @rule(
        prompt=prompts,
        max_tokens=st.one_of(st.none(), st.integers(1, 12)),
        min_tokens=st.integers(0, 3),
        stop=st.booleans(),
        ignore_eos=st.booleans(),
        priority=st.integers(-1, 2),
        arrival=st.integers(0, 3),
    )
    def add(self, prompt, max_tokens, min_tokens, stop, ignore_eos, priority, arrival, parent=None, index=0):
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=STOP_IDS if stop else [],
            ignore_eos=ignore_eos,
            priority=priority,
        )
        rid = f"r{self.next_id}"
        self.next_id += 1
        # Front ends' clocks disagree: arrival times need not grow.
        req = Request(rid, prompt, params, arrival_time=float(arrival), parent_id=parent, sample_index=index)
        cfg, n = self.cfg, len(prompt)
        fits = n < cfg.max_model_len and n <= (cfg.num_blocks - 1) * cfg.block_size
        fits &= cfg.enable_chunked_prefill or n <= cfg.max_num_batched_tokens
        try:
            self.sched.add_request(req)
        except ValueError:
            assert not fits
            event("add: rejected")
            return
        assert fits
        self.requests_by_id[rid] = req

    @rule(
        prompt=prompts,
        copies=st.integers(2, 4),
        max_tokens=st.integers(1, 12),
        priority=st.integers(-1, 2),
        arrival=st.integers(0, 3),
    )
    def burst(self, prompt, copies, max_tokens, priority, arrival) -> None:
        """One request's samples (n = copies) sharing its prompt: prefix hits and memory pressure."""
        parent = f"p{self.next_id}"
        for i in range(copies):
            self.add(prompt, max_tokens, 0, False, True, priority, arrival, parent, i)

    @rule()
    def one_step(self) -> None:
        self.step()

    @rule(n=st.integers(2, 6))
    def steps(self, n) -> None:
        for _ in range(n):
            self.step()

    @rule(data=st.data())
    def abort(self, data) -> None:
        ids = [*sorted(self.requests_by_id), "unknown"]
        picked = data.draw(st.lists(st.sampled_from(ids), max_size=3))
        live = [rid for rid in dict.fromkeys(picked) if rid in self.sched.requests]
        outputs = self.sched.abort_requests(picked)
        assert [o.request_id for o in outputs] == live
        for o in outputs:
            assert o.finish_reason == "abort" and o.new_token_ids == []
            self.check_finish(o.request_id, "abort", None)
        assert self.sched.abort_requests(picked) == []  # idempotent

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.sched.reset_prefix_cache() == (not self.sched.running)

    def preemption_rank(self, req: Request) -> tuple:
        """The running request of the highest rank is preempted first: under fcfs the latest admitted,
        under priority the lowest priority, then the latest arrival, then the latest admitted."""
        admitted = self.admitted[req.request_id]
        if self.cfg.scheduling_policy == "priority":
            return req.priority, req.sample_index, req.arrival_time, admitted
        return req.sample_index, admitted

    def queue_rank(self, req: Request) -> tuple:
        """The waiting queue's order: by priority, sample index and arrival under priority, by sample index
        under fcfs; then, among equals, preempted requests ahead of those never admitted, which keep the
        order they were added in."""
        fresh = req.status == RequestStatus.WAITING
        if self.cfg.scheduling_policy == "priority":
            by_policy = (req.priority, req.sample_index, req.arrival_time)
        else:
            by_policy = (req.sample_index,)
        return (*by_policy, fresh, int(req.request_id[1:]) if fresh else 0)

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def queues_and_blocks_are_consistent(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched, kv = self.sched, self.sched.kv_cache_manager
        pool = kv.block_pool
        running, waiting = sched.running, [r for r in sched.waiting if not r.status.finished]
        assert len(waiting) == len(sched.waiting)
        first = [r for r in waiting if r.sample_index == 0]
        # Their tokens as queued: a sample preempted with a step in flight gains its token while it waits.
        assert sched.waiting.num_first == len(first)
        assert sum(r.num_prompt_tokens for r in first) <= sched.waiting.first_tokens
        assert sched.waiting.first_tokens <= sum(r.num_tokens for r in first)
        ranks = [self.queue_rank(r) for r in waiting]
        assert ranks == sorted(ranks)
        assert len(running) <= self.cfg.max_num_seqs
        assert {r.request_id for r in running + waiting} == set(sched.requests)
        assert len(running) + len(waiting) == len(sched.requests)
        for r in running:
            assert r.status == RequestStatus.RUNNING
            # Drafts a step in flight verifies are computed already (pipeline stages: while it runs).
            in_flight = self.drafts if self.cfg.pipeline_parallel_size > 1 else 0
            assert 0 < r.num_computed_tokens <= r.num_tokens + in_flight and r.num_tokens < sched.max_len
            assert len(kv.get_block_ids(r.request_id)) * self.cfg.block_size >= r.num_computed_tokens
            # No block hash covers a drafted token: a hashed block of the table holds the request's own.
            for i, block in enumerate(kv.req_to_blocks[r.request_id]):
                if block.block_hash is not None:
                    assert i < len(r.block_hashes) and block.block_hash == r.block_hashes[i]
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0 and kv.get_block_ids(r.request_id) == []
        held: dict[int, int] = {}
        for r in running:
            for bid in kv.get_block_ids(r.request_id):
                held[bid] = held.get(bid, 0) + 1
        for b in pool.blocks[1:]:
            assert b.ref_cnt == held.get(b.block_id, 0)
        assert pool.get_num_free_blocks() + len(held) == pool.num_blocks - 1

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        # The first running request can always get its blocks and makes progress every step, so
        # each request finishes within about max_len steps once it is first in line.
        bound = (10 + (sched.max_len + 2) * (len(sched.requests) + 1)) * self.cfg.pipeline_parallel_size
        for _ in range(bound):
            if not sched.has_unfinished_requests() and not self.in_flight:
                break
            self.step()
        assert not sched.has_unfinished_requests(), f"not done after {bound} steps: {sched.requests}"
        assert set(self.finished) == set(self.requests_by_id)
        pool = sched.kv_cache_manager.block_pool
        assert sched.stats().kv_cache_usage == 0.0
        assert pool.get_num_free_blocks() == pool.num_blocks - 1
        self.step()  # delivers the last finished ids to the runner
        assert not self.runner
        if sched.stats().num_preemptions:
            event("preemptions happened")

    requests_by_id: dict[str, Request]

    def __init__(self) -> None:
        super().__init__()
        self.requests_by_id = {}


TestScheduler = SchedulerMachine.TestCase

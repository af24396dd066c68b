import itertools
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future

import pytest

from engine.params import SamplingParams
from engine.request import Request, RequestStatus
from engine.request_queue import RequestQueue
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step import ModelRunnerOutput, SchedulerOutput
from engine.step_budget import BULK_STRETCH, StepBudget, query_key_pairs, step_tokens
from engine.structured_output import Grammar

EOS = 0
_fresh = itertools.count(1000)


def make(**kw) -> Scheduler:
    cfg = dict(max_model_len=256, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), eos_token_id=EOS)


def add(s: Scheduler, rid: str, prompt: list[int] | int, **params) -> Request:
    if isinstance(prompt, int):
        prompt = [next(_fresh) for _ in range(prompt)]  # fresh tokens: no accidental prefix hits
    params.setdefault("max_tokens", 100)
    r = Request(rid, prompt, SamplingParams(**params))
    s.add_request(r)
    return r


def step(s: Scheduler, token: int | Callable[[str], int] = 7, logprobs: bool = False):
    """schedule() + a fake runner that samples for every request whose chunk reached its end."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sample = token if callable(token) else (lambda _rid: token)
    toks = [[sample(r)] if s.requests[r].num_computed_tokens == s.requests[r].num_tokens else [] for r in ids]
    lps = [[(-0.5, [(t[0], -0.5)])] if t else None for t in toks] if logprobs else None
    return out, s.update_from_output(out, ModelRunnerOutput(ids, toks, lps))


def by_id(outputs) -> dict:
    return {o.request_id: o for o in outputs}


# ---- admission and rejection ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "kw", "match"),
    [
        (0, {}, "empty"),
        (16, dict(max_model_len=16), "max_model_len"),
        (17, dict(num_blocks=5), "KV blocks"),  # 4 usable blocks of 4 tokens
        (65, dict(enable_chunked_prefill=False), "chunked prefill"),
    ],
)
def test_prompts_that_can_never_fit_are_rejected(prompt, kw, match):
    s = make(**kw)
    with pytest.raises(ValueError, match=match):
        add(s, "a", prompt)
    assert not s.has_unfinished_requests()


def test_largest_fitting_prompts_are_accepted():
    add(make(max_model_len=16), "a", 15)
    add(make(num_blocks=5), "a", 16)
    add(make(enable_chunked_prefill=False), "a", 64)


def test_duplicate_request_id_is_rejected():
    s = make()
    add(s, "a", 4)
    with pytest.raises(ValueError, match="already"):
        add(s, "a", 4)


def test_seed_is_resolved_at_add_time():
    s = make()
    assert add(s, "a", 4, seed=123).seed == 123
    b = add(s, "b", 4)
    assert isinstance(b.seed, int) and 0 <= b.seed < 2**63
    out, _ = step(s)
    assert {n.req_id: n.seed for n in out.new_reqs} == {"a": 123, "b": b.seed}


# ---- budgets and chunks -----------------------------------------------------------------------


def test_budget_is_split_over_waiting_requests_fcfs():
    s = make(max_num_batched_tokens=12)
    add(s, "a", 10)
    add(s, "b", 10)
    out, outs = step(s)
    assert out.num_scheduled_tokens == {"a": 10, "b": 2}
    assert [o.request_id for o in outs] == ["a"]  # b is still prefilling
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 8}  # running first: a's decode, then b's chunk
    assert [c.num_computed_tokens for c in out.cached_reqs] == [10, 2]
    assert out.total_num_scheduled_tokens == 9


def test_steps_that_carry_decodes_are_capped_and_a_lone_prefill_is_not():
    s = make(max_num_batched_tokens=40, max_num_batched_tokens_decoding=8)
    add(s, "a", 30)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 30}  # nobody decodes yet: the whole budget
    add(s, "b", 30)
    sizes = []
    while s.requests["b"].num_computed_tokens < 30:
        out, _ = step(s)
        assert out.num_scheduled_tokens["a"] == 1 and out.total_num_scheduled_tokens <= 8
        sizes.append(out.num_scheduled_tokens.get("b", 0))
    assert sizes == [7, 7, 7, 7, 2]  # b's prompt in chunks beside a's decodes


def test_streams_in_their_first_tokens_leave_a_burst_the_whole_budget():
    s = make(max_num_batched_tokens=40, max_num_batched_tokens_decoding=8, settling_tokens=3)
    add(s, "a", 30)
    add(s, "b", 30)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 30, "b": 10}
    out, _ = step(s)  # a streams, one token in: b's rest at the whole budget
    assert out.num_scheduled_tokens == {"a": 1, "b": 20}
    add(s, "c", 30)
    out, _ = step(s)  # a two tokens in, b one
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 30}
    add(s, "d", 30)
    out, _ = step(s)  # a has settled: the step is capped again
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 5}


def test_decoding_cap_never_starves_running_decodes():
    s = make(max_num_batched_tokens=64, max_num_batched_tokens_decoding=2, max_num_seqs=4)
    for rid in "abcd":
        add(s, rid, 3)
    step(s)
    out, _ = step(s)
    assert out.num_scheduled_tokens == dict.fromkeys("abcd", 1)


def test_long_prefill_token_threshold_caps_chunks():
    s = make(long_prefill_token_threshold=4)
    add(s, "a", 10)
    sizes = []
    for _ in range(4):
        out, _ = step(s)
        sizes.append(out.num_scheduled_tokens["a"])
    assert sizes == [4, 4, 2, 1]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_it_fits():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    add(s, "a", 10, max_tokens=2)
    add(s, "b", 10)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 10}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1}  # 9 left but b needs 10 in one go: it waits
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 10}
    s2 = make(max_num_batched_tokens=12, enable_chunked_prefill=False)
    add(s2, "a", 10)
    add(s2, "b", 2)
    out, _ = step(s2)
    assert out.num_scheduled_tokens == {"a": 10, "b": 2}


def test_max_num_seqs():
    s = make(max_num_seqs=2)
    for i in range(3):
        add(s, f"r{i}", 3)
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(s.waiting) == 1


def test_scheduled_tokens_have_blocks():
    s = make(max_num_batched_tokens=5)
    add(s, "a", 9)
    out, _ = step(s)
    assert out.new_reqs[0].block_ids == s.kv_cache_manager.get_block_ids("a")
    assert len(out.new_reqs[0].block_ids) == 2  # 5 tokens in blocks of 4
    out, _ = step(s)
    assert out.cached_reqs[0].new_block_ids == s.kv_cache_manager.get_block_ids("a")[2:]


# ---- prefix caching ---------------------------------------------------------------------------


def test_prefix_hits_skip_cached_tokens():
    s = make()
    add(s, "a", list(range(1, 11)))
    _, outs = step(s)
    assert outs[0].num_cached_tokens == 0
    add(s, "b", list(range(1, 11)))
    out, outs = step(s)
    (new,) = out.new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 8
    assert out.num_scheduled_tokens["b"] == 2
    assert by_id(outs)["b"].num_cached_tokens == 8
    _, outs = step(s)
    assert by_id(outs)["b"].num_cached_tokens == 0  # reported on the first output only
    st = s.stats()
    assert st.prefix_cache_queries == 20 and st.prefix_cache_hits == 8


# ---- preemption -------------------------------------------------------------------------------


def test_preemption_takes_the_most_recently_admitted_and_keeps_its_tokens():
    s = make(num_blocks=7, max_num_batched_tokens=64)  # 6 usable blocks of 4
    for rid in ("a", "b", "c"):
        add(s, rid, 4, ignore_eos=True)  # one block each, then decode
    step(s)
    assert [r.request_id for r in s.running] == ["a", "b", "c"]
    # Each request gets a second block, then a and b need a third; c must give way.
    out, _ = step(s)
    out, _ = step(s)
    for _ in range(3):
        out, _ = step(s)
    assert out.finished_req_ids == {"c"}
    c = s.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert c.num_computed_tokens == 0 and c.num_output_tokens == 5  # its tokens are kept
    assert list(s.waiting) == [c] and [r.request_id for r in s.running] == ["a", "b"]
    assert "c" not in out.num_scheduled_tokens and not out.new_reqs
    assert s.stats().num_preemptions == 1


def test_preempted_request_goes_to_the_front_and_resumes_with_all_tokens():
    s = make(num_blocks=5, max_num_batched_tokens=64)  # 4 usable blocks of 4
    add(s, "a", 4, ignore_eos=True, max_tokens=8)
    add(s, "b", 4, ignore_eos=True, max_tokens=8)
    add(s, "c", 2, ignore_eos=True, max_tokens=1)  # waits behind b; a preempted b must go before it
    preempted_at = None
    for i in range(20):
        out, _ = step(s)
        if "b" in out.finished_req_ids and preempted_at is None:
            preempted_at = i
            assert [r.request_id for r in s.waiting][:1] == ["b"]
        if preempted_at is not None and any(n.req_id == "b" for n in out.new_reqs):
            (new,) = [n for n in out.new_reqs if n.req_id == "b"]
            b = s.requests["b"]
            assert new.token_ids == b.prompt_token_ids + b.output_token_ids[: len(new.token_ids) - 4]
            assert len(new.token_ids) > 4 and new.num_prompt_tokens == 4
            break
    assert preempted_at is not None


def test_last_running_request_preempts_itself():
    s = make(num_blocks=4, max_num_batched_tokens=64, long_prefill_token_threshold=4)  # 3 usable
    add(s, "a", 4, ignore_eos=True)
    add(s, "b", 8, ignore_eos=True)
    step(s)  # a: 4 tokens, b: 4-token chunk (threshold); 2 blocks used
    s.running.reverse()  # pretend b was admitted first so that a is the last one
    out, _ = step(s)  # b's second chunk takes the last block; a's decode then has none left
    assert "a" in out.finished_req_ids and s.requests["a"].status == RequestStatus.PREEMPTED
    assert set(out.num_scheduled_tokens) == {"b"}


def test_no_admission_in_a_step_that_preempted():
    s = make(num_blocks=5, long_prefill_token_threshold=4, enable_prefix_caching=False)  # 4 usable
    add(s, "a", 4, ignore_eos=True)
    add(s, "c", 11, ignore_eos=True)
    step(s)  # a: 4 (1 block), c: 4 (1 block)
    step(s)  # a's decode and c's next chunk take a block each: the pool is full
    out, _ = step(s)  # c's last chunk needs a block: c preempts itself, freeing 2
    assert out.finished_req_ids == {"c"} and s.kv_cache_manager.block_pool.get_num_free_blocks() == 2
    assert not out.new_reqs  # c's 4-token chunk would fit now, but not in this step
    out, _ = step(s)
    assert [n.req_id for n in out.new_reqs] == ["c"] and out.num_scheduled_tokens["c"] == 4


def test_everything_finishes_and_frees_under_memory_pressure():
    s = make(num_blocks=6, max_num_batched_tokens=8)
    for i in range(6):
        add(s, f"r{i}", 5 + i, ignore_eos=True, max_tokens=10)
    for _ in range(500):
        step(s)
        if not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests()
    assert s.stats().num_preemptions > 0
    assert s.kv_cache_manager.usage == 0.0


def test_request_outgrowing_the_pool_stops_with_length():
    s = make(num_blocks=3, max_model_len=1000)  # 2 blocks of 4: KV for 8 tokens
    add(s, "a", 5, ignore_eos=True, max_tokens=None)
    assert run_until_done(s) == {"a": ("length", None, [7] * 4)}  # the 9th token needs no KV


# ---- stops ------------------------------------------------------------------------------------


def run_until_done(s: Scheduler, token=7, limit: int = 100) -> dict:
    final = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(limit):
        _, outs = step(s, token)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = (o.finish_reason, o.stop_reason, tokens[o.request_id])
        if not s.has_unfinished_requests():
            return final
    raise AssertionError("did not finish")


def test_eos_stops():
    s = make()
    add(s, "a", 4)
    assert run_until_done(s, token=EOS) == {"a": ("stop", None, [EOS])}


def test_ignore_eos_runs_to_max_tokens():
    s = make()
    add(s, "a", 4, ignore_eos=True, max_tokens=3)
    assert run_until_done(s, token=EOS) == {"a": ("length", None, [EOS] * 3)}


def test_stop_token_ids():
    s = make()
    add(s, "a", 4, stop_token_ids=[5, 9])
    seq = iter([3, 9, 4])
    assert run_until_done(s, token=lambda _: next(seq)) == {"a": ("stop", 9, [3, 9])}


def test_min_tokens_defers_eos_and_stop_ids():
    s = make()
    add(s, "a", 4, min_tokens=3, stop_token_ids=[9])
    seq = iter([EOS, 9, EOS, 5])
    assert run_until_done(s, token=lambda _: next(seq)) == {"a": ("stop", None, [EOS, 9, EOS])}


def test_min_tokens_does_not_override_length_limits():
    s = make(max_model_len=6)
    add(s, "a", 4, min_tokens=5, max_tokens=5)
    assert run_until_done(s, token=EOS)["a"][0] == "length"


def test_max_tokens():
    s = make()
    add(s, "a", 4, max_tokens=2)
    assert run_until_done(s) == {"a": ("length", None, [7, 7])}


def test_eos_on_the_last_allowed_token_is_a_stop():
    s = make()
    add(s, "a", 4, max_tokens=2)
    seq = iter([7, EOS])
    assert run_until_done(s, token=lambda _: next(seq)) == {"a": ("stop", None, [7, EOS])}


def test_max_model_len():
    s = make(max_model_len=7)
    add(s, "a", 4, max_tokens=None)
    assert run_until_done(s) == {"a": ("length", None, [7, 7, 7])}


def test_finished_request_frees_blocks_and_is_reported_once():
    s = make()
    add(s, "a", 4, max_tokens=1)
    out, outs = step(s)
    assert outs[0].finished and s.kv_cache_manager.usage == 0.0
    out, _ = step(s)
    assert out.finished_req_ids == {"a"} and out.is_empty
    out, _ = step(s)
    assert out.finished_req_ids == set()


def test_logprobs_are_passed_through():
    s = make()
    add(s, "a", 4, logprobs=1)
    _, outs = step(s, logprobs=True)
    assert outs[0].new_logprobs == [(-0.5, [(7, -0.5)])]


# ---- aborts -----------------------------------------------------------------------------------


def test_abort_is_idempotent_and_frees_blocks():
    s = make()
    add(s, "a", 6)
    add(s, "b", 6)
    add(s, "w", 6)
    step(s)
    s.running.remove(s.requests["w"])  # keep "w" waiting for the test
    s.kv_cache_manager.free(s.requests["w"])
    s.requests["w"].status = RequestStatus.WAITING
    s.requests["w"].num_computed_tokens = 0
    s.waiting.add(s.requests["w"])
    outs = s.abort_requests(["a", "w", "nope"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort"), ("w", "abort")]
    assert s.abort_requests(["a", "w"]) == []
    assert s.abort_requests("a") == []
    assert [r.request_id for r in s.running] == ["b"] and not s.waiting
    assert len(s.requests) == 1
    out, _ = step(s)
    assert out.finished_req_ids == {"a", "w"}
    assert set(out.num_scheduled_tokens) == {"b"}
    s.abort_requests(["b"])
    assert s.stats().kv_cache_usage == 0.0 and not s.has_unfinished_requests()


def test_output_for_a_request_aborted_mid_step_is_dropped():
    s = make()
    add(s, "a", 4)
    out = s.schedule()
    s.abort_requests(["a"])
    assert s.update_from_output(out, ModelRunnerOutput(["a"], [[7]])) == []
    assert s.kv_cache_manager.usage == 0.0


def test_reset_prefix_cache_and_stats():
    s = make()
    add(s, "a", list(range(1, 10)), max_tokens=1)
    step(s)
    st = s.stats()
    assert (st.num_running, st.num_waiting, st.kv_cache_usage) == (0, 0, 0.0)
    assert s.reset_prefix_cache() is True
    add(s, "b", list(range(1, 10)))
    out, _ = step(s)
    assert out.new_reqs[0].num_computed_tokens == 0
    assert s.reset_prefix_cache() is False  # b holds blocks


def test_out_is_empty_when_idle():
    s = make()
    out: SchedulerOutput = s.schedule()
    assert out.is_empty and not out.new_reqs and not out.cached_reqs


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_aborting_a_waiting_request_leaves_the_queue_in_place_until_half_of_it_is_stale(policy):
    s = make(max_num_seqs=2, scheduling_policy=policy)
    for i in range(10):
        add(s, f"r{i}", 6)
    assert [o.request_id for o in s.abort_requests(["r0", "r3"])] == ["r0", "r3"]
    assert s.waiting.num_stale == 2 and len(s.waiting) == 8 == s.stats().num_waiting  # no pass over the queue
    out, _ = step(s)
    assert sorted(out.num_scheduled_tokens) == ["r1", "r2"]  # the aborted one at the front is skipped
    s.abort_requests(["r4", "r5", "r6", "r7"])
    assert [r.request_id for r in s.waiting] == ["r8", "r9"] and len(s.waiting) == 2
    assert s.waiting.num_stale == 0  # compacted


# ---- overlapped scheduling -------------------------------------------------------------------


class FakeRunner:
    """The model runner's bookkeeping: its own copy of each request's tokens, extended by what it samples,
    and a 'model' whose next token is a function of all the tokens before it."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
        starts = {c.req_id: c.num_computed_tokens for c in so.cached_reqs}
        for new in so.new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            starts[new.req_id] = new.num_computed_tokens
        ids, sampled = list(so.num_scheduled_tokens), []
        for rid in ids:
            tokens, end = self.tokens[rid], starts[rid] + so.num_scheduled_tokens[rid]
            assert end <= len(tokens), "a step computes a position whose token the runner does not know"
            sampled.append([])
            if end == len(tokens):
                tokens.append((sum(tokens) * 31 + len(tokens)) % 23)  # 0 is EOS
                sampled[-1].append(tokens[-1])
        return ModelRunnerOutput(ids, sampled)


def drive(s: Scheduler, overlap: bool, abort_at: dict[int, str] | None = None) -> dict[str, list]:
    """Run every request to its end, the runner one step ahead of the scheduler's updates when `overlap`."""
    runner, got, in_flight, i = FakeRunner(), {}, None, 0
    while s.has_unfinished_requests() or in_flight is not None:
        if abort_at and i in abort_at:
            for o in s.abort_requests(abort_at[i]):
                got.setdefault(o.request_id, []).append(o.finish_reason)
        so = s.schedule()
        result = runner.execute(so)
        done, in_flight = (
            (in_flight, None if so.is_empty else (so, result)) if overlap else ((so, result), None)
        )
        for o in s.update_from_output(*done) if done is not None else []:
            got.setdefault(o.request_id, []).extend(
                [*o.new_token_ids, *([o.finish_reason] if o.finished else [])]
            )
        i += 1
        assert i < 10_000
    return got


def workload(overlap: bool) -> Scheduler:
    # 11 usable blocks of 4 tokens for up to 6 sequences: preemptions are certain.
    s = make(num_blocks=12, max_num_seqs=6, max_num_batched_tokens=16, async_scheduling=overlap)
    for k in range(10):
        add(s, f"r{k}", [1 + k, *range(2, 3 + k)], max_tokens=1 + 3 * k, ignore_eos=k % 3 == 0)
    return s


def test_overlapped_scheduling_gives_every_request_the_same_tokens_and_frees_every_block():
    results = {}
    for overlap in (False, True):
        s = workload(overlap)
        results[overlap] = drive(s, overlap)
        assert s.num_preemptions > 0
        assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 11 and not s.requests
        assert all(not r.num_output_placeholders for r in s.waiting)
    assert results[True] == results[False]
    ends = [tokens[-1] for tokens in results[True].values()]
    assert "stop" in ends and "length" in ends


def test_overlapped_scheduling_never_computes_past_max_tokens_and_aborts_cleanly():
    s = make(async_scheduling=True)
    add(s, "one", 5, max_tokens=1, ignore_eos=True)
    add(s, "long", 5, max_tokens=50, ignore_eos=True)
    got = drive(s, overlap=True, abort_at={6: "long"})
    assert got["one"][-1] == "length" and len(got["one"]) == 2  # one token, then its end
    assert got["long"][-1] == "abort"
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 63 and not s.requests


# ---- scheduling policy ------------------------------------------------------------------------

ARRIVALS = [("a", 0, 1.0), ("b", 5, 2.0), ("c", -1, 3.0), ("d", 5, 0.5), ("e", 0, 1.0)]  # id, priority, time


def admission_order(s: Scheduler) -> list[str]:
    order = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        order += [n.req_id for n in out.new_reqs]
    return order


@pytest.mark.parametrize(
    ("policy", "expected"), [("priority", ["c", "a", "e", "d", "b"]), ("fcfs", ["a", "b", "c", "d", "e"])]
)
def test_waiting_requests_go_by_priority_then_arrival_or_first_come_first_served(policy, expected):
    s = make(max_num_seqs=1, scheduling_policy=policy)
    for rid, priority, arrival in ARRIVALS:  # "e" ties with "a" in both: the insertion order decides
        sp = SamplingParams(priority=priority, max_tokens=1)
        s.add_request(Request(rid, [next(_fresh) for _ in range(3)], sp, arrival_time=arrival))
    assert [r.request_id for r in s.waiting] == expected
    assert admission_order(s) == expected


def run_until_preempted(s: Scheduler) -> Request:
    for _ in range(20):
        out, _ = step(s)
        if out.finished_req_ids:
            (rid,) = out.finished_req_ids
            return s.requests[rid]
    raise AssertionError("nothing was preempted")


@pytest.mark.parametrize(("policy", "victim"), [("priority", "a"), ("fcfs", "c")])
def test_preemption_takes_the_lowest_priority_running_request_under_priority(policy, victim):
    s = make(num_blocks=7, scheduling_policy=policy)  # 6 usable blocks of 4
    add(s, "a", 4, ignore_eos=True, priority=9)  # admitted first, yet the least urgent
    step(s)
    add(s, "b", 4, ignore_eos=True, priority=1)
    add(s, "c", 4, ignore_eos=True, priority=0)
    preempted = run_until_preempted(s)
    assert preempted.request_id == victim and preempted.status == RequestStatus.PREEMPTED
    assert sorted(r.request_id for r in s.running) == sorted({"a", "b", "c"} - {victim})
    if policy == "priority":  # kept in priority order: the next victim is the last one
        assert [r.request_id for r in s.running] == ["c", "b"]


def test_a_preempted_request_goes_back_at_its_own_priority_and_arrival():
    s = make(num_blocks=7, max_num_seqs=3, scheduling_policy="priority")
    add(s, "a", 4, ignore_eos=True, priority=9)
    step(s)
    add(s, "b", 4, ignore_eos=True, priority=1)
    add(s, "c", 4, ignore_eos=True, priority=0)
    add(s, "later", 4, ignore_eos=True, priority=9)  # no room: it waits while a runs
    assert run_until_preempted(s).request_id == "a"
    add(s, "urgent", 4, priority=2)
    assert [r.request_id for r in s.waiting] == ["urgent", "a", "later"]


def test_the_priority_queue_puts_back_what_it_popped_in_the_same_order():
    q = RequestQueue("priority")
    reqs = [Request(f"r{i}", [1], SamplingParams(priority=i % 2), arrival_time=1.0) for i in range(5)]
    for r in reqs:
        q.add(r)
    popped = [q.pop() for _ in range(3)]
    assert [r.request_id for r in popped] == ["r0", "r2", "r4"]
    q.prepend_all(popped)
    assert [r.request_id for r in q] == ["r0", "r2", "r4", "r1", "r3"]
    q.prepend(Request("back", [1], SamplingParams(priority=1), arrival_time=1.0))
    assert [q.pop().request_id for _ in range(len(q))] == ["r0", "r2", "r4", "back", "r1", "r3"]
    fcfs = RequestQueue("fcfs")  # a deque: priorities and arrival times play no part
    for r in reversed(reqs[:3]):
        fcfs.add(r)
    fcfs.prepend(reqs[3])
    fcfs.prepend(reqs[4])
    assert [r.request_id for r in fcfs] == ["r4", "r3", "r2", "r1", "r0"]


def test_the_queue_counts_the_short_unconstrained_first_samples_that_hold_bulk_work_back():
    """Of first samples, those of at most `long` tokens with no grammar still compiling count as short (the
    fewest tokens of them `shortest`), through pops, put-backs and aborts alike; further samples never."""
    q = RequestQueue("fcfs", long=8)
    short, longer = Request("s", [1] * 5, SamplingParams()), Request("l", [1] * 9, SamplingParams())
    compiling = Request("c", [1] * 2, SamplingParams(), grammar=Grammar(Future()))
    compiled = Future()
    compiled.set_exception(ValueError("bad"))  # done: a grammar that has compiled (or failed to) counts
    shorter = Request("t", [1] * 3, SamplingParams(), grammar=Grammar(compiled))
    further = Request("f", [1] * 2, SamplingParams(), parent_id="l", sample_index=1)
    for r in (short, longer, compiling, shorter, further):
        q.add(r)
    assert (q.num_first, q.first_tokens, q.short_tokens, q.shortest) == (4, 19, 8, 3)
    popped = q.pop()
    assert popped is short and (q.short_tokens, q.shortest) == (3, 3)
    q.prepend(popped)
    assert (q.short_tokens, q.shortest) == (8, 3)
    shorter.status = RequestStatus.FINISHED_ABORTED
    q.note_finished([shorter])
    assert (q.num_first, q.first_tokens, q.short_tokens, q.shortest) == (3, 16, 5, 5)
    assert [q.pop().request_id for _ in range(3)] == ["s", "l", "c"] and q.shortest == sys.maxsize


def samples(s: Scheduler, parent: str, prompt: list[int], n: int, **params) -> list[Request]:
    """A request's n samples, as the engine core queues them."""
    params.setdefault("max_tokens", 100)
    reqs = [
        Request(f"{parent}#{i}", prompt, SamplingParams(**params), parent_id=parent, sample_index=i)
        for i in range(n)
    ]
    for r in reqs:
        s.add_request(r)
    return reqs


def test_a_requests_samples_wait_behind_other_requests_first_samples_and_leave_them_seats():
    """Sample i waits behind every other request's sample i - 1, and samples past the first take no
    seat of the last quarter: a later request still gets in beside a request with many samples."""
    s = make(max_num_seqs=8)
    samples(s, "a", [next(_fresh) for _ in range(4)], 10)
    add(s, "b", 4)
    assert [r.request_id for r in s.waiting][:3] == ["a#0", "b", "a#1"] and s.waiting.num_first == 2
    out, _ = step(s)
    assert [r.req_id for r in out.new_reqs] == ["a#0", "b", "a#1", "a#2", "a#3", "a#4"]
    assert s.waiting.num_first == 0
    add(s, "c", 4)
    add(s, "d", 4)
    out, _ = step(s)
    assert [r.req_id for r in out.new_reqs] == ["c", "d"]  # the kept seats
    s.finish_requests(["a#9"], RequestStatus.FINISHED_ABORTED)
    assert len(s.waiting) == 4 and s.waiting.num_first == 0


def test_a_running_prompts_chunk_leaves_room_for_a_waiting_prompt_and_the_decodes_after_it():
    s = make(max_num_batched_tokens=64)
    add(s, "long", 200, ignore_eos=True)
    add(s, "short", 4, ignore_eos=True)
    assert step(s)[0].num_scheduled_tokens == {"long": 64}
    assert step(s)[0].num_scheduled_tokens == {"long": 60, "short": 4}
    assert step(s)[0].num_scheduled_tokens == {"long": 63, "short": 1}


def test_further_samples_are_priced_by_their_context_beside_other_requests_streams():
    """Measured: a step is 100 ms + 1 ms a row + 10 µs a context token + 1 ms a chunk token. Beside another
    request's stream, the further samples over a long prompt take only the room the leads' step leaves
    (each at the price of its context); alone, every sample decodes in every step; all finish."""
    s = make(
        max_model_len=4096,
        num_blocks=1200,
        max_num_batched_tokens=4096,
        max_num_batched_tokens_decoding=16,
        step_stretch=4.0,
        max_num_seqs=16,
    )
    for rows, context, chunk in [(r, r * c, t) for r in (1, 4, 8) for c in (10, 1000, 3000) for t in (0, 64)]:
        s.step_budget.observe(rows, context, chunk, 0.100 + 0.001 * rows + 1e-5 * context + 0.001 * chunk)
    a = samples(s, "a", [next(_fresh) for _ in range(2000)], 8, max_tokens=12, ignore_eos=True)
    while any(r.num_output_tokens == 0 for r in s.running) or s.waiting:
        step(s)
    out, _ = step(s)
    assert len(out.num_scheduled_tokens) == 8  # one request alone: all its samples
    b = add(s, "b", 8, max_tokens=40, ignore_eos=True)
    step(s)
    out, _ = step(s)
    a0 = a[0]
    bulk = s.step_budget.tokens(2, a0.num_tokens - 1 + b.num_tokens - 1, stretch=BULK_STRETCH) - 2
    expected = bulk // s.step_budget.price(a0.num_tokens - 1)
    further = [rid for rid in out.num_scheduled_tokens if rid not in ("a#0", "b")]
    assert {"a#0", "b"} <= set(out.num_scheduled_tokens) and 0 < len(further) == expected < 7
    while s.has_unfinished_requests():
        step(s)
    assert [r.num_output_tokens for r in a] == [12] * 8 and b.num_output_tokens == 40
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 1200 - 1


def test_a_step_is_observed_with_the_context_its_decodes_read_between_them(monkeypatch):
    """A's three samples decode over one 40-token prompt's pages, B over its own: of their context tokens
    the prompt's count once as distinct, and each sample's own past it (B's all of its own)."""
    s = make(max_num_batched_tokens_decoding=16, step_stretch=4.0)
    samples(s, "a", [next(_fresh) for _ in range(40)], 3, ignore_eos=True)
    add(s, "b", 8, ignore_eos=True)
    while any(r.num_output_tokens < 2 for r in s.running) or s.waiting:
        step(s)
    seen = []
    monkeypatch.setattr(s.step_budget, "observe", lambda *args: seen.append(args))
    a = [s.requests[f"a#{i}"].num_computed_tokens + 1 for i in range(3)]  # each decode's context
    b = s.requests["b"].num_computed_tokens + 1
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a#0": 1, "a#1": 1, "a#2": 1, "b": 1} and min(a) > 41
    s.step_budget.observe_step(out, 0.05, s.requests)
    assert seen == [(4, sum(a) + b, 0, 0.05, 0, 40 + sum(c - 40 for c in a) + b, 0)]


def test_a_step_that_serves_several_clients_is_remembered_by_the_time_it_ran():
    """A step of A's three samples served one client request, a step of A's and B's two: only the second
    is a reason to keep lone steps short (other clients are likely back soon)."""
    s = make(max_num_batched_tokens_decoding=16, step_stretch=4.0)
    samples(s, "a", [next(_fresh) for _ in range(40)], 3, ignore_eos=True)
    budget = s.step_budget
    out, _ = step(s)
    assert len(out.num_scheduled_tokens) == 3  # three requests of one client
    budget.observe_step(out, 0.05, s.requests)
    assert budget.shared_at == -math.inf
    add(s, "b", 8, ignore_eos=True)
    before = time.monotonic()
    out, _ = step(s)
    assert "b" in out.num_scheduled_tokens and len(out.num_scheduled_tokens) > 1
    budget.observe_step(out, 0.05, s.requests)
    assert before <= budget.shared_at <= time.monotonic()


class FixedPrices:
    """A measured budget that always says `tokens`, and prices a further sample's decode at `price`."""

    stretch = 4.0

    def __init__(self, tokens: int, price: int) -> None:
        self.tokens_, self.price_ = tokens, price

    def tokens(self, running: int, context: int = 0, waiting: int = 0, stretch: float | None = None) -> int:
        return self.tokens_

    def room(self, running: int, context: int = 0, waiting: int = 0, stretch: float | None = None) -> float:
        return self.tokens(running, context, waiting, stretch) - running

    def probing(self) -> bool:
        return False

    def stand_aside(self) -> bool:
        return True

    def price(self, start: int, n: int = 1, shared: int = 0) -> int:
        return self.price_ if n == 1 else n

    def most(self, start: int, room: int) -> int:
        return room  # the scheduler checks the price of what it takes


def test_priced_further_samples_leave_room_for_a_lead_behind_them():
    """A's first four samples are gone, so its lead is sample 4, behind B's further samples in the policy's
    order; at 3 tokens each, B#1..B#3 would take all 9 tokens left after B#0, none for A#4's decode."""
    s = make(max_num_batched_tokens_decoding=4, max_num_seqs=16)
    samples(s, "b", [next(_fresh) for _ in range(4)], 4, ignore_eos=True)
    samples(s, "a", [next(_fresh) for _ in range(4)], 5, ignore_eos=True)
    step(s)
    s.finish_requests([f"a#{i}" for i in range(4)], RequestStatus.FINISHED_ABORTED)
    s.step_budget = FixedPrices(10, 3)
    assert [r.request_id for r in s.running] == ["b#0", "b#1", "b#2", "b#3", "a#4"]
    for _ in range(3):
        assert set(step(s)[0].num_scheduled_tokens) == {"b#0", "b#1", "b#2", "a#4"}
    s.step_budget = FixedPrices(11, 3)  # room for all
    assert set(step(s)[0].num_scheduled_tokens) == {"b#0", "b#1", "b#2", "b#3", "a#4"}


class WaitingWidens(FixedPrices):
    """`tokens` more room for each waiting first sample."""

    def tokens(self, running: int, context: int = 0, waiting: int = 0, stretch: float | None = None) -> int:
        return self.tokens_ * (1 + waiting)


def test_a_step_that_lets_another_clients_prompt_in_carries_no_further_sample():
    """B's lead and A's samples decode (four further ones running, 3 tokens each: two fit the 6 tokens the
    leads' step leaves); then C arrives. Its wait doubles the step's budget, which its prompt may use, but
    none of it goes to A's further samples: the step that lets C in carries none, the next one again (C's
    decode is a lead's now)."""
    s = make(max_num_batched_tokens_decoding=4, max_num_seqs=8)
    add(s, "b", 4, ignore_eos=True)
    samples(s, "a", [next(_fresh) for _ in range(4)], 6, ignore_eos=True)
    step(s)
    s.step_budget = WaitingWidens(8, 3)
    assert {r.request_id for r in s.running} == {"b", "a#0", "a#1", "a#2", "a#3", "a#4"}
    assert len(set(step(s)[0].num_scheduled_tokens) - {"a#0", "b"}) == 2
    add(s, "c", 2)
    assert set(step(s)[0].num_scheduled_tokens) == {"a#0", "b", "c"}
    scheduled = set(step(s)[0].num_scheduled_tokens)
    assert {"a#0", "b", "c"} <= scheduled and len(scheduled - {"a#0", "b", "c"}) == 1


class BulkStretch(FixedPrices):
    """`tokens` at the budget's stretch, `bulk` at a smaller one."""

    def __init__(self, tokens: int, bulk: int, price: int = 1) -> None:
        super().__init__(tokens, price)
        self.bulk = bulk

    def tokens(self, running: int, context: int = 0, waiting: int = 0, stretch: float | None = None) -> int:
        return self.tokens_ if stretch is None else self.bulk


@pytest.mark.parametrize("settling", [0, 3], ids=["settled", "settling"])
def test_a_chunk_that_cannot_end_its_prompt_is_bulk_and_a_shorter_prompt_goes_past_it(settling):
    """Beside B's stream a step may take 40 tokens (settling: the whole 64, a burst's), bulk work 9 (8
    beside B's decode): the short prompt behind the long ones goes in whole at once, in a step that carries
    no bulk work; then the long prompts get their bulk room, the first of them."""
    s = make(
        max_num_batched_tokens_decoding=4,
        settling_tokens=settling,
        max_num_seqs=8,
        max_model_len=512,
        num_blocks=128,
    )
    add(s, "b", 4, ignore_eos=True)
    step(s)
    s.step_budget = BulkStretch(40, 9)
    add(s, "long", 100)
    add(s, "longer", 200)
    add(s, "short", 20)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 1, "short": 20}
    assert [r.request_id for r in s.waiting] == ["long", "longer"]  # still first in line
    out, _ = step(s)  # two leads now: 7 tokens of bulk, all the first long prompt's
    assert out.num_scheduled_tokens == {"b": 1, "short": 1, "long": 7}


def test_further_samples_leave_half_the_bulk_room_to_a_long_prompt():
    """B's stream and A's samples decode; bulk work may take 12 tokens less one a lead, a further sample's
    decode costs 5. Alone, two further samples take all 10; while a prompt longer than a step waits or goes
    in, one sample decodes each step and the prompt takes the other half of the room until it is in."""
    s = make(max_num_batched_tokens_decoding=4, max_num_seqs=16, max_model_len=512, num_blocks=256)
    add(s, "b", 4, ignore_eos=True)
    samples(s, "a", [next(_fresh) for _ in range(4)], 6, ignore_eos=True, max_tokens=200)
    step(s)
    s.step_budget = BulkStretch(40, 12, price=5)
    assert len(set(step(s)[0].num_scheduled_tokens) - {"a#0", "b"}) == 2
    add(s, "long", 100)
    chunks = []
    while s.requests["long"].num_computed_tokens < 100:  # bulk to its end: the whole costs over a step
        scheduled = step(s)[0].num_scheduled_tokens
        assert len(set(scheduled) - {"a#0", "b", "long"}) == 1
        chunks.append(scheduled["long"])
    assert chunks[0] == 5 and set(chunks[1:-1]) == {4} and chunks[-1] == 3  # 10 // 2, then 9 // 2
    while s.requests["long"].num_output_tokens == 0:
        step(s)


def test_under_priority_a_first_sample_behind_a_further_one_gets_a_kept_seat():
    s = make(max_num_seqs=4, scheduling_policy="priority")
    add(s, "x", 4, priority=0)
    add(s, "y", 4, priority=0)
    add(s, "z", 4, priority=0)
    step(s)  # three running: the last seat is kept for first samples
    samples(s, "a", [next(_fresh) for _ in range(4)], 2, priority=0)
    s.finish_requests(["a#0"], RequestStatus.FINISHED_ABORTED)
    add(s, "c", 4, priority=1)  # less urgent, so behind a#1 in the queue
    assert [r.request_id for r in s.waiting] == ["a#1", "c"]
    out, _ = step(s)
    assert [r.req_id for r in out.new_reqs] == ["c"] and [r.request_id for r in s.waiting] == ["a#1"]


class DeepChunks(FixedPrices):
    """A chunk costs a token more for each token of depth it starts at; a lone request's step is `tokens`."""

    def price(self, start: int, n: int = 1, shared: int = 0) -> int:
        return n + start

    def most(self, start: int, room: int) -> int:
        return max(0, room - start)

    def lone_tokens(self) -> int:
        return self.tokens_


def test_room_held_for_a_prompt_that_cannot_get_blocks_does_not_idle_the_running_one():
    """P's prompt holds every block, two tokens short of its end; W waits. The room a step holds for W's
    first tokens leaves too little for P's deep chunk, and W cannot go in (no block is free): the step gives
    the room back to P, which ends and frees its blocks for W, rather than neither ever running."""
    s = make(max_num_batched_tokens=7, num_blocks=7, max_num_batched_tokens_decoding=4)
    add(s, "p", 23, max_tokens=1)
    for _ in range(3):
        step(s)
    assert s.requests["p"].num_computed_tokens == 21
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    s.step_budget = DeepChunks(7, 1)
    add(s, "w", 10, max_tokens=1)
    assert step(s)[0].num_scheduled_tokens == {"p": 1}
    assert "p" in by_id(step(s)[1]) and "p" not in s.requests
    for _ in range(10):  # W's deep chunks take a token a step on their own
        step(s)
    assert not s.requests


def test_a_fit_that_prices_chunk_tokens_near_nothing_still_lets_a_further_sample_run():
    """At 0.1 µs a chunk token a further sample's 1 ms decode would cost 10,000 tokens, past any budget: its
    price is capped at what the step leaves beside the leads, so one runs each step."""
    s = make(max_num_batched_tokens_decoding=16, step_stretch=4.0)
    for rows, chunk in [(r, t) for r in (1, 4, 8) for t in (0, 64, 512)]:
        s.step_budget.observe(rows, 0, chunk, 0.010 + 0.001 * rows + 1e-7 * chunk)
    assert s.step_budget.price(0) > 64
    samples(s, "a", [next(_fresh) for _ in range(4)], 3, ignore_eos=True)
    add(s, "b", 4, ignore_eos=True)
    while any(r.num_output_tokens == 0 for r in s.running) or s.waiting:  # all of them in
        step(s)
    for _ in range(3):
        scheduled = step(s)[0].num_scheduled_tokens
        assert {"a#0", "b"} <= set(scheduled) and len(set(scheduled) & {"a#1", "a#2"}) == 1


def machine(rows: int, context: int, tokens: int, pairs: int) -> float:
    """A step's seconds: 20 ms + 1 ms a row + 10 µs a context token + 1 ms a chunk token + 4 µs a pair."""
    return 0.020 + 0.001 * rows + 1e-5 * context + 0.001 * tokens + 4e-6 * pairs


def measured(s: Scheduler) -> None:
    """The step budget fitted to `machine`, chunks at several depths."""
    for rows, c, t, start in itertools.product((1, 4, 8), (10, 1000, 3000), (0, 64, 256), (0, 2000)):
        pairs = query_key_pairs(start, t) if t else 0
        s.step_budget.observe(rows, rows * c, t, machine(rows, rows * c, t, pairs), pairs)


@pytest.mark.parametrize("floor", [4, 64])
def test_a_long_prompts_chunks_shrink_with_depth_so_the_streams_step_stays_bounded(floor):
    """Beside B's stream, a prompt longer than a step goes in as bulk work: each chunk, as the machine
    computes it, stretches B's step by BULK_STRETCH at most, so the chunks shrink as they go deeper; the
    decoding floor's 64 tokens (the serving default), which cost three of B's steps here, lend it no room."""
    s = make(
        max_model_len=2048, num_blocks=600, max_num_batched_tokens=256, max_num_batched_tokens_decoding=floor
    )
    s.config.step_stretch = 4.0
    s.step_budget = StepBudget.of(s.config)
    measured(s)
    b = add(s, "b", 8, max_tokens=1000, ignore_eos=True)
    step(s)
    add(s, "long", 700, max_tokens=1)
    chunks = []
    while "long" in s.requests:
        left = 700 - s.requests["long"].num_computed_tokens
        out, _ = step(s)
        if "long" in out.num_scheduled_tokens and left > 256:
            n, start = out.num_scheduled_tokens["long"], 700 - left
            decode = machine(1, b.num_tokens - 1, 0, 0)
            assert machine(1, b.num_tokens - 1, n, query_key_pairs(start, n)) <= BULK_STRETCH * decode + 0.001
            chunks.append(n)
    assert chunks[0] >= 2 * chunks[-1] and chunks == sorted(chunks, reverse=True)


def test_prompts_that_come_beside_a_long_one_take_its_step_but_a_token():
    """Alone, a prompt longer than a step goes in a lone request's steps; once A and B wait for their first
    tokens, the step that lets them in carries a token of it (a decode row's work), not a lone step."""
    s = make(
        max_model_len=2048, num_blocks=600, max_num_batched_tokens=256, max_num_batched_tokens_decoding=4
    )
    s.config.step_stretch = 4.0
    s.step_budget = StepBudget.of(s.config)
    measured(s)
    add(s, "long", 700, max_tokens=1)
    alone = step(s)[0].num_scheduled_tokens["long"]
    add(s, "a", 8)
    add(s, "b", 8)
    assert s.waiting.short_tokens == 16  # their prompts are no longer than a step
    start = s.requests["long"].num_computed_tokens
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"long": 1, "a": 8, "b": 8} and alone > 1 and start == alone


def test_a_prompt_no_longer_than_a_step_but_priced_past_it_is_bulk_work_that_goes_in_beside_a_stream():
    """400 tokens fit a step of 512, but their attention prices them past it (bulk work): waiting beside
    B's stream, they do not hold bulk work back as a short prompt would, or they could never go in."""
    s = make(
        max_model_len=2048, num_blocks=600, max_num_batched_tokens=512, max_num_batched_tokens_decoding=4
    )
    s.config.step_stretch = 4.0
    s.step_budget = StepBudget.of(s.config)
    measured(s)
    add(s, "b", 4, ignore_eos=True)
    step(s)
    add(s, "mid", 400, max_tokens=1)
    assert s.step_budget.price(0, 400) > 512 and s.waiting.shortest == 400
    outs = [step(s)[0].num_scheduled_tokens for _ in range(4)]
    assert sum(out.get("mid", 0) for out in outs) > 0 and all("b" in out for out in outs)


@pytest.mark.parametrize("seats", [1, 8])
def test_two_long_prompts_with_no_stream_beside_them_both_go_in(seats):
    """Two prompts longer than a step, the second waiting (for a seat or for room) while the first goes in:
    with nothing decoding beside them, every step carries as much of them as a lone prompt's step holds,
    priced, until both have their first token."""
    s = make(
        max_model_len=2048, num_blocks=600, max_num_batched_tokens=256, max_num_batched_tokens_decoding=4
    )
    s.config.step_stretch, s.config.max_num_seqs = 4.0, seats
    s.step_budget = StepBudget.of(s.config)
    measured(s)
    s.step_budget.steps = StepBudget.PROBE - 1  # a probing step next: none while nothing decodes
    add(s, "l1", 600, max_tokens=1)
    step(s)
    add(s, "l2", 600, max_tokens=1)
    assert s.waiting.short_tokens == 0 and s.waiting.first_tokens == 600
    steps = 0
    while s.has_unfinished_requests():
        room, out = s.step_budget.lone_tokens(), step(s)[0]
        starts = {r.req_id: r.num_computed_tokens for r in out.new_reqs + out.cached_reqs}
        work = [(starts[r], n) for r, n in out.num_scheduled_tokens.items()]
        assert work and sum(s.step_budget.price(*w) for w in work) <= room + 1
        steps += 1
    assert steps <= 30


def beside_a_stream() -> Scheduler:
    """A measured scheduler (fitted to `machine`) with B's stream running."""
    s = make(
        max_model_len=1024, num_blocks=600, max_num_batched_tokens=256, max_num_batched_tokens_decoding=16
    )
    s.config.step_stretch, s.config.max_num_seqs = 4.0, 16
    s.step_budget = StepBudget.of(s.config)
    measured(s)
    add(s, "b", 8, max_tokens=1000, ignore_eos=True)
    step(s)
    return s


def test_prompts_that_keep_coming_let_bulk_work_in_every_other_step_at_least():
    """A's further samples decode beside B's stream while a short prompt arrives before every step: bulk
    work stands aside for them every other step at most (none in probing steps), so it still runs."""
    s = beside_a_stream()
    samples(s, "a", [next(_fresh) for _ in range(40)], 4, max_tokens=500, ignore_eos=True)
    while s.waiting:
        step(s)
    ran = []  # whether a further sample decoded, step by step
    for k in range(24):
        add(s, f"c{k}", 4, max_tokens=1)
        probing = s.step_budget.probing()
        out, _ = step(s)
        assert f"c{k}" in out.num_scheduled_tokens
        s.step_budget.observe_step(out, 0.05, s.requests)
        ran.append(probing or any(r in out.num_scheduled_tokens for r in ("a#1", "a#2", "a#3")))
    assert 8 <= sum(ran) < 24 and all(a or b for a, b in itertools.pairwise(ran))


def test_a_requests_further_samples_are_bulk_work_from_their_admission_on():
    """Beside B's stream, A's further samples (their prompts, first tokens and decodes alike) take no more
    than the bulk room in any step, or one of them where one costs more; all finish, every block free."""
    s = beside_a_stream()
    a = samples(s, "a", [next(_fresh) for _ in range(120)], 6, max_tokens=4, ignore_eos=True)
    ran = 0
    while any(r.num_output_tokens < 4 for r in a):
        leads = {r.parent_id: r for r in reversed(s.running)}
        room = step_tokens(s.config, s.running, leads, s.waiting, s.step_budget).samples
        out, _ = step(s)
        starts = {r.req_id: r.num_computed_tokens for r in out.new_reqs + out.cached_reqs}
        lead = leads["a"].request_id if "a" in leads else out.new_reqs[0].req_id if out.new_reqs else None
        bulk = [
            (starts[r], n) for r, n in out.num_scheduled_tokens.items() if r.startswith("a#") and r != lead
        ]
        assert sum(s.step_budget.price(*work) for work in bulk) <= room or len(bulk) == 1
        ran += len(bulk)
    assert ran > 6 and s.requests.keys() == {"b"}
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 600 - 1


def test_every_probe_th_step_beside_other_streams_carries_no_bulk_work():
    """A's further samples decode beside B's stream in every step but each PROBE-th, in which the fit sees
    what the leads' own step costs; the leads decode in every step."""
    s = beside_a_stream()
    samples(s, "a", [next(_fresh) for _ in range(120)], 4, max_tokens=500, ignore_eos=True)
    seen = []  # (probing, further samples decoded) once A's samples are all in
    for k in range(4 * StepBudget.PROBE):
        probing = s.step_budget.probing()
        out, _ = step(s)
        starts = {r.req_id: r.num_computed_tokens for r in out.cached_reqs}
        rows = [r for r, n in out.num_scheduled_tokens.items() if n == 1]
        context = sum(starts.get(r, 0) + 1 for r in rows)
        s.step_budget.observe_step(out, machine(len(rows), context, 0, 0), s.requests)
        if k >= 2 * StepBudget.PROBE:
            assert {"a#0", "b"} <= set(out.num_scheduled_tokens)
            seen.append((probing, bool(set(out.num_scheduled_tokens) - {"a#0", "b"})))
    assert seen.count((True, False)) == 2 and seen.count((False, True)) == len(seen) - 2


@pytest.mark.parametrize("caching", [True, False])
def test_a_further_sample_goes_in_once_its_leads_prompt_is_scheduled_and_shares_it(caching):
    """A's prompt goes in 16 tokens a step; its further samples wait until the last chunk is scheduled,
    then go in beside it on the prefix cache's 36 tokens (9 full blocks, never the whole prompt). Without
    prefix caching nothing is shared: they go in at once, each computing its own prompt."""
    s = make(max_num_batched_tokens=64, long_prefill_token_threshold=16, enable_prefix_caching=caching)
    samples(s, "a", [next(_fresh) for _ in range(40)], 3, ignore_eos=True)
    admitted = [[(r.req_id, r.num_computed_tokens) for r in step(s)[0].new_reqs] for _ in range(3)]
    if caching:
        assert admitted == [[("a#0", 0)], [], [("a#1", 36), ("a#2", 36)]]
    else:
        assert admitted[0] == [("a#0", 0), ("a#1", 0), ("a#2", 0)]


def test_a_lone_prompt_goes_in_steps_of_half_a_second():
    """Alone, a long prompt's chunks are priced as well: each step costs half a second (LONE_SECONDS) besides
    its fixed cost, at most, so a request that comes meanwhile waits no longer; deeper chunks are smaller.
    Before anything is measured, full steps."""
    s = make(
        max_model_len=2048, num_blocks=600, max_num_batched_tokens=512, max_num_batched_tokens_decoding=4
    )
    s.config.step_stretch = 4.0
    s.step_budget = StepBudget.of(s.config)
    add(s, "first", 600, max_tokens=1)
    assert step(s)[0].num_scheduled_tokens == {"first": 512}
    step(s)
    measured(s)
    add(s, "long", 1200, max_tokens=1)
    chunks = []
    while "long" in s.requests:
        start = s.requests["long"].num_computed_tokens
        n = step(s)[0].num_scheduled_tokens.get("long", 0)
        assert machine(0, 0, n, query_key_pairs(start, n)) <= 0.020 + StepBudget.LONE_SECONDS + 0.001
        chunks.append(n)
    assert chunks[0] >= 2 * chunks[-2] and chunks[:-1] == sorted(chunks[:-1], reverse=True)
    assert s.step_budget.price(0, chunks[0]) >= 450  # half a second's work at 1 ms a priced token


def test_a_lone_requests_samples_go_in_steps_of_half_a_second():
    """Alone, a request's samples over a deep prompt are priced as its prompt is: each step costs half a
    second (LONE_SECONDS) besides its fixed cost and the lead's own decode, at most, so a request that comes
    meanwhile waits no longer. Not every sample decodes in every step; all finish, every block free."""
    s = make(
        max_model_len=4096, num_blocks=1200, max_num_batched_tokens=512, max_num_batched_tokens_decoding=4
    )
    s.config.step_stretch, s.config.max_num_seqs = 4.0, 16
    s.step_budget = StepBudget.of(s.config)
    measured(s)
    a = samples(s, "a", [next(_fresh) for _ in range(2000)], 16, max_tokens=6, ignore_eos=True)
    lead = machine(1, 2006, 0, 0) - machine(0, 0, 0, 0)  # the deepest the lead's decode reads
    most = 0
    while s.has_unfinished_requests():
        out, _ = step(s)
        starts = {r.req_id: r.num_computed_tokens for r in out.new_reqs + out.cached_reqs}
        work = [(starts[r], n) for r, n in out.num_scheduled_tokens.items()]
        rows = [start + 1 for start, n in work if n == 1]
        chunks = [(start, n) for start, n in work if n > 1]
        pairs = sum(query_key_pairs(*chunk) for chunk in chunks)
        seconds = machine(len(rows), sum(rows), sum(n for _, n in chunks), pairs)
        assert seconds <= 0.020 + StepBudget.LONE_SECONDS + lead + 0.001
        most = max(most, len(rows))
    assert 1 < most < 16 and [r.num_output_tokens for r in a] == [6] * 16
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 1200 - 1


def test_a_lone_requests_sample_that_costs_more_than_its_step_still_decodes_beside_its_lead():
    """At 600 ms a row, a further sample's decode costs more than a lone request's step of half a second:
    it runs beside its lead's decode, one a step, rather than waiting for the lead to finish."""
    s = make(max_model_len=256, num_blocks=200, max_num_batched_tokens=512, max_num_batched_tokens_decoding=4)
    s.config.step_stretch, s.config.max_num_seqs = 4.0, 16
    s.step_budget = StepBudget.of(s.config)
    for rows, tokens in itertools.product((1, 4, 8), (0, 64, 256)):
        s.step_budget.observe(rows, rows * 10, tokens, 0.020 + 0.6 * rows + 0.001 * tokens)
    assert s.step_budget.price(20) > s.step_budget.lone_tokens()
    a = samples(s, "a", [next(_fresh) for _ in range(20)], 3, max_tokens=6, ignore_eos=True)
    steps = 0
    while a[0].num_output_tokens < 6:
        step(s)
        steps += 1
    assert steps <= 7 and sum(r.num_output_tokens for r in a[1:]) >= 4

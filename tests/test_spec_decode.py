"""Speculative decoding: n-gram drafts verified in one forward, output unchanged by them."""

import contextlib
import itertools
import random
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.llm import LLM
from engine.params import SamplingParams, StructuredOutputsParams
from engine.proposer import ContextCounts, NgramIndex, NgramProposer, SuffixProposer
from engine.request import Request

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 6}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


VOCAB = 96  # small enough that a random model's greedy text falls into loops that drafts partly predict


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory, smollm2_dir) -> str:
    """A random 2-layer Llama over the first VOCAB ids of SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_spec")
    config = LlamaConfig(**dict(TINY, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2))
    LlamaForCausalLM(config).save_pretrained(path)
    for f in Path(smollm2_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return str(path)


def prompts() -> list[list[int]]:
    """Prompts that repeat a span (drafts find it) and prompts that do not."""
    rng = random.Random(0)
    span = [rng.randrange(3, VOCAB) for _ in range(12)]
    out = [[1, *span, *span, *span[:5]], [1, *span[:8], 7, 8, *span[:8]]]
    out += [[1] + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (9, 30, 70)]
    return [*out, list(out[0])]  # a repeat: a prefix-cache hit


def engine(model: str, spec: dict | None, **args) -> LLM:
    args = dict(dtype="float32", max_num_seqs=8, num_kv_blocks=64, block_size=16, enforce_eager=True) | args
    return LLM(model, speculative_config=spec, **args)


@pytest.fixture(scope="module")
def plain(looping_model):
    with engine(looping_model, None) as llm:
        yield llm


@pytest.fixture(scope="module")
def drafting(looping_model):
    """An engine with the default n-gram drafts, shared by the tests that need no other settings."""
    with engine(looping_model, SPEC) as llm:
        yield llm


def counted(llm: LLM, before: dict) -> dict:
    """The engine's stats now, its counters since `before` (a shared engine's earlier work left out)."""
    after = llm.get_stats()
    s0, s1 = before["spec_decoding"] or {}, after["spec_decoding"]
    if s1 is not None:
        per_pos = itertools.zip_longest(
            s1["num_accepted_tokens_per_pos"], s0.get("num_accepted_tokens_per_pos", [])
        )
        s1 = {k: v - s0.get(k, 0) for k, v in s1.items() if k != "num_accepted_tokens_per_pos"}
        s1["num_accepted_tokens_per_pos"] = [a - (b or 0) for a, b in per_pos]
    counters = ("prefix_cache_hits", "prefix_cache_queries", "num_preemptions")
    return after | {k: after[k] - before[k] for k in counters} | {"spec_decoding": s1}


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in plain.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    "spec, args",
    [
        (SPEC, dict()),
        # Prompts over several steps, drafts within the budget, and a cache too small for every sequence.
        (SPEC, dict(num_kv_blocks=12, max_model_len=128, max_num_batched_tokens=16)),
        (SPEC, dict(async_scheduling=True)),
        (SPEC, dict(enforce_eager=False)),
        (SUFFIX, dict()),
        (SUFFIX, dict(num_kv_blocks=12, max_model_len=128, max_num_batched_tokens=16)),
    ],
    ids=["eager", "chunked-preemption", "async", "compiled", "suffix", "suffix-chunked-preemption"],
)
def test_greedy_output_is_the_same_with_drafts(looping_model, reference, drafting, spec, args):
    shared = spec is SPEC and not args
    with contextlib.nullcontext(drafting) if shared else engine(looping_model, spec, **args) as llm:
        before = llm.get_stats()
        outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        stats = counted(llm, before)
    assert [o.outputs[0].token_ids for o in outs] == reference
    spec = stats["spec_decoding"]
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]
    # Each request reports its own counts as it ends, adding up to the engine's.
    assert sum(o.metrics.num_draft_tokens for o in outs) == spec["num_draft_tokens"]
    assert sum(o.metrics.num_accepted_tokens for o in outs) == spec["num_accepted_tokens"]
    assert stats["prefix_cache_hits"] > 0 and stats["kv_cache_usage"] == 0.0
    if "num_kv_blocks" in args:
        assert stats["num_preemptions"] > 0


def test_max_tokens_stops_and_n_samples_and_seeds_are_unchanged_by_drafts(plain, drafting, reference):
    seeded = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=30, seed=7, ignore_eos=True)
    two = SamplingParams(n=2, temperature=1.0, max_tokens=30, seed=3, ignore_eos=True, presence_penalty=0.5)
    short = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in range(1, 12)]
    runs = []
    for llm in (plain, drafting):
        before = llm.get_stats()
        got = llm.generate([prompts()[0]] * len(short), short, use_tqdm=False)
        got += llm.generate(prompts()[:2], seeded, use_tqdm=False)
        got += llm.generate(prompts()[:1], two, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in got])
        stats = counted(llm, before)
    assert runs[0] == runs[1]
    assert stats["spec_decoding"]["num_accepted_tokens"] > 0
    for m, out in zip(range(1, 12), runs[1]):  # max_tokens lands inside accepted runs: never past it
        assert out == [reference[0][:m]]


def test_biases_and_bans_are_unchanged_by_drafts(plain, drafting, reference):
    ref = reference[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, logit_bias={ref[3]: -100.0, ref[9]: 5.0}),
        SamplingParams(temperature=0.0, max_tokens=30, allowed_token_ids=sorted(set(ref) - {ref[5]})),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20, stop_token_ids=[ref[8]]),
        SamplingParams(temperature=0.9, max_tokens=30, seed=1, bad_words=["ab"], logit_bias={ref[2]: 3.0}),
    ]
    runs = []
    for llm in (plain, drafting):
        before = llm.get_stats()
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts()[:1] * 4, params, False)])
        stats = counted(llm, before)
    assert runs[0] == runs[1] and stats["spec_decoding"]["num_accepted_tokens"] > 0
    assert ref[3] not in runs[1][0] and ref[5] not in runs[1][1] and ref[8] not in runs[1][2][:20]


def test_stop_strings_end_the_text_where_they_would_without_drafts(plain, drafting):
    text = plain.generate(prompts()[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    middle = text[len(text) // 2 : len(text) // 2 + 3]
    stop = SamplingParams(temperature=0.0, max_tokens=40, stop=[middle])
    outs = [llm.generate(prompts()[0], stop, use_tqdm=False)[0].outputs[0] for llm in (plain, drafting)]
    assert (outs[0].text, outs[0].finish_reason) == (outs[1].text, outs[1].finish_reason)
    assert outs[1].finish_reason == "stop" and len(outs[1].text) < len(text)


def test_the_ngram_index_drafts_what_followed_the_latest_earlier_match_longest_first():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7]
    index.update(tokens)
    assert index.continuation(tokens, 3) == [9, 4, 6]  # [6, 7] last ended before 9 (and before 8)
    tokens += [8]  # now [6, 7, 8] matches at the start: the longest n-gram wins
    index.update(tokens)
    assert index.continuation(tokens, 2) == [1, 6]
    tokens += [42]
    index.update(tokens)
    assert index.continuation(tokens, 4) == []  # 42 never occurred before
    assert index.indexed == len(tokens) - 1


def test_the_proposer_pauses_where_drafts_miss():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    req = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams())
    assert proposer.propose(req, 10) == [3, 1, 2, 3]  # what followed the match, and on as a loop
    assert proposer.propose(req, 2) == [3, 1]  # no more than the room left
    proposer.verified(req, 3, 1)
    assert proposer.propose(req, 10) == [3, 1, 2, 3]  # as far as the match goes
    proposer.verified(req, 2, 0)
    proposer.verified(req, 1, 0)
    assert proposer.propose(req, 10) == []  # two misses in a row: a pause
    assert proposer.stats.num_drafts == 3 and proposer.stats.num_accepted_tokens_per_pos == [1, 0, 0]


def test_context_counts_add_and_take_away_exactly():
    counts = ContextCounts(depth=2)
    a, b = [1, 2, 3, 1, 2, 4], [2, 3, 5]
    counts.add(a)
    counts.add(b)
    assert counts.counts[(1, 2)] == {3: 1, 4: 1} and counts.counts[(2,)] == {3: 2, 4: 1}
    counts.add(a, sign=-1)
    assert counts.counts == {(2,): {3: 1}, (3,): {5: 1}, (2, 3): {5: 1}}  # b's alone, no zero left
    counts.add(b, sign=-1)
    assert counts.counts == {}


def test_suffix_drafts_what_recent_requests_wrote_as_far_as_the_evidence_goes():
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=8)
    config = msgspec.structs.replace(config, suffix_decoding_max_cached_requests=1)
    proposer = SuffixProposer(config)
    first = Request("a", [9, 9], SamplingParams())
    first.output_token_ids = [10, 11, 12, 13, 14]
    proposer.finished(first)
    later = Request("b", [7, 10, 11], SamplingParams())
    assert proposer.propose(later, 8) == [12, 13]  # a context of 2 tokens: at most 2 drafted
    later.all_token_ids += [12, 13]
    assert proposer.propose(later, 8) == [14]  # nothing seen after 14: the draft ends there
    other = Request("c", [8], SamplingParams())
    other.output_token_ids = [10, 20, 21]
    proposer.finished(other)  # the cache holds one request: the first's output is forgotten
    assert proposer.shared.counts[(10,)] == {20: 1}
    again = Request("c", [8], SamplingParams())  # an id used before: still one output, counted once
    again.output_token_ids = [10, 22]
    proposer.finished(again)
    assert proposer.shared.counts == {(10,): {22: 1}}
    unsure = Request("d", [10, 30, 10, 31, 10], SamplingParams())
    proposer.config = msgspec.structs.replace(config, suffix_decoding_min_token_prob=0.5)
    assert proposer.propose(unsure, 8) == []  # 10 was followed by 30, 31 and 20: none likely enough


def test_constrained_requests_do_not_draft_beside_ones_that_do(tiny_chat_model):
    choice = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    with engine(tiny_chat_model, SPEC) as llm:
        free, constrained = llm.generate([prompts()[0]] * 2, [GREEDY, choice], use_tqdm=False)
    assert constrained.outputs[0].text in ("yes", "no") and constrained.metrics.num_draft_tokens == 0
    assert free.metrics.num_draft_tokens > 0


def test_a_bad_speculative_config_is_a_clear_error():
    for bad, why in [
        ({"method": "eagle"}, "method must be ngram or suffix"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"typo": 1}, "unknown field"),
        ("{not json", "malformed"),
    ]:
        with pytest.raises(ValueError, match=why):
            EngineConfig(speculative_config=bad)


def test_decode_rows_of_sequences_verifying_every_draft_are_not_padded_further():
    from compiled.input_batch import InputBatch

    batch = InputBatch(4, 8, 16, torch.device("cpu"), max_drafts=8)
    assert {9, 18, 36} <= set(batch.buckets) and batch.buckets[-1] == 36
    assert batch.decode_rows(9) == 9 and batch.decode_rows(10) == 16


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_verify_steps_compile_nothing_after_the_warm_up(tiny_llama, monkeypatch, quantization):
    """Steps verifying 0 to K drafts for 1 to 3 sequences, with and without a prompt's chunk beside them,
    run on the warm-up's graphs (the int4 model's few-row kind too), guards checked on every call."""
    from compiled.guard_free import GuardFreeGraph
    from server.bench.driver import RunnerDriver, build_runner

    monkeypatch.setattr(GuardFreeGraph, "check_guards", True)
    torch._dynamo.reset()  # graphs other tests compiled count against Dynamo's recompile limit
    args = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    runner = build_runner(tiny_llama, **args, quantization=quantization, speculative_config=SPEC)
    runner.initialize_kv_cache(128)
    runner.warmup()
    drv, rng, k = RunnerDriver(runner), random.Random(0), SPEC["num_speculative_tokens"]
    for i in range(3):
        drv.add(str(i), [rng.randrange(320) for _ in range(20 + 7 * i)])
    drv.step()
    verified = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(16):
            if step == 8:  # a fresh prompt's chunk in the same step as the drafts
                drv.add("new", [rng.randrange(320) for _ in range(30)])
            rids = [*list(drv.reqs)[: 1 + step % 3], *(["new"] if step == 8 else [])]
            so = drv.build(rids)
            for data in so.cached_reqs:
                r, n = drv.reqs[data.req_id], rng.randint(0, k)
                data.new_block_ids += drv._ensure_blocks(r, r["computed"] + 1 + n)
                if n:
                    so.spec_tokens[data.req_id] = [rng.randrange(320) for _ in range(n)]
            out = drv.apply(so, runner.execute_model(so))
            for rid, drafts in so.spec_tokens.items():
                assert 1 <= len(out[rid]) <= len(drafts) + 1
                drv.reqs[rid]["computed"] += len(out[rid]) - 1  # the accepted drafts' KV stays
                verified += 1
    assert verified >= 10

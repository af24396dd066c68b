"""Structured outputs: the bitmask layout, the scheduler's handling of grammars still compiling or failed,
and generation through LLM on a random-weight model (which follows no format of its own, so only the
grammar keeps its outputs valid): every JSON schema, regex and choice output matches, over schemas and
patterns Hypothesis draws."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future

import jsonschema
import llguidance.numpy
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled.sampler import allowed_tokens
from engine import structured_output
from engine.llm import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step import ModelRunnerOutput
from engine.structured_output import Grammar, StructuredOutputManager

S = StructuredOutputsParams


def test_params_take_exactly_one_constraint():
    assert S(regex="a+").kind == "regex"
    assert S(json_object=True).kind == "json_object"
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"json_object": False}):
        with pytest.raises(ValueError, match="exactly one"):
            S(**bad)
    with pytest.raises(ValueError, match="non-empty"):
        S(choice=[])


@pytest.mark.parametrize(
    ("so", "says"),
    [
        (S(json={"type": "strin"}), "structured_outputs.json: Invalid type"),
        (S(json='{"type": '), "structured_outputs.json"),
        (S(json="[1]"), "must be an object"),
        (S(regex="a(b"), "structured_outputs.regex: .*unclosed group"),
        (S(grammar="start: foo"), "structured_outputs.grammar: .*unknown name"),
        (S(grammar="root ::= ("), "structured_outputs.grammar"),
    ],
)
def test_check_names_the_field(so, says):
    with pytest.raises(ValueError, match=says):
        structured_output.check(so)


def test_bitmask_unpacks_as_llguidance_lays_it_out():
    vocab = 100
    mask = llguidance.numpy.allocate_token_bitmask(3, vocab)
    mask[:] = 0
    allowed = [[0, 31, 32, 99], [5], list(range(vocab))]
    words = mask.view(np.uint32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    got = allowed_tokens(torch.from_numpy(mask), vocab)
    assert got.shape == (3, vocab)
    for row, tokens in enumerate(allowed):
        assert got[row].nonzero().flatten().tolist() == tokens
    assert set(got.unique().tolist()) == {0, 1}


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64, num_blocks=16, block_size=4))


def test_a_compiling_grammar_does_not_hold_the_batch():
    sched = _scheduler()
    compiling: Future = Future()
    sched.add_request(
        Request("g", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_id=0, grammar=Grammar(compiling))
    )
    sched.add_request(Request("plain", [4, 5, 6], SamplingParams(max_tokens=4), eos_token_id=0))
    out = sched.schedule()
    assert [r.req_id for r in out.new_reqs] == ["plain"]
    assert [r.request_id for r in sched.waiting] == ["g"]  # still first in line

    failed: Future = Future()
    failed.set_exception(ValueError("no such rule"))
    sched.add_request(Request("bad", [7, 8], SamplingParams(), eos_token_id=0, grammar=Grammar(failed)))
    sched.schedule()
    (gone,) = sched.take_failed()
    assert gone.request_id == "bad" and gone.finish_reason == "abort"
    assert "no such rule" in gone.stop_reason
    assert "bad" not in sched.requests and sched.take_failed() == []
    assert [r.request_id for r in sched.waiting] == ["g"]
    sched.finish_requests(["g", "plain"], sched.requests["g"].status.FINISHED_ABORTED)
    assert sched.kv_cache_manager.usage == 0.0  # nothing leaked


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    with LLM(tiny_chat_model, dtype="float32", enforce_eager=True, max_num_seqs=16) as engine:
        yield engine


# Bounded parts only: a random-weight model stops a document only where the grammar leaves no choice.
_KEYS = ["id", "name", "tags", "ok", "n"]
_ENUM = ["red", "green", "a b", "7", 'x"y']
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(
        lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w},
        st.integers(-50, 50),
        st.integers(0, 500),
    ),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.sampled_from(_ENUM), min_size=1, max_size=3, unique=True)),
)


@st.composite
def _object(draw, children):
    keys = draw(st.lists(st.sampled_from(_KEYS), min_size=1, max_size=3, unique=True))
    return {
        "type": "object",
        "properties": {k: draw(children) for k in keys},
        "required": sorted(draw(st.sets(st.sampled_from(keys)))),
        "additionalProperties": False,
    }


def _array(children):
    return st.builds(
        lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)
    )


_schema = _object(st.recursive(_leaf, lambda c: st.one_of(_object(c), _array(c)), max_leaves=3))


_regex = st.lists(
    st.sampled_from([r"[a-z]{1,4}", r"[0-9]{2}", r"-", r"(ab|cd)", r"\.", r"[A-F0-9]{0,3}", r"x?"]),
    min_size=1,
    max_size=4,
).map("".join)
_choice = st.lists(st.text("abcxyz -", min_size=1, max_size=6), min_size=1, max_size=4, unique=True)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schema, regex=_regex, choice=_choice, seed=st.integers(0, 2**32))
def test_outputs_match_their_constraint(llm, schema, regex, choice, seed):
    params = [
        SamplingParams(n=2, seed=seed, max_tokens=300, structured_outputs=so)
        for so in (S(json=schema), S(regex=regex), S(choice=choice))
    ]
    json_out, regex_out, choice_out = llm.generate(["Answer:"] * 3, params, use_tqdm=False)
    for c in json_out.outputs:
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    for c in regex_out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), (regex, c.text)
    for c in choice_out.outputs:
        assert c.finish_reason == "stop" and c.text in choice, (choice, c.text)


def test_any_json_object_and_a_grammar(llm):
    outs = llm.generate(
        ["Hi"] * 2,
        [
            SamplingParams(temperature=0, max_tokens=200, structured_outputs=S(json_object=True)),
            SamplingParams(
                seed=3, max_tokens=20, structured_outputs=S(grammar='root ::= "a" ("b" | "c"){1,5}')
            ),
        ],
        use_tqdm=False,
    )
    text = outs[0].outputs[0].text
    assert text.startswith("{") and outs[0].outputs[0].finish_reason in ("stop", "length")
    if outs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert re.fullmatch("a[bc]{1,5}", outs[1].outputs[0].text)


def test_unconstrained_rows_sample_as_before(llm):
    """A constrained row in the batch changes nothing for the others (greedy, token for token)."""
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["Once upon a time", "Pick"],
        [
            greedy,
            SamplingParams(temperature=0, max_tokens=12, structured_outputs=S(choice=["left", "right"])),
        ],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].text in ("left", "right")


def test_bad_constraint_is_refused_before_the_engine(llm):
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.regex"):
        llm.generate("x", SamplingParams(structured_outputs=S(regex="(")), use_tqdm=False)
    assert llm.get_stats()["num_running"] == 0 and llm.get_stats()["kv_cache_usage"] == 0.0


def test_grammars_compile_below_the_model_and_their_tokenizer_is_built_at_the_cores_priority(
    tiny_chat_model, monkeypatch
):
    """Building llguidance's tokenizer holds the GIL for most of a second: at the lowest priority, without
    a core, it would stall the core's own thread. Compiles release the GIL and wait below the model."""
    import os

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    manager, seen = StructuredOutputManager(tiny_chat_model, 49152), []

    def recorded(name: str):
        real = getattr(manager, name)

        def call(*args):
            seen.append((name, niceness()))
            return real(*args)

        return call

    for name in ("_build_tokenizer", "_compile"):
        monkeypatch.setattr(manager, name, recorded(name))
    grammars = manager.grammars(S(choice=["yes"]), 2) + manager.grammars(S(choice=["no"]), 2)
    for grammar in grammars:
        assert grammar.future.result(timeout=60).is_error() is False
    assert sorted(seen) == [("_build_tokenizer", niceness()), ("_compile", 19), ("_compile", 19)]


def test_a_failed_build_of_the_grammar_tokenizer_is_tried_again(tiny_chat_model, monkeypatch):
    manager, calls = StructuredOutputManager(tiny_chat_model, 49152), []
    real = manager._build_tokenizer

    def flaky(eos: int | None):
        calls.append(eos)
        if len(calls) == 1:
            raise OSError("tokenizer files unreadable")
        return real(eos)

    monkeypatch.setattr(manager, "_build_tokenizer", flaky)
    (first,) = manager.grammars(S(choice=["yes"]), 2)
    with pytest.raises(OSError, match="unreadable"):
        first.future.result(timeout=60)
    (second,) = manager.grammars(S(choice=["no"]), 2)
    assert second.future.result(timeout=60).is_error() is False and len(calls) == 2


def test_a_grammar_error_ends_the_request(tiny_chat_model):
    manager = StructuredOutputManager(tiny_chat_model, 49152)
    (grammar,) = manager.grammars(S(choice=["yes"]), eos_token_id=2)
    grammar.future.result(timeout=60)
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=16, block_size=4), structured=manager)
    sched.add_request(Request("r", [5, 6], SamplingParams(), eos_token_id=2, grammar=grammar))
    so = sched.schedule()
    (row,) = so.grammar_bitmasks["r"][None]
    assert not row.view(np.uint32)[0] & (1 << 2)  # no EOS before "yes"
    no = manager._tokenizer.result().tokenize_str("no")[0]
    (out,) = sched.update_from_output(so, ModelRunnerOutput(["r"], [[no]]))  # a token outside the mask
    assert out.finish_reason == "abort" and "doesn't satisfy" in out.stop_reason
    assert out.stop_reason.startswith("structured_outputs: ") and sched.kv_cache_manager.usage == 0.0
    # A matcher in error allows only EOS from then on.
    (row,) = manager.bitmask([grammar])
    assert allowed_tokens(torch.from_numpy(row[None]), 49152).nonzero()[:, 1].tolist() == [2]


def test_grammar_work_is_bounded_cancelled_on_abort_and_timed_out(tiny_chat_model, monkeypatch):
    from engine import structured_output

    with pytest.raises(ValueError, match=r"structured_outputs\.choice: its grammar is \d+ bytes, past the"):
        structured_output.check(S(choice=["x" * 1000] * 600))
    manager = StructuredOutputManager(tiny_chat_model, 49152)
    gate = threading.Event()
    monkeypatch.setattr(manager, "_compile", lambda text, eos: gate.wait() and None)
    try:
        busy = [manager.grammars(S(choice=[f"busy{i}"]), 2)[0] for i in range(2)]  # both compile threads
        queued = manager.grammars(S(choice=["queued"]), 2, n=2)
        manager.release(queued[0])
        assert not queued[1].future.cancelled()  # another sample still waits for it
        manager.release(queued[1])
        assert queued[1].future.cancelled() and len(manager.cache) == 2  # never compiled, nothing cached
        monkeypatch.setattr(structured_output, "COMPILE_TIMEOUT_S", 0.0)
        assert busy[0].ready and "did not compile within" in busy[0].error
    finally:
        gate.set()

"""Pipeline parallelism on CPU (gloo): the layers split into stages of worker processes give the same greedy
tokens and prompt logprobs as one process, with chunked prefill, prefix-cache hits, preemptions and
overlapped scheduling; splits that cannot be made are refused; a dead stage fails the engine."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from compiled.pipeline import Stage
from engine.config import EngineConfig
from engine.config import pipeline_partition as partition
from engine.errors import EngineDeadError
from engine.llm import LLM
from engine.params import SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step import ModelRunnerOutput
from tests.conftest import children_of, engine_core_children
from tests.test_tensor_parallel import PROMPTS, assert_same, make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
# Pages of 16 tokens, too few for every sequence at once (preemptions); chunks of at most 48 tokens.
ENGINE = dict(
    dtype="float32",
    max_num_seqs=8,
    max_model_len=128,
    block_size=16,
    num_kv_blocks=24,
    max_num_batched_tokens=48,
)


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory, smollm2_dir) -> str:
    """A tiny Llama of 5 layers with tied embeddings (the last stage holds the embedding as its LM head)."""
    return make_model(tmp_path_factory.mktemp("five_layers"), "five_layers", smollm2_dir)


@pytest.fixture(scope="module")
def one_process(five_layers) -> list:
    return run(five_layers, enforce_eager=True)[0]


def run(model: str, **engine_args) -> tuple[list, dict]:
    """Greedy outputs with prompt logprobs, then the longest prompt again twice, without them: from the
    prefix cache (prompt logprobs need every position's logits, which a cache hit skips)."""
    with LLM(model, **ENGINE, **engine_args) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        again = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs += llm.generate([PROMPTS[-1]] * 2, again, use_tqdm=False)
        stats = llm.get_stats()
        assert stats["kv_cache_usage"] == 0.0
    return outs, stats


@pytest.mark.parametrize(
    "parallel, enforce_eager",
    [
        (dict(pipeline_parallel_size=2), False),
        (dict(pipeline_parallel_size=2, tensor_parallel_size=2, async_scheduling=True), True),
    ],
    ids=["2-stages-compiled", "2-stages-of-2-ranks-overlapped"],
)
def test_stages_match_one_process(five_layers, one_process, parallel, enforce_eager):
    outs, stats = run(five_layers, enforce_eager=enforce_eager, **parallel)
    assert_same(outs[: len(PROMPTS)], one_process)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in one_process]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert not engine_core_children()


def test_layers_are_split_as_evenly_as_can_be_or_as_asked():
    assert partition(30, 2) == [15, 15]
    assert partition(5, 3) == [2, 2, 1]  # the last stage computes the LM head besides
    assert partition(7, 4) == [2, 2, 2, 1]
    assert partition(5, 3, "1,3,1") == [1, 3, 1]
    for bad in ("1,3", "2,2,2", "0,4,1"):
        with pytest.raises(ValueError, match="does not split the model's 5 layers into 3 stages"):
            partition(5, 3, bad)
    with pytest.raises(ValueError, match="2 layers cannot fill pipeline_parallel_size=3"):
        partition(2, 3)
    with pytest.raises(ValueError, match="pipeline_layer_partition must be"):
        EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition="3")
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        EngineConfig(pipeline_parallel_size=0)


def test_each_stage_loads_only_its_own_weights():
    state = {
        "tok_embeddings.weight": 0,
        "layers.0.attention.wqkv.weight": 1,
        "layers.3.feed_forward.w2.weight": 2,
        "layers.4.ffn_norm.weight": 3,
        "norm.weight": 4,
        "output.weight": 5,
        "stray.weight": 6,
    }
    first, middle, last = (
        Stage(r, 3, a, b, 5, tied=True) for r, (a, b) in enumerate([(0, 1), (1, 4), (4, 5)])
    )
    assert first.state_dict(state) == {
        "tok_embeddings.weight": 0,
        "layers.0.attention.wqkv.weight": 1,
        "stray.weight": 6,
    }
    assert middle.state_dict(state) == {"layers.2.feed_forward.w2.weight": 2, "stray.weight": 6}
    assert last.state_dict(state) == {
        "tok_embeddings.weight": 0,  # tied: the LM head's weight
        "layers.0.ffn_norm.weight": 3,
        "norm.weight": 4,
        "output.weight": 5,
        "stray.weight": 6,
    }


def test_steps_in_flight_share_the_sampling_requests_and_prefill_chunks_take_no_seat():
    cfg = SchedulerConfig(
        max_model_len=512, num_blocks=64, block_size=16, max_num_batched_tokens=64, max_num_seqs=4
    )
    s = Scheduler(dataclasses.replace(cfg, long_prefill_token_threshold=16, pipeline_parallel_size=2))
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    for rid, n in (("b", 4), ("c", 4), ("a", 200)):
        s.add_request(Request(rid, list(range(1, n + 1)), greedy))
    first = s.schedule()  # all three admitted: b and c sample, a's first chunk
    assert first.num_scheduled_tokens == {"b": 4, "c": 4, "a": 16}
    second = s.schedule()  # b and c wait for their tokens; a's next chunk goes on
    assert second.num_scheduled_tokens == {"a": 16}
    s.update_from_output(first, ModelRunnerOutput(["b", "c", "a"], [[7], [7], []]))
    third = s.schedule()  # 3 running over 2 stages: 2 seats for samples, beside a's chunk
    assert third.num_scheduled_tokens == {"b": 1, "c": 1, "a": 16}
    assert [c.new_token_ids for c in third.cached_reqs] == [[7], [7], []]
    s.update_from_output(second, ModelRunnerOutput(["a"], [[]]))
    s.update_from_output(third, ModelRunnerOutput(["b", "c", "a"], [[8], [8], []]))
    fourth = s.schedule()
    assert fourth.num_scheduled_tokens == {"b": 1, "c": 1, "a": 16}


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel, stressed",
    [
        (dict(pipeline_parallel_size=3, pipeline_layer_partition="8,12,10", async_scheduling=True), True),
        (dict(tensor_parallel_size=3), False),  # its 9 heads do not split in 2
    ],
    ids=["3-uneven-stages-overlapped", "3-ranks"],
)
def test_smollm2_across_processes_is_token_exact_with_transformers(
    smollm2_dir, smollm2_hf, parallel, stressed
):
    """Chunks of 32 tokens; `stressed`: a cache of 2 pages of 64 tokens for 6 chats (preemptions), then two
    chats in one prompt, twice (prefix-cache hits), else 3 chats with room. Three ranks split 9 query heads,
    3 KV heads and a vocabulary of 49,152 rows in 3."""
    from transformers import AutoTokenizer

    from server.bench.driver import hf_greedy_batch
    from tests.test_llm import QUESTIONS, chat_ids

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS[: 6 if stressed else 3]]
    longer = prompts[0] + prompts[1]  # past a 64-token page
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = dict(enforce_eager=True, max_model_len=128, max_num_batched_tokens=32)
    with LLM(dtype="float32", num_kv_blocks=3 if stressed else 16, **engine, **parallel) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        for _ in range(2 if stressed else 0):  # one after the other: the second finds the first's blocks
            outs += llm.generate([longer], params, use_tqdm=False)
        stats = llm.get_stats()
    assert not stressed or (stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0), stats
    assert len(outs) == len(prompts) + 2 * stressed
    expected = hf_greedy_batch(smollm2_hf, [*prompts, longer] if stressed else prompts, 24)
    assert [out.outputs[0].token_ids for out in outs] == (expected + expected[-1:] if stressed else expected)


def test_a_dead_stage_fails_the_engine_and_leaves_no_process(five_layers):
    """Any worker that dies (here the first stage's, the other blocked receiving from it) fails the engine
    within seconds, naming it, and takes every other process with it."""
    engine = dict(ENGINE, max_model_len=512, num_kv_blocks=64)
    llm = LLM(five_layers, **engine, enforce_eager=True, pipeline_parallel_size=2)
    (core,) = engine_core_children()
    workers = children_of(core, "compiled.worker")
    assert len(workers) == 2
    errors: list[BaseException] = []

    def generate() -> None:
        try:  # work that outlasts the kill however fast the machine
            llm.generate(PROMPTS, SamplingParams(n=16, max_tokens=400, ignore_eos=True), use_tqdm=False)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(2)
    killed = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)  # the first stage: the last waits for it, blocked in a receive
    thread.join(timeout=30)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], EngineDeadError)
    assert "worker 0 exited unexpectedly" in str(errors[0])
    assert time.monotonic() - killed < 10
    llm.shutdown()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in [core, *workers]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine_core_children() and not children_of(core, "compiled.worker")

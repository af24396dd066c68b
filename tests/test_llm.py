"""The engine as users call it: LLM (engine-core process, IPC, scheduler, runner) end to end."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm import LLM
from engine.params import SamplingParams
from server.bench.driver import hf_greedy_batch
from tests.conftest import engine_core_children

DRAGON = (
    "Tell me a short story about a dragon who learns to bake bread in a small village by the sea, from an "
    "old baker who has never seen a dragon before, and who bakes for the whole village every morning."
)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain gravity to a child.",
    "Hi!",
    "List three prime numbers.",
    "Why is the sky blue? Answer in detail, please.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Name a famous painter.",
    "What is a kiln used for?",
    DRAGON,
    "Give me a recipe for pancakes.",
    "What is the boiling point of water?",
    "Who wrote Hamlet?",
    "Describe the color blue to someone who cannot see.",
    DRAGON,  # a repeat: its first KV page (64 tokens with the chat template) is a prefix hit
]


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [chat_ids(tok, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(prompts, smollm2_hf):
    """transformers' greedy continuation of exactly 64 tokens for each prompt."""
    return hf_greedy_batch(smollm2_hf, prompts, 64)


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_args, count",
    [
        (dict(), 16),  # compiled, prefix caching and chunked prefill on
        # Prompts prefill over several steps, nothing comes from the prefix cache, and a cache too small
        # for 10 sequences at once forces preemptions.
        (
            dict(
                enforce_eager=True, max_num_batched_tokens=24, enable_prefix_caching=False, num_kv_blocks=12
            ),
            10,
        ),
    ],
    ids=["compiled", "chunked-preempted-no-prefix-caching"],
)
def test_greedy_is_token_exact_with_transformers(prompts, reference, engine_args, count):
    # Eager steps of 24 tokens are many: half the tokens still cross pages and outlast preemptions.
    n, prompts = (32 if engine_args.get("enforce_eager") else 64), prompts[:count]
    with LLM(
        dtype="float32", max_num_seqs=16, max_model_len=512, **{"kv_cache_memory": 1 << 28, **engine_args}
    ) as llm:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False
        )
        stats = llm.get_stats()
        # Without ignore_eos the same greedy run stops at the model's EOS, which ends no text.
        stopped = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[
            0
        ].outputs[0]
    eos = reference[0].index(llm.processor.eos_token_id)
    assert stopped.token_ids == reference[0][: eos + 1] and stopped.finish_reason == "stop"
    assert stopped.text == llm.tokenizer.decode(reference[0][:eos]) and "<|im_end|>" not in stopped.text
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == ref[:n], f"prompt {i} ({QUESTIONS[i]!r}) diverged"
        assert out.outputs[0].finish_reason == "length"
    if engine_args.get("num_kv_blocks"):
        assert stats["num_preemptions"] > 0
    if "enable_prefix_caching" not in engine_args:
        assert stats["prefix_cache_hits"] > 0
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    with LLM(
        tiny_chat_model, dtype="float32", max_num_seqs=8, num_kv_blocks=256, enforce_eager=True
    ) as engine:
        yield engine
    assert not engine_core_children()


def texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate(
        ["Hello there", "Once upon a time", "A B C"], [others, params, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm.generate(["Once upon a time"] * 2, others, use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_max_tokens_min_tokens_and_ignore_eos(llm):
    out = llm.generate(
        "Count:", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    # Make EOS the greedy choice from the first step by making it a stop token of a sampled step.
    first = out.outputs[0].token_ids[0]
    stopped = llm.generate(
        "Count:", SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[first]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason == first
    held = llm.generate(
        "Count:",
        SamplingParams(temperature=0, max_tokens=7, min_tokens=3, stop_token_ids=[first]),
        use_tqdm=False,
    )[0].outputs[0]
    # Before min_tokens the stop token is masked (as vLLM does), not sampled and ignored.
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
    assert held.finish_reason == "length" or held.token_ids[-1] == first


def test_stop_string_ends_generation_and_frees_the_sequence(llm):
    full = llm.generate(
        "The story", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    out = llm.generate(
        "The story",
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert len(out.token_ids) < 30
    assert llm.get_stats()["num_running"] == 0


def test_n_samples_share_the_prompt_and_differ(llm):
    out = llm.generate(
        "Pick a word:",
        SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert all(len(c.token_ids) == 12 for c in out.outputs)


def test_logprobs_are_sorted_and_include_the_sampled_token_at_temperature_zero(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, (lp, top) in zip(out.token_ids, out.logprobs):
        assert len(top) == 3 and top[0][0] == token and abs(top[0][1] - lp) < 1e-5
        assert [t[1] for t in top] == sorted((t[1] for t in top), reverse=True) and lp <= 0.0


def test_bad_input_gets_a_clear_error_and_costs_nothing(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate([[5] * 600], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate("hi", SamplingParams(max_tokens=10_000), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert llm.generate("still fine", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished
    stats = llm.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0


def test_chat_applies_the_template(llm):
    conversation = [{"role": "user", "content": "Hi"}]
    out = llm.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    expected = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)


def test_killed_engine_core_fails_pending_requests_quickly(tiny_chat_model):
    engine = LLM(tiny_chat_model, dtype="float32", num_kv_blocks=64, enforce_eager=True)
    pid = engine.client.cores[0].proc.pid
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()  # mid-generation
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="exited unexpectedly"):
        engine.generate(["a long one"] * 4, SamplingParams(max_tokens=500, ignore_eos=True), use_tqdm=False)
    assert 1.0 <= time.monotonic() - start < 10
    with pytest.raises(EngineDeadError):
        engine.generate("again", use_tqdm=False)
    engine.shutdown()
    assert pid not in engine_core_children()


def test_missing_model_is_a_clear_error_and_leaves_no_engine_core(tmp_path):
    # The core process starts before the model is resolved; a model that does not resolve must stop it.
    before = set(engine_core_children())  # other tests' engines may still be running
    with pytest.raises(FileNotFoundError, match="neither a directory nor a file"):
        LLM(str(tmp_path / "no-such-model"), enforce_eager=True)
    assert set(engine_core_children()) <= before


def test_engine_core_failing_to_start_is_reported(tmp_path, tiny_chat_model):
    # A directory that resolves (it has a config.json) but holds no weights fails inside the core.
    before = set(engine_core_children())
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(tiny_chat_model).iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(EngineDeadError, match=r"failed to start.*safetensors"):
        LLM(str(broken), enforce_eager=True, num_kv_blocks=16)
    assert set(engine_core_children()) <= before

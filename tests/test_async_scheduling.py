"""Overlapped scheduling (`async_scheduling`): the engine core schedules step N+1 while the model runs
step N. Everything a user sees must be as without it: the same tokens under stop strings, n > 1 and
preemption, and aborts that leave nothing behind."""

from __future__ import annotations

import asyncio

from engine.async_llm import AsyncLLM
from engine.llm import LLM
from engine.params import SamplingParams

TEXT = "the potter fired the clay in the kiln until the glaze ran like glass over the rim"
PROMPTS = [f"{TEXT[k * 3 :]} {TEXT[: k * 2]} ({k})" for k in range(12)]
# 19 usable blocks of 16 tokens for 8 sequences of up to ~90 tokens: preemptions are certain.
ENGINE = dict(
    dtype="float32", enforce_eager=True, max_model_len=256, block_size=16, num_kv_blocks=20, max_num_seqs=8
)


def params(k: int, stop: str | None = None) -> SamplingParams:
    if k % 4 == 3:  # sampled, two samples per prompt, reproducible through the seed
        return SamplingParams(n=2, temperature=0.8, seed=k, max_tokens=30 + k, ignore_eos=True)
    return SamplingParams(
        temperature=0, max_tokens=10 + 5 * k, ignore_eos=k % 2 == 0, stop=[stop] if stop else []
    )


def outputs(llm: LLM, stops: list[str | None], rounds: int = 1) -> list:
    """Every round's outputs: the same, or the assertion says which round differs."""
    rounds_texts = []
    for _ in range(rounds):
        outs = llm.generate(PROMPTS, [params(k, stop) for k, stop in enumerate(stops)], use_tqdm=False)
        rounds_texts.append(
            [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]
        )
    assert all(texts == rounds_texts[0] for texts in rounds_texts), "a later round differs"
    return rounds_texts[0]


def generate(
    model: str, overlap: bool, stops: list[str | None], rounds: int = 1, **engine_args
) -> tuple[list, dict]:
    """`outputs` of a fresh engine, and its stats."""
    with LLM(model, async_scheduling=overlap, **ENGINE, **engine_args) as llm:
        return outputs(llm, stops, rounds), llm.get_stats()


def test_overlapped_steps_give_the_same_outputs_under_stop_strings_samples_and_preemption(tiny_chat_model):
    with LLM(tiny_chat_model, async_scheduling=False, **ENGINE) as llm:
        plain = outputs(llm, [None] * len(PROMPTS))
        # A stop string from the middle of some greedy outputs, so that those stop early.
        stops = [
            out[0][0][6:9] if k % 3 == 1 and len(out[0][0]) > 12 else None for k, out in enumerate(plain)
        ]
        assert sum(s is not None for s in stops) >= 2
        before = llm.get_stats()["num_preemptions"]
        texts, stats = outputs(llm, stops), llm.get_stats()
        results = {False: (texts, {**stats, "num_preemptions": stats["num_preemptions"] - before})}
    results[True] = generate(tiny_chat_model, True, stops)
    # Two tensor-parallel workers, which answer the steps the core sends ahead in the order sent, empty
    # ones too (sent while a request waits for its pending token): a second round reads no stale answer.
    results["tp"] = generate(tiny_chat_model, True, stops, rounds=2, tensor_parallel_size=2)
    assert results[True][0] == results[False][0] == results["tp"][0]
    for texts, stats in results.values():
        assert stats["num_preemptions"] > 0 and stats["kv_cache_usage"] == 0.0
        assert any(sample[3] in stops for out in texts for sample in out if sample[3])  # a stop string hit
        assert all(len(out) == params(k).n for k, out in enumerate(texts))


def test_aborted_streams_leave_nothing_behind(tiny_chat_model):
    llm = AsyncLLM(tiny_chat_model, async_scheduling=True, **ENGINE)

    async def one(k: int) -> str:
        gen = llm.generate(PROMPTS[k % 12], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        async with asyncio.timeout(120):
            async for out in gen:
                if k % 2 and len(out.outputs[0].token_ids) >= 3:
                    await gen.aclose()  # the client went away
                    return "aborted"
        return out.outputs[0].finish_reason

    async def go():
        results = await asyncio.gather(*(one(k) for k in range(24)))
        await asyncio.sleep(0.5)  # let the last aborts reach the core
        return results, await llm.get_stats()

    try:
        results, stats = asyncio.run(go())
    finally:
        llm.shutdown()
    assert results == ["length", "aborted"] * 12
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0

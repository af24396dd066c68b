"""AsyncLLM, the streaming front end the server uses: deltas, aborts, and a soak test."""

import asyncio
import random

import pytest

from engine.async_llm import AsyncLLM
from engine.errors import InvalidRequestError
from engine.params import SamplingParams
from tests.conftest import engine_core_children


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    llm = AsyncLLM(
        tiny_chat_model,
        dtype="float32",
        max_num_seqs=32,
        num_kv_blocks=160,
        block_size=16,
        max_num_batched_tokens=256,
        enforce_eager=True,
    )
    yield llm
    llm.shutdown()
    assert not engine_core_children()


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_stream_deltas_add_up_to_the_final_output(engine):
    async def go():
        deltas, tokens, last = [], [], None
        async for out in engine.generate(
            "Tell me", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        ):
            deltas.append(out.outputs[0].delta_text)
            tokens += out.outputs[0].delta_token_ids
            last = out
        return deltas, tokens, last

    deltas, tokens, last = run(go())
    assert last.finished and len(deltas) > 1
    assert "".join(deltas) == last.outputs[0].text and tokens == last.outputs[0].token_ids


def test_a_request_id_in_use_is_refused_and_the_first_request_unharmed(engine):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def go():
        first = engine.generate("Tell me", params, request_id="twice")
        outs = [await anext(first)]
        with pytest.raises(InvalidRequestError, match="already in use"):
            await anext(engine.generate("Tell me more", params, request_id="twice"))
        outs += [out async for out in first]
        return outs[-1]

    last = run(asyncio.wait_for(go(), timeout=60))
    assert last.finished and len(last.outputs[0].token_ids) == 8
    assert not engine.queues


def test_soak_random_lengths_aborts_and_stop_strings(engine):
    """500 requests; afterwards nothing runs, nothing waits and every KV block is free."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kiln", "fire", "clay", "glaze"]

    async def one(i: int) -> str:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 120)))
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8]),
            max_tokens=rng.randint(1, 40),
            stop=[rng.choice("aeiou")] if rng.random() < 0.3 else [],
            ignore_eos=True,
        )
        abort_after = rng.randint(1, 10) if rng.random() < 0.25 else None
        await asyncio.sleep(rng.random() * 2)
        n = 0
        gen = engine.generate(prompt, params, request_id=f"soak-{i}")
        try:
            async for out in gen:
                n += 1
                if abort_after is not None and n >= abort_after:
                    return "aborted"
                if out.finished:
                    return out.outputs[0].finish_reason
        finally:
            await gen.aclose()
        return "none"

    async def go():
        results = await asyncio.gather(*(one(i) for i in range(500)))
        await asyncio.sleep(0.5)  # let the last aborts reach the core
        return results, await engine.get_stats()

    results, stats = run(go())
    assert set(results) <= {"stop", "length", "aborted"} and "stop" in results and "length" in results
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_cache_usage"] == 0.0
    assert not engine.output_processor.requests and not engine.queues

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


def test_admission_counts_samples_prompt_tokens_and_constraint_bytes(tiny_chat_model):
    from engine.errors import EngineOverloadedError
    from engine.params import StructuredOutputsParams

    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    prompt = list(range(10, 70))  # 60 tokens
    llm = AsyncLLM(
        tiny_chat_model,
        dtype="float32",
        max_num_seqs=2,
        max_pending_requests=2,  # 4 samples in flight
        max_pending_tokens=200,
        max_pending_constraint_bytes=1000,
        num_kv_blocks=80,
        block_size=16,
        enforce_eager=True,
    )

    async def go():
        held = [llm.add(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=400, ignore_eos=True))]
        assert llm.load == [3, 180, 0]
        with pytest.raises(EngineOverloadedError, match="samples"):
            llm.add(prompt, SamplingParams(n=2, temperature=1.0, max_tokens=4))
        with pytest.raises(EngineOverloadedError, match="prompt tokens"):
            llm.add(prompt, long)
        with pytest.raises(InvalidRequestError, match="alone brings 240 prompt tokens"):
            llm.add(prompt * 4, SamplingParams(max_tokens=4))
        held[0].close()  # its samples are aborted and no longer count
        assert llm.load == [0, 0, 0]
        choice = StructuredOutputsParams(choice=["x" * 300, "y" * 300])
        held.append(llm.add(prompt, SamplingParams(max_tokens=4, structured_outputs=choice)))
        with pytest.raises(EngineOverloadedError, match="bytes of constraints"):
            llm.add(prompt, SamplingParams(max_tokens=4, structured_outputs=choice))
        outs = [out async for out in held[1]]
        assert outs[-1].finished and llm.load == [0, 0, 0]
        again = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        return [out async for out in llm.generate(prompt, again)][-1]  # room again once all ended

    try:
        last = run(go())
        assert len(last.outputs[0].token_ids) == 8
        stats = run(llm.get_stats())
        assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0
    finally:
        llm.shutdown()


def test_a_stream_that_sends_its_logprobs_on_keeps_none_of_them(engine):
    """keep_logprobs=False (the server's streams): each output carries its new logprobs only, and the front
    end holds none of those already handed over; a whole-list reader still gets the whole list."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    async def go(keep: bool):
        stream = engine.add("Tell me", params, keep_logprobs=keep)
        (sample,) = engine.output_processor.requests[stream.request_id].samples.values()
        deltas, held, last = [], [], None
        async for out in stream:
            deltas += out.outputs[0].delta_logprobs
            held.append(len(sample.out.logprobs))
            last = out
        return deltas, held, last

    deltas, held, last = run(go(keep=False))
    assert len(deltas) == 24 and last.outputs[0].logprobs == [] and set(held) == {0}
    whole, _, last = run(go(keep=True))
    assert last.outputs[0].logprobs == whole == deltas  # greedy: the same tokens, the same logprobs


def test_a_failure_handling_one_requests_outputs_ends_that_request_alone(engine):
    """A request whose outputs cannot be handled (here its detokenizer raises) gets that error and is
    aborted in the core; the requests beside it and the engine go on. Last in this file: before this was
    so, such a failure took the module's engine down with it."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    async def drain(stream):
        try:
            return [out async for out in stream][-1]
        except Exception as e:
            return e

    async def go():
        poisoned, healthy = engine.add("Tell me", params), engine.add("Tell me more", params)
        (sample,) = engine.output_processor.requests[poisoned.request_id].samples.values()
        sample.detok.update = boom
        results = await asyncio.gather(drain(poisoned), drain(healthy))
        again = [out async for out in engine.generate("Once more", params)][-1]
        await asyncio.sleep(0.3)  # the abort reaches the core
        return results, again, await engine.get_stats()

    (error, healthy), again, stats = run(asyncio.wait_for(go(), timeout=60))
    assert isinstance(error, RuntimeError) and str(error) == "boom", error
    assert healthy.finished and len(healthy.outputs[0].token_ids) == 40
    assert again.finished and not engine.dead
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0
    assert not engine.output_processor.requests and not engine.queues

"""Request priority end to end (`--scheduling-policy priority`): with the batch full, a request sent last
but more urgent runs before the less urgent ones that were waiting; under fcfs a priority is refused."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_llm import AsyncLLM
from engine.errors import InvalidRequestError
from engine.input_processor import InputProcessor
from engine.params import SamplingParams
from tests.conftest import engine_core_children

ENGINE = dict(
    dtype="float32", enforce_eager=True, max_num_seqs=1, max_model_len=256, num_kv_blocks=32, block_size=16
)


def test_an_urgent_request_sent_last_finishes_before_the_waiting_ones(tiny_chat_model):
    llm = AsyncLLM(tiny_chat_model, scheduling_policy="priority", **ENGINE)
    finished: list[str] = []

    async def drain(name: str, stream) -> None:
        async for out in stream:
            if out.finished:
                finished.append(name)

    def send(name: str, max_tokens: int, priority: int):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)
        return llm.generate(f"Request {name}:", params, request_id=name)

    async def go() -> None:
        busy = send("busy", 64, 0)
        await anext(busy)  # its first token is out: it holds the one slot, and the others all wait
        rest = [("low-1", 5), ("low-2", 5), ("normal", 0), ("urgent", -3)]
        await asyncio.gather(drain("busy", busy), *(drain(n, send(n, 4, p)) for n, p in rest))

    try:
        asyncio.run(go())
        assert finished == ["busy", "urgent", "normal", "low-1", "low-2"]
    finally:
        llm.shutdown()
    assert not engine_core_children()


def test_a_priority_is_refused_under_fcfs_in_vllms_words(tiny_chat_model):
    from engine.model_files import load_tokenizer

    tok = load_tokenizer(tiny_chat_model)
    fcfs, priority = (InputProcessor(tok, 64, [2], len(tok), policy) for policy in ("fcfs", "priority"))
    refusal = "Got priority 1 but Priority scheduling is not enabled"
    with pytest.raises(InvalidRequestError, match=refusal) as e:
        fcfs.process("r", "hi", SamplingParams(priority=1), 0.0)
    assert e.value.param == "priority"
    assert fcfs.process("r", "hi", SamplingParams(priority=0), 0.0).params.priority == 0
    prepared = priority.process("r", "hi", SamplingParams(n=2, priority=-7), 0.0)
    assert [r.sampling_params.priority for r in prepared.core_requests] == [-7, -7]

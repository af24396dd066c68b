"""Conditions that used to hang, freeze or crash the engine: each fails fast and clearly now, costing no other
request anything. What would hang runs in a subprocess or thread with a deadline."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine import processes
from engine.async_llm import AsyncLLM
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from engine.input_processor import InputProcessor
from engine.llm import LLM
from engine.output_processor import OutputProcessor
from engine.params import SamplingParams
from tests.conftest import TINY, engine_core_children
from tests.test_server_app import EOS, ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(dtype="float32", enforce_eager=True, num_kv_blocks=64)


def run_script(source: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `source` in a fresh Python from the repository root; a hang past `timeout` fails the test."""
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(source)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"still running after {timeout} s: {(e.stdout or b'')[-2000:]!r} {(e.stderr or b'')[-2000:]!r}"
        )


def in_thread(coro_fn, timeout: float = 30):
    """Run `coro_fn()` on its own event loop in a daemon thread: a frozen loop fails the test, not the run."""
    result: list = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro_fn()))
        except BaseException as e:  # raised in the test's thread
            result.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the event loop was still blocked after {timeout} s"
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def test_a_script_that_leaves_its_engine_alive_exits(tiny_chat_model):
    done = run_script(
        f"""
        from engine import LLM, SamplingParams
        from transformers import AutoModelForCausalLM

        llm = LLM({tiny_chat_model!r}, dtype="float32", enforce_eager=True, num_kv_blocks=64)
        out = llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
        hf = AutoModelForCausalLM.from_pretrained({tiny_chat_model!r})
        print("generated", len(out[0].outputs[0].token_ids))
        """,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generated 3" in done.stdout


def test_a_core_that_exits_before_connecting_fails_the_start(tiny_chat_model):
    done = run_script(
        f"""
        import subprocess, sys
        import engine.core_client as cc
        from engine import LLM
        from engine.errors import EngineDeadError

        real = subprocess.Popen
        cc.subprocess.Popen = lambda cmd, **kw: real([sys.executable, "-c", "raise SystemExit(3)"], **kw)
        try:
            LLM({tiny_chat_model!r}, dtype="float32", enforce_eager=True, num_kv_blocks=64)
        except EngineDeadError as e:
            print("refused:", e)
        """,
        timeout=60,
    )
    assert "refused: engine core process exited unexpectedly (exit code 3)" in done.stdout, done.stderr[
        -3000:
    ]


def test_the_core_stays_when_its_front_end_is_pid_1(monkeypatch):
    monkeypatch.setattr(processes.ctypes, "CDLL", lambda *a, **k: SimpleNamespace(prctl=lambda *a: 0))
    monkeypatch.setattr(os, "getppid", lambda: 1)
    processes.die_with_parent(1)  # a container's entrypoint: the front end really is pid 1
    with pytest.raises(SystemExit):
        processes.die_with_parent(4242)  # reparented to init: the front end is gone


@pytest.fixture
def async_engine(tiny_chat_model):
    """An engine of the test's own: for tests that break it."""
    llm = AsyncLLM(tiny_chat_model, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def shared_engine(tiny_chat_model):
    """One engine for the tests that leave it as they found it."""
    llm = AsyncLLM(tiny_chat_model, **ENGINE)
    yield llm
    llm.shutdown()


def test_a_request_just_after_the_core_died_fails_without_freezing_the_loop(async_engine):
    async def go():
        proc = async_engine.client.cores[0].proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()  # dead, and nothing on this loop has had a chance to notice
        with pytest.raises(EngineDeadError, match="exited unexpectedly"):
            async for _ in async_engine.generate("hi", SamplingParams(max_tokens=2)):
                pass
        return True

    assert in_thread(go) is True


def test_a_failure_handling_outputs_fails_every_request_in_flight(async_engine, monkeypatch):
    def broken(outputs):
        raise RuntimeError("boom")

    async def one(prompt: str) -> BaseException | None:
        try:
            async for _ in async_engine.generate(prompt, SamplingParams(max_tokens=50, ignore_eos=True)):
                monkeypatch.setattr(async_engine.output_processor, "process_outputs", broken)
        except BaseException as e:
            return e
        return None

    async def go():
        results = await asyncio.wait_for(asyncio.gather(one("a"), one("b")), 30)
        with pytest.raises(EngineDeadError):  # not a fresh reader that silently serves nothing
            await anext(async_engine.generate("c", SamplingParams(max_tokens=2)))
        return results

    results = in_thread(go, timeout=60)
    assert all(isinstance(e, EngineDeadError) and "RuntimeError: boom" in str(e) for e in results), results


def test_a_request_id_equal_to_another_requests_sample_id_is_refused():
    tok = ByteTokenizer()
    inputs, outputs = InputProcessor(tok, 64, [EOS], len(tok)), OutputProcessor(tok)
    outputs.add_request(inputs.process("x", "hello", SamplingParams(n=2), 0.0))
    with pytest.raises(InvalidRequestError, match="already in use"):
        outputs.add_request(inputs.process("x#0", "hello", SamplingParams(), 0.0))
    outputs.add_request(inputs.process("y#1", "hello", SamplingParams(), 0.0))
    with pytest.raises(InvalidRequestError, match="already in use"):
        outputs.add_request(inputs.process("y", "hello", SamplingParams(n=2), 0.0))
    assert set(outputs.core_to_request) == {"x#0", "x#1", "y#1"}


def test_a_requests_samples_share_one_prompt_and_constraint_on_the_wire():
    import msgspec

    from engine.params import StructuredOutputsParams

    tok = ByteTokenizer()
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(2000)}}
    params = SamplingParams(n=64, seed=5, structured_outputs=StructuredOutputsParams(json=schema))
    prepared = InputProcessor(tok, 64, [EOS], len(tok)).process("r", "hello", params, 0.0)
    wire = msgspec.msgpack.encode(prepared.core_request)
    assert len(wire) < 1.1 * len(msgspec.msgpack.encode(schema))  # once, not 64 times
    samples = msgspec.msgpack.decode(wire, type=type(prepared.core_request)).samples()
    assert (
        [s.request_id for s in samples] == [f"r#{i}" for i in range(64)] == prepared.core_request.sample_ids()
    )
    assert [s.sampling_params.seed for s in samples] == list(range(5, 69))
    assert all(s.prompt_token_ids is samples[0].prompt_token_ids for s in samples)
    assert prepared.cost == (
        64,
        64 * len(prepared.prompt_token_ids),
        len(msgspec.json.encode(params.structured_outputs)),
    )


def test_a_kv_cache_smaller_than_one_sequence_is_refused_at_start(tiny_chat_model):
    with pytest.raises(EngineDeadError, match=r"holds 448 tokens \(7 blocks of 64\), fewer than one"):
        LLM(tiny_chat_model, dtype="float32", enforce_eager=True, num_kv_blocks=8, max_model_len=512)


def test_token_ids_the_model_cannot_embed_are_refused(tmp_path, tiny_chat_model):
    """A tokenizer longer than the model's vocabulary (added tokens): the ids in between are a 400, not a
    crash of the engine core for everyone."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**dict(TINY, vocab_size=49000))).save_pretrained(tmp_path)
    for f in Path(tiny_chat_model).iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, tmp_path / f.name)
    with LLM(str(tmp_path), **ENGINE) as llm:
        assert len(llm.tokenizer) > 49000
        with pytest.raises(InvalidRequestError, match=r"in \[0, 49000\)"):
            llm.generate([[1, 49100]], use_tqdm=False)
        out = llm.generate([[1, 48999]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        pid = llm.client.cores[0].proc.pid
    assert pid not in engine_core_children()


def test_a_front_end_holding_its_limit_refuses_more_until_one_finishes(tiny_chat_model):
    llm = AsyncLLM(tiny_chat_model, **ENGINE, max_num_seqs=1, max_pending_requests=1)

    async def go():
        async def drain(prompt: str) -> list:
            return [o async for o in llm.generate(prompt, SamplingParams(max_tokens=64, ignore_eos=True))]

        held = [asyncio.ensure_future(drain(p)) for p in ("a", "b")]  # one running, one waiting for a slot
        while len(llm.output_processor.requests) < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineOverloadedError, match="limit is 2"):
            await anext(llm.generate("c", SamplingParams(max_tokens=2)))
        firsts = await asyncio.gather(*held)
        outs = [o async for o in llm.generate("d", SamplingParams(max_tokens=2))]
        return firsts, outs

    try:
        firsts, outs = in_thread(go, timeout=120)
    finally:
        llm.shutdown()
    assert [len(f[-1].outputs[0].token_ids) for f in firsts] == [64, 64] and outs[-1].finished


def test_a_reader_that_falls_behind_holds_one_merged_output(shared_engine):
    """Outputs a stream's reader has not taken are merged, not queued: one waits, carrying every delta."""

    async def go():
        stream = shared_engine.generate(
            "Tell me", SamplingParams(max_tokens=200, ignore_eos=True, logprobs=1)
        )
        first = await anext(stream)
        rid = first.request_id
        while rid in shared_engine.output_processor.requests:  # the engine runs on; nobody reads
            await asyncio.sleep(0.05)
        rest = [out async for out in stream]
        return first, rest

    first, rest = in_thread(go, timeout=120)
    assert len(rest) == 1 and rest[0].finished
    a, b = first.outputs[0], rest[0].outputs[0]
    assert a.delta_token_ids + b.delta_token_ids == b.token_ids and len(b.token_ids) == 200
    assert a.delta_text + b.delta_text == b.text
    assert a.delta_logprobs + b.delta_logprobs == b.logprobs


def test_requests_share_cached_prefixes_only_within_their_cache_salt(shared_engine):
    prompt = list(range(1, 130))  # two full pages of 64 tokens, and one more token

    async def cached(salt: str | None) -> int:
        request = shared_engine.process(prompt, SamplingParams(max_tokens=1), cache_salt=salt)
        outs = [o async for o in shared_engine.generate(request)]
        return outs[-1].num_cached_tokens

    async def go():
        return [await cached(s) for s in ("alice", "bob", "alice", None, None)]

    first_alice, bob, alice, first_unsalted, unsalted = in_thread(go, timeout=60)
    assert first_alice == 0 and bob == 0 and first_unsalted == 0  # no salt sees another's blocks
    assert alice > 0 and unsalted > 0


def test_a_request_head_that_trickles_in_is_cut_off(monkeypatch):
    import socket
    import time

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from server import transport

    monkeypatch.setattr(transport, "HEAD_TIMEOUT_S", 0.5)

    async def echo(request):
        return PlainTextResponse(f"got {len(await request.body())}")

    app = Starlette(routes=[Route("/x", echo, methods=["GET", "POST"])])
    config = transport.uvicorn_config(app, limit_concurrency=16, log_level="warning")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        config.port = s.getsockname()[1]
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def connect() -> socket.socket:
        conn = socket.create_connection(("127.0.0.1", config.port), timeout=5)
        conn.settimeout(5)
        return conn

    try:
        with connect() as slow:  # a header line every 0.2 s: never a whole head
            slow.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\n")
            start, closed = time.monotonic(), False
            while time.monotonic() - start < 4 and not closed:
                time.sleep(0.2)
                try:
                    slow.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    closed = True
            if not closed:
                slow.settimeout(0.5)
                try:
                    closed = slow.recv(100) == b""
                except TimeoutError:
                    closed = False
            assert closed, "a trickling head kept its connection"
            assert time.monotonic() - start < 2
        with connect() as kept:  # whole heads, two on one connection, and a body slower than the deadline
            for _ in range(2):
                kept.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
                assert read_reply(kept, b"got 0").startswith(b"HTTP/1.1 200")
                time.sleep(0.3)
            kept.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\n")
            for byte in b"body":
                time.sleep(0.3)
                kept.sendall(bytes([byte]))
            assert read_reply(kept, b"got 4").startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(10)


def read_reply(conn, marker: bytes) -> bytes:
    reply = b""
    while marker not in reply:
        chunk = conn.recv(1000)
        assert chunk, f"closed before {marker!r}: {reply!r}"
        reply += chunk
    return reply


def test_a_big_step_is_detokenized_in_chunks_between_which_the_loop_runs(shared_engine, monkeypatch):
    from engine import async_llm
    from engine.messages import EngineCoreOutput

    events: list = []
    process = shared_engine.output_processor.process_outputs

    def recorded(outputs):
        events.append(len(outputs))
        return process(outputs)

    monkeypatch.setattr(shared_engine.output_processor, "process_outputs", recorded)

    async def go():
        async def tick():
            while True:
                events.append("tick")
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        await shared_engine._on_outputs([EngineCoreOutput(f"x{i}", [1]) for i in range(100)])
        ticker.cancel()
        return events

    chunks = [e for e in in_thread(go) if e != "tick"]
    assert chunks == [32, 32, 32, 4] and async_llm.OUTPUT_CHUNK == 32
    between = "".join("t" if e == "tick" else "c" for e in events)
    assert "ctc" in between.replace("tt", "t"), between  # the loop ran between every two chunks
    assert between.count("cc") == 0, between


def test_sends_to_a_core_whose_inbox_is_full_never_freeze_the_event_loop(monkeypatch):
    """Past what a core's inbox holds (here: one that has not connected yet), a send returns at once and
    its message follows the ones before it once the core takes them; the loop never waits on the core."""
    import socket
    import time

    import msgspec
    import zmq
    import zmq.asyncio

    from engine import core_client, core_procs
    from engine import messages as m
    from engine.config import EngineConfig

    for port in range(23000, 24000, 2):  # the core's input port, and its output port after it
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        break
    deadline = time.monotonic() + 5  # a send that waits for room would wait until the core is gone
    gone = lambda _: "gone" if time.monotonic() > deadline else None  # noqa: E731
    monkeypatch.setattr(core_procs.RemoteCore, "gone", gone)
    count = 1500  # past the 1,000 messages a socket queues

    async def go():
        client = core_client.AsyncCoreClient(EngineConfig(engine_core_addresses=f"tcp://127.0.0.1:{port}"))
        client.ready = object()  # past the start, whose sends wait for room
        try:
            start = time.monotonic()
            for i in range(count):
                client.send(client.cores[0], m.AbortRequests([str(i)]))
            took = time.monotonic() - start
            inbox = zmq.asyncio.Socket.from_socket(client.ctx.socket(zmq.PULL))
            inbox.bind(f"tcp://127.0.0.1:{port}")  # the core starts taking messages
            decoder, got = msgspec.msgpack.Decoder(m.CoreInput), []
            while len(got) < count and await inbox.poll(2000):
                msg = decoder.decode(await inbox.recv())
                got += [] if isinstance(msg, m.Heartbeat) else msg.request_ids
            return took, got
        finally:
            client.shutdown()

    took, got = in_thread(go, timeout=30)
    assert took < 1.0, f"{count} sends held the event loop for {took:.1f} s"
    assert got == [str(i) for i in range(count)]

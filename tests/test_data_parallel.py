"""Data parallelism through the server: two engine cores behind one front end serve a burst of requests
with the output of one core, both taking a share, and one core's death fails only the requests it held."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.llm import LLM, SamplingParams
from engine.processes import free_port
from server import cli
from tests.conftest import children_of
from tests.test_server_lifecycle import ROOT, start

GREEDY = {"max_tokens": 8, "temperature": 0}


def cores_of(server_pid: int) -> dict[int, int]:
    """The server's engine-core processes by data-parallel index (read from their input socket's name)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().decode()
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            match = re.search(r"engine\.core\0ipc://\S+?/in(\d+)\0", cmd)
            if match and ppid == server_pid:
                found[int(match.group(1))] = int(proc.name)
    return found


# Over a KV block each, so that every core's prefix-cache lookups count the prompts it served.
PROMPTS = [
    f"Story {i}: once upon a time, in a land far away, a potter fired clay in a kiln" for i in range(64)
]
ENGINE = dict(dtype="float32", enforce_eager=True, kv_cache_memory=50_000_000)


def generate(model: str, prompts: list[str], **engine_args) -> tuple[list[str], dict]:
    with LLM(model, **ENGINE, **engine_args) as llm:
        outs = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
        return [o.outputs[0].text for o in outs], llm.get_stats()


@pytest.fixture(scope="module")
def expected(tiny_chat_model) -> list[str]:
    """One engine core's greedy outputs."""
    return generate(tiny_chat_model, PROMPTS)[0]


def test_two_engine_cores_share_the_load_and_one_dying_fails_only_its_requests(
    tiny_chat_model, expected, tmp_path
):
    prompts = PROMPTS
    proc, url = start(tiny_chat_model, tmp_path / "log", "--data-parallel-size", "2")
    try:
        cores = cores_of(proc.pid)
        assert sorted(cores) == [0, 1]

        async def burst() -> list[str]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                rs = await asyncio.gather(
                    *(http.post("/v1/completions", json={**GREEDY, "prompt": p}) for p in prompts)
                )
            return [r.json()["choices"][0]["text"] for r in rs]

        assert asyncio.run(burst()) == expected
        served: set[str] = set()
        deadline = time.monotonic() + 10  # /metrics may answer from stats a second old
        while served != {"0", "1"} and time.monotonic() < deadline:
            metrics = httpx.get(url + "/metrics").text
            queries = re.findall(
                r'^kiln:prefix_cache_queries_total\{engine="(\d)",[^}]*\} (\S+)$', metrics, re.M
            )
            served = {engine for engine, value in queries if float(value) > 0}
            time.sleep(0.3)
        assert served == {"0", "1"}, metrics

        ends: dict[int, dict] = {}
        started = [threading.Event() for _ in range(8)]

        def stream(i: int) -> None:
            body = {"prompt": f"Tale {i}", "max_tokens": 490, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ends[i] = json.loads(line.removeprefix("data: "))
                        started[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(60)
        os.kill(cores[1], signal.SIGKILL)
        for t in threads:
            t.join(60)
        failed = [end["error"]["message"] for end in ends.values() if "error" in end]
        finished = [end["choices"][0]["finish_reason"] for end in ends.values() if "error" not in end]
        assert failed and all("engine core 1" in message for message in failed), failed
        assert finished and set(finished) == {"length"}, ends  # core 0's streams ran to their end
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "engine core 1" in health.text, health.text
        r = httpx.post(url + "/v1/completions", json={**GREEDY, "prompt": prompts[0]}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[0]  # core 0 serves on
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert not Path(f"/proc/{cores[0]}").exists()


def listening_port() -> int:
    """A port P with P+1 free too: a headless core listens on both."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def test_headless_cores_on_two_hosts_serve_one_front_end(tiny_chat_model, expected, tmp_path):
    """Two `kiln serve --headless` processes on loopback stand for two hosts, each running one engine
    core for a front end started with their addresses; when it leaves, each waits for the next."""
    ports = [listening_port()]
    ports.append(next(p for p in iter(listening_port, None) if abs(p - ports[0]) > 1))
    hosts = []
    for port in ports:
        with open(tmp_path / f"host-{port}.log", "wb") as log:
            hosts.append(
                subprocess.Popen(
                    [sys.executable, "-m", "server", "--headless", "--port", str(port)],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
    try:
        addresses = [f"tcp://127.0.0.1:{port}" for port in ports]
        texts, stats = generate(tiny_chat_model, PROMPTS, engine_core_addresses=",".join(addresses))
        assert texts == expected
        assert all(stats["engines"][str(i)]["prefix_cache_queries"] > 0 for i in range(2)), stats
        texts, _ = generate(tiny_chat_model, PROMPTS[:4], engine_core_addresses=addresses[1])
        assert texts == expected[:4]  # the next front end finds a fresh core waiting
        assert all(host.poll() is None for host in hosts)
    finally:
        for host in hosts:
            host.terminate()
        for host in hosts:
            host.wait(30)
    time.sleep(0.5)
    left = [p for p in Path("/proc").glob("[0-9]*") if b"--listen" in _cmdline(p)]
    assert not [p for p in left if any(f":{port}".encode() in _cmdline(p) for port in ports)]


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_headless_host_s_core_still_starting_ends_with_it(stop):
    """Stopped while its core is still starting (before the kernel would kill the core with it), a host stops
    the core and waits for it; killed, it leaves a core that ends itself once it finds its host gone."""
    host = subprocess.Popen(
        [sys.executable, "-m", "server", "--headless", "--port", str(listening_port())],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    cores: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not (cores := children_of(host.pid, "engine.core")):
            assert time.monotonic() < deadline and host.poll() is None, "the host started no core"
            time.sleep(0.01)
        host.send_signal(stop)
        assert host.wait(30) == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
        deadline = time.monotonic() + (0 if stop == signal.SIGTERM else 30)
        while _cmdline(Path(f"/proc/{cores[0]}")):  # gone, or a zombie left for init to reap
            assert time.monotonic() < deadline, "the core outlived its host"
            time.sleep(0.1)
    finally:
        host.kill()
        host.wait()
        for core in cores:
            with contextlib.suppress(ProcessLookupError):
                os.kill(core, signal.SIGKILL)


def test_headless_takes_no_model_or_engine_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--headless", "--dtype", "float32"])
    assert exit_.value.code == 2
    assert "takes the model and engine flags from the front end" in capsys.readouterr().err


def test_a_prompt_goes_to_the_core_that_caches_its_prefix_though_another_is_idle(tiny_chat_model):
    from engine.async_llm import AsyncLLM

    llm = AsyncLLM(tiny_chat_model, data_parallel_size=2, **ENGINE)
    prefix = PROMPTS[0] * 3  # a few KV blocks

    async def go() -> dict:
        async def finish(prompt: str, **params) -> None:
            async for _ in llm.generate(prompt, SamplingParams(temperature=0, **params)):
                pass

        await finish(prefix + " first", max_tokens=1)  # both idle: core 0, which now caches the prefix
        view = llm.client.coordinator.cached  # what the cores report they cache
        assert view[0] and not view[1]
        busy = asyncio.ensure_future(finish("unrelated", max_tokens=400, ignore_eos=True))  # core 0 again
        await asyncio.sleep(0.5)
        before = (await llm.get_stats())["engines"]
        await finish(prefix + " second", max_tokens=1)  # core 1 is idle, but core 0 holds the prefix
        after = (await llm.get_stats())["engines"]
        busy.cancel()
        counts = ("prefix_cache_hits", "prefix_cache_queries")
        return {core: {k: after[core][k] - before[core][k] for k in counts} for core in after}

    try:
        delta = asyncio.run(go())
    finally:
        llm.shutdown()
    assert delta["0"]["prefix_cache_hits"] > 0 and delta["1"]["prefix_cache_queries"] == 0, delta

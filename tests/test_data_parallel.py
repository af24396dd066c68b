"""Data parallelism through the server: two engine cores behind one front end serve a burst of requests
with the output of one core, both taking a share, and one core's death fails only the requests it held."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx

from engine.llm import LLM, SamplingParams
from tests.test_server_lifecycle import start

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


def test_two_engine_cores_share_the_load_and_one_dying_fails_only_its_requests(tiny_chat_model, tmp_path):
    # Over a KV block each, so that every core's prefix-cache lookups count the prompts it served.
    prompts = [
        f"Story {i}: once upon a time, in a land far away, a potter fired clay in a kiln" for i in range(64)
    ]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    with LLM(tiny_chat_model, dtype="float32", enforce_eager=True, kv_cache_memory=50_000_000) as llm:
        expected = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]

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

"""`kiln serve` stopping: a drain on SIGTERM that ends every stream properly, and an exit when the engine
core dies for a supervisor that asks for one. Each test runs its own server, in its own process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import engine_core_of

ROOT = Path(__file__).resolve().parents[1]


def start(model: str, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--kv-cache-memory", "50000000"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", model, *args, *flags],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, as under a supervisor
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail("kiln serve did not become ready: " + log.read_text()[-3000:])


def test_sigterm_to_the_group_drains_then_ends_streams_with_an_error_and_done(tiny_chat_model, tmp_path):
    proc, url = start(tiny_chat_model, tmp_path / "log", "--shutdown-timeout", "2")
    events: dict[int, list] = {i: [] for i in range(4)}
    started = [threading.Event() for _ in events]

    def stream(i: int) -> None:
        body = {"prompt": "Once", "max_tokens": 490, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[i].append((time.monotonic(), line.removeprefix("data: ")))
                    started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in events]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(60)
    core, signalled = engine_core_of(proc.pid), time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)  # the engine core gets it too, and must stay for the drain
    time.sleep(0.3)
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and "shutting down" in health.text
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=5).status_code == 503
    for t in threads:
        t.join(30)
    assert proc.wait(30) is not None
    for i, evs in events.items():
        assert evs[-1][1] == "[DONE]", (i, evs[-3:])
        assert any(t > signalled + 0.2 for t, _ in evs[:-1]), "tokens kept coming during the drain"
        last = json.loads(evs[-2][1])
        assert last.get("error", {}).get("message") == "the server is shutting down" or (
            last["choices"] and last["choices"][0]["finish_reason"] == "length"
        ), last
    assert any("error" in json.loads(evs[-2][1]) for evs in events.values()), "no stream outlived the drain"
    assert not Path(f"/proc/{core}").exists()  # stopped by its front end, after the drain


def test_exit_on_engine_death_exits_for_a_supervisor(tiny_chat_model, tmp_path):
    proc, _ = start(tiny_chat_model, tmp_path / "log", "--exit-on-engine-death")
    os.kill(engine_core_of(proc.pid), signal.SIGKILL)
    assert proc.wait(20) == 1, (tmp_path / "log").read_text()[-3000:]

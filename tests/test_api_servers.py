"""`kiln serve --api-server-count 2 --data-parallel-size 2`: two HTTP server processes on one port, both
reaching both engine cores through the DP coordinator's view; requests spread over the cores, a repeated
prefix goes to the core that caches it whichever server takes it, one scrape counts every server's
requests, and a dead API server or core leaves the rest serving."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from server.api import STATS_MAX_AGE_S
from tests.conftest import children_of
from tests.test_server_lifecycle import start

LONG = " ".join(f"word{i}" for i in range(150))  # a few blocks of 64 tokens


def complete(url: str, prompt: str, max_tokens: int = 4) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        return client.post(url + "/v1/completions", json=body).status_code  # a connection of its own


def scrape(url: str, engines: bool = True) -> dict[str, float]:
    """Each series of /metrics by its name and labels, e.g. 'kiln:prefix_cache_hits_total{engine="0"}'; with
    `engines`, the engines' as they are now (a server answers from stats up to STATS_MAX_AGE_S old)."""
    time.sleep(STATS_MAX_AGE_S + 0.1 if engines else 0)
    with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        text = client.get(url + "/metrics").text
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model_name="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
            series[name] = float(value)
    return series


def per_engine(series: dict[str, float], name: str) -> list[float]:
    return [series.get(f'{name}{{engine="{i}"}}', 0.0) for i in range(2)]


def served_by(log: Path, marker: str) -> set[str]:
    """The API servers (their index) whose request log lines hold `marker`."""
    return set(re.findall(rf"\[api (\d)\] \S+ {re.escape(marker)}", log.read_text()))


def test_two_api_servers_route_over_two_cores_and_outlive_each_other(tiny_chat_model, tmp_path):
    log = tmp_path / "log"
    flags = ("--api-server-count", "2", "--data-parallel-size", "2", "--max-num-seqs", "16")
    launcher, url = start(tiny_chat_model, log, *flags)
    try:
        servers = children_of(launcher.pid, "--api-server ")
        cores = children_of(launcher.pid, "engine.core")
        coordinator = children_of(launcher.pid, "engine.coordinator")
        assert len(servers) == 2 and len(cores) == 2 and len(coordinator) == 1
        # Concurrent prompts spread over both cores; both servers take some.
        prompts = [f"Story {i}: once upon a time" for i in range(24)]
        with ThreadPoolExecutor(12) as pool:
            assert list(pool.map(lambda p: complete(url, p), prompts)) == [200] * 24
        assert served_by(log, "prompt_tokens=") == {"1", "2"}
        series = scrape(url)
        assert all(n > 0 for n in per_engine(series, "kiln:prefix_cache_queries_total")), series
        # Any scrape counts both servers' requests.
        for _ in range(4):
            assert scrape(url, engines=False)['kiln:request_success_total{finished_reason="length"}'] == 24
        # A long prompt, then the same again, a few at a time, through either server: all to the core that
        # cached it the first time (three in flight are well within the load a cached prefix may carry).
        body = {"prompt": LONG, "max_tokens": 4, "ignore_eos": True}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        long_tokens = first["usage"]["prompt_tokens"]
        before = per_engine(scrape(url), "kiln:prefix_cache_hits_total")
        with ThreadPoolExecutor(3) as pool:  # three at a time: both servers take some
            assert list(pool.map(lambda _: complete(url, LONG), range(12))) == [200] * 12
        hits = [a - b for a, b in zip(per_engine(scrape(url), "kiln:prefix_cache_hits_total"), before)]
        assert sorted(hits)[0] == 0 and sorted(hits)[1] >= 12 * 64, hits
        assert served_by(log, f"prompt_tokens={long_tokens} ") == {"1", "2"}  # LONG's came through both
        # One API server killed mid-stream: its requests end in the cores, the other serves on.
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(complete, url, f"Tale {i}", 300) for i in range(8)]
            time.sleep(1.0)
            os.kill(servers[0], signal.SIGKILL)
            codes = [s.exception() or s.result() for s in streams]
        assert any(c == 200 for c in codes), codes
        assert [complete(url, f"After {i}") for i in range(4)] == [200] * 4
        deadline, usage = time.monotonic() + 10, [1.0]
        while any(usage) and time.monotonic() < deadline:
            usage = per_engine(scrape(url), "kiln:kv_cache_usage_perc")
        assert not any(usage), usage
        # One core killed: the servers go on with the other, and say so.
        os.kill(cores[0], signal.SIGKILL)
        time.sleep(1.0)
        assert [complete(url, f"Later {i}") for i in range(4)] == [200] * 4
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "engine core" in health.text
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    assert launcher.returncode == 0, log.read_text()[-3000:]
    assert not [pid for pid in [*servers, *cores, *coordinator] if Path(f"/proc/{pid}").exists()]

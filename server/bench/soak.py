"""`kiln bench soak`: many clients misbehaving at once against one `kiln serve`, then whether it came back.

Clients stream, wait for whole answers, hang up after the first chunk, read one chunk a second, give up
mid-request, send bad bodies and bursts that draw 429s, paced so `requests` start over `duration_s`.
Throughout, a thread times /health and reads both processes' resident memory. The verdict: no
unexpected answer, /health p99 under 100 ms, every KV block free once idle, resident memory of the
server and its engine core within 20 % of where it stood after a warm-up round, and no engine core left
once the server has stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from server.bench.serve import launch

HEALTH_P99_MS = 100.0
RSS_GROWTH = 1.2
BURST = 12  # requests a burst sends at once: more than the limits in the defaults below let in
DEFAULT_FLAGS = {"--max-num-seqs": "8", "--max-pending-requests": "4"}
SLOW_PAUSE_S = 1.0  # a slow reader's pause after each event it reads
KINDS = {"stream": 25, "complete": 15, "drop": 15, "slow": 8, "abort": 12, "bad": 15, "burst": 2}
BAD_BODIES = [
    b"{not json",
    b"[]",
    json.dumps({"prompt": "hi", "max_tokens": -3}).encode(),
    json.dumps({"prompt": "hi", "n": 100000}).encode(),
    json.dumps({"prompt": "hi", "stop": ["x" * 5000]}).encode(),
    json.dumps({"prompt": [[10**9]]}).encode(),
    json.dumps({"prompt": "hi", "temperature": "hot"}).encode(),
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    json.dumps(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"},
        }
    ).encode(),
]


def _rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+)", text, re.M).group(1)) * 1024


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def engine_core_pid(server_pid: int) -> int:
    """The server's child that runs the engine core."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes()
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
            if b"engine.core" in cmd and ppid == server_pid:
                return int(proc.name)
    raise RuntimeError(f"no engine core under process {server_pid}")


# Timed in a process of its own: in the clients' process, their event loop would hold the GIL and the
# wait would be the client's, not the server's.
PROBE = """
import http.client, sys, time
host, port = sys.argv[1], int(sys.argv[2])
while True:
    start = time.perf_counter()
    try:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
    except OSError:
        ok = False
    print(f"{(time.perf_counter() - start) * 1000:.3f} {int(ok)}", flush=True)
    time.sleep(0.2)
"""


class Watch(threading.Thread):
    """Times /health every 0.2 s from a process of its own, and tracks resident memory, until stopped."""

    def __init__(self, url: str, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.stop = pids, threading.Event()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, host, port], stdout=subprocess.PIPE, text=True
        )
        self.health_ms: list[float] = []
        self.health_fail = 0
        self.rss_max = {name: 0 for name in pids}

    def run(self) -> None:
        for line in self.probe.stdout:  # type: ignore[union-attr]
            ms, ok = line.split()
            self.health_ms.append(float(ms))
            self.health_fail += ok != "1"
            for name, pid in self.pids.items():
                self.rss_max[name] = max(self.rss_max[name], _rss(pid))
            if self.stop.is_set():
                break

    def finish(self) -> None:
        self.stop.set()
        self.probe.kill()  # its output ends, and with it the loop above
        self.probe.wait()
        self.join()


class Clients:
    """The misbehaving clients; `outcomes` counts (kind, result), `unexpected` keeps what should not be."""

    def __init__(self, client: httpx.AsyncClient, model: str, seed: int) -> None:
        self.c, self.model, self.rng = client, model, random.Random(seed)
        self.outcomes: Counter = Counter()
        self.unexpected: list[str] = []

    def body(self, chat: bool, max_tokens: int, stream: bool) -> tuple[str, dict]:
        words = " ".join(self.rng.choice(["kiln", "fire", "clay", "glaze", "pot"]) for _ in range(12))
        base = {"model": self.model, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
        if chat:
            return "/v1/chat/completions", base | {"messages": [{"role": "user", "content": words}]}
        return "/v1/completions", base | {"prompt": words}

    def note(self, kind: str, result: str, ok: bool, detail: object = "") -> None:
        self.outcomes[kind, result] += 1
        if not ok:
            self.unexpected.append(f"{kind}: {result} {detail}"[:300])

    async def run(self, kind: str) -> None:
        try:
            await getattr(self, kind)()
        except httpx.TimeoutException as e:
            self.note(kind, "client timeout", kind == "abort", e)
        except httpx.HTTPError as e:
            self.note(kind, type(e).__name__, False, e)

    async def _stream(self, kind: str, max_tokens: int, chunks: int | None, pause: float) -> None:
        path, body = self.body(self.rng.random() < 0.5, max_tokens, True)
        async with self.c.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self.note(kind, str(r.status_code), r.status_code == 429, r.text)
                return
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if chunks is not None and len(events) >= chunks:
                        self.note(kind, "dropped", True)
                        return
                    await asyncio.sleep(pause)
            done = len(events) >= 2 and events[-1] == "[DONE]" and "error" not in json.loads(events[-2])
            self.note(kind, "done" if done else "cut", done, events[-2:])

    async def stream(self) -> None:
        await self._stream("stream", self.rng.randint(1, 48), None, 0)

    async def drop(self) -> None:
        await self._stream("drop", 400, 1, 0)

    async def slow(self) -> None:
        await self._stream("slow", 6, None, SLOW_PAUSE_S)

    async def complete(self, kind: str = "complete", max_tokens: int | None = None) -> None:
        path, body = self.body(self.rng.random() < 0.5, max_tokens or self.rng.randint(1, 48), False)
        r = await self.c.post(path, json=body)
        usage_ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == body["max_tokens"]
        self.note(kind, str(r.status_code), usage_ok or r.status_code == 429, r.text[:200])

    async def abort(self) -> None:
        path, body = self.body(False, 400, False)
        r = await self.c.post(path, json=body, timeout=0.5)
        self.note("abort", str(r.status_code), r.status_code in (200, 429), r.text[:200])

    async def bad(self) -> None:
        data = self.rng.choice(BAD_BODIES)
        path = "/v1/chat/completions" if b"messages" in data else "/v1/completions"
        r = await self.c.post(path, content=data, headers={"Content-Type": "application/json"})
        self.note("bad", str(r.status_code), 400 <= r.status_code < 500, r.text[:200])

    async def burst(self) -> None:
        await asyncio.gather(*(self.complete("burst", 24) for _ in range(BURST)))


async def _drive(
    url: str,
    headers: dict,
    model: str,
    requests: int,
    duration_s: float,
    clients: int,
    seed: int,
    warm: int,
    on_warm,
) -> Clients:
    # Idle connections expire before uvicorn's 5 s keep-alive does: one the server is closing is never reused.
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients, keepalive_expiry=2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as c:
        load = Clients(c, model, seed)
        kinds, weights = list(KINDS), list(KINDS.values())
        await asyncio.gather(*(load.run(kinds[i % len(kinds)]) for i in range(warm)))
        on_warm()
        next_index, start = 0, time.monotonic()

        async def worker() -> None:
            nonlocal next_index
            while next_index < requests:
                i, next_index = next_index, next_index + 1
                await asyncio.sleep(max(0.0, start + i * duration_s / requests - time.monotonic()))
                await load.run(load.rng.choices(kinds, weights)[0])

        await asyncio.gather(*(worker() for _ in range(clients)))
    return load


def engine_gauges(metrics: str) -> dict[str, float]:
    """Requests running and waiting, and KV-cache use, from a /metrics page, summed over engine cores."""
    names = "num_requests_running|num_requests_waiting|kv_cache_usage_perc"
    gauges: dict[str, float] = {}
    for name, value in re.findall(rf"^kiln:({names})\{{[^}}]*\}} (\S+)$", metrics, re.M):
        gauges[name] = gauges.get(name, 0.0) + float(value)
    return gauges


def run(
    model: str | None = None,
    serve_flags: list[str] | None = None,
    requests: int = 2000,
    duration_s: float = 300.0,
    clients: int = 64,
    seed: int = 0,
    log: Path | None = None,
) -> dict:
    """Launch `kiln serve`, soak it, stop it; the figures and a verdict (`ok`)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the report
    flags = list(serve_flags or [])
    for flag, value in DEFAULT_FLAGS.items():
        if flag not in flags:
            flags += [flag, value]
    key = "soak-key"
    headers = {"Authorization": f"Bearer {key}"}
    started = time.monotonic()
    with launch(model, [*flags, "--api-key", key], log=log) as (url, proc):
        pids = {"server": proc.pid, "engine_core": engine_core_pid(proc.pid)}
        name = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        watches, baseline = [], {}

        def metrics() -> str:
            return httpx.get(url + "/metrics", headers=headers, timeout=10).text

        def on_warm() -> None:
            baseline.update({n: _rss(pid) for n, pid in pids.items()})
            watches.append(Watch(url, pids))
            watches[0].start()

        load = asyncio.run(_drive(url, headers, name, requests, duration_s, clients, seed, clients, on_warm))
        deadline = time.monotonic() + 30
        while any((gauges := engine_gauges(metrics())).values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        watch = watches[0]
        watch.finish()
        final = {n: _rss(pid) for n, pid in pids.items()}
    soak_s = time.monotonic() - started
    deadline = time.monotonic() + 10
    while (orphan := _alive(pids["engine_core"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    ms = sorted(watch.health_ms) or [float("inf")]
    result = {
        "config": {"requests": requests, "duration_s": duration_s, "clients": clients, "flags": flags},
        "outcomes": {f"{k} {r}": n for (k, r), n in sorted(load.outcomes.items())},
        "unexpected": load.unexpected[:20],
        "num_unexpected": len(load.unexpected),
        "health": {
            "checks": len(watch.health_ms),
            "failed": watch.health_fail,
            "p50_ms": ms[len(ms) // 2],
            "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
            "max_ms": ms[-1],
        },
        "rss_mib": {
            n: {"after_warm_up": baseline[n] >> 20, "max": watch.rss_max[n] >> 20, "end": final[n] >> 20}
            for n in pids
        },
        "gauges_at_end": gauges,
        "engine_core_left": orphan,
        "wall_s": soak_s,
    }
    result["ok"] = (
        not load.unexpected
        and watch.health_fail == 0
        and result["health"]["p99_ms"] < HEALTH_P99_MS
        and len(gauges) == 3
        and not any(gauges.values())
        and all(final[n] <= baseline[n] * RSS_GROWTH for n in pids)
        and not orphan
    )
    return result


def format_report(result: dict) -> str:
    c, h, rss = result["config"], result["health"], result["rss_mib"]
    lines = [
        f"soak: {c['requests']} requests over {c['duration_s']:.0f} s from {c['clients']} clients "
        f"({' '.join(c['flags'])}), {result['wall_s']:.0f} s in all",
        "outcomes: " + ", ".join(f"{k} {n}" for k, n in result["outcomes"].items()),
        f"/health: {h['checks']} checks, {h['failed']} failed, p50 {h['p50_ms']:.1f} ms, "
        f"p99 {h['p99_ms']:.1f} ms, max {h['max_ms']:.1f} ms",
        "resident MiB (after warm-up / max / end): "
        + ", ".join(f"{n} {v['after_warm_up']} / {v['max']} / {v['end']}" for n, v in rss.items()),
        f"gauges once idle: {result['gauges_at_end']}; "
        f"engine core left after stop: {result['engine_core_left']}",
        f"unexpected: {result['num_unexpected']}" + "".join(f"\n  {u}" for u in result["unexpected"]),
        "verdict: " + ("ok" if result["ok"] else "FAILED"),
    ]
    return "\n".join(lines)

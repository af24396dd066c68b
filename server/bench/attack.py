"""`kiln bench attack`: well-behaved streaming clients alone, then beside every attack at once, then after.

Phases: the good clients alone (the baseline), the good clients beside attackers that loop what a client
with no key could send to hurt the others (huge `n` over long prompts, fresh large grammars, 8 MiB
/tokenize and /detokenize bodies, whole echo + logprobs answers never read, bodies trickled in, browser
requests from a foreign origin), and an idle wait once the attackers stop. The verdict: every good request
completed; their time to first token p99 at most TTFT_RATIO and inter-token latency p99 at most ITL_RATIO
times the baseline's; each process's peak resident memory under RSS_LIMIT_MIB; the server's back within
RSS_RETURN of its level before the attack, and every KV block free, once idle.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from server.bench.serve import launch
from server.bench.soak import Watch, _rss, engine_core_pid, engine_gauges

TTFT_RATIO, ITL_RATIO, RSS_RETURN = 2.0, 1.5, 1.1
SETTLE_S = 5.0  # seconds idle before the memory after the attack is read
PACE_S = 0.1  # an attack starts again this long after it last started, at the soonest
# A good client waits up to this long (at random) before each request: clients in lockstep would put their
# prompts in the same steps, never beside each other's streams, as real clients and attacked ones do.
THINK_S = 0.5
# README's bounds for the default model on a 24 GiB host: the core's is its KV cache (25 % of RAM), which it
# commits as blocks are first used (so it is not expected back once idle), plus the weights and about 2 GiB.
RSS_LIMIT_MIB = {"server": 2048, "engine_core": 8192}
JSON = {"Content-Type": "application/json"}
WORDS = ["kiln", "fire", "clay", "glaze", "pot", "ash", "slip", "cone"]


def p99(values: list[float]) -> float:
    v = sorted(values) or [float("inf")]
    return v[min(len(v) - 1, int(len(v) * 0.99))]


class Good:
    """Streaming chat clients that behave: each answer's time to first token and gaps between tokens."""

    def __init__(self, c: httpx.AsyncClient, model: str) -> None:
        self.c, self.model = c, model
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.done = self.failed = 0
        self.why: Counter = Counter()  # what ended each failed request: its status, or the client's error

    async def loop(self, stop: asyncio.Event, seed: int) -> None:
        rng = random.Random(seed)
        while not await _stopped(stop, rng.uniform(0.0, THINK_S)):
            words = " ".join(rng.choice(WORDS) for _ in range(12))
            body = {
                "model": self.model,
                "messages": [{"role": "user", "content": f"Write about {words}"}],
                "max_tokens": 32,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            start, times, usage = time.perf_counter(), [], None
            try:
                async with self.c.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line.removeprefix("data: "))
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            times.append(time.perf_counter())
                        usage = chunk.get("usage") or usage
                ok = r.status_code == 200 and usage is not None and usage["completion_tokens"] == 32
                reason = f"{r.status_code} with {len(times)} tokens"
            except (httpx.HTTPError, ValueError) as e:  # a stream cut off mid-chunk: a failed request
                ok, reason = False, f"{type(e).__name__} after {len(times)} tokens"
            self.done += ok
            self.failed += not ok
            if not ok:
                self.why[reason] += 1
            else:
                self.ttft.append(times[0] - start)
                self.itl += [b - a for a, b in itertools.pairwise(times)]


class Attackers:
    """One task per attack, each looping until stopped; `outcomes` counts (attack, status)."""

    def __init__(self, c: httpx.AsyncClient, url: str, model: str, max_model_len: int) -> None:
        self.c, self.model, self.outcomes = c, model, Counter()
        self.host, self.port = url.removeprefix("http://").rsplit(":", 1)
        self.long_text = " ".join(WORDS[i % len(WORDS)] for i in range(max_model_len // 2))
        self.rng = random.Random(7)
        # Encoded once: on a small machine the attackers' own JSON work would take the cores from the server.
        self.bodies = {
            "samples": {"model": model, "prompt": self.long_text, "n": 128, "max_tokens": 16},
            "tokenize": {"prompt": "kiln " * 1_500_000},
            "detokenize": {"tokens": [self.rng.randrange(1000) for _ in range(1_000_000)]},
        }
        self.bodies = {name: json.dumps(body).encode() for name, body in self.bodies.items()}

    async def post(self, name: str, path: str, **kw) -> None:
        try:
            r = await self.c.post(path, **kw)
            self.outcomes[name, r.status_code] += 1
        except httpx.HTTPError as e:
            self.outcomes[name, type(e).__name__] += 1

    async def samples(self) -> None:
        await self.post("samples", "/v1/completions", content=self.bodies["samples"], headers=JSON)

    async def grammar(self) -> None:
        tag = self.rng.getrandbits(64)
        fields = {
            f"f{tag}_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 9 + 1}}}$"} for i in range(2500)
        }
        so = {"json": {"type": "object", "properties": fields}}
        body = {"model": self.model, "prompt": "hi", "n": 8, "max_tokens": 8, "structured_outputs": so}
        await self.post("grammar", "/v1/completions", json=body)

    async def tokenize(self) -> None:
        await self.post("tokenize", "/tokenize", content=self.bodies["tokenize"], headers=JSON)

    async def detokenize(self) -> None:
        await self.post("detokenize", "/detokenize", content=self.bodies["detokenize"], headers=JSON)

    async def browser(self) -> None:
        data = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
        headers = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
        await self.post("browser", "/v1/completions", content=data, headers=headers)

    async def unread(self, stop: asyncio.Event) -> None:
        """A whole echo + logprobs answer over six long prompts, asked for and never read."""
        body = {
            "model": self.model,
            "prompt": [self.long_text] * 6,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 5,
        }
        await self._raw("unread", json.dumps(body).encode(), stop, trickle=False)

    async def trickle(self, stop: asyncio.Event) -> None:
        """A body sent a byte a second."""
        await self._raw("trickle", json.dumps({"prompt": "hi", "max_tokens": 4}).encode(), stop, trickle=True)

    async def _raw(self, name: str, body: bytes, stop: asyncio.Event, trickle: bool) -> None:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            _, writer = await asyncio.open_connection(self.host, int(self.port))
        except OSError as e:
            self.outcomes[name, type(e).__name__] += 1
            return
        try:
            writer.write(head if trickle else head + body)
            await writer.drain()
            for byte in body if trickle else b"":
                writer.write(bytes([byte]))
                await writer.drain()
                if stop.is_set() or await _stopped(stop, 1.0):
                    break
            if not trickle:
                await _stopped(stop, 30.0)  # reading nothing meanwhile
            self.outcomes[name, "held"] += 1
        except OSError:
            self.outcomes[name, "closed by the server"] += 1
        finally:
            writer.transport.abort()

    async def loop(self, name: str, stop: asyncio.Event) -> None:
        """The attack again and again, at most 1 / PACE_S a second: what it sends is the attack, not how
        often (a flood of requests is a proxy's to limit), and on one host the attackers' own client work
        would take the cores from the server."""
        attack = getattr(self, name)
        while not stop.is_set():
            start = time.monotonic()
            await (attack(stop) if name in ("unread", "trickle") else attack())
            await _stopped(stop, PACE_S - (time.monotonic() - start))


async def _stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Wait up to `seconds` for `stop`; whether it came."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except TimeoutError:
        return False


ATTACKS = ["samples", "grammar", "tokenize", "detokenize", "browser", "unread", "trickle"]


async def _phase(url: str, headers: dict, model: str, good: int, seconds: float, attack: bool, max_len: int):
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16, keepalive_expiry=2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as c:
        clients, stop = Good(c, model), asyncio.Event()
        attackers = Attackers(c, url, model, max_len) if attack else None  # their bodies take a second
        tasks = [asyncio.ensure_future(clients.loop(stop, i)) for i in range(good)]
        if attackers is not None:
            tasks += [asyncio.ensure_future(attackers.loop(name, stop)) for name in ATTACKS]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
    return clients, Counter() if attackers is None else attackers.outcomes


def run(
    model: str | None = None,
    serve_flags: list[str] | None = None,
    duration_s: float = 600.0,
    baseline_s: float = 120.0,
    good: int = 4,
    log: Path | None = None,
) -> dict:
    """Launch `kiln serve`, run the three phases, stop it; the figures and a verdict (`ok`)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the report
    key = "attack-key"
    headers = {"Authorization": f"Bearer {key}"}  # the good clients' (attackers need none for most routes)
    with launch(model, [*(serve_flags or []), "--api-key", key], log=log) as (url, proc):
        pids = {"server": proc.pid, "engine_core": engine_core_pid(proc.pid)}
        card = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
        model_name, max_len = card["id"], card.get("max_model_len") or 2048
        args = (url, headers, model_name, good)
        base, _ = asyncio.run(_phase(*args, baseline_s, False, max_len))
        before = {n: _rss(pid) for n, pid in pids.items()}
        watch = Watch(url, pids)
        watch.start()
        hit, outcomes = asyncio.run(_phase(*args, duration_s, True, max_len))
        watch.finish()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            gauges = engine_gauges(httpx.get(url + "/metrics", headers=headers, timeout=30).text)
            if len(gauges) == 3 and not any(gauges.values()):
                break
            time.sleep(1.0)
        time.sleep(SETTLE_S)  # idle, with no request at all: the server gives its freed memory back
        after = {n: _rss(pid) for n, pid in pids.items()}
    peak = {n: max(watch.rss_max[n], after[n]) >> 20 for n in pids}
    result = {
        "config": {"duration_s": duration_s, "baseline_s": baseline_s, "good": good, "flags": serve_flags},
        "good": {
            phase: {
                "completed": g.done,
                "failed": g.failed,
                "why_failed": dict(g.why),
                "ttft_p99_ms": p99(g.ttft) * 1e3,
                "itl_p99_ms": p99(g.itl) * 1e3,
            }
            for phase, g in (("alone", base), ("attacked", hit))
        },
        "attacks": {f"{name} {status}": n for (name, status), n in sorted(outcomes.items(), key=str)},
        "rss_mib": {n: {"before": before[n] >> 20, "peak": peak[n], "after": after[n] >> 20} for n in pids},
        "gauges_after": gauges,
        "health_p99_ms": p99(watch.health_ms),
    }
    a, b = result["good"]["attacked"], result["good"]["alone"]
    result["ttft_ratio"] = a["ttft_p99_ms"] / b["ttft_p99_ms"]
    result["itl_ratio"] = a["itl_p99_ms"] / b["itl_p99_ms"]
    result["ok"] = (
        a["failed"] == b["failed"] == 0
        and a["completed"] > 0
        and result["ttft_ratio"] <= TTFT_RATIO
        and result["itl_ratio"] <= ITL_RATIO
        and all(peak[n] <= RSS_LIMIT_MIB[n] for n in pids)
        and after["server"] <= before["server"] * RSS_RETURN
        and len(gauges) == 3
        and not any(gauges.values())
    )
    return result


def why(failures: dict[str, int]) -> str:
    return " (" + ", ".join(f"{n} {reason}" for reason, n in failures.items()) + ")" if failures else ""


def format_report(result: dict) -> str:
    c, g = result["config"], result["good"]
    lines = [
        f"attack: {c['good']} good streaming clients, {c['baseline_s']:.0f} s alone, then "
        f"{c['duration_s']:.0f} s beside the attackers ({' '.join(c['flags'] or [])})",
        *(
            f"good {phase}: {v['completed']} completed, {v['failed']} failed{why(v['why_failed'])}, "
            f"TTFT p99 {v['ttft_p99_ms']:.0f} ms, ITL p99 {v['itl_p99_ms']:.0f} ms"
            for phase, v in g.items()
        ),
        f"ratios attacked/alone: TTFT p99 {result['ttft_ratio']:.2f} (≤ {TTFT_RATIO}), "
        f"ITL p99 {result['itl_ratio']:.2f} (≤ {ITL_RATIO}); /health p99 {result['health_p99_ms']:.0f} ms",
        "attacks: " + ", ".join(f"{k} {n}" for k, n in result["attacks"].items()),
        "resident MiB (before / peak / after): "
        + ", ".join(f"{n} {v['before']} / {v['peak']} / {v['after']}" for n, v in result["rss_mib"].items()),
        f"gauges once idle: {result['gauges_after']}",
        "verdict: " + ("ok" if result["ok"] else "FAILED"),
    ]
    return "\n".join(lines)

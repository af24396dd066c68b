"""`kiln bench serve`: load an OpenAI-compatible server as vLLM's `bench serve` does, and measure what its
clients see: time to first token, time per output token, inter-token latency and end-to-end latency,
with Poisson arrivals under a concurrency cap.

Works against any server (kiln, vLLM, transformers serve, ...) that streams SSE. Requests carry
`ignore_eos` so that every one produces `--output-len` tokens; `--no-ignore-eos` leaves it out for
servers that reject it (greedy decoding keeps the workload the same across servers of one model).
`--launch` starts `kiln serve` for the run and stops it afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.processes import free_port
from server.bench import vllm_cpu
from server.bench.prompts import dataset_prompts, token_prompts

METRICS = ("ttft", "tpot", "itl", "e2e")
# The client's own setup (tokenizer, prompts) keeps a core busy just before the first request; a server
# whose threads follow the machine's load must see it idle again first, as it would with a remote client.
SETTLE_S = 1.5


def _httpx():
    try:
        import httpx
    except ImportError:
        raise ValueError("kiln bench serve needs httpx: pip install httpx (or kiln-llm[test])") from None
    return httpx


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def _stats(xs: list[float]) -> dict:
    if not xs:
        return dict.fromkeys(("mean_ms", "p50_ms", "p90_ms", "p99_ms"))
    ms = [x * 1e3 for x in xs]
    return {"mean_ms": sum(ms) / len(ms), **{f"p{q}_ms": _percentile(ms, q) for q in (50, 90, 99)}}


async def _request(client, path: str, payload: dict) -> dict:
    """One streamed request. A chunk that carries text counts as an arrival of tokens: the first sets TTFT,
    the gaps between the next ones are the inter-token latencies."""
    start = time.perf_counter()
    ttft, itl, last, chunks, usage, error = None, [], start, 0, None, None
    try:
        async with client.stream("POST", path, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    body = json.loads(body)["error"]["message"]
                error = f"HTTP {resp.status_code}: {body[:500]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = str(chunk["error"].get("message", chunk["error"]))
                        break
                    usage = chunk.get("usage") or usage
                    choice = (chunk.get("choices") or [{}])[0]
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - start
                        else:
                            itl.append(now - last)
                        last, chunks = now, chunks + 1
    except Exception as e:  # a transport error or a malformed stream fails this request, not the run
        error = f"{type(e).__name__}: {e}"
    e2e = time.perf_counter() - start
    if error is None and ttft is None:
        error = "the stream carried no tokens"
    output_tokens = usage["completion_tokens"] if usage else chunks
    return {
        "ok": error is None,
        "error": error,
        "ttft": ttft,
        "itl": itl,
        "e2e": e2e,
        "tpot": (e2e - ttft) / (output_tokens - 1) if error is None and output_tokens > 1 else None,
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "output_tokens": output_tokens,
    }


async def _run_requests(
    base_url: str,
    path: str,
    payloads: list[dict],
    request_rate: float,
    max_concurrency: int,
    seed: int,
    headers: dict,
) -> tuple[list[dict], float]:
    """Requests arrive as a Poisson process at `request_rate` per second (all at once for inf); at most
    `max_concurrency` are in flight, the others wait their turn in this client."""
    httpx = _httpx()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=httpx.Timeout(600.0)
    ) as c:

        async def one(payload: dict) -> dict:
            async with gate:
                return await _request(c, path, payload)

        start, tasks = time.perf_counter(), []
        for payload in payloads:
            tasks.append(asyncio.create_task(one(payload)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


@contextlib.contextmanager
def launch(
    model: str | None,
    serve_flags: list[str],
    timeout: float = 900.0,
    log: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`kiln serve` on a free local port for the duration of the block; yields its base URL and process once
    /health answers. Its output goes to `log` (default: a temporary file), quoted if it fails to start."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", *([model] if model else []), "--port", str(port), *serve_flags]
    with launched("kiln serve", cmd, port, timeout, log, env) as running:
        yield running


@contextlib.contextmanager
def launched(
    name: str,
    cmd: list[str],
    port: int,
    timeout: float = 900.0,
    log: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Any server `cmd` that listens on 127.0.0.1:`port`, as `launch` runs kiln's; stopped with SIGTERM."""
    httpx = _httpx()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-serve-") as tmp:
        log = log or Path(tmp) / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with code {proc.returncode}:\n"
                        f"{log.read_text(errors='replace')[-3000:]}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{name} not ready after {timeout:.0f} s:\n{log.read_text(errors='replace')[-3000:]}"
                    )
                time.sleep(0.5)
            yield url, proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def model_card(base_url: str, headers: dict | None = None) -> dict:
    """The first model the server lists: its id, and (kiln, vLLM) its directory and context length."""
    httpx = _httpx()
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers or {}, timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]


def against_vllm(
    kiln: dict, card: dict, dtype: str, threads: int, vllm_python: str, load: Callable[[str], dict]
) -> dict:
    """`vllm serve` on the model, dtype, context length and threads the kiln server had, loaded by `load`
    (the same prompts, client and settings kiln's run had) once it is ready: {"kiln": ..., "vllm": ...}."""
    port = free_port()
    with vllm_cpu.model_dir(card["root"]) as d:
        cmd = vllm_cpu.serve_command(vllm_python, d, port, card["id"], dtype, card["max_model_len"], threads)
        with launched("vllm serve", cmd, port, timeout=1800) as (url, _):
            peer = load(url)
    peer["config"]["server"] = f"vLLM (CPU backend, {threads} threads)"
    return {"kiln": kiln, "vllm": peer}


def request_payloads(
    prompts: list[str], endpoint: str, model: str, output_len: int, ignore_eos: bool
) -> tuple[str, list[dict]]:
    """The path and the streamed, greedy request bodies for `prompts`."""
    common = {
        "model": model,
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # an extension (kiln, vLLM); servers without it reject the field
        common["ignore_eos"] = True
    if endpoint == "chat":
        return "/v1/chat/completions", [
            {**common, "messages": [{"role": "user", "content": p}]} for p in prompts
        ]
    return "/v1/completions", [{**common, "prompt": p} for p in prompts]


def run(
    base_url: str = "http://127.0.0.1:8000",
    model: str | None = None,
    endpoint: str = "completions",
    num_prompts: int = 64,
    input_len_min: int = 32,
    input_len_max: int = 512,
    output_len: int = 128,
    dataset: str | None = None,
    tokenizer: str | None = None,
    request_rate: float = math.inf,
    max_concurrency: int = 16,
    seed: int = 0,
    api_key: str | None = None,
    ignore_eos: bool = True,
) -> dict:
    """Send the prompts, streamed, and summarise. `tokenizer` (a model directory or .gguf; default the
    embedded model) turns the random token windows into text."""
    from engine.model_files import load_tokenizer
    from server.bench.driver import model_dir

    if max_concurrency < 1 or not request_rate > 0:
        raise ValueError("--max-concurrency must be at least 1 and --request-rate positive")
    if dataset:
        prompts = dataset_prompts(dataset, num_prompts)
    else:
        tok = load_tokenizer(model_dir(tokenizer))
        prompts = [
            tok.decode(ids) for ids in token_prompts(tok, num_prompts, input_len_min, input_len_max, seed)
        ]
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = model or model_card(base_url, headers)["id"]
    path, payloads = request_payloads(prompts, endpoint, model, output_len, ignore_eos)
    time.sleep(SETTLE_S)
    results, duration = asyncio.run(
        _run_requests(base_url, path, payloads, request_rate, max_concurrency, seed, headers)
    )
    ok = [r for r in results if r["ok"]]
    failed = [r for r in results if not r["ok"]]
    output_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    return {
        "config": {
            "base_url": base_url,
            "model": model,
            "endpoint": endpoint,
            "num_prompts": len(prompts),
            "dataset": dataset,
            "input_len_min": input_len_min,
            "input_len_max": input_len_max,
            "output_len": output_len,
            "max_concurrency": max_concurrency,
            "request_rate": request_rate if math.isfinite(request_rate) else "inf",
            "seed": seed,
            "ignore_eos": ignore_eos,
        },
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0]["error"] if failed else None,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        **{
            m: _stats([x for r in ok for x in (r[m] if m == "itl" else [r[m]]) if x is not None])
            for m in METRICS
        },
        "requests": results,
    }


def format_report(r: dict) -> str:
    if "vllm" in r:
        return "\n\n".join(
            ["kiln:", format_report(r["kiln"]), "vLLM:", format_report(r["vllm"]), format_ratios(r)]
        )
    c = r["config"]
    rows = [
        f"serve: {c['num_prompts']} prompts to {c['base_url']} /{c['endpoint']} ({c['model']}), "
        f"{c['output_len']} output tokens each, request rate {c['request_rate']}/s, "
        f"max concurrency {c['max_concurrency']}",
        f"completed {r['completed']}, failed {r['failed']} in {r['duration_s']:.1f} s"
        + (f" (first error: {r['first_error']})" if r["first_error"] else ""),
        f"requests/s {r['request_throughput']:.2f}, output tok/s {r['output_throughput']:.1f}, "
        f"total tok/s {r['total_token_throughput']:.1f}",
        "| ms | mean | p50 | p90 | p99 |",
        "|---|---|---|---|---|",
    ]
    for m in METRICS:
        rows.append(
            f"| {m.upper()} | " + " | ".join("n/a" if v is None else f"{v:.1f}" for v in r[m].values()) + " |"
        )
    return "\n".join(rows)


def format_ratios(r: dict) -> str:
    """kiln against vLLM on what the targets name: throughput (higher is better), latencies (lower)."""
    k, v = r["kiln"], r["vllm"]

    def row(label: str, a: float | None, b: float | None, better: str) -> str:
        if a is None or b is None:
            return f"| {label} | {a} | {b} | |"
        return f"| {label} | {a:.1f} | {b:.1f} | {a / b:.2f}x ({better} is better) |"

    rows = ["| | kiln | vLLM | kiln / vLLM |", "|---|---|---|---|"]
    rows.append(row("output tok/s", k["output_throughput"], v["output_throughput"], "higher"))
    for m, q in (
        ("ttft", "p50_ms"),
        ("ttft", "p99_ms"),
        ("itl", "p50_ms"),
        ("itl", "p99_ms"),
        ("tpot", "mean_ms"),
    ):
        rows.append(row(f"{m.upper()} {q.removesuffix('_ms')} ms", k[m][q], v[m][q], "lower"))
    return "\n".join(rows)

"""`kiln bench latency`: one request at a time, as a chat user sees it: time to first token for a few
prompt lengths, then the decode rate, against the memory roofline (a batch-1 decode step reads every
weight once, so it cannot beat copy bandwidth ÷ weight bytes).

kiln is timed through AsyncLLM's stream, from submitting the prompt to each arriving token, so TTFT
includes everything a caller waits for (IPC, scheduling, chunked prefill, sampling). transformers is
timed through `generate` with a streamer that stamps each token as it comes out, in this process, on
the engine's threads, while the engine core waits idle. The two take turns request by request (who goes
first alternates), so that both meet the same moments of a machine whose speed drifts. Each length
runs one untimed warm-up request first; the prefix cache is reset before every request, so TTFT is a
real prefill.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import time
from pathlib import Path

from engine.model_files import default_model_path
from engine.params import SamplingParams
from server.bench.prompts import token_prompts
from server.bench.throughput import load_transformers, use_engine_threads

LLAMA_CPP_PYTHON = str(Path.home() / ".cache" / "kiln-peers" / "llamacpp" / "bin" / "python")


def _summary(runs: list[tuple[float, float]]) -> dict:
    ttft = [t * 1e3 for t, _ in runs]
    decode = [d for _, d in runs]
    return {
        "ttft_ms": ttft,
        "decode_tok_s": decode,
        "ttft_ms_mean": statistics.mean(ttft),
        "ttft_ms_median": statistics.median(ttft),
        "decode_tok_s_mean": statistics.mean(decode),
        "decode_tok_s_median": statistics.median(decode),
    }


def weight_bytes(model_dir: str, dtype: str) -> int:
    """Bytes one batch-1 decode step reads: every stored parameter once (tied embeddings are stored once),
    at the dtype the engine runs."""
    import torch
    from safetensors import safe_open

    from compiled.loader import resolve_dtype

    numel = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            numel += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (not a dict)
    return numel * resolve_dtype(dtype, torch.device("cpu")).itemsize


async def kiln_request(llm, prompt: list[int], params: SamplingParams) -> tuple[float, float]:
    """(TTFT seconds, decode tok/s) of one request through AsyncLLM's stream."""
    await llm.reset_prefix_cache()
    start, first, first_count = time.perf_counter(), 0.0, 0
    async for out in llm.generate(prompt, params):
        now, count = time.perf_counter(), len(out.outputs[0].token_ids)
        if not first_count and count:
            first, first_count = now, count
    return first - start, (count - first_count) / (now - first)


def transformers_request(model, prompt: list[int], output_len: int, pad_id: int) -> tuple[float, float]:
    """(TTFT seconds, decode tok/s) of one `generate` call, stamped token by token by a streamer."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """generate() puts the prompt first, then each new token: stamp the tokens."""

        def __init__(self) -> None:
            self.prompt_seen, self.times = False, []

        def put(self, value) -> None:
            if self.prompt_seen:
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    clock, ids = Clock(), torch.tensor([prompt], device=model.device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            streamer=clock,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=pad_id,
        )
    t = clock.times
    return t[0] - start, (len(t) - 1) / (t[-1] - t[0])


class LlamaCpp:
    """llama.cpp in its own process and venv (server/bench/llamacpp_peer.py), on the same GGUF file;
    `lookup` (draft tokens, longest n-gram): a second model there drafts by prompt lookup."""

    def __init__(
        self, python: str, gguf_file: str, threads: int, n_ctx: int, lookup: tuple[int, int] | None = None
    ) -> None:
        import subprocess

        script = str(Path(__file__).with_name("llamacpp_peer.py"))
        self.proc = subprocess.Popen(
            [python, script, gguf_file, str(threads), str(n_ctx), *map(str, lookup or ())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"llama.cpp peer did not start ({python}); see ../shared/peers")
        self.version = json.loads(ready)["ready"]

    def call(self, prompt: list[int], output_len: int, **options: object) -> dict:
        """One greedy answer (options: `stop` token ids, `lookup`), timed in the peer's process."""
        self.proc.stdin.write(json.dumps({"prompt": prompt, "output_len": output_len, **options}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def request(self, prompt: list[int], output_len: int) -> tuple[float, float]:
        answer = self.call(prompt, output_len)
        return answer["ttft_s"], answer["decode_tok_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def start_llama_cpp(
    model: str | None, python: str | None, llm, lookup: tuple[int, int] | None = None
) -> LlamaCpp:
    """llama.cpp on `llm`'s GGUF file, with its threads and context length (`python`: the peer venv's
    interpreter, default $KILN_LLAMA_CPP_PYTHON, else ../shared/peers' venv)."""
    gguf_file = model or default_model_path()
    if not gguf_file.endswith(".gguf"):
        raise ValueError("--compare llama.cpp needs a .gguf model")
    python = python or os.environ.get("KILN_LLAMA_CPP_PYTHON", LLAMA_CPP_PYTHON)
    threads = llm.config.num_threads or len(os.sched_getaffinity(0))
    return LlamaCpp(python, gguf_file, threads, llm.max_model_len, lookup)


async def bench(llm, peer, prompts: dict[int, list[list[int]]], output_len: int, threads: int | None) -> dict:
    """Each prompt through kiln and through the peer (transformers' model, or LlamaCpp), taking turns."""
    import torch

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    name = "llama.cpp" if isinstance(peer, LlamaCpp) else "transformers"
    engines = ["kiln"] + ([name] if peer is not None else [])
    result: dict[str, dict] = {name: {} for name in engines}
    for n, batch in prompts.items():
        runs: dict[str, list] = {name: [] for name in engines}
        for i, prompt in enumerate(batch):
            for name in engines if i % 2 == 0 else engines[::-1]:
                if name == "kiln":
                    run = await kiln_request(llm, prompt, params)
                elif name == "llama.cpp":  # its own process; the engine core waits idle
                    run = peer.request(prompt, output_len)
                else:  # on the engine's threads, the front end's single one while kiln runs
                    use_engine_threads(llm.client.ready.device, threads)
                    run = transformers_request(peer, prompt, output_len, pad_id)
                    torch.set_num_threads(1)
                if i:  # the first request of each length is the warm-up
                    runs[name].append(run)
        for name in engines:
            result[name][n] = _summary(runs[name])
    return result


def run(
    model: str | None,
    engine_args: dict,
    input_lens: tuple[int, ...] = (128, 512, 2048),
    output_len: int = 128,
    iters: int = 3,
    seed: int = 0,
    compare: str | None = None,
    llama_cpp_python: str | None = None,
) -> dict:
    """kiln TTFT and decode rate per prompt length, the roofline, and (with `compare`) transformers
    or llama.cpp (`llama_cpp_python`: the peer venv's interpreter; llama.cpp needs a .gguf model)."""
    import torch

    from compiled.worker import resolve_device
    from engine.async_llm import AsyncLLM
    from server.bench.runner import copy_bandwidth

    if output_len < 2 or iters < 1:
        raise ValueError(
            "latency needs --output-len of at least 2 (one decode step) and --iters of at least 1"
        )
    # The bandwidth drifts on a shared machine: measure it just before and just after the requests.
    device = str(resolve_device(engine_args.get("device", "auto")))
    use_engine_threads(device, engine_args.get("num_threads"))
    before = copy_bandwidth(device=device)
    llm = AsyncLLM(model, **engine_args)
    try:
        if llm.max_model_len <= output_len:
            raise ValueError(
                f"output_len {output_len} leaves no room for a prompt in max_model_len {llm.max_model_len}"
            )
        lens = sorted({min(n, llm.max_model_len - output_len) for n in input_lens})
        prompts = {n: token_prompts(llm.tokenizer, iters + 1, n, n, seed + n) for n in lens}
        ready, model_dir, threads = llm.client.ready, llm.model_dir, llm.config.num_threads
        peer = None
        if compare == "transformers":
            peer = load_transformers(model_dir, ready.dtype, ready.device, threads)
        elif compare == "llama.cpp":
            peer = start_llama_cpp(model, llama_cpp_python, llm)
        torch.set_num_threads(1)  # the engine core owns the cores while kiln runs
        out: dict = {
            "config": {
                "model": model_dir,
                "dtype": ready.dtype,
                "device": ready.device,
                "input_lens": lens,
                "output_len": output_len,
                "iters": iters,
                "seed": seed,
                "quantization": llm.config.quantization,
                **({"llama.cpp": peer.version} if isinstance(peer, LlamaCpp) else {}),
            },
            **asyncio.run(bench(llm, peer, prompts, output_len, threads)),
        }
    finally:
        llm.shutdown()
        if isinstance(peer, LlamaCpp):
            peer.close()
    use_engine_threads(ready.device, threads)
    out["weight_bytes"] = weight_bytes(model_dir, ready.dtype)
    after = copy_bandwidth(device=ready.device)
    out["copy_bandwidth_GBps_before_after"] = [before / 1e9, after / 1e9]
    out["copy_bandwidth_GBps"] = (before + after) / 2e9
    out["roofline_tok_s"] = out["copy_bandwidth_GBps"] * 1e9 / out["weight_bytes"]
    return out


def format_report(r: dict) -> str:
    c, roof = r["config"], r["roofline_tok_s"]
    rows = [
        f"latency: batch 1, {c['output_len']} output tokens, {c['iters']} timed requests per prompt length "
        f"(after one warm-up); {c['model']} {c['dtype']} (quantization {c.get('quantization', 'none')}) "
        f"on {c['device']}",
        f"copy bandwidth {r['copy_bandwidth_GBps']:.1f} GB/s (mean of "
        f"{' and '.join(f'{x:.1f}' for x in r['copy_bandwidth_GBps_before_after'])}"
        f" just before and after the requests), weights {r['weight_bytes'] / 2**30:.2f} GiB "
        f"{'de-quantized ' if c.get('quantization', 'none') != 'none' else ''}"
        f"-> decode roofline {roof:.1f} tok/s",
        "| prompt tokens | engine | TTFT ms mean | TTFT ms median | decode tok/s mean | decode tok/s median "
        "| % of roofline |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in c["input_lens"]:
        for engine in ("kiln", "transformers", "llama.cpp"):
            if engine in r:
                d = r[engine][n]
                rows.append(
                    f"| {n} | {engine} | {d['ttft_ms_mean']:.1f} | {d['ttft_ms_median']:.1f} "
                    f"| {d['decode_tok_s_mean']:.1f} | {d['decode_tok_s_median']:.1f} "
                    f"| {100 * d['decode_tok_s_median'] / roof:.0f}% |"
                )
        for peer in ("transformers", "llama.cpp"):
            if peer in r:
                k, t = r["kiln"][n], r[peer][n]
                rows.append(
                    f"| {n} | kiln / {peer} | | {t['ttft_ms_median'] / k['ttft_ms_median']:.2f}x faster | "
                    f"| {k['decode_tok_s_median'] / t['decode_tok_s_median']:.2f}x | |"
                )
    return "\n".join(rows)

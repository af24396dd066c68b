"""`kiln bench gpu-check`: on a CUDA machine, the three things the CPU suite cannot show.

1. Correctness on the device: greedy generation through the compiled ModelRunner (chunked prefill
   beside running decodes, then a batch-1 tail) is token-exact with transformers in float32.
2. CUDA graphs: after warm-up, a decode step of every bucket replays a captured graph (the profiler
   sees `cudaGraphLaunch`) and Inductor skipped none.
3. Speed: decode tokens/s per bucket, compiled (CUDA graphs) vs eager, at a fixed context.

`--device cpu` runs 1 and 3 without graphs, so the command itself stays tested where there is no GPU.
"""

from __future__ import annotations

import time

import torch

from compiled.input_batch import decode_buckets
from compiled.model_runner import ModelRunner
from server.bench import runner as bench
from server.bench.driver import build_runner, chat_prompts, greedy_mismatches, model_dir


def graph_launches(fn) -> int:
    """CUDA graph replays during fn(): zero means every kernel was launched one by one."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key in ("cudaGraphLaunch", "cuGraphLaunch"))


def check_graphs(runner: ModelRunner, context: int) -> dict[int, int]:
    """Graph replays in one decode step of each bucket, once its graph is recorded."""
    launches = {}
    engine = bench.KilnEngine(runner, context)
    for b in runner.buckets:
        engine.start(b, context)  # cudagraph trees warm up a new shape, then record it; later calls replay
        engine.step()
        engine.step()
        launches[b] = graph_launches(engine.step)
        engine.finish()
    return launches


def run(
    model: str | None = None,
    dtype: str = "float32",
    device: str = "cuda",
    max_num_seqs: int = 64,
    context: int = 512,
    steps: int = 8,
) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "gpu-check needs a CUDA device (torch.cuda.is_available() is False); --device cpu runs "
            "the correctness and speed parts without CUDA graphs"
        )
    path = model_dir(model)
    out: dict = {
        "config": {
            "model": path,
            "dtype": dtype,
            "device": device,
            "max_num_seqs": max_num_seqs,
            "context": context,
            "steps": steps,
        },
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }
    buckets = decode_buckets(max_num_seqs)
    common = dict(
        dtype=dtype,
        device=device,
        max_num_seqs=max_num_seqs,
        max_model_len=context + 64 + 1,
        max_num_batched_tokens=64,
    )
    for name, eager in (("compiled", False), ("eager", True)):
        runner = build_runner(path, **common, enforce_eager=eager)
        runner.initialize_kv_cache(bench.bench_kv_blocks(runner.block_size, max_num_seqs, context, context))
        start = time.perf_counter()
        runner.warmup()
        warmup_s = time.perf_counter() - start
        if not eager:
            # The exactness check runs in float32 whatever dtype is timed.
            exact = runner if dtype == "float32" else build_runner(path, **{**common, "dtype": "float32"})
            if exact is not runner:
                exact.initialize_kv_cache(256)
                exact.warmup()
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
            out["greedy_mismatches"] = greedy_mismatches(
                exact, hf, chat_prompts(AutoTokenizer.from_pretrained(path), min(9, max_num_seqs))
            )
            del hf, exact
            if device == "cuda":
                torch._dynamo.utils.counters.clear()
                out["graph_launches"] = check_graphs(runner, context)
                out["cudagraph_skips"] = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        out[name] = {
            "warmup_s": warmup_s,
            **bench.measure({name: bench.KilnEngine(runner, context)}, buckets, context, steps)[name],
        }
        del runner
    out["ok"] = not out["greedy_mismatches"] and (
        device != "cuda"
        or (all(n > 0 for n in out["graph_launches"].values()) and out["cudagraph_skips"] == 0)
    )
    return out


def format_report(r: dict) -> str:
    c = r["config"]
    rows = [
        f"gpu-check: {c['model']} {c['dtype']} on {r['device_name']}",
        "greedy vs transformers (float32): "
        + ("token-exact" if not r["greedy_mismatches"] else "DIVERGED: " + ", ".join(r["greedy_mismatches"])),
    ]
    if "graph_launches" in r:
        missing = [b for b, n in r["graph_launches"].items() if n == 0]
        rows.append(
            f"CUDA graphs: replayed for {len(r['graph_launches']) - len(missing)}/{len(r['graph_launches'])} "
            f"decode buckets"
            + (f" (none for {missing})" if missing else "")
            + f"; Inductor cudagraph skips: {r['cudagraph_skips']}"
        )
    buckets = list(r["compiled"]["decode_tok_s"])
    rows += [
        f"decode tok/s at context {c['context']}:",
        "| bucket | compiled | eager | ratio |",
        "|---|---|---|---|",
    ]
    for b in buckets:
        comp, eager = r["compiled"]["decode_tok_s"][b], r["eager"]["decode_tok_s"][b]
        rows.append(f"| {b} | {comp:.1f} | {eager:.1f} | {comp / eager:.2f}x |")
    rows.append(
        f"prefill tok/s ({c['context']} tokens): compiled {r['compiled']['prefill_tok_s']:.0f}, "
        f"eager {r['eager']['prefill_tok_s']:.0f}; warm-up {r['compiled']['warmup_s']:.1f} s"
    )
    rows.append("OK" if r["ok"] else "FAILED")
    return "\n".join(rows)

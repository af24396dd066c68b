"""`kiln bench gpu-check`: on a CUDA machine, what the CPU suite cannot show.

1. Correctness on the device: greedy generation through the compiled ModelRunner (chunked prefill
   beside running decodes, then a batch-1 tail) is token-exact with transformers in float32.
2. CUDA graphs: after warm-up, the decode forward of every bucket replays a recorded graph
   (`CUDAGraph.replay` calls, counted) and launches (almost) no kernel one by one (the profiler's kernel
   launches, against the eager forward's); counted from before warm-up, Dynamo compiled nothing after
   it, broke no graph and Inductor skipped no CUDA graph.
3. Speed: decode tokens/s per bucket compiled vs eager, prefill tokens/s, and the decode roofline
   (weight bytes against the device's copy bandwidth, measured in the same run).

The phases add to one result and hand it to `on_phase` after each, so a crash still leaves what was
measured; an exception ends its phase, is recorded, and fails the verdict. `--device cpu` runs it all
but the graph counts, so the command itself stays tested where there is no GPU.
"""

from __future__ import annotations

import contextlib
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from compiled.input_batch import decode_buckets
from compiled.model_runner import ModelRunner
from server.bench import runner as bench
from server.bench.driver import build_runner, chat_prompts, greedy_mismatches, hf_greedy, model_dir

# Kernel launches the profiler records on the host: each one is a kernel not replayed from a graph.
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
# A replayed decode forward may still launch a few kernels of its own (copies of non-static inputs).
EAGER_LAUNCH_SHARE = 0.05


def launches(fn: Callable[[], object]) -> dict[str, int]:
    """CUDA graph replays and kernels launched one by one while fn() runs."""
    replays, replay = [0], torch.cuda.CUDAGraph.replay

    def counted(graph: torch.cuda.CUDAGraph) -> None:
        replays[0] += 1
        replay(graph)

    torch.cuda.CUDAGraph.replay = counted
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        with torch.profiler.profile(activities=activities) as prof:
            fn()
            torch.cuda.synchronize()
    finally:
        torch.cuda.CUDAGraph.replay = replay
    kernels = sum(e.count for e in prof.key_averages() if e.key in LAUNCH_EVENTS)
    return {"replays": replays[0], "kernels": kernels}


def forward_launches(engine: bench.KilnEngine, buckets: list[int], context: int) -> dict[int, dict]:
    """`launches` of the model forward alone (no sampling) in a decode step of each bucket at `context`."""
    runner, drv, out = engine.runner, engine.driver, {}
    for b in buckets:
        engine.start(b, context)
        so = drv.build()
        runner.batch.update(so)
        step = runner.batch.prepare(
            *runner.batch.split(so.num_scheduled_tokens, so.spec_tokens), so.num_scheduled_tokens
        )
        out[b] = launches(lambda step=step: runner.hidden_states(step))
        engine.finish()
    return out


def compile_counters() -> dict[str, int]:
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }


def _strict_cuda_graphs() -> contextlib.AbstractContextManager:
    """Where the running torch has it, a graph Inductor cannot capture is an error, not a silent skip
    (with graph partitions, a skipped partition is not even counted)."""
    triton = torch._inductor.config.triton
    if hasattr(triton, "cudagraph_or_error"):
        return torch._inductor.config.patch({"triton.cudagraph_or_error": True})
    return contextlib.nullcontext()


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_name()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env |= {
            "device_name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_GiB": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
        }
        with contextlib.suppress(ImportError):
            import triton

            env["triton"] = triton.__version__
    else:
        env["device_name"] = env["cpu"]
    return env


def run(
    model: str | None = None,
    dtype: str = "float32",
    device: str = "cuda",
    max_num_seqs: int = 64,
    context: int = 512,
    steps: int = 8,
    on_phase: Callable[[dict], None] = lambda result: None,
    tensor_parallel_size: int = 1,
) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "gpu-check needs a CUDA device (torch.cuda.is_available() is False); --device cpu runs "
            "the correctness and speed parts without CUDA graphs"
        )
    path = model_dir(model)
    buckets = decode_buckets(max_num_seqs)
    out: dict = {
        "config": dict(
            model=path,
            dtype=dtype,
            device=device,
            max_num_seqs=max_num_seqs,
            context=context,
            steps=steps,
            buckets=buckets,
            tensor_parallel_size=tensor_parallel_size,
        ),
        "environment": environment(device),
        "errors": {},
        "phase_s": {},
    }
    common = dict(
        device=device,
        max_num_seqs=max_num_seqs,
        max_model_len=context + 64 + 1,
        max_num_batched_tokens=64,
    )
    cuda = device == "cuda"
    on_phase(out)

    def phase(name: str, fn: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            fn()
        except Exception:
            out["errors"][name] = traceback.format_exc()
        out["phase_s"][name] = round(time.perf_counter() - start, 2)
        on_phase(out)

    def runner_for(dtype: str, eager: bool) -> ModelRunner:
        runner = build_runner(path, **common, dtype=dtype, enforce_eager=eager)
        runner.initialize_kv_cache(bench.bench_kv_blocks(runner.block_size, max_num_seqs, context, context))
        return runner

    def exactness(runner: ModelRunner) -> None:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        prompts = chat_prompts(AutoTokenizer.from_pretrained(path), min(9, max_num_seqs))
        out["greedy_mismatches"] = greedy_mismatches(runner, hf, prompts)

    def timed(name: str, runner: ModelRunner) -> None:
        engine = bench.KilnEngine(runner, context)
        if cuda:
            out.setdefault("graphs", {})[name] = forward_launches(engine, buckets, context)
        out[name] |= bench.measure({name: engine}, buckets, context, steps)[name]

    def compiled() -> None:
        counters.clear()
        with _strict_cuda_graphs() if cuda else contextlib.nullcontext():
            runner = runner_for(dtype, eager=False)
            start = time.perf_counter()
            runner.warmup()
            out["compiled"] = {"warmup_s": time.perf_counter() - start, "weight_bytes": runner.weight_bytes}
            out["counters"] = warm = compile_counters()
            on_phase(out)
            timed("compiled", runner)
            if dtype == "float32":
                exactness(runner)
        after = compile_counters()
        out["counters"] = {**after, "graphs_after_warmup": after["graphs"] - warm["graphs"]}

    def float32_exactness() -> None:
        # A runner of its own dtype on fresh caches: two runners' graphs in one cache reach its limits.
        torch._dynamo.reset()
        runner = runner_for("float32", eager=False)
        runner.warmup()
        exactness(runner)

    def eager() -> None:
        out["eager"] = {}
        timed("eager", runner_for(dtype, eager=True))

    def tensor_parallel() -> None:
        """The whole engine over tensor_parallel_size workers, one device each: greedy exactness against
        transformers in float32, and decode tok/s at batch 1 and with every prompt in one batch."""
        from engine.llm import LLM, SamplingParams

        prompts = chat_prompts(AutoTokenizer.from_pretrained(path), min(9, max_num_seqs))
        greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        long = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        tp = out["tensor_parallel"] = {"batch": len(prompts)}
        with LLM(path, device=device, dtype="float32", tensor_parallel_size=tensor_parallel_size) as llm:
            ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            for name, batch in (("batch1_tok_s", prompts[:1]), ("batch_tok_s", prompts)):
                start = time.perf_counter()
                llm.generate(batch, long, use_tqdm=False)
                tp[name] = len(batch) * long.max_tokens / (time.perf_counter() - start)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        tp["greedy_mismatches"] = [
            f"prompt {i}" for i, (p, got) in enumerate(zip(prompts, ours)) if got != hf_greedy(hf, p, 32)
        ]

    def roofline() -> None:
        bandwidth = bench.copy_bandwidth(device=device)
        out["copy_bandwidth_GBps"] = bandwidth / 1e9
        out["roofline_tok_s"] = bandwidth / out["compiled"]["weight_bytes"]

    phase("compiled", compiled)
    if dtype != "float32":
        phase("exactness", float32_exactness)
    phase("eager", eager)
    phase("roofline", roofline)
    if tensor_parallel_size > 1:
        phase("tensor_parallel", tensor_parallel)
    out["problems"] = verdict(out)
    out["ok"] = not out["problems"]
    on_phase(out)
    return out


def verdict(r: dict) -> list[str]:
    """What the run failed to show; empty when it proved everything it should."""
    problems = [f"phase {name} raised: {err.strip().splitlines()[-1]}" for name, err in r["errors"].items()]
    if r.get("greedy_mismatches"):
        problems.append("greedy output diverged from transformers: " + ", ".join(r["greedy_mismatches"]))
    elif "greedy_mismatches" not in r:
        problems.append("greedy exactness was not checked")
    c = r.get("counters", {})
    if c.get("graphs_after_warmup"):
        problems.append(f"{c['graphs_after_warmup']} graphs compiled after warm-up")
    if c.get("graph_breaks"):
        problems.append(f"{c['graph_breaks']} graph breaks")
    tp = r.get("tensor_parallel", {})
    if tp.get("greedy_mismatches"):
        problems.append("tensor-parallel greedy output diverged: " + ", ".join(tp["greedy_mismatches"]))
    elif r["config"].get("tensor_parallel_size", 1) > 1 and "greedy_mismatches" not in tp:
        problems.append("tensor-parallel exactness was not checked")
    if r["config"]["device"] != "cuda":
        return problems
    if c.get("cudagraph_skips"):
        problems.append(f"Inductor skipped {c['cudagraph_skips']} CUDA graphs")
    graphs = r.get("graphs", {})
    compiled, eager = graphs.get("compiled", {}), graphs.get("eager", {})
    for b in r["config"]["buckets"]:
        got, ref = compiled.get(b), eager.get(b)
        if got is None or ref is None:
            problems.append(f"bucket {b}: launches not counted")
        elif got["replays"] == 0:
            problems.append(f"bucket {b}: no CUDA graph replayed")
        elif got["kernels"] > EAGER_LAUNCH_SHARE * ref["kernels"]:
            problems.append(
                f"bucket {b}: {got['kernels']} kernels launched one by one (eager forward: {ref['kernels']})"
            )
    return problems


def format_report(r: dict) -> str:
    c, env = r["config"], r["environment"]
    rows = [f"gpu-check: {c['model']} {c['dtype']} on {env['device_name']} (torch {env['torch']})"]
    if "greedy_mismatches" in r:
        mismatches = r["greedy_mismatches"]
        rows.append(
            "greedy vs transformers (float32): "
            + ("token-exact" if not mismatches else "DIVERGED: " + ", ".join(mismatches))
        )
    if "counters" in r:
        k = r["counters"]
        rows.append(
            f"compiled graphs: {k['graphs']} ({k.get('graphs_after_warmup', '?')} after warm-up), "
            f"graph breaks {k['graph_breaks']}, cudagraph skips {k['cudagraph_skips']}"
        )
    if "graphs" in r:
        rows += ["| bucket | replays | kernels launched (compiled) | (eager) |", "|---|---|---|---|"]
        compiled, eager = r["graphs"].get("compiled", {}), r["graphs"].get("eager", {})
        for b in c["buckets"]:
            got, ref = compiled.get(b, {}), eager.get(b, {})
            rows.append(
                f"| {b} | {got.get('replays', '-')} | {got.get('kernels', '-')} | {ref.get('kernels', '-')} |"
            )
    if "decode_tok_s" in r.get("compiled", {}) and "decode_tok_s" in r.get("eager", {}):
        rows += [
            f"decode tok/s at context {c['context']}:",
            "| bucket | compiled | eager | ratio |",
            "|---|---|---|---|",
        ]
        for b in c["buckets"]:
            comp, eager = r["compiled"]["decode_tok_s"][b], r["eager"]["decode_tok_s"][b]
            rows.append(f"| {b} | {comp:.1f} | {eager:.1f} | {comp / eager:.2f}x |")
        rows.append(
            f"prefill tok/s ({c['context']} tokens): compiled {r['compiled']['prefill_tok_s']:.0f}, "
            f"eager {r['eager']['prefill_tok_s']:.0f}; warm-up {r['compiled']['warmup_s']:.1f} s"
        )
    if "roofline_tok_s" in r:
        rows.append(
            f"copy bandwidth {r['copy_bandwidth_GBps']:.0f} GB/s -> "
            f"batch-1 roofline {r['roofline_tok_s']:.0f} tok/s"
        )
    if "batch_tok_s" in r.get("tensor_parallel", {}):
        tp = r["tensor_parallel"]
        rows.append(
            f"tensor parallel x{c['tensor_parallel_size']}: greedy "
            + ("token-exact" if not tp.get("greedy_mismatches") else "DIVERGED")
            + f", decode {tp['batch1_tok_s']:.1f} tok/s at batch 1, "
            + f"{tp['batch_tok_s']:.1f} at batch {tp['batch']}"
        )
    rows += [f"PROBLEM: {p}" for p in r["problems"]]
    rows.append("OK" if r["ok"] else "FAILED")
    return "\n".join(rows)

"""`kiln bench runner` and `kiln bench gpu-check`: the model runner alone, against transformers.

Decode is timed with synthetic context: each sequence gets `context` positions of KV-cache blocks
and decodes from there (the cost of a decode step does not depend on what the cache holds), so
large batches need no long prefill first. Prefill is timed on a real prompt.
"""

from __future__ import annotations

import statistics
import time

import torch

from compiled.model_runner import ModelRunner, cdiv
from engine.config import EngineConfig
from engine.params import SamplingParams
from engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


class Copy:
    """A large tensor copy on `device`, the memory roofline's yardstick: `moved` bytes (read + write) per run."""

    def __init__(self, nbytes: int = 256 << 20, device: str | torch.device = "cpu") -> None:
        self.src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)
        self.moved = 2 * nbytes

    def seconds(self) -> float:
        return _timed(lambda: self.dst.copy_(self.src))

    def bandwidth(self, repeats: int = 5) -> float:
        """Bytes per second moved by the best of `repeats` copies."""
        return self.moved / min(self.seconds() for _ in range(repeats))


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Bytes per second moved by the best of `repeats` large tensor copies on `device`."""
    return Copy(nbytes, device).bandwidth(repeats)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


class _Batch:
    """B sequences at `context` positions, stepped one decode token at a time through the runner."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, first_block: int) -> None:
        self.runner, self.ids = runner, [f"b{batch}-{i}" for i in range(batch)]
        self.pos = {rid: context - 1 for rid in self.ids}
        per_seq = cdiv(context + 64, runner.block_size)
        so = SchedulerOutput()
        for i, rid in enumerate(self.ids):
            blocks = list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq))
            tokens = torch.randint(0, runner.vocab_size, (context,)).tolist()
            so.new_reqs.append(NewRequestData(rid, tokens, context, GREEDY, blocks, context - 1, i))
            so.num_scheduled_tokens[rid] = 1
        so.total_num_scheduled_tokens = batch
        runner.execute_model(so)

    def step(self) -> None:
        so = SchedulerOutput(cached_reqs=[CachedRequestData(r, [], self.pos[r] + 1) for r in self.ids],
                             num_scheduled_tokens=dict.fromkeys(self.ids, 1), total_num_scheduled_tokens=len(self.ids))
        self.runner.execute_model(so)
        for r in self.ids:
            self.pos[r] += 1

    def finish(self) -> None:
        self.runner.execute_model(SchedulerOutput(finished_req_ids=set(self.ids)))


def bench_kv_blocks(block_size: int, batch: int, context: int, prefill_len: int) -> int:
    """KV blocks for `time_runner`: `batch` sequences at `context` plus one prompt, and the null block."""
    return batch * cdiv(context + 64, block_size) + cdiv(prefill_len, block_size) + 2


def bench_kiln(config: EngineConfig, batches: list[int], context: int, steps: int, prefill_len: int,
               copy: Copy | None = None) -> dict:
    runner = ModelRunner(config)
    runner.initialize_kv_cache(bench_kv_blocks(config.block_size, max(batches), context, prefill_len))
    start = time.perf_counter()
    runner.warmup()
    return {"warmup_s": time.perf_counter() - start, **time_runner(runner, batches, context, steps, prefill_len, copy)}


def time_runner(runner: ModelRunner, batches: list[int], context: int, steps: int, prefill_len: int,
                copy: Copy | None = None) -> dict:
    """Decode tokens/s per batch size and prefill tokens/s of a runner whose KV cache holds the largest batch
    at `context` plus one prompt of `prefill_len`.

    With `copy`, batch 1 is also measured against the roofline step by step: each decode step is followed by
    a timed copy, and the result is the median over steps of (weight bytes / step time) / (copy bandwidth),
    so that the bandwidth a step is held to is the machine's at that moment (it drifts by a third here).
    """
    # The synthetic context reads slots no step wrote. Serving reads only written slots, or fresh pages
    # (zeros); here they would hold whatever the allocator left, and denormal garbage slows float math
    # many times over.
    for layer in runner.model.layers:
        layer.attention.k_cache.zero_()
        layer.attention.v_cache.zero_()
    result: dict = {"decode_tok_s": {}, "weight_bytes": runner.weight_bytes}
    for b in batches:
        batch = _Batch(runner, b, context, first_block=1)
        batch.step()  # first step at this size: settle caches
        elapsed = sum(_timed(batch.step) for _ in range(steps))
        result["decode_tok_s"][b] = b * steps / elapsed
        if b == 1 and copy is not None:
            pairs = [(_timed(batch.step), copy.seconds()) for _ in range(steps)]
            result["batch1_roofline"] = statistics.median(runner.weight_bytes * c / (copy.moved * t) for t, c in pairs)
            result["paired_copy_GBps"] = statistics.median(copy.moved / c for _, c in pairs) / 1e9
        batch.finish()
    prompt = torch.randint(0, runner.vocab_size, (prefill_len,)).tolist()
    blocks = list(range(runner.num_blocks - cdiv(prefill_len, runner.block_size) - 1, runner.num_blocks - 1))

    def prefill(i: int) -> None:
        so = SchedulerOutput(new_reqs=[NewRequestData(f"p{i}", prompt, prefill_len, GREEDY, blocks, 0, 0)],
                             num_scheduled_tokens={f"p{i}": prefill_len}, total_num_scheduled_tokens=prefill_len)
        runner.execute_model(so)
        runner.execute_model(SchedulerOutput(finished_req_ids={f"p{i}"}))

    prefill(0)
    result["prefill_tok_s"] = prefill_len * 3 / sum(_timed(lambda i=i: prefill(i)) for i in range(1, 4))
    return result


def bench_transformers(model_dir: str, dtype: torch.dtype, batches: list[int], context: int, steps: int,
                       prefill_len: int) -> dict:
    """transformers' own forward and KV cache, driven as `generate` drives them (prefill, then one greedy
    token per step), with only the decode steps timed: generate's bookkeeping is left out, in its favour."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    vocab = model.config.vocab_size

    def prefill(ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
        cache = DynamicCache()
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return cache, logits[:, -1:].argmax(-1)

    def decode(cache: DynamicCache, token: torch.Tensor) -> float:
        def loop() -> None:
            nonlocal token
            for _ in range(steps):
                token = model(input_ids=token, past_key_values=cache, use_cache=True).logits.argmax(-1)
        return _timed(loop)

    result: dict = {"decode_tok_s": {}}
    with torch.no_grad():
        for b in batches:
            cache, token = prefill(torch.randint(0, vocab, (b, context)))
            decode(cache, token)  # settle
            cache, token = prefill(torch.randint(0, vocab, (b, context)))
            result["decode_tok_s"][b] = b * steps / decode(cache, token)
        ids = torch.randint(0, vocab, (1, prefill_len))
        prefill(ids)
        result["prefill_tok_s"] = prefill_len * 3 / sum(_timed(lambda: prefill(ids)) for _ in range(3))
    return result


def run(model: str | None = None, dtype: str = "float32", batches: tuple[int, ...] = (1, 8, 32, 64),
        context: int = 512, steps: int = 8, prefill_len: int = 512, compare: bool = True,
        num_threads: int | None = None) -> dict:
    """Compiled vs eager kiln vs transformers, plus the memory roofline, measured in one run."""
    from compiled.loader import resolve_dtype, resolve_model
    from compiled.model_runner import resolve_device

    model_dir = resolve_model(model)
    common = dict(model=model_dir, dtype=dtype, max_num_seqs=max(batches), num_threads=num_threads,
                  max_model_len=max(context + 64, prefill_len + 1))
    out: dict = {"config": {"model": model_dir, "dtype": dtype, "batches": list(batches), "context": context,
                            "steps": steps, "prefill_len": prefill_len, "threads": num_threads or torch.get_num_threads()}}
    copy = Copy()
    out["kiln_compiled"] = bench_kiln(EngineConfig(**common), list(batches), context, steps, prefill_len, copy)
    out["kiln_eager"] = bench_kiln(EngineConfig(**common, enforce_eager=True), list(batches), context, steps, prefill_len)
    if compare:
        torch_dtype = resolve_dtype(dtype, resolve_device("auto"))
        out["transformers"] = bench_transformers(model_dir, torch_dtype, list(batches), context, steps, prefill_len)
    bandwidth = copy.bandwidth()
    out["copy_bandwidth_GBps"] = bandwidth / 1e9
    out["roofline_tok_s"] = bandwidth / out["kiln_compiled"]["weight_bytes"]
    return out


def format_report(r: dict) -> str:
    rows = [f"runner benchmark: {r['config']}",
            f"copy bandwidth {r['copy_bandwidth_GBps']:.1f} GB/s -> batch-1 roofline {r['roofline_tok_s']:.1f} tok/s",
            "| decode tok/s | " + " | ".join(f"batch {b}" for b in r["config"]["batches"]) + " | prefill tok/s |",
            "|---|" + "---|" * (len(r["config"]["batches"]) + 1)]
    engines = [k for k in ("kiln_compiled", "kiln_eager", "transformers") if k in r]
    for k in engines:
        d = r[k]["decode_tok_s"]
        rows.append(f"| {k} | " + " | ".join(f"{d[b]:.1f}" for b in r["config"]["batches"]) + f" | {r[k]['prefill_tok_s']:.0f} |")
    base = "transformers" if "transformers" in r else "kiln_eager"
    d, ref = r["kiln_compiled"]["decode_tok_s"], r[base]["decode_tok_s"]
    rows.append(f"| compiled / {base} | " + " | ".join(f"{d[b] / ref[b]:.2f}x" for b in r["config"]["batches"])
                + f" | {r['kiln_compiled']['prefill_tok_s'] / r[base]['prefill_tok_s']:.2f}x |")
    if "batch1_roofline" in r["kiln_compiled"]:
        k = r["kiln_compiled"]
        rows.append(f"batch-1 compiled decode = {100 * k['batch1_roofline']:.0f}% of roofline (median over steps, "
                    f"each paired with a copy: {k['paired_copy_GBps']:.1f} GB/s); "
                    f"{100 * d[1] / r['roofline_tok_s']:.0f}% against the best copy at the end of the run")
    rows.append(f"compile warm-up {r['kiln_compiled']['warmup_s']:.1f} s")
    return "\n".join(rows)

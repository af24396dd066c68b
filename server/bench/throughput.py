"""`kiln bench throughput`: an offline batch through `LLM.generate`, as vLLM's `bench throughput` runs it,
optionally against transformers on the same prompts in the same run.

Every request generates exactly `output_len` tokens (ignore_eos, greedy), so all engines do the same
work and the ratio of their rates is the ratio of their speeds. Engine startup (weights, KV cache,
compile) is left out: the clock runs from the first submitted prompt to the last finished one.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from engine.params import SamplingParams
from server.bench.models import w8a8_checkpoint
from server.bench.prompts import dataset_prompts, token_prompts

BASELINES = {
    "vllm": "vLLM (CPU backend)",
    "vllm_w8a8": "vLLM on kiln's W8A8 weights",
    "transformers_static": "transformers, static batches",
    "transformers_continuous": "transformers, continuous batching",
}


def _rates(num_requests: int, prompt_tokens: int, output_tokens: int, elapsed: float) -> dict:
    return {
        "elapsed_s": elapsed,
        "num_requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": num_requests / elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
    }


def use_engine_threads(device: str, num_threads: int | None) -> None:
    """Give this process the CPU threads the engine core had: the front end runs on one, and what is measured
    here after the engine has shut down (transformers, copy bandwidth) gets the same cores the engine got."""
    import torch

    if torch.device(device).type == "cpu":
        torch.set_num_threads(num_threads or len(os.sched_getaffinity(0)))


def load_transformers(model_dir: str, dtype: str, device: str, num_threads: int | None):
    """transformers' model on the weights, dtype, device and CPU threads the engine ran with."""
    import torch
    from transformers import AutoModelForCausalLM

    from compiled.loader import resolve_dtype

    use_engine_threads(device, num_threads)
    dev = torch.device(device)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype, dev)).to(dev).eval()


def bench_kiln(llm, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    return _rates(
        len(prompts), sum(map(len, prompts)), sum(len(o.outputs[0].token_ids) for o in outs), elapsed
    )


def bench_transformers_static(
    model, prompts: list[list[int]], output_len: int, batch_size: int, pad_id: int
) -> dict:
    """`generate` over left-padded batches of `batch_size` prompts in input order: the usual way to batch with
    transformers. A batch runs until its longest prompt is done, and no new prompt joins it."""
    import torch
    from tqdm.auto import tqdm

    def generate(batch: list[list[int]], n: int) -> int:
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=pad_id,
        )
        return out.shape[0] * (out.shape[1] - width)

    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    with torch.no_grad():
        generate(prompts[:1], 2)  # first-call setup, not timed (the engine's warm-up is not timed either)
        start = time.perf_counter()
        generated = sum(generate(b, output_len) for b in tqdm(batches, desc="transformers static batches"))
        elapsed = time.perf_counter() - start
    return _rates(len(prompts), sum(map(len, prompts)), generated, elapsed)


def bench_transformers_continuous(
    model, prompts: list[list[int]], output_len: int, max_num_seqs: int, max_batch_tokens: int, pad_id: int
) -> dict:
    """transformers' own continuous batching (paged KV cache, `generate_batch`'s manager), sized as kiln is:
    same sequences and tokens per step, and a cache that holds `max_num_seqs` of the longest requests (left to
    itself it sizes the cache from free memory, which on CPU is most of the machine's RAM)."""
    import transformers
    from tqdm.auto import tqdm
    from transformers import ContinuousBatchingConfig, GenerationConfig

    if not hasattr(model, "generate_batch"):
        return {"unavailable": f"transformers {transformers.__version__} has no continuous batching"}
    page = ContinuousBatchingConfig().page_size
    per_request = -(-(max(map(len, prompts)) + output_len) // page)
    cb_config = ContinuousBatchingConfig(
        num_blocks=max_num_seqs * per_request + 1,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_num_seqs,
    )
    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=output_len, eos_token_id=-1, pad_token_id=pad_id
    )
    try:
        with model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=5
        ) as manager:
            start = time.perf_counter()
            ids = manager.add_requests(inputs=prompts, max_new_tokens=output_len)
            results: dict[str, Any] = {}
            with tqdm(total=len(ids), desc="transformers continuous batching") as bar:
                while len(results) < len(ids):
                    r = manager.get_result(timeout=1)
                    if r is None and not manager.is_running():
                        raise RuntimeError("its generation thread stopped")
                    if r is not None and r.is_finished():
                        results[r.request_id] = r
                        bar.update(1)
            elapsed = time.perf_counter() - start
    except Exception as e:
        return {"unavailable": f"{type(e).__name__}: {e}"}
    errors = [r.error for r in results.values() if r.error]
    if errors:
        return {"unavailable": f"{len(errors)} requests failed: {errors[0]}"}
    generated = sum(len(r.generated_tokens) for r in results.values())
    return _rates(len(prompts), sum(map(len, prompts)), generated, elapsed)


def run(
    model: str | None,
    engine_args: dict,
    num_prompts: int = 256,
    input_len_min: int = 32,
    input_len_max: int = 512,
    output_len: int = 128,
    dataset: str | None = None,
    seed: int = 0,
    compare: str | None = None,
    hf_continuous: bool = True,
    vllm_python: str | None = None,
) -> dict:
    """kiln, then on the same prompts either (`compare="transformers"`) transformers static batches and (with
    `hf_continuous`) its continuous batching, or (`compare="vllm"`) vLLM's CPU backend in its own venv."""
    from engine.llm import LLM
    from server.bench import vllm_cpu

    if compare == "vllm":
        vllm_python = vllm_cpu.python(vllm_python)

    llm = LLM(model, **engine_args)
    try:
        if dataset:
            prompts = [llm.processor.tokenize(p) for p in dataset_prompts(dataset, num_prompts)]
        else:
            prompts = token_prompts(llm.tokenizer, num_prompts, input_len_min, input_len_max, seed)
        limit = llm.max_model_len - output_len
        if (too_long := sum(len(p) > limit for p in prompts)) > 0:
            raise ValueError(
                f"{too_long} prompts are longer than max_model_len - output_len = {limit} tokens"
            )
        ready, model_dir, pad_id = llm.client.ready, llm.model_dir, llm.tokenizer.pad_token_id
        max_model_len = llm.max_model_len
        cfg = llm.config
        out: dict = {
            "config": {
                "model": model_dir,
                "dtype": ready.dtype,
                "quantization": cfg.quantization,
                "device": ready.device,
                "num_prompts": len(prompts),
                "dataset": dataset,
                "input_len_min": min(map(len, prompts)),
                "input_len_max": max(map(len, prompts)),
                "input_len_mean": sum(map(len, prompts)) / len(prompts),
                "output_len": output_len,
                "seed": seed,
                "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
            }
        }
        out["kiln"] = bench_kiln(llm, prompts, output_len)
    finally:
        llm.shutdown()
    if compare == "vllm":
        threads = cfg.num_threads or len(os.sched_getaffinity(0))

        def vllm_on(weights: str) -> dict:
            peer = vllm_cpu.offline(
                vllm_python, weights, ready.dtype, max_model_len, prompts, output_len, threads
            )
            if "unavailable" in peer:
                return peer
            return {
                **{k: peer[k] for k in ("version", "max_num_seqs", "max_num_batched_tokens")},
                "threads": threads,
                **_rates(len(prompts), peer["prompt_tokens"], peer["output_tokens"], peer["elapsed_s"]),
            }

        out["vllm"] = vllm_on(model_dir)
        if cfg.quantization == "w8a8":  # and vLLM on the int8 weights kiln computed with
            with tempfile.TemporaryDirectory(prefix="kiln-w8a8-") as tmp:
                try:
                    out["vllm_w8a8"] = vllm_on(w8a8_checkpoint(model_dir, ready.dtype, tmp))
                except ValueError as e:  # a model the checkpoint cannot hold: reported, the runs kept
                    out["vllm_w8a8"] = {"unavailable": str(e)}
    elif compare == "transformers":
        hf = load_transformers(model_dir, ready.dtype, ready.device, cfg.num_threads)
        pad_id = pad_id if pad_id is not None else 0
        out["transformers_static"] = bench_transformers_static(
            hf, prompts, output_len, cfg.max_num_seqs, pad_id
        )
        if hf_continuous:
            out["transformers_continuous"] = bench_transformers_continuous(
                hf, prompts, output_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, pad_id
            )
    return out


def format_report(r: dict) -> str:
    c, kiln = r["config"], r["kiln"]
    source = c["dataset"] or f"random windows of {c['input_len_min']}-{c['input_len_max']} tokens"
    rows = [
        f"throughput: {c['num_prompts']} prompts ({source}, mean {c['input_len_mean']:.0f} tokens), "
        f"{c['output_len']} output tokens each; {c['model']} {c['dtype']} "
        f"(quantization {c.get('quantization', 'none')}) on {c['device']}, "
        f"max_num_seqs {c['max_num_seqs']}",
        "| engine | requests/s | output tok/s | total tok/s | time s | kiln / this |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in {"kiln": "kiln", **BASELINES}.items():
        d = r.get(key)
        if d is None:
            continue
        if "unavailable" in d:
            reason = d["unavailable"].splitlines()[0][:200].replace("|", "/")
            rows.append(f"| {label} | unavailable: {reason} | | | | |")
            continue
        ratio = "" if key == "kiln" else f"{kiln['output_tok_s'] / d['output_tok_s']:.2f}x"
        if key.startswith("vllm"):
            weights = "W8A8, kiln's int8 weights" if key == "vllm_w8a8" else "CPU backend"
            label = (
                f"vLLM {d['version']} ({weights}, {d['threads']} threads, "
                f"max_num_seqs {d['max_num_seqs']}, max_num_batched_tokens {d['max_num_batched_tokens']})"
            )
        rows.append(
            f"| {label} | {d['requests_per_s']:.2f} | {d['output_tok_s']:.1f} | {d['total_tok_s']:.1f} "
            f"| {d['elapsed_s']:.1f} | {ratio} |"
        )
    return "\n".join(rows)

"""`kiln bench runner`: the model runner alone, against transformers.

Decode is timed with synthetic context: each sequence gets `context` positions of KV-cache blocks
holding random K/V (server/bench/driver.py: RunnerDriver) and decodes from there, so large batches need
no long prefill first. Prefill is timed on a random prompt. The engines take
turns, a few steps each, so that their ratios hold on a machine whose speed drifts.
"""

from __future__ import annotations

import statistics
import time

import torch

from compiled.input_batch import cdiv
from compiled.model_runner import ModelRunner
from compiled.worker import resolve_device
from server.bench.driver import RunnerDriver, build_runner, model_dir


class Copy:
    """A large tensor copy on `device`, the memory roofline's yardstick: `moved` bytes read + written."""

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


class KilnEngine:
    """A ModelRunner as `measure` drives it: decode batches over synthetic context, one-prompt prefills."""

    def __init__(self, runner: ModelRunner, prefill_len: int) -> None:
        self.runner, self.prefill_len = runner, prefill_len
        self.driver = RunnerDriver(runner)
        self.prompt = torch.randint(0, runner.vocab_size, (prefill_len,)).tolist()
        self.prefills = 0

    def start(self, batch: int, context: int) -> None:
        for i in range(batch):
            self.driver.add(
                f"b{batch}-{i}",
                torch.randint(0, self.runner.vocab_size, (context,)).tolist(),
                seed=i,
                computed=context - 1,
            )
        self.driver.step()

    def step(self) -> None:
        self.driver.step()

    def finish(self) -> None:
        self.driver.finish()

    def prefill(self) -> None:
        self.prefills += 1
        self.driver.add(f"p{self.prefills}", self.prompt)
        self.driver.step()
        self.driver.finish()


class TransformersEngine:
    """transformers' own forward and KV cache, driven as `generate` drives them (prefill, then one greedy
    token per step); only the steps are timed: generate's bookkeeping is left out, in its favour."""

    def __init__(self, model, prefill_len: int) -> None:
        self.model, self.vocab, self.prefill_len = model, model.config.vocab_size, prefill_len
        self.prompt = torch.randint(0, self.vocab, (1, prefill_len))

    def _prefill(self, ids: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        with torch.no_grad():  # generate asks for the last position's logits only
            logits = self.model(
                input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1
            ).logits
        self.token = logits.argmax(-1)

    def start(self, batch: int, context: int) -> None:
        self._prefill(torch.randint(0, self.vocab, (batch, context)))

    def step(self) -> None:
        with torch.no_grad():
            self.token = self.model(
                input_ids=self.token, past_key_values=self.cache, use_cache=True
            ).logits.argmax(-1)

    def finish(self) -> None:
        self.cache = self.token = None

    def prefill(self) -> None:
        self._prefill(self.prompt)


def bench_kv_blocks(block_size: int, batch: int, context: int, prefill_len: int) -> int:
    """KV blocks for a KilnEngine: `batch` sequences at `context` plus one prompt, and the null block."""
    return batch * cdiv(context + 64, block_size) + cdiv(prefill_len, block_size) + 2


def kiln_engine(engine_args: dict, batch: int, context: int, prefill_len: int) -> tuple[KilnEngine, float]:
    """A warmed-up runner for `measure`, and its warm-up's seconds; its KV cache holds `batch` sequences
    decoding to `context`."""
    runner = build_runner(engine_args.pop("model"), **engine_args)
    runner.initialize_kv_cache(bench_kv_blocks(runner.block_size, batch, context, prefill_len))
    start = time.perf_counter()
    runner.warmup()
    return KilnEngine(runner, prefill_len), time.perf_counter() - start


def _turn_order(engines: dict, round_index: int) -> list[str]:
    """Engine names in the order of this round: reversed every other round, so none always goes first."""
    names = list(engines)
    return names if round_index % 2 == 0 else names[::-1]


def measure(
    engines: dict,
    batches: list[int],
    context: int,
    steps: int,
    copy: Copy | None = None,
    roofline_engine: str | None = None,
    rounds: int = 2,
) -> dict[str, dict]:
    """Decode tokens/s per batch size at `context` and prefill tokens/s of each engine, measured in turns:
    each engine's `steps` timed steps come in `rounds` blocks, alternating with the other engines' blocks,
    so that every engine meets the same moments of a machine whose speed drifts by a third in minutes.
    The first step after a switch of engines runs slow (kiln batch 8: ~15 %, after transformers' steps),
    so each block starts with an untimed step.

    With `copy`, the `roofline_engine`'s batch 1 is also measured against the roofline step by step: each
    decode step is followed by a timed copy, and the result is the median over steps of (weight bytes /
    step time) / (copy bandwidth), so that the bandwidth a step is held to is the machine's at that moment.
    """
    out: dict[str, dict] = {name: {"decode_tok_s": {}} for name in engines}
    blocks = [steps // rounds + (i < steps % rounds) for i in range(rounds)]
    for b in batches:
        elapsed = dict.fromkeys(engines, 0.0)
        for engine in engines.values():
            engine.start(b, context)
        for i, n in enumerate(blocks):
            for name in _turn_order(engines, i):
                engines[name].step()
                elapsed[name] += sum(_timed(engines[name].step) for _ in range(n))
        for name, engine in engines.items():
            out[name]["decode_tok_s"][b] = b * steps / elapsed[name]
            if b == 1 and copy is not None and name == roofline_engine:
                runner = engine.runner
                engine.step()  # the first step after a switch runs slow
                pairs = [(_timed(engine.step), copy.seconds()) for _ in range(steps)]
                out[name]["batch1_roofline"] = statistics.median(
                    runner.weight_bytes * c / (copy.moved * t) for t, c in pairs
                )
                out[name]["paired_copy_GBps"] = statistics.median(copy.moved / c for _, c in pairs) / 1e9
            engine.finish()
    elapsed = dict.fromkeys(engines, 0.0)
    for engine in engines.values():
        engine.prefill()
    for i in range(3):
        for name in _turn_order(engines, i):
            elapsed[name] += _timed(engines[name].prefill)
    for name, engine in engines.items():
        out[name]["prefill_tok_s"] = engine.prefill_len * 3 / elapsed[name]
    return out


def run(
    model: str | None = None,
    dtype: str = "float32",
    batches: tuple[int, ...] = (1, 8, 32, 64),
    context: int = 512,
    steps: int = 8,
    prefill_len: int = 512,
    compare: bool = True,
    num_threads: int | None = None,
    quantization: str = "none",
    against: str | None = None,
) -> dict:
    """Compiled vs eager kiln vs transformers, plus the memory roofline, measured in one run.
    Transformers runs the de-quantized weights whatever kiln's `quantization`. `against`
    ("QUANTIZATION:DTYPE", e.g. "none:bfloat16"): compiled kiln on those weights instead of eager kiln."""
    from compiled.loader import resolve_dtype

    path = model_dir(model)

    def weights(quant: str) -> str | None:
        return model if quant == "gguf" else path  # gguf reads the file itself

    reach = context + 2 * steps  # batch 1 decodes its timed steps twice (the roofline's pairs)
    common = dict(
        model=weights(quantization),
        quantization=quantization,
        dtype=dtype,
        max_num_seqs=max(batches),
        num_threads=num_threads,
        max_model_len=max(reach + 64, prefill_len + 1),
    )
    out: dict = {
        "config": {
            "model": path,
            "dtype": dtype,
            "quantization": quantization,
            "batches": list(batches),
            "context": context,
            "steps": steps,
            "prefill_len": prefill_len,
            "threads": num_threads or torch.get_num_threads(),
            "against": against,
        }
    }
    copy = Copy()
    engines, batch = {}, max(batches)
    engines["kiln_compiled"], compiled_warmup = kiln_engine(dict(common), batch, reach, prefill_len)
    if against:
        quant, _, against_dtype = against.partition(":")
        other = dict(common, model=weights(quant), quantization=quant, dtype=against_dtype or dtype)
        engines[f"kiln_{quant}_{other['dtype']}"], _ = kiln_engine(other, batch, reach, prefill_len)
    else:
        engines["kiln_eager"], _ = kiln_engine(dict(common, enforce_eager=True), batch, reach, prefill_len)
    if compare:
        from transformers import AutoModelForCausalLM

        torch_dtype = resolve_dtype(dtype, resolve_device("auto"))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
        engines["transformers"] = TransformersEngine(hf, prefill_len)
    out |= measure(engines, list(batches), context, steps, copy, roofline_engine="kiln_compiled")
    out["kiln_compiled"]["warmup_s"] = compiled_warmup
    out["kiln_compiled"]["weight_bytes"] = engines["kiln_compiled"].runner.weight_bytes
    bandwidth = copy.bandwidth()
    out["copy_bandwidth_GBps"] = bandwidth / 1e9
    out["roofline_tok_s"] = bandwidth / out["kiln_compiled"]["weight_bytes"]
    return out


def format_report(r: dict) -> str:
    rows = [
        f"runner benchmark: {r['config']}",
        f"copy bandwidth {r['copy_bandwidth_GBps']:.1f} GB/s -> "
        f"batch-1 roofline {r['roofline_tok_s']:.1f} tok/s",
        "| decode tok/s | " + " | ".join(f"batch {b}" for b in r["config"]["batches"]) + " | prefill tok/s |",
        "|---|" + "---|" * (len(r["config"]["batches"]) + 1),
    ]
    engines = [k for k in r if k.startswith("kiln_") or k == "transformers"]
    for k in engines:
        d = r[k]["decode_tok_s"]
        rows.append(
            f"| {k} | "
            + " | ".join(f"{d[b]:.1f}" for b in r["config"]["batches"])
            + f" | {r[k]['prefill_tok_s']:.0f} |"
        )
    base = "transformers" if "transformers" in r else engines[1]
    d, ref = r["kiln_compiled"]["decode_tok_s"], r[base]["decode_tok_s"]
    rows.append(
        f"| compiled / {base} | "
        + " | ".join(f"{d[b] / ref[b]:.2f}x" for b in r["config"]["batches"])
        + f" | {r['kiln_compiled']['prefill_tok_s'] / r[base]['prefill_tok_s']:.2f}x |"
    )
    if "batch1_roofline" in r["kiln_compiled"]:
        k = r["kiln_compiled"]
        rows.append(
            f"batch-1 compiled decode = {100 * k['batch1_roofline']:.0f}% of roofline (median over steps, "
            f"each paired with a copy: {k['paired_copy_GBps']:.1f} GB/s); "
            f"{100 * d[1] / r['roofline_tok_s']:.0f}% against the best copy at the end of the run"
        )
    rows.append(f"compile warm-up {r['kiln_compiled']['warmup_s']:.1f} s")
    return "\n".join(rows)

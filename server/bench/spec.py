"""`kiln bench spec`: speculative decoding's speed, drafts off against n-gram drafts, on two prompt sets
shipped beside this file: input-grounded chat (the answer copies spans of the prompt: a rewrite with one
change, a bug fix, a config edit, field extraction, a story repeated with one name changed) and
open-ended chat. Greedy, answers to their end (or --output-len); batch 1 (one request at a time) and
streams served concurrently. The two engines take turns, set by set and concurrency by concurrency, so
both meet the same moments of a machine whose speed drifts; their answers must be the same. A suffix
drafter starts afresh before each run: its cache of earlier answers would otherwise hold these very
answers from the run before. With `--compare llama.cpp` (a .gguf model), llama.cpp answers the same
prompts one at a time on the same file, plain and drafting by its own prompt lookup, in the same turns.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec

from engine.params import SamplingParams
from server.bench.latency import start_llama_cpp

PROMPTS = Path(__file__).with_name("spec_prompts.json")


async def _answers(llm, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> tuple:
    """Every prompt's answer, `concurrency` at a time: (answers, output tokens per second)."""
    gate, answers = asyncio.Semaphore(concurrency), [None] * len(prompts)

    async def one(i: int) -> None:
        async with gate:
            async for out in llm.generate(prompts[i], params):
                answers[i] = out.outputs[0].token_ids

    await llm.reset_prefix_cache()
    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return answers, sum(map(len, answers)) / (time.perf_counter() - start)


def _peer_answers(peer, prompts: list[list[int]], output_len: int, stop: list[int], lookup: bool) -> tuple:
    """llama.cpp's answers one at a time (each to a stop token or `output_len`), as `_answers` gives them."""
    answers, seconds = [], 0.0
    for prompt in prompts:
        answer = peer.call(prompt, output_len, stop=stop, lookup=lookup)
        answers.append(answer["tokens"])
        seconds += answer["seconds"]
    return answers, sum(map(len, answers)) / seconds


def _accepted(stats: dict) -> tuple[int, int]:
    spec = stats.get("spec_decoding") or {}
    return spec.get("num_drafts", 0), spec.get("num_accepted_tokens", 0)


async def _bench(
    engines: dict, renew, sets: dict, params: SamplingParams, concurrency: tuple, rounds: int, peer=None
) -> dict:
    """`renew`: None, or a function that replaces the drafting engine with a fresh one. `peer`: None, or
    llama.cpp (`LlamaCpp` with lookup), which runs at concurrency 1 beside them."""
    results: dict = {}
    stop = [engines["off"].processor.eos_token_id, *engines["off"].processor.extra_stop_ids]
    for name, prompts in sets.items():
        for c in concurrency:
            kinds = [*engines, *(("llama.cpp", "llama.cpp lookup") if peer is not None and c == 1 else ())]
            runs = {kind: [] for kind in kinds}
            answers, acceptance = {}, []
            for r in range(rounds + 1):  # the first round warms up, untimed
                for kind in kinds if r % 2 else kinds[::-1]:
                    batch = prompts * -(-c // len(prompts))  # at least one prompt per stream
                    if kind.startswith("llama.cpp"):
                        lookup = kind.endswith("lookup")
                        answers[kind], tok_s = _peer_answers(peer, batch, params.max_tokens, stop, lookup)
                        if r:
                            runs[kind].append(tok_s)
                        continue
                    if kind == "drafts" and renew is not None:
                        if not r:  # a fresh engine each timed run: nothing to warm
                            continue
                        renew()
                    llm = engines[kind]
                    before = _accepted(await llm.get_stats())
                    answers[kind], tok_s = await _answers(llm, batch, params, c)
                    after = _accepted(await llm.get_stats())
                    if r:
                        runs[kind].append(tok_s)
                        if after[0] > before[0]:
                            acceptance.append(1 + (after[1] - before[1]) / (after[0] - before[0]))
            row = {kind: sum(v) / len(v) for kind, v in runs.items()}
            row["ratio"] = row["drafts"] / row["off"]
            row["mean_acceptance_length"] = sum(acceptance) / len(acceptance) if acceptance else None
            row["same_answers"] = answers["drafts"] == answers["off"]
            if "llama.cpp" in row:
                row["llama.cpp tokens"] = sum(map(len, answers["llama.cpp lookup"]))
                row["kiln tokens"] = sum(map(len, answers["drafts"]))
                row["llama.cpp same"] = answers["llama.cpp lookup"] == answers["llama.cpp"]
            results[f"{name}, {c} at a time"] = row
    return results


def run(
    model: str | None,
    engine_args: dict,
    spec: str,
    output_len: int,
    concurrency: tuple,
    rounds: int,
    compare: str | None = None,
    llama_cpp_python: str | None = None,
) -> dict:
    from engine.async_llm import AsyncLLM
    from engine.config import SpeculativeConfig

    args = {key: value for key, value in engine_args.items() if key != "speculative_config"}
    config = msgspec.convert(json.loads(spec), SpeculativeConfig)
    lookup = (config.num_speculative_tokens, config.prompt_lookup_max)
    # Suffix drafts learn from what their engine answered: a fresh engine for each timed run (renew).
    fresh = config.method == "suffix"
    engines = {
        "off": AsyncLLM(model, **args),
        "drafts": None if fresh else AsyncLLM(model, speculative_config=spec, **args),
    }
    peer = None

    def renew() -> None:
        if engines["drafts"] is not None:
            engines["drafts"].shutdown()
        engines["drafts"] = AsyncLLM(model, speculative_config=spec, **args)

    try:
        if compare == "llama.cpp":
            peer = start_llama_cpp(model, llama_cpp_python, engines["off"], lookup)
        data = json.loads(PROMPTS.read_text())
        sets = {name: [engines["off"].chat_prompt(m) for m in chats] for name, chats in data.items()}
        params = SamplingParams(temperature=0.0, max_tokens=output_len)
        results = asyncio.run(
            _bench(engines, renew if fresh else None, sets, params, concurrency, rounds, peer)
        )
    finally:
        for llm in filter(None, engines.values()):
            llm.shutdown()
        if peer is not None:
            peer.close()
    out = {"speculative_config": spec, "output_len": output_len, "rows": results}
    if peer is not None:
        out["llama.cpp"] = {
            "version": peer.version,
            "num_pred_tokens": lookup[0],
            "max_ngram_size": lookup[1],
        }
    return out


def format_report(result: dict) -> str:
    lines = [
        f"speculative decoding {result['speculative_config']}, greedy, up to {result['output_len']} tokens"
    ]
    lines.append(f"{'':34} {'off tok/s':>10} {'drafts tok/s':>12} {'ratio':>6} {'accept len':>10} same")
    for name, row in result["rows"].items():
        length = row["mean_acceptance_length"]
        length = f"{length:.2f}" if length is not None else "-"
        lines.append(
            f"{name:34} {row['off']:10.1f} {row['drafts']:12.1f} {row['ratio']:6.2f} {length:>10} "
            f"{'yes' if row['same_answers'] else 'NO'}"
        )
    lines.append(
        "same: the drafting engine's answers equal the other's token for token; exact in float32, while "
        "bfloat16 kernels round differently with the rows a step carries"
    )
    if "llama.cpp" in result:
        peer = result["llama.cpp"]
        lines.append(
            f"llama.cpp {peer['version']} on the same GGUF file, one request at a time; lookup: its "
            f"LlamaPromptLookupDecoding(num_pred_tokens={peer['num_pred_tokens']}, "
            f"max_ngram_size={peer['max_ngram_size']})"
        )
        lines.append(
            f"{'':34} {'plain tok/s':>11} {'lookup tok/s':>12} {'kiln drafts / lookup':>21} tokens, same"
        )
        for name, row in result["rows"].items():
            if "llama.cpp" in row:
                lines.append(
                    f"{name:34} {row['llama.cpp']:11.1f} {row['llama.cpp lookup']:12.1f} "
                    f"{row['drafts'] / row['llama.cpp lookup']:20.2f}x "
                    f"{row['llama.cpp tokens']} (kiln {row['kiln tokens']}), "
                    f"{'yes' if row['llama.cpp same'] else 'NO'}"
                )
    return "\n".join(lines)

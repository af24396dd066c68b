"""`kiln bench spec`: speculative decoding's speed, drafts off against n-gram drafts, on two prompt sets
shipped beside this file: input-grounded chat (the answer copies spans of the prompt: a rewrite with one
change, a bug fix, a config edit, field extraction, a story repeated with one name changed) and
open-ended chat. Greedy, answers to their end (or --output-len); batch 1 (one request at a time) and
streams served concurrently. The two engines take turns, set by set and concurrency by concurrency, so
both meet the same moments of a machine whose speed drifts; their answers must be the same. A suffix
drafter starts afresh before each run: its cache of earlier answers would otherwise hold these very
answers from the run before.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from engine.params import SamplingParams

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


def _accepted(stats: dict) -> tuple[int, int]:
    spec = stats.get("spec_decoding") or {}
    return spec.get("num_drafts", 0), spec.get("num_accepted_tokens", 0)


async def _bench(
    engines: dict, renew, sets: dict, params: SamplingParams, concurrency: tuple, rounds: int
) -> dict:
    """`renew`: None, or a function that replaces the drafting engine with a fresh one."""
    results: dict = {}
    for name, prompts in sets.items():
        for c in concurrency:
            runs = {kind: [] for kind in engines}
            answers, acceptance = {}, []
            for r in range(rounds + 1):  # the first round warms up, untimed
                order = list(engines) if r % 2 else list(reversed(engines))
                for kind in order:
                    if kind == "drafts" and renew is not None:
                        if not r:  # a fresh engine each timed run: nothing to warm
                            continue
                        renew()
                    llm = engines[kind]
                    before = _accepted(await llm.get_stats())
                    batch = prompts * -(-c // len(prompts))  # at least one prompt per stream
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
            results[f"{name}, {c} at a time"] = row
    return results


def run(
    model: str | None, engine_args: dict, spec: str, output_len: int, concurrency: tuple, rounds: int
) -> dict:
    from engine.async_llm import AsyncLLM

    args = {key: value for key, value in engine_args.items() if key != "speculative_config"}
    engines = {"off": AsyncLLM(model, **args), "drafts": AsyncLLM(model, speculative_config=spec, **args)}

    def renew() -> None:
        engines["drafts"].shutdown()
        engines["drafts"] = AsyncLLM(model, speculative_config=spec, **args)

    try:
        data = json.loads(PROMPTS.read_text())
        sets = {name: [engines["off"].chat_prompt(m) for m in chats] for name, chats in data.items()}
        params = SamplingParams(temperature=0.0, max_tokens=output_len)
        fresh = renew if json.loads(spec).get("method") == "suffix" else None
        results = asyncio.run(_bench(engines, fresh, sets, params, concurrency, rounds))
    finally:
        for llm in engines.values():
            llm.shutdown()
    return {"speculative_config": spec, "output_len": output_len, "rows": results}


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
    return "\n".join(lines)

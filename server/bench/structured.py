"""`kiln bench structured`: what a grammar costs. Per output token, a JSON-schema request against the same
request unconstrained, at batch 1 and 16, the two taking turns; and time to first token for a schema
the engine has not seen (its grammar compiles first), for the same schema again (cached), and without
one.

Both kinds decode exactly `output_len` tokens (the unconstrained with EOS ignored, the constrained held
open by a schema that needs more items than fit), so they run the same steps; the cost per token is each
request's time from its first token to its last over the tokens in between.
"""

from __future__ import annotations

import statistics
import uuid

from engine.params import SamplingParams, StructuredOutputsParams

QUESTIONS = [
    "List fruits.", "Name some cities.", "Give me colours.", "Which animals live in the sea?",
    "List programming languages.", "Name rivers.", "Some vegetables, please.", "List musical instruments.",
    "Name famous painters.", "Which sports use a ball?", "List kitchen tools.", "Name planets and moons.",
    "List car brands.", "Name trees.", "Give me words that rhyme with cat.", "List board games.",
]  # fmt: skip


def _schema(key: str = "items") -> dict:
    items = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1000}
    return {"type": "object", "properties": {key: items}, "required": [key], "additionalProperties": False}


def _per_token_ms(outs) -> list[float]:
    return [
        1e3 * (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outs
    ]


def run(model: str | None, engine_args: dict, output_len: int = 128, rounds: int = 3) -> dict:
    from engine.llm import LLM
    from server.bench.gpu_check import cpu_name

    llm = LLM(model, **engine_args)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    free = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    json = SamplingParams(
        temperature=0, max_tokens=output_len, structured_outputs=StructuredOutputsParams(json=_schema())
    )
    llm.chat(conversations[:1], json, use_tqdm=False)  # warm-up: compiles, and builds the grammar tokenizer
    result: dict = {"cpu": cpu_name(), "output_len": output_len, "batches": {}}
    for batch in (1, 16):
        runs: dict[str, list[float]] = {"free": [], "json": []}
        for r in range(rounds):
            for kind in ("free", "json") if r % 2 == 0 else ("json", "free"):
                outs = llm.chat(conversations[:batch], free if kind == "free" else json, use_tqdm=False)
                assert all(len(o.outputs[0].token_ids) == output_len for o in outs), "a request ended early"
                runs[kind] += _per_token_ms(outs)
        free_ms, json_ms = statistics.median(runs["free"]), statistics.median(runs["json"])
        result["batches"][batch] = {"free_ms": free_ms, "json_ms": json_ms, "overhead": json_ms / free_ms - 1}

    def ttft(params: SamplingParams) -> float:
        llm.reset_prefix_cache()
        (out,) = llm.chat(conversations[:1], params, use_tqdm=False)
        return 1e3 * out.metrics.time_to_first_token

    short = dict(temperature=0, max_tokens=2)
    first, cached, plain = [], [], []
    for _ in range(rounds):
        fresh = StructuredOutputsParams(json=_schema(f"k{uuid.uuid4().hex[:8]}"))
        first.append(ttft(SamplingParams(**short, structured_outputs=fresh)))
        cached.append(ttft(SamplingParams(**short, structured_outputs=fresh)))
        plain.append(ttft(SamplingParams(**short)))
    result["ttft_ms"] = {
        "first_seen": statistics.median(first),
        "cached": statistics.median(cached),
        "unconstrained": statistics.median(plain),
    }
    llm.shutdown()
    return result


def format_report(r: dict) -> str:
    lines = [f"structured outputs ({r['cpu']}), {r['output_len']} tokens a request, greedy"]
    for batch, b in r["batches"].items():
        lines.append(
            f"  batch {batch}: {b['free_ms']:.2f} ms/token unconstrained, {b['json_ms']:.2f} with a JSON "
            f"schema ({100 * b['overhead']:+.1f} %)"
        )
    t = r["ttft_ms"]
    lines.append(
        f"  TTFT: {t['unconstrained']:.0f} ms unconstrained, {t['first_seen']:.0f} ms for a first-seen "
        f"schema, {t['cached']:.0f} ms for a cached one"
    )
    return "\n".join(lines)

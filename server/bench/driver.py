"""Driving a ModelRunner without the engine, for the benchmarks, gpu-check and the tests: a minimal stand-in
for the scheduler, and the greedy check against transformers."""

from __future__ import annotations

import weakref

import torch

from compiled.gguf import convert_gguf
from compiled.input_batch import cdiv
from compiled.model_runner import ModelRunner
from compiled.worker import Worker
from engine.config import EngineConfig
from engine.model_files import default_model_path, locate_model
from engine.params import SamplingParams
from engine.step import CachedRequestData, NewRequestData, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


def model_dir(model: str | None) -> str:
    """The HF directory of `model` (None: the default), converting a GGUF file on its first use."""
    path, gguf_file = locate_model(model)
    if gguf_file is not None:
        convert_gguf(gguf_file, path)
    return path


def build_runner(model: str | None, **engine_args) -> ModelRunner:
    """A model runner as the engine core builds it (threads, device, resolved budgets), without a KV cache."""
    path, gguf_file = locate_model(model)
    return Worker(EngineConfig(model=model or default_model_path(), **engine_args), path, gguf_file).runner


class RunnerDriver:
    """Sequential block allocation, prefill in chunks of at most `chunk` tokens, then decode.

    A request may start at a synthetic context (`computed`): its first `computed` positions count as cached
    although no step computed them, which is how the benchmarks decode at a long context without a prefill.
    Their blocks are filled with random K/V first: pages never written read as the one shared zero page,
    which stays in cache, and attention over them would run faster than over a real context.
    """

    def __init__(self, runner: ModelRunner, chunk: int = 1 << 30) -> None:
        self.runner, self.chunk, self.next_block = runner, chunk, 1
        self.reqs: dict[str, dict] = {}

    def add(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams | None = None,
        seed: int = 0,
        computed: int = 0,
    ) -> None:
        self.reqs[rid] = dict(
            tokens=list(prompt),
            n_prompt=len(prompt),
            computed=computed,
            blocks=[],
            new=True,
            params=params or GREEDY,
            seed=seed,
            out=[],
        )

    def _ensure_blocks(self, r: dict, upto: int) -> list[int]:
        new = list(
            range(self.next_block, self.next_block + cdiv(upto, self.runner.block_size) - len(r["blocks"]))
        )
        r["blocks"] += new
        self.next_block += len(new)
        return new

    def build(self, rids: list[str] | None = None) -> SchedulerOutput:
        so = SchedulerOutput()
        for rid in rids or list(self.reqs):
            r = self.reqs[rid]
            n = min(len(r["tokens"]) - r["computed"], self.chunk)
            new_blocks = self._ensure_blocks(r, r["computed"] + n)
            if r["new"]:
                if r["computed"]:
                    self._fill(r["blocks"])
                so.new_reqs.append(
                    NewRequestData(
                        rid,
                        list(r["tokens"]),
                        r["n_prompt"],
                        r["params"],
                        list(r["blocks"]),
                        r["computed"],
                        r["seed"],
                    )
                )
                r["new"] = False
            else:
                so.cached_reqs.append(CachedRequestData(rid, new_blocks, r["computed"]))
            so.num_scheduled_tokens[rid] = n
            so.total_num_scheduled_tokens += n
        return so

    def _fill(self, blocks: list[int]) -> None:
        index = torch.tensor(blocks, device=self.runner.device)
        for layer in self.runner.model.layers:
            for cache in (layer.attention.k_cache, layer.attention.v_cache):
                noise = torch.randn((len(blocks), *cache.shape[1:]), device=cache.device)
                cache.index_copy_(0, index, noise.to(cache.dtype))

    def apply(self, so: SchedulerOutput, out) -> dict[str, list[int]]:
        result = {}
        for rid, toks in zip(out.req_ids, out.sampled_token_ids):
            r = self.reqs[rid]
            r["computed"] += so.num_scheduled_tokens[rid]
            r["tokens"] += toks
            r["out"] += toks
            result[rid] = toks
        return result

    def step(self, rids: list[str] | None = None) -> dict[str, list[int]]:
        so = self.build(rids)
        return self.apply(so, self.runner.execute_model(so))

    def logits(self, so: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Logits of every token the step computes, keyed by request, in position order (no sampling)."""
        batch = self.runner.batch
        batch.update(so)
        singles, chunks = batch.split(so.num_scheduled_tokens, so.spec_tokens)
        step = batch.prepare(singles, chunks, so.num_scheduled_tokens)
        with torch.no_grad():
            logits = self.runner.policy.logits(self.runner.hidden_states(step))
        out = {s.req_id: logits[i : i + 1] for i, s in enumerate(singles)}
        offset = step.meta.decode_block_tables.shape[0]  # past the padding rows
        for s in chunks:
            n = so.num_scheduled_tokens[s.req_id]
            out[s.req_id] = logits[offset : offset + n]
            offset += n
        return out

    def finish(self) -> None:
        """Release every request's runner state (its block-table row); blocks are handed out from 1 again."""
        self.runner.execute_model(SchedulerOutput(finished_req_ids=set(self.reqs)))
        self.reqs.clear()
        self.next_block = 1

    def generate(self, max_new: int) -> dict[str, list[int]]:
        while any(len(r["out"]) < max_new for r in self.reqs.values()):
            self.step([rid for rid, r in self.reqs.items() if len(r["out"]) < max_new])
        return {rid: r["out"][:max_new] for rid, r in self.reqs.items()}


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """Up to nine chat-templated questions of different lengths, as token ids."""
    questions = [
        "What is the capital of France?",
        "Write a haiku about autumn.",
        "Explain gravity to a child.",
        "List three prime numbers.",
        "Why is the sky blue? Answer in detail, please.",
        "Hi!",
        "Translate 'good morning' into Spanish and German.",
        "What is 17 times 23?",
        "Tell me a short story about a dragon who learns to bake bread in a small village.",
    ]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in questions[:n]
    ]


# Each model's greedy runs so far, by prompt: (tokens, KV cache, last token), so that asking again for
# the same prompt continues the same steps instead of repeating them (the tests share many prompts).
_greedy_runs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of exactly n tokens: argmax over its own forward and KV cache,
    without `generate`'s stopping rules (the engine side runs with ignore_eos)."""
    from transformers import DynamicCache

    runs = _greedy_runs.setdefault(model, {})
    out, cache, ids = runs.get(tuple(prompt)) or ([], None, None)
    if len(out) >= n:
        return out[:n]
    if cache is None:  # none yet, or a batch's tokens (`hf_greedy_batch`), which cannot be continued
        out, cache, ids = [], DynamicCache(), torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        while len(out) < n:
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids))
    runs[tuple(prompt)] = out, cache, ids
    return out[:n]


def hf_greedy_batch(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """`hf_greedy` of several prompts as one batch, each left-padded to the longest under transformers'
    attention mask and positions, several times faster than one prompt at a time; prompts already run
    that far are not run again, and the others' tokens are kept for later calls."""

    runs = _greedy_runs.setdefault(model, {})
    todo = [p for p in prompts if len(runs.get(tuple(p), ([],))[0]) < n]
    if todo:
        for p, tokens in zip(todo, _greedy_batch(model, todo, n)):
            runs[tuple(p)] = tokens, None, None
    return [runs[tuple(p)][0][:n] for p in prompts]


def _greedy_batch(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Left-padded prompts' greedy tokens, computed together."""
    from transformers import DynamicCache

    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    cache, out = DynamicCache(), []
    with torch.no_grad():
        while len(out) < n:
            positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1] :]
            logits = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            ).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            out.append(ids[:, 0].tolist())
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return [list(tokens) for tokens in zip(*out)]


def greedy_mismatches(
    runner: ModelRunner,
    hf_model,
    prompts: list[list[int]],
    batch_tokens: int = 24,
    tail_tokens: int = 64,
    chunk: int = 24,
) -> list[str]:
    """Generate greedily for all prompts together (longer prompts prefill in chunks beside running decodes),
    then continue prompt 0 alone (decode at batch 1), and compare each with transformers token by token.
    Returns what diverged; empty when everything is token-exact."""
    drv = RunnerDriver(runner, chunk=chunk)
    for i, p in enumerate(prompts):
        drv.add(str(i), p)
    ours = drv.generate(batch_tokens)
    for _ in range(tail_tokens - batch_tokens):
        drv.step(["0"])
    tail = drv.reqs["0"]["out"]
    drv.finish()
    bad = []
    if tail != hf_greedy(hf_model, prompts[0], tail_tokens):
        bad.append("prompt 0 (batch 1 tail)")
    bad += [
        f"prompt {i}"
        for i, p in enumerate(prompts[1:], start=1)
        if ours[str(i)] != hf_greedy(hf_model, p, batch_tokens)
    ]
    return bad

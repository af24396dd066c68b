"""A minimal stand-in for the scheduler, so model-runner tests do not depend on it."""

from __future__ import annotations

from engine.params import SamplingParams
from engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


class MiniDriver:
    """Sequential block allocation, prefill in chunks of at most `chunk` tokens, then decode."""

    def __init__(self, runner, chunk: int = 1 << 30) -> None:
        self.runner, self.chunk, self.next_block = runner, chunk, 1
        self.reqs: dict[str, dict] = {}

    def add(self, rid: str, prompt: list[int], params: SamplingParams | None = None, seed: int = 0) -> None:
        self.reqs[rid] = dict(tokens=list(prompt), n_prompt=len(prompt), computed=0, blocks=[], new=True,
                              params=params or SamplingParams(temperature=0.0, max_tokens=1 << 20), seed=seed,
                              out=[])

    def _ensure_blocks(self, r: dict, upto: int) -> list[int]:
        bs = self.runner.block_size
        new = []
        while len(r["blocks"]) * bs < upto:
            new.append(self.next_block)
            r["blocks"].append(self.next_block)
            self.next_block += 1
        return new

    def step(self, rids: list[str] | None = None) -> dict[str, list[int]]:
        so = self.build(rids)
        return self.apply(so, self.runner.execute_model(so))

    def build(self, rids: list[str] | None = None) -> SchedulerOutput:
        so = SchedulerOutput()
        for rid in rids or list(self.reqs):
            r = self.reqs[rid]
            n = min(len(r["tokens"]) - r["computed"], self.chunk)
            new_blocks = self._ensure_blocks(r, r["computed"] + n)
            if r["new"]:
                so.new_reqs.append(NewRequestData(rid, list(r["tokens"]), r["n_prompt"], r["params"],
                                                  list(r["blocks"]), r["computed"], r["seed"]))
                r["new"] = False
            else:
                so.cached_reqs.append(CachedRequestData(rid, new_blocks, r["computed"]))
            so.num_scheduled_tokens[rid] = n
            so.total_num_scheduled_tokens += n
        return so

    def apply(self, so: SchedulerOutput, out) -> dict[str, list[int]]:
        result = {}
        for rid, toks in zip(out.req_ids, out.sampled_token_ids):
            r = self.reqs[rid]
            r["computed"] += so.num_scheduled_tokens[rid]
            r["tokens"] += toks
            r["out"] += toks
            result[rid] = toks
        return result

    def generate(self, max_new: int) -> dict[str, list[int]]:
        while any(len(r["out"]) < max_new for r in self.reqs.values()):
            self.step([rid for rid, r in self.reqs.items() if len(r["out"]) < max_new])
        return {rid: r["out"][:max_new] for rid, r in self.reqs.items()}

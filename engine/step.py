"""What crosses between the scheduler and the model runner each step.

The model runner keeps persistent per-request state (token ids, block table row), so a step
carries only what changed: full data for requests it has not seen (new, or resumed after a
preemption), new block ids for the ones it has, and the ids it must forget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.params import SamplingParams

if TYPE_CHECKING:
    from engine.request import Request

# (sampled token logprob, [(token id, logprob) for the top-N])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class NewRequestData:
    req_id: str
    # Prompt plus any tokens generated before a preemption: the runner recomputes them all.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    # Tokens whose KV is already in the cache (prefix-cache hit); computing starts here.
    num_computed_tokens: int
    # Resolved sampling seed (a random one when the user gave none).
    seed: int
    eos_token_id: int | None = None  # banned with the stop token ids until min_tokens are out

    @classmethod
    def of(cls, req: Request, block_ids: list[int], num_computed_tokens: int) -> NewRequestData:
        """`req` as it joins the runner; its tokens copied, since the runner may append to its own."""
        tokens, num_prompt = list(req.all_token_ids), req.num_prompt_tokens
        state = (block_ids, num_computed_tokens, req.seed, req.eos_token_id)
        return cls(req.request_id, tokens, num_prompt, req.sampling_params, *state)


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Pipeline parallelism: the tokens sampled since the runner last saw the request (no stage samples
    # them itself). Otherwise empty: the runner appends what it samples.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to compute this step, for every scheduled request (drafted ones included).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # req_id -> the drafted tokens it verifies this step, after its one known token (speculative decoding).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Finished, aborted or preempted since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # req_id -> int32 bitmask of the tokens its grammar allows next, for constrained requests sampling now.
    grammar_bitmasks: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of multi-token chunks: prompt work, or recomputation after a preemption (drafts are not)."""
        return sum(n for r, n in self.num_scheduled_tokens.items() if n > 1 and r not in self.spec_tokens)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """One entry per request scheduled this step, in `req_ids` order.

    `sampled_token_ids[i]` is empty while request i is still prefilling (the step's chunk did not
    reach the end of its known tokens) and holds one token otherwise, or, where it verified drafts, the
    accepted ones and the token sampled after them.
    `logprobs[i]` (when the request asked for them) is a list, one per sampled token, of
    (sampled token logprob, [(token_id, logprob) for the top-N]); prompt logprobs are of the same shape.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # req_id -> (first prompt position covered, logprobs of the prompt tokens from there), for requests
    # that asked for prompt logprobs and computed prompt positions this step.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # req_id -> embedding, for each pooling request whose prompt this step finished.
    pooled: dict[str, list[float]] = field(default_factory=dict)

"""The engine core's view of one sequence: its tokens, progress and lifecycle."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from engine.params import SamplingParams

if TYPE_CHECKING:
    from engine.proposer import Drafter
    from engine.structured_output import Grammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


class Request:
    """A sequence in the engine core.

    Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
    `0 <= num_computed_tokens <= num_tokens`; tokens past `num_computed_tokens` have no KV yet.
    `block_hashes[i]` is the chain hash of the i-th full block of `all_token_ids`
    (kept up to date by the KV-cache manager).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        grammar: Grammar | None = None,
        parent_id: str | None = None,
        sample_index: int = 0,
    ) -> None:
        self.request_id = request_id
        # The client's request this is sample `sample_index` of (n > 1 makes several of one request).
        self.parent_id = request_id if parent_id is None else parent_id
        self.sample_index = sample_index
        self.prompt_token_ids = prompt_token_ids  # shared by a request's samples: never changed
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = sampling_params.priority  # scheduling_policy "priority": lower goes first
        self.cache_salt = cache_salt
        self.grammar = grammar  # the structured-output matcher, when the request has a constraint
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Overlapped scheduling: tokens a step in flight will sample, which the next step already computes.
        self.num_output_placeholders = 0
        self.num_sent_tokens = 0  # pipeline parallelism: the tokens the runner has been sent
        self.num_steps_in_flight = 0  # steps scheduled with it whose output the scheduler has not had
        self.status = RequestStatus.WAITING
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # The sampling seed the runner uses; the scheduler resolves a None to a random one at add time.
        self.seed: int | None = sampling_params.seed
        # Prefix-cache hit tokens at first admission; -1 until then (reported on the first output).
        self.num_cached_tokens = -1
        # Speculative decoding: the tokens drafted to follow `all_token_ids` (verified when next scheduled),
        # the proposer's state, and the request's drafted and accepted token counts.
        self.spec_token_ids: list[int] = []
        self.drafter: Drafter | None = None
        self.num_draft_tokens = self.num_accepted_tokens = 0
        # Filled position by position as the prompt is computed (so a recompute rewrites, not appends).
        self.prompt_logprobs: list | None = (
            None if sampling_params.prompt_logprobs is None else [None] * len(prompt_token_ids)
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens the runner will know once the steps in flight are done."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, token: int, max_len: int) -> RequestStatus | None:
        """How the request ends with `token`, its newest output (appended already); None if it goes on."""
        sp, num_output = self.sampling_params, self.num_output_tokens
        if num_output >= sp.min_tokens:
            if token == self.eos_token_id and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if (sp.max_tokens is not None and num_output >= sp.max_tokens) or self.num_tokens >= max_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.name})"
        )

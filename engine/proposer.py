"""Draft proposers for speculative decoding: CPU work on a request's token ids, no model.

A proposer drafts the tokens a request is likely to produce next; the model runner verifies them all in
one forward (compiled/model_runner.py) and keeps the longest run the target model agrees with, so a
draft changes how fast tokens come, never which tokens come.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.config import SpeculativeConfig
from engine.request import Request


class NgramIndex:
    """Where each n-gram of a request's tokens last ended, for n in [lo, hi].

    Invariant: `ends[n - lo][gram]` is the largest e <= `indexed` with `tokens[e - n : e] == gram`, and
    `indexed` is one less than the token count when last updated: the request's own final n-gram is never
    in the index, so a lookup finds an earlier occurrence of it, whose continuation is the draft."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(hi - lo + 1)]
        self.indexed = 0

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams ending at positions up to len(tokens) - 1: a step adds a few, O(hi - lo) each."""
        for end in range(max(self.indexed + 1, self.lo), len(tokens)):
            for n in range(self.lo, min(self.hi, end) + 1):
                self.ends[n - self.lo][tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest final n-gram found, or []. Where
        they run past the end, the copy goes on over what it copied, as a loop would."""
        for n in range(min(self.hi, len(tokens) - 1), self.lo - 1, -1):
            end = self.ends[n - self.lo].get(tuple(tokens[-n:]))
            if end is not None:
                draft = tokens[end : end + k]
                period = len(tokens) - end
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []


class NgramProposer:
    """Prompt lookup (`"method": "ngram"`): the last n tokens of the request (longest n first, from
    `prompt_lookup_max` down to `prompt_lookup_min`) matched in its prompt and output so far, and the
    `num_speculative_tokens` tokens that followed the match drafted."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self.stats = SpecDecodingStats()

    def propose(self, req: Request, room: int) -> list[int]:
        """Drafted tokens to follow the request's: at most `room`, none while the request pauses."""
        if req.drafter is None:
            req.drafter = Drafter(NgramIndex(self.lo, self.hi))
        d = req.drafter
        tokens = req.all_token_ids
        d.index.update(tokens)
        if d.pause:
            d.pause -= 1
            return []
        return d.index.continuation(tokens, min(room, self.k))

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        """Count a verification of `drafted` tokens of which the first `accepted` were kept."""
        req.drafter.observe(accepted)
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted
        self.stats.observe(drafted, accepted)


@dataclass
class SpecDecodingStats:
    """Cumulative counters with vLLM's meaning: verifications, drafted tokens, accepted tokens, and accepted
    tokens by their position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (drafted - len(per_pos)))
        for pos in range(accepted):
            per_pos[pos] += 1

    def copy(self) -> SpecDecodingStats:
        return replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))


class Drafter:
    """A request's proposer state: its index, and whether it drafts this step.

    Adaptive: a verify step of several drafts costs barely more than of one (the weights are read once for
    all its rows), so a request drafts as far as the match goes, or not at all: after wholly rejected drafts
    twice in a row it pauses, for twice as many steps each time, so text that does not repeat is verified
    rarely."""

    def __init__(self, index: NgramIndex) -> None:
        self.index = index
        self.misses = self.pause = 0

    def observe(self, accepted: int) -> None:
        self.misses = 0 if accepted else self.misses + 1
        if self.misses >= 2:
            self.pause = min(2**self.misses, 64)


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | None:
    return None if config is None else NgramProposer(config)

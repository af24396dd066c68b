"""Draft proposers for speculative decoding: CPU work on a request's token ids, no model.

A proposer drafts the tokens a request is likely to produce next; the model runner verifies them all in
one forward (compiled/model_runner.py) and keeps the longest run the target model agrees with, so a
draft changes how fast tokens come, never which tokens come.
"""

from __future__ import annotations

import sys
from collections import deque
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


class ContextCounts:
    """What followed each context of 1 to `depth` tokens in the sequences counted, and how often.

    Invariant: `counts[ctx][t]` is the number of positions e of the counted sequences (added and not taken
    away) with `seq[e - len(ctx) : e] == ctx` and `seq[e] == t`; no count is zero. `indexed`: the
    positions of the one sequence `update` follows that are counted."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.indexed = 1

    def add(self, tokens: list[int], start: int = 1, sign: int = 1) -> None:
        for e in range(max(start, 1), len(tokens)):
            for n in range(1, min(self.depth, e) + 1):
                ctx = tuple(tokens[e - n : e])
                following = self.counts.setdefault(ctx, {})
                following[tokens[e]] = following.get(tokens[e], 0) + sign
                if not following[tokens[e]]:
                    del following[tokens[e]]
                    if not following:
                        del self.counts[ctx]

    def update(self, tokens: list[int]) -> None:
        """Count the positions of a growing sequence not counted yet: a step adds a few, O(depth) each."""
        self.add(tokens, self.indexed)
        self.indexed = max(self.indexed, len(tokens))


class Proposer:
    """What both methods share: the counters, and each request's pause after drafts that miss."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config, self.k = config, config.num_speculative_tokens
        self.stats = SpecDecodingStats()

    def propose(self, req: Request, room: int, max_len: int = sys.maxsize) -> list[int]:
        """Drafted tokens to follow the request's: at most `room`, never more than could be emitted before
        its max_tokens or `max_len`; none where a grammar would have to vet them, while a token of it is
        still in flight, or while the request pauses."""
        if req.grammar is not None or req.num_output_placeholders:
            return []
        room = min(room, self.k, max_len - req.num_tokens - 1)
        if req.sampling_params.max_tokens is not None:  # the token sampled after the accepted drafts counts
            room = min(room, req.sampling_params.max_tokens - req.num_output_tokens - 1)
        if room <= 0:
            return []
        if req.drafter is None:
            req.drafter = Drafter(self.new_index())
        d = req.drafter
        d.index.update(req.all_token_ids)
        if d.pause:
            d.pause -= 1
            return []
        return self.draft(req, room)

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        """Count a verification of `drafted` tokens of which the first `accepted` were kept."""
        req.drafter.observe(accepted)
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted
        self.stats.observe(drafted, accepted)

    def finished(self, req: Request) -> None:
        """A request ended (its output may serve the requests after it)."""

    def new_index(self) -> NgramIndex | ContextCounts:
        raise NotImplementedError

    def draft(self, req: Request, k: int) -> list[int]:
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup (`"method": "ngram"`): the last n tokens of the request (longest n first, from
    `prompt_lookup_max` down to `prompt_lookup_min`) matched in its prompt and output so far, and the
    `num_speculative_tokens` tokens that followed the match drafted."""

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def draft(self, req: Request, k: int) -> list[int]:
        return req.drafter.index.continuation(req.all_token_ids, k)


class SuffixProposer(Proposer):
    """Suffix decoding (`"method": "suffix"`): the continuation seen most often after the request's longest
    final context (up to `suffix_decoding_max_tree_depth` tokens) in its own prompt and output and in the
    outputs of the last `suffix_decoding_max_cached_requests` requests, extended token by token while the
    product of each token's frequency stays at least `suffix_decoding_min_token_prob`, and for at most
    `suffix_decoding_max_spec_factor` times the context's length: the draft is as long as its evidence."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.depth = config.suffix_decoding_max_tree_depth
        self.shared = ContextCounts(self.depth)  # recent requests' outputs
        self.outputs: deque[list[int]] = deque()  # least recently finished first (ids may be reused)

    def new_index(self) -> ContextCounts:
        return ContextCounts(self.depth)

    def draft(self, req: Request, k: int) -> list[int]:
        c, own = self.config, req.drafter.index.counts
        context, draft, prob = req.all_token_ids[-self.depth :], [], 1.0
        while len(draft) < k:
            for n in range(min(self.depth, len(context)), 0, -1):
                key = tuple(context[-n:])
                following = dict(own.get(key, {}))
                for token, count in self.shared.counts.get(key, {}).items():
                    following[token] = following.get(token, 0) + count
                if following:
                    break
            else:
                break
            token, count = max(following.items(), key=lambda item: item[1])
            prob *= count / sum(following.values())
            if prob < c.suffix_decoding_min_token_prob:
                break
            if not draft:  # a longer context is better evidence: a longer draft
                k = min(k, max(1, int(c.suffix_decoding_max_spec_factor * n)))
            draft.append(token)
            context.append(token)
        return draft

    def finished(self, req: Request) -> None:
        if req.output_token_ids:
            self.outputs.append(list(req.output_token_ids))
            self.shared.add(self.outputs[-1])
        while len(self.outputs) > self.config.suffix_decoding_max_cached_requests:
            self.shared.add(self.outputs.popleft(), sign=-1)


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

    def __init__(self, index: NgramIndex | ContextCounts) -> None:
        self.index = index
        self.misses = self.pause = 0

    def observe(self, accepted: int) -> None:
        self.misses = 0 if accepted else self.misses + 1
        if self.misses >= 2:
            self.pause = min(2**self.misses, 64)


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    return SuffixProposer(config) if config.method == "suffix" else NgramProposer(config)

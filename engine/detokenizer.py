"""Incremental detokenization and stop strings, in the front end.

Decoding a growing token list one token at a time is wrong for byte-fallback and multi-byte
characters (a character may span tokens) and for tokenizers that merge spaces across tokens, so
each step decodes a short window twice: `[prefix_offset, read_offset)` is text already emitted,
`[prefix_offset, end)` is that plus the new tokens; the difference is the new text, held back
while it ends in an incomplete character (U+FFFD). The window stays short whatever the tokens: one that adds
no text (a skipped special token) leaves it, and text still incomplete after _MAX_PENDING tokens is
emitted as it is (bytes that never form a character), so each token costs two short decodes.
"""

from __future__ import annotations

from engine.params import SamplingParams

# Prompt tokens decoded before the first output token, so its leading space comes out right.
_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 bytes: past this many tokens an incomplete ending is not one.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    """Text of one sequence's output tokens, with stop strings applied.

    Invariant: `text` is exactly what the user sees when the sequence ends; while it runs,
    `text[:emittable]` is safe to stream (no stop string can still swallow it).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""
        self.num_output_tokens = 0
        self.stop_reason: str | None = None  # the stop string that ended the sequence
        self._max_stop = max((len(s) for s in params.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def update(self, new_token_ids: list[int], *, skip_last: bool = False) -> bool:
        """Add tokens; return True when a stop string ended the sequence. `skip_last`: the last token (EOS
        or a stop token id) ended it and stays out of the text unless include_stop_str_in_output."""
        for i, token in enumerate(new_token_ids):
            self.num_output_tokens += 1
            if skip_last and i == len(new_token_ids) - 1 and not self.params.include_stop_str_in_output:
                break
            self.ids.append(token)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if full == prefix:
                del self.ids[self.read_offset :]  # no text: kept, it would lengthen every later decode
                continue
            held = len(full) <= len(prefix) or full.endswith("\ufffd")
            if held and len(self.ids) - self.read_offset < _MAX_PENDING:
                continue
            before = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self._check_stop(before):
                return True
        return False

    def _check_stop(self, before: int) -> bool:
        if not self.params.stop or self.num_output_tokens <= self.params.min_tokens:
            return False
        # Only new text can complete a stop string: search from just before it.
        start = max(before - self._max_stop + 1, 0)
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) != -1]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + len(stop) if self.params.include_stop_str_in_output else index]
        self.stop_reason = stop
        return True

    def emittable(self, finished: bool) -> int:
        """Length of the text prefix that is final."""
        if finished or not self._max_stop:
            return len(self.text)
        return max(len(self.text) - self._max_stop + 1, 0)

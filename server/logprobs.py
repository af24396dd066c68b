"""Tokens as OpenAI's logprobs show them: each token's exact bytes and text, in the two endpoints' formats."""

from __future__ import annotations

import functools
import re

from engine.messages import TokenLogprobs
from server.protocol import ChatLogprobs, ChatLogprobToken, CompletionLogprobs, PromptLogprob, TopLogprob

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table that byte-level BPE vocabularies are written in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


class TokenStrings:
    """A token's exact bytes and its text, as OpenAI's logprobs show them (cached per token id)."""

    _HEX = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)
        self.text = functools.lru_cache(maxsize=1 << 16)(self._text)

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id not in self.special:
            if self.byte_level and all(ch in self.byte_decoder for ch in piece):
                return bytes(self.byte_decoder[ch] for ch in piece)
            if (m := self._HEX.match(piece)) is not None:  # SentencePiece byte fallback
                return bytes([int(m.group(1), 16)])
            piece = piece.replace("\u2581", " ")  # SentencePiece's word-boundary marker
        return piece.encode("utf-8", errors="replace")

    def _text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a multi-byte character
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def completion_logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprobs | None], offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """/v1/completions' logprobs for these tokens, their text offsets counted from `offset`; and the
        offset after them. A None entry (an echoed prompt's first token, which nothing precedes) is null."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for tid, entry_lp in zip(token_ids, logprobs):
            text, lp, top = self.text(tid), None, None
            if entry_lp is not None:
                lp, top = _clamp(entry_lp[0]), {self.text(t): _clamp(v) for t, v in entry_lp[1]}
                top.setdefault(text, lp)
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(self.bytes(tid).decode("utf-8", errors="ignore"))
        return out, offset

    def chat_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> ChatLogprobs:
        content = [
            ChatLogprobToken(
                token=self.text(tid),
                logprob=_clamp(lp),
                bytes=list(self.bytes(tid)),
                top_logprobs=[
                    TopLogprob(token=self.text(t), logprob=_clamp(v), bytes=list(self.bytes(t)))
                    for t, v in top
                ],
            )
            for tid, (lp, top) in zip(token_ids, logprobs)
        ]
        return ChatLogprobs(content=content)

    def prompt_logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprobs | None], n: int
    ) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's `prompt_logprobs`: per prompt token (None for the first), its own entry then the top-N
        keyed by token id; a rank is known for the top-N, and for the prompt token where it is among them."""
        out: list[dict[str, PromptLogprob] | None] = []
        for tid, entry in zip(token_ids, logprobs):
            if entry is None:
                out.append(None)
                continue
            top = {
                t: PromptLogprob(logprob=_clamp(v), rank=k + 1, decoded_token=self.text(t))
                for k, (t, v) in enumerate(entry[1][:n])
            }
            own = top.get(tid) or PromptLogprob(
                logprob=_clamp(entry[0]), rank=None, decoded_token=self.text(tid)
            )
            out.append({str(tid): own, **{str(t): lp for t, lp in top.items() if t != tid}})
        return out


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)

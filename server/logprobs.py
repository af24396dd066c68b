"""Tokens as OpenAI's logprobs show them: each token's exact bytes and text, in the two endpoints' formats."""

from __future__ import annotations

import functools
import re

from engine.messages import TokenLogprobs
from server.protocol import ChatLogprobs, ChatLogprobToken, CompletionLogprobs, TopLogprob

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table that byte-level BPE vocabularies are written in."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


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
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tid, entry_lp in zip(token_ids, logprobs):
            text = self.text(tid)
            tokens.append(text)
            if entry_lp is None:
                token_lps.append(None)
                tops.append(None)
            else:
                lp, top = entry_lp
                token_lps.append(_clamp(lp))
                entry = {self.text(t): _clamp(v) for t, v in top}
                entry.setdefault(text, _clamp(lp))
                tops.append(entry)
            offsets.append(offset)
            offset += len(self.bytes(tid).decode("utf-8", errors="ignore"))
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets
        ), offset

    def chat_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for tid, (lp, top) in zip(token_ids, logprobs):
            content.append(
                ChatLogprobToken(
                    token=self.text(tid),
                    logprob=_clamp(lp),
                    bytes=list(self.bytes(tid)),
                    top_logprobs=[
                        TopLogprob(token=self.text(t), logprob=_clamp(v), bytes=list(self.bytes(t)))
                        for t, v in top
                    ],
                )
            )
        return ChatLogprobs(content=content)


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)

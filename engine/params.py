"""Per-request sampling parameters, validated where they enter the system."""

from __future__ import annotations

from typing import Any

import msgspec

_INT32 = 2**31
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
# Temperatures below this sample greedily: dividing logits by less overflows to inf/NaN.
_SAMPLING_EPS = 1e-5


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Constrain the output to one of: a JSON schema (`json`, a dict or its text), any JSON object
    (`json_object`), a regular expression, one of the `choice` strings, or a `grammar` (Lark or GBNF/EBNF).
    vLLM's field names."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, grammar "
                f"(got {', '.join(given) or 'none'})"
            )
        if self.choice is not None and not (self.choice and all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    def _given(self) -> list[str]:
        return [name for name in self.__struct_fields__ if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._given()[0]


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Embed the prompt instead of generating: its final hidden states (after the last norm) pooled over
    the last token (a causal model's summary of the whole prompt) or the mean of every token, then
    L2-normalised unless `normalize` is off."""

    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean' (got {self.pooling!r})")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick tokens and when to stop. Field names and defaults follow vLLM's.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters.
    A `seed` makes the request's samples reproducible whether it runs alone or in any batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Logprob of every prompt token given the tokens before it, plus the top-N (the first token has none).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    priority: int = 0  # scheduling_policy "priority": lower values are scheduled first
    # Added to the logits before any other transform: token id -> bias in [-100, 100] (OpenAI's range).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # every other token is banned
    # Banned continuations: a word's last token is banned after the output ends with its other tokens.
    bad_words: list[str] = []
    # `bad_words` as token ids (with and without a leading space), filled in where the text is tokenized.
    bad_words_token_ids: list[list[int]] = []
    # Set: the request computes its prompt and returns its embedding (one step's work, no token sampled).
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1 (disabled), 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be positive"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "must not exceed max_tokens",
            ),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                "must be in [0, 20]",
            ),
            (self.seed is None or -(2**63) <= self.seed < 2**63, "seed", "must fit in 64 bits"),
            (-(2**63) <= self.priority < 2**63, "priority", "must fit in 64 bits"),
            (self.top_k < _INT32, "top_k", f"must be below {_INT32}"),
            (self.min_tokens < _INT32, "min_tokens", f"must be below {_INT32}"),
            (self.max_tokens is None or self.max_tokens < _INT32, "max_tokens", f"must be below {_INT32}"),
            (all(s for s in self.stop), "stop", "must not contain empty strings"),
            (
                len(self.logit_bias or ()) <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"may hold {MAX_LOGIT_BIAS} entries",
            ),
            (
                all(-100.0 <= b <= 100.0 and 0 <= t < _INT32 for t, b in (self.logit_bias or {}).items()),
                "logit_bias",
                "must map token ids to biases in [-100, 100]",
            ),
            (self.allowed_token_ids != [], "allowed_token_ids", "must not be empty"),
            (
                all(0 <= t < _INT32 for t in self.allowed_token_ids or ()),
                "allowed_token_ids",
                f"must be in [0, {_INT32})",
            ),
            (all(w.strip() for w in self.bad_words), "bad_words", "must not contain blank strings"),
            (
                self.pooling is None or (self.n, self.max_tokens) == (1, 1),
                "pooling",
                "needs n = 1 and max_tokens = 1",
            ),
            (
                all(0 <= t < _INT32 for t in self.stop_token_ids),
                "stop_token_ids",
                f"must be in [0, {_INT32})",
            ),
        ]
        for ok, field, message in checks:
            if not ok:
                raise ValueError(f"{field} {message} (got {getattr(self, field)!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def every_position(self) -> bool:
        """Whether every prompt position must be computed (no prefix-cache hit may skip one)."""
        mean = self.pooling is not None and self.pooling.pooling == "mean"
        return self.prompt_logprobs is not None or mean

    def banned_or_biased(self, num_output_tokens: int) -> bool:
        """Whether the sampler must add a bias row for this request at this output length."""
        return bool(
            self.logit_bias
            or self.allowed_token_ids
            or self.bad_words_token_ids
            or num_output_tokens < self.min_tokens
        )

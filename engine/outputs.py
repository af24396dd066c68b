"""What the front end returns for a request: RequestOutput, one CompletionOutput per sample, and timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # What is new since the previous RequestOutput of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: tokens drafted for the request's samples, and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing before it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # with SamplingParams.pooling, once finished


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt, as vLLM names it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

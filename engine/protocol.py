"""Every message that crosses the front end <-> engine core boundary: msgspec Structs, msgpack-encoded.

Never pickle: a msgpack frame can only decode into these types.
"""

from __future__ import annotations

import msgspec

from engine.params import SamplingParams

# (sampled token logprob, [(token id, logprob) for the top-N])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


class EngineCoreRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request since the last output, and its finish reason once it ends."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id (or string) that ended it
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

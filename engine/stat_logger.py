"""The engine core's periodic log line: what it runs and waits on, its cache, and its throughput since the
last line (and speculative decoding's acceptance, where it drafts)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.proposer import SpecDecodingStats

logger = logging.getLogger("kiln.core")

STATS_INTERVAL_S = 5.0


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens looked up (cumulative)
    prefix_cache_hits: int  # tokens found (cumulative)
    num_preemptions: int  # cumulative
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding


class StatLogger:
    """Counts a core's prompt and generated tokens and logs a line at most every STATS_INTERVAL_S."""

    def __init__(self) -> None:
        self.tokens = [0, 0]  # prompt, generation tokens since the last line
        self.spec = (0, 0)  # verifications and accepted drafts at the last line
        self.last = time.monotonic()

    def record(self, prompt_tokens: int, generated_tokens: int) -> None:
        self.tokens[0] += prompt_tokens
        self.tokens[1] += generated_tokens

    def maybe_log(self, stats: Callable[[], dict]) -> None:
        """`stats`: the core's (EngineCore.stats), read only when a line is due."""
        now = time.monotonic()
        if now - self.last < STATS_INTERVAL_S:
            return
        dt, s = now - self.last, stats()
        logger.info(
            "running: %d, waiting: %d, KV usage: %.1f%%, prefix-cache hit rate: %.1f%%, "
            "prompt: %.1f tok/s, generation: %.1f tok/s, preemptions: %d",
            s["num_running"],
            s["num_waiting"],
            100 * s["kv_cache_usage"],
            100 * s["prefix_cache_hits"] / max(s["prefix_cache_queries"], 1),
            self.tokens[0] / dt,
            self.tokens[1] / dt,
            s["num_preemptions"],
        )
        if (spec := s["spec_decoding"]) is not None:
            drafts, accepted = spec["num_drafts"] - self.spec[0], spec["num_accepted_tokens"] - self.spec[1]
            logger.info(
                "speculative decoding: mean acceptance length %.2f over %d verifications, %d tokens accepted",
                1 + accepted / max(drafts, 1),
                drafts,
                accepted,
            )
            self.spec = (spec["num_drafts"], spec["num_accepted_tokens"])
        self.tokens, self.last = [0, 0], now

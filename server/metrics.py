"""Prometheus metrics under `kiln:` and the per-request access log."""

from __future__ import annotations

import logging
import os
import time

from engine.output_processor import RequestOutput

logger = logging.getLogger("kiln.server")

# ---- metrics -------------------------------------------------------------------------------------


class ServerMetrics:
    """Prometheus metrics under `kiln:`, in a registry of their own (several apps may share a process)."""

    TIME_BUCKETS = (
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
        160.0,
        640.0,
    )
    ITL_BUCKETS = (
        0.005,
        0.01,
        0.015,
        0.02,
        0.025,
        0.03,
        0.04,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        10.0,
    )

    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

        disable_created_metrics()  # no `_created` series next to every counter and histogram
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]
        self.model_name = model_name
        self.request_success = Counter(
            "kiln:request_success",
            "Finished sequences, by finish reason",
            [*label, "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("kiln:prompt_tokens", "Prompt tokens processed", label, registry=r)
        self.generation_tokens = Counter("kiln:generation_tokens", "Tokens generated", label, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = self.TIME_BUCKETS) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r)

        self.ttft = histogram("kiln:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram(
            "kiln:inter_token_latency_seconds", "Time between output tokens", self.ITL_BUCKETS
        )
        self.e2e = histogram("kiln:e2e_request_latency_seconds", "Request latency, arrival to last token")
        self.queue_time = histogram("kiln:request_queue_time_seconds", "Time from arrival to first scheduled")
        self.engine = EngineStatsCollector(model_name)
        r.register(self.engine)
        self.scraped = r
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # one of several API servers: every one's counts
            from prometheus_client import multiprocess

            self.scraped = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.scraped)
            self.scraped.register(self.engine)
        # Export every series from the start, at zero, rather than once it first moves.
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        timed = (self.ttft, self.itl, self.e2e, self.queue_time)
        for metric in (self.prompt_tokens, self.generation_tokens, *timed):
            metric.labels(model_name)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.scraped)


class EngineStatsCollector:
    """The engine cores' scheduler stats as of the last scrape (refreshed by /metrics), one series per
    core, labelled `engine` (its data-parallel index); `sum without (engine)` gives the totals."""

    GAUGES = (
        ("kiln:num_requests_running", "num_running", "Requests in the running queue"),
        ("kiln:num_requests_waiting", "num_waiting", "Requests in the waiting queue"),
        ("kiln:kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (0 to 1)"),
    )
    COUNTERS = (
        ("kiln:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
        ("kiln:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
        ("kiln:num_preemptions", "num_preemptions", "Requests preempted (KV cache full)"),
    )
    SPEC_COUNTERS = (
        ("kiln:spec_decode_num_drafts", "num_drafts", "Drafts verified (speculative decoding)"),
        ("kiln:spec_decode_num_draft_tokens", "num_draft_tokens", "Drafted tokens verified"),
        ("kiln:spec_decode_num_accepted_tokens", "num_accepted_tokens", "Drafted tokens accepted"),
    )

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, float] = {}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engines = self.stats.get("engines", {})
        for family, specs in ((GaugeMetricFamily, self.GAUGES), (CounterMetricFamily, self.COUNTERS)):
            for name, key, doc in specs:
                metric = family(name, doc, labels=["model_name", "engine"])
                for index, stats in engines.items():
                    metric.add_metric([self.model_name, index], float(stats[key]))
                yield metric
        spec = {index: s["spec_decoding"] for index, s in engines.items() if s.get("spec_decoding")}
        if spec:
            yield from self._spec_decoding(spec)

    def _spec_decoding(self, per_engine: dict[str, dict]):
        """Speculative decoding's counters, as vLLM names them (kiln: for vllm:)."""
        from prometheus_client.core import CounterMetricFamily

        labels = ["model_name", "engine"]
        for name, key, doc in self.SPEC_COUNTERS:
            metric = CounterMetricFamily(name, doc, labels=labels)
            for index, spec in per_engine.items():
                metric.add_metric([self.model_name, index], float(spec[key]))
            yield metric
        doc = "Accepted draft tokens, by their position in the draft"
        metric = CounterMetricFamily(
            "kiln:spec_decode_num_accepted_tokens_per_pos", doc, labels=[*labels, "position"]
        )
        for index, spec in per_engine.items():
            for pos, count in enumerate(spec["num_accepted_tokens_per_pos"]):
                metric.add_metric([self.model_name, index, str(pos)], float(count))
        yield metric


class RequestTracker:
    """One engine request's timings: feeds the metrics while it runs, logs one line when it ends."""

    def __init__(self, metrics: ServerMetrics, request_id: str, num_prompt_tokens: int, n: int) -> None:
        self.m, self.request_id, self.num_prompt_tokens, self.n = metrics, request_id, num_prompt_tokens, n
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}
        self.num_generated = 0
        self.finish: dict[int, str] = {}
        self.queue_time: float | None = None
        self.spec = (0, 0)  # drafted and accepted tokens (speculative decoding)

    def update(self, out: RequestOutput) -> None:
        m, name = self.m, self.m.model_name
        now = time.monotonic()
        for c in out.outputs:
            k = len(c.delta_token_ids)
            if k:
                if self.first_token is None:
                    self.first_token = now
                    m.prompt_tokens.labels(name).inc(self.num_prompt_tokens)
                    m.ttft.labels(name).observe(now - self.start)
                prev = self.last_token.get(c.index)
                if prev is not None:
                    for _ in range(k):
                        m.itl.labels(name).observe((now - prev) / k)
                self.last_token[c.index] = now
                self.num_generated += k
                m.generation_tokens.labels(name).inc(k)
            if c.finish_reason is not None and c.index not in self.finish:
                self.finish[c.index] = c.finish_reason
                m.request_success.labels(name, c.finish_reason).inc()
        self.spec = out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens
        if self.queue_time is None and out.metrics.queue_time is not None:
            self.queue_time = max(out.metrics.queue_time, 0.0)
            m.queue_time.labels(name).observe(self.queue_time)

    def close(self) -> None:
        name = self.m.model_name
        for i in range(self.n):
            if i not in self.finish:
                self.finish[i] = "abort"
                self.m.request_success.labels(name, "abort").inc()
        total = time.monotonic() - self.start
        reasons = sorted(set(self.finish.values()))
        if "abort" not in reasons:
            self.m.e2e.labels(name).observe(total)
        ttft = "-" if self.first_token is None else f"{self.first_token - self.start:.3f}s"
        drafted, accepted = self.spec
        logger.info(
            "%s prompt_tokens=%d generation_tokens=%d ttft=%s total=%.3fs finish_reason=%s%s",
            self.request_id,
            self.num_prompt_tokens,
            self.num_generated,
            ttft,
            total,
            ",".join(reasons),
            f" draft_tokens={drafted} accepted={accepted}" if drafted else "",
        )

"""What the server tells its operators: Prometheus metrics and the periodic stats log line.

The metric names are vLLM's (vllm/v1/metrics/loggers.py: `PrometheusStatLogger`) under a
`minivllm:` prefix, so vLLM's Grafana dashboards need one search-and-replace. Each app owns its
`CollectorRegistry` (not prometheus_client's global one), so tests can build several apps in one
process. The log line is vLLM's `LoggingStatLogger`: throughputs over the last interval, queue
lengths, KV cache usage, prefix-cache hit rate and preemptions.

Everything here runs in the engine thread, through `AsyncLLMEngine.on_step`, after each step:
the latencies come from the engine's own timestamps (`RequestOutput.metrics`, time.monotonic).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from minivllm.outputs import RequestOutput
from minivllm.stats import EngineStats

logger = logging.getLogger("minivllm")

# vLLM's buckets (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]  # fmt: skip
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")


_ZERO_STATS = EngineStats(**{f.name: 0 for f in fields(EngineStats)})


@dataclass
class _Seen:
    """What the metrics remember of a running request between steps."""

    last_token_time: float | None = None
    num_tokens: int = 0


class ServerMetrics:
    def __init__(self, model_name: str, log_interval_s: float = 5.0) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r, p = self.registry, "minivllm:"

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(p + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(p + name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(p + name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter(
            "request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Between two tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self._label = {"model_name": model_name}
        for reason in FINISH_REASONS:  # present at 0 from the start, as vLLM does
            self.success.labels(model_name=model_name, finished_reason=reason)
        self._seen: dict[str, _Seen] = {}
        self._last: EngineStats | None = None
        self.log_interval_s = log_interval_s
        # The first window counts from the server's start, so a burst shorter than two
        # intervals still gets its line.
        self._log_last = _ZERO_STATS
        self._log_time = time.monotonic()

    # ------------------------------------------------------------------ the engine-thread hook
    def on_step(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        lab = self._label
        self.running.labels(**lab).set(stats.num_running)
        self.waiting.labels(**lab).set(stats.num_waiting)
        self.kv_usage.labels(**lab).set(stats.kv_cache_usage)
        last = self._last or _ZERO_STATS
        self.generation_tokens.labels(**lab).inc(
            stats.num_generated_tokens - last.num_generated_tokens
        )
        self.prefix_queries.labels(**lab).inc(
            stats.num_prefix_cache_queries - last.num_prefix_cache_queries
        )
        self.prefix_hits.labels(**lab).inc(
            stats.num_prefix_cache_hit_tokens - last.num_prefix_cache_hit_tokens
        )
        self.preemptions.labels(**lab).inc(stats.num_preemptions - last.num_preemptions)
        self._last = stats
        for out in outputs:
            self._observe(out)
        self._maybe_log(stats)

    def _observe(self, out: RequestOutput) -> None:
        lab, m = self._label, out.metrics
        seen = self._seen.setdefault(out.request_id, _Seen())
        first, last = m.get("first_token_time"), m.get("last_token_time")
        num_tokens = max((len(o.token_ids) for o in out.outputs), default=0)
        if first is not None and seen.last_token_time is None:
            self.prompt_tokens.labels(**lab).inc(len(out.prompt_token_ids))
            self.ttft.labels(**lab).observe(first - m["arrival_time"])
        elif last is not None and seen.last_token_time is not None and num_tokens > seen.num_tokens:
            self.itl.labels(**lab).observe(last - seen.last_token_time)
        if last is not None:
            seen.last_token_time, seen.num_tokens = last, num_tokens
        if out.finished:
            del self._seen[out.request_id]
            reason = "error" if out.error else (out.outputs[0].finish_reason or "abort")
            self.success.labels(**lab, finished_reason=reason).inc()
            end = m.get("finished_time", time.monotonic())
            self.e2e.labels(**lab).observe(end - m["arrival_time"])

    def _maybe_log(self, stats: EngineStats) -> None:
        now = time.monotonic()
        elapsed = now - self._log_time
        if elapsed < self.log_interval_s:
            return
        prev = self._log_last
        self._log_time, self._log_last = now, stats
        prompt = stats.num_prompt_tokens_computed - prev.num_prompt_tokens_computed
        gen = stats.num_generated_tokens - prev.num_generated_tokens
        idle = prompt == gen == stats.num_running == stats.num_waiting == 0
        if idle and stats.num_preemptions == prev.num_preemptions:
            return  # vLLM too stays quiet while nothing happens
        queries = stats.num_prefix_cache_queries
        hit_rate = stats.num_prefix_cache_hit_tokens / queries if queries else 0.0
        logger.info(
            "Engine: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
            "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%, Preemptions: %d",
            prompt / elapsed,
            gen / elapsed,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_cache_usage,
            100 * hit_rate,
            stats.num_preemptions,
        )

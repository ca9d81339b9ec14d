"""What the server tells its operators: Prometheus metrics and the periodic stats log line.

The names, types, labels and buckets are vLLM v1's (`vllm/v1/metrics/loggers.py`:
`PrometheusStatLogger`), `vllm:` prefix included, so that a Grafana dashboard or an autoscaler
written for vLLM reads this server unchanged; every series carries a `model_name` label. Each app
owns its `CollectorRegistry` (not prometheus_client's global one), so tests can build several apps
in one process. The log line is vLLM's `LoggingStatLogger`: throughputs over the last interval,
queue lengths, KV cache usage, prefix-cache hit rate and preemptions.

Everything here runs in the engine client's thread, through its `on_step` / `on_add` hooks, after
each step: the latencies come from the engine's own timestamps (`RequestOutput.metrics`,
time.monotonic), and the intervals are vLLM's (docs/design/metrics.md there): queue = arrival to
the latest scheduling, prefill = scheduling to first token, decode = first to last token,
inference = scheduling to last token.

With data parallelism (`minivllm serve -dp N`, minivllm/engine/dp_client.py) each engine core's
steps arrive with its index: every series then also carries vLLM's `engine="<index>"` label, and
the counters' differences and the log line are kept per core. With one engine the label is left
out, so that single-engine series keep the names they have always had here (vLLM writes
`engine="0"` there too).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from minivllm.core.outputs import RequestOutput
from minivllm.engine.beam_search import BeamSearchParams
from minivllm.engine.stats import EngineStats
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.metrics import log_spec_decode

logger = logging.getLogger("minivllm")

PREFIX = "vllm:"  # vLLM's own prefix: dashboards query these names verbatim

# vLLM's buckets (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")


def show_hidden_metrics(show_hidden_metrics_for_version: str | None) -> bool:
    """Whether the deprecated series are shown: with --show-hidden-metrics-for-version, or under
    `VLLM_USE_V1=0`, where vLLM's V0 engine served `vllm:gpu_cache_usage_perc` as its own KV-cache
    gauge (vLLM's tests read it there without the flag). minivllm has one engine; the variable
    only chooses the names it reports under."""
    import os

    return show_hidden_metrics_for_version is not None or os.environ.get("VLLM_USE_V1") == "0"


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


_ZERO_STATS = EngineStats(
    **{
        f.name: () if f.name.endswith("_per_pos") else 0
        for f in fields(EngineStats)
        if not f.name.endswith("_lora_adapters")  # their defaults: no adapter
    }  # type: ignore[arg-type]
)


@dataclass
class _Seen:
    """What the metrics remember of a running request between steps."""

    last_token_time: float | None = None
    num_tokens: int = 0


class ServerMetrics:
    """vLLM's Prometheus series, registered in phases (one per kind of series), and the hooks
    that update them."""

    def __init__(
        self,
        model_name: str,
        log_interval_s: float = 5.0,
        max_model_len: int = 2048,
        cache_config: dict[str, Any] | None = None,
        show_hidden_metrics: bool = False,
        data_parallel_size: int = 1,
        max_loras: int | None = None,
    ) -> None:
        """`max_loras`: the engine's LoRA slots, with `enable_lora` (None: LoRA is off, and
        there is no vllm:lora_requests_info, as in vLLM)."""
        self.registry = CollectorRegistry()
        self._label_names = ("model_name", "engine") if data_parallel_size > 1 else ("model_name",)
        self._add_scheduler_gauges()
        self._add_step_counters()
        self.hidden = self._add_hidden_series() if show_hidden_metrics else None
        self._add_request_histograms(build_1_2_5_buckets(max_model_len))
        self._add_latency_histograms()
        self._add_cache_info(cache_config or {})
        self.max_loras = max_loras
        self.lora_info = self._add_lora_info() if max_loras is not None else None
        # Each engine's labels; one engine: no `engine` label (the module's docstring says why).
        self._labels = [
            {"model_name": model_name, **({"engine": str(i)} if data_parallel_size > 1 else {})}
            for i in range(data_parallel_size)
        ]
        for lab in self._labels:
            for reason in FINISH_REASONS:  # present at 0 from the start, as vLLM does
                self.success.labels(**lab, finished_reason=reason)
        self._seen: dict[str, _Seen] = {}
        self.spec_decode: tuple[Counter, Counter, Counter, Counter] | None = None
        self._spec_lock = threading.Lock()  # several cores' reader threads may register it
        self._last: list[EngineStats | None] = [None] * data_parallel_size
        self.log_interval_s = log_interval_s
        # The first window counts from the server's start, so a burst shorter than two
        # intervals still gets its line.
        self._log_last = [_ZERO_STATS] * data_parallel_size
        self._log_time = [time.monotonic()] * data_parallel_size

    # ------------------------------------------------------------------ the series
    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, self._label_names, registry=self.registry)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, [*self._label_names, *extra], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: list[float] | list[int]) -> Histogram:
        return Histogram(
            PREFIX + name, doc, self._label_names, buckets=buckets, registry=self.registry
        )

    def _add_scheduler_gauges(self) -> None:
        # Scheduler state, after every step (gauges).
        self.running = self._gauge(
            "num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = self._gauge(
            "num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = self._gauge(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )

    def _add_step_counters(self) -> None:
        # What the steps did (counters; prometheus_client appends `_total`).
        self.prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self.preemptions = self._counter(
            "num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prefix_queries = self._counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = self._counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.success = self._counter(
            "request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.iteration_tokens = self._histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        )  # fmt: skip

    def _add_spec_decode_counters(self) -> tuple[Counter, Counter, Counter, Counter]:
        # Speculative decoding (vLLM's SpecDecodingProm), registered once an engine speculates.
        with self._spec_lock:
            if self.spec_decode is None:
                self.spec_decode = (
                    self._counter("spec_decode_num_drafts", "Number of spec decoding drafts."),
                    self._counter("spec_decode_num_draft_tokens", "Number of draft tokens."),
                    self._counter("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                    self._counter(
                        "spec_decode_num_accepted_tokens_per_pos",
                        "Accepted tokens per draft position.",
                        ("position",),
                    ),
                )
            return self.spec_decode

    def _observe_spec_decode(self, stats: EngineStats, last: EngineStats, engine: int) -> None:
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        if not per_pos:
            return
        drafts, draft_tokens, accepted, accepted_per_pos = (
            self.spec_decode or self._add_spec_decode_counters()
        )
        lab = self._labels[engine]
        drafts.labels(**lab).inc(stats.spec_decode_num_drafts - last.spec_decode_num_drafts)
        draft_tokens.labels(**lab).inc(
            stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens
        )
        accepted.labels(**lab).inc(
            stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens
        )
        before = last.spec_decode_num_accepted_tokens_per_pos or (0,) * len(per_pos)
        for i, (now, then) in enumerate(zip(per_pos, before)):
            accepted_per_pos.labels(**lab, position=str(i)).inc(now - then)

    def _add_hidden_series(self) -> tuple[Gauge, Counter, Counter]:
        # vLLM's deprecated names, shown only with --show-hidden-metrics-for-version (vLLM's
        # rule: a deprecated series stays one minor version behind that flag before it goes).
        return (
            self._gauge("gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage."),
            self._counter("gpu_prefix_cache_queries", "GPU prefix cache queries, in tokens."),
            self._counter("gpu_prefix_cache_hits", "GPU prefix cache hits, in tokens."),
        )

    def _add_request_histograms(self, token_buckets: list[int]) -> None:
        # Per request, at its end (histograms).
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_max_generation_tokens = self._histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets,
        )  # fmt: skip
        self.request_params_n = self._histogram(
            "request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]
        )
        self.request_params_max_tokens = self._histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets,
        )  # fmt: skip

    def _add_latency_histograms(self) -> None:
        # Latencies (histograms, seconds).
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )  # fmt: skip
        # vLLM keeps this older name beside inter_token_latency (same observations) for dashboards.
        self.tpot = self._histogram(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds (deprecated name of the inter-token "
            "latency).", ITL_BUCKETS,
        )  # fmt: skip
        self.request_tpot = self._histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_time = self._histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.inference_time = self._histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.prefill_time = self._histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.decode_time = self._histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip

    def _add_cache_info(self, cache_config: dict[str, Any]) -> None:
        # The cache's configuration as labels of a constant 1 (vLLM's Info-style gauge).
        info = {k: str(v) for k, v in cache_config.items()}
        cache_info = Gauge(
            PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig",
            list(info), registry=self.registry,
        )  # fmt: skip
        if info:
            cache_info.labels(**info).set(1)
        else:
            cache_info.set(1)

    def _add_lora_info(self) -> Gauge:
        # vLLM's LoRA gauge: which adapters run and wait, as labels (comma-joined names); its
        # value is the time of the step that set them. No model_name label, as in vLLM.
        return Gauge(
            PREFIX + "lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )  # fmt: skip

    def _observe_loras(self) -> None:
        """The server's adapters: with data parallelism, those of every core's latest step (the
        gauge has no `engine` label, so a core's step must not hide what another core runs)."""
        if self.lora_info is None:
            return
        running: dict[str, None] = {}  # insertion-ordered sets of names: core 0's first
        waiting: dict[str, None] = {}
        for stats in self._last:
            if stats is not None:
                running |= dict.fromkeys(stats.running_lora_adapters)
                waiting |= dict.fromkeys(stats.waiting_lora_adapters)
        self.lora_info.labels(
            max_lora=str(self.max_loras),
            waiting_lora_adapters=",".join(waiting),
            running_lora_adapters=",".join(running),
        ).set_to_current_time()

    # ------------------------------------------------------------------ the engine-thread hooks
    def on_add(self, request_id: str, params: object, engine: int = 0) -> None:
        """A request entered engine core `engine`: its parameters' histograms (a pooling
        request's none: it samples nothing)."""
        if not isinstance(params, SamplingParams | BeamSearchParams):
            return
        lab = self._labels[engine]
        n = params.n if isinstance(params, SamplingParams) else params.beam_width
        self.request_params_n.labels(**lab).observe(n)
        if params.max_tokens is not None:
            self.request_params_max_tokens.labels(**lab).observe(params.max_tokens)

    def on_step(self, stats: EngineStats, outputs: list[RequestOutput], engine: int = 0) -> None:
        """Engine core `engine` published a step: its stats and outputs."""
        lab = self._labels[engine]
        self.running.labels(**lab).set(stats.num_running)
        self.waiting.labels(**lab).set(stats.num_waiting)
        self.kv_usage.labels(**lab).set(stats.kv_cache_usage)
        last = self._last[engine] or _ZERO_STATS
        prompt = stats.num_prompt_tokens_computed - last.num_prompt_tokens_computed
        generated = stats.num_generated_tokens - last.num_generated_tokens
        self.generation_tokens.labels(**lab).inc(generated)
        if stats.num_steps > last.num_steps and prompt + generated > 0:
            self.iteration_tokens.labels(**lab).observe(prompt + generated)
        queries = stats.num_prefix_cache_queries - last.num_prefix_cache_queries
        hits = stats.num_prefix_cache_hit_tokens - last.num_prefix_cache_hit_tokens
        self.prefix_queries.labels(**lab).inc(queries)
        self.prefix_hits.labels(**lab).inc(hits)
        if self.hidden is not None:  # the deprecated names, the same values
            gpu_usage, gpu_queries, gpu_hits = self.hidden
            gpu_usage.labels(**lab).set(stats.kv_cache_usage)
            gpu_queries.labels(**lab).inc(queries)
            gpu_hits.labels(**lab).inc(hits)
        self.preemptions.labels(**lab).inc(stats.num_preemptions - last.num_preemptions)
        self._observe_spec_decode(stats, last, engine)
        self._last[engine] = stats
        self._observe_loras()
        for out in outputs:
            self._observe(out, lab)
        self._maybe_log(stats, engine)

    def _observe(self, out: RequestOutput, lab: dict[str, str]) -> None:
        m = out.metrics
        seen = self._seen.setdefault(out.request_id, _Seen())
        first, last = m.get("first_token_time"), m.get("last_token_time")
        num_tokens = max((len(o.token_ids) for o in out.outputs), default=0)
        if first is not None and seen.last_token_time is None:
            # vLLM counts a request's prompt tokens once, when its first token arrives.
            self.prompt_tokens.labels(**lab).inc(len(out.prompt_token_ids))
            self.ttft.labels(**lab).observe(first - m["arrival_time"])
        elif last is not None and seen.last_token_time is not None and num_tokens > seen.num_tokens:
            self.itl.labels(**lab).observe(last - seen.last_token_time)
            self.tpot.labels(**lab).observe(last - seen.last_token_time)
        if last is not None:
            seen.last_token_time, seen.num_tokens = last, num_tokens
        if out.finished:
            del self._seen[out.request_id]
            self._observe_finished(out, lab)

    def _observe_finished(self, out: RequestOutput, lab: dict[str, str]) -> None:
        m = out.metrics
        reason = "error" if out.error else (out.outputs[0].finish_reason or "abort")
        self.success.labels(**lab, finished_reason=reason).inc()
        arrival, end = m["arrival_time"], m.get("finished_time", time.monotonic())
        self.e2e.labels(**lab).observe(end - arrival)
        lengths = [len(o.token_ids) for o in out.outputs]
        self.request_prompt_tokens.labels(**lab).observe(len(out.prompt_token_ids))
        self.request_generation_tokens.labels(**lab).observe(sum(lengths))
        self.request_max_generation_tokens.labels(**lab).observe(max(lengths, default=0))
        scheduled, first, last = (
            m.get("scheduled_time"),
            m.get("first_token_time"),
            m.get("last_token_time"),
        )
        if scheduled is None:
            return  # aborted or failed while it waited: it never ran
        self.queue_time.labels(**lab).observe(scheduled - arrival)
        if first is None or last is None:
            return
        self.prefill_time.labels(**lab).observe(max(first - scheduled, 0.0))
        self.decode_time.labels(**lab).observe(last - first)
        self.inference_time.labels(**lab).observe(max(last - scheduled, 0.0))
        if max(lengths, default=0) > 1:
            self.request_tpot.labels(**lab).observe((last - first) / (max(lengths) - 1))

    def _maybe_log(self, stats: EngineStats, engine: int) -> None:
        now = time.monotonic()
        elapsed = now - self._log_time[engine]
        if elapsed < self.log_interval_s:
            return
        prev = self._log_last[engine]
        self._log_time[engine], self._log_last[engine] = now, stats
        prompt = stats.num_prompt_tokens_computed - prev.num_prompt_tokens_computed
        gen = stats.num_generated_tokens - prev.num_generated_tokens
        idle = prompt == gen == stats.num_running == stats.num_waiting == 0
        if idle and stats.num_preemptions == prev.num_preemptions:
            return  # vLLM too stays quiet while nothing happens
        queries = stats.num_prefix_cache_queries
        hit_rate = stats.num_prefix_cache_hit_tokens / queries if queries else 0.0
        logger.info(
            "Engine%s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
            "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%, Preemptions: %d",
            f" {engine:03d}" if len(self._labels) > 1 else "",  # vLLM's "Engine 000:"
            prompt / elapsed,
            gen / elapsed,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_cache_usage,
            100 * hit_rate,
            stats.num_preemptions,
        )
        log_spec_decode(stats, prev, elapsed)  # vLLM's second line, when the engine speculates

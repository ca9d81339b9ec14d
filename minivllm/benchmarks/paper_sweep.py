"""The experiment of `minivllm bench paper`: Poisson arrivals served by one engine, and the
paper's metrics (§6.2): normalized latency, batched requests, the highest sustained rate.

`serve` drives any engine (simulated or real) through one arrival sequence; `sweep` runs every
(workload, policy, rate) point; `summarize` finds each policy's sustained rate and paged's ratios.
The same seed draws the same lengths at every rate (only the gaps between arrivals scale), so
points differ in load alone.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from minivllm.benchmarks.sharing import WORKLOADS
from minivllm.config import KV_ALLOCATIONS
from minivllm.core.scheduler import SchedulerOutput
from minivllm.engine.llm_engine import LLMEngine
from minivllm.experiments.simulated_executor import SimulatedExecutor
from minivllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class PaperRequest:
    arrival: float  # seconds after the start
    prompt_len: int
    output_len: int


@dataclass
class PointResult:
    workload: str
    policy: str
    rate: float  # requests / s offered
    normalized_latency: float  # mean of (e2e latency / output tokens), s/token
    mean_latency: float  # s
    mean_batched_requests: float  # Fig. 13: requests in a step, averaged over steps
    num_requests: int
    num_steps: int
    duration: float  # clock seconds from the first arrival to the last finish
    num_preemptions: int
    # Mean over steps of each share of the KV cache's slots (the paper's Fig. 2 split).
    kv_shares: dict[str, float] = field(default_factory=dict)


def draw_requests(
    workload: str, num: int, rate: float, seed: int, max_model_len: int, length_scale: float = 1.0
) -> list[PaperRequest]:
    """Poisson arrivals at `rate`; exponential lengths around the workload's Fig. 11 means."""
    rng = random.Random(f"{workload}-{seed}")
    mean_in, mean_out = (m * length_scale for m in WORKLOADS[workload])
    requests = []
    clock = 0.0
    for _ in range(num):
        clock += rng.expovariate(rate)
        prompt = max(1, min(max_model_len - 1, round(rng.expovariate(1 / mean_in))))
        output = max(1, min(max_model_len - prompt, round(rng.expovariate(1 / mean_out))))
        requests.append(PaperRequest(clock, prompt, output))
    return requests


class _StepProbe:
    """Stands in for the engine's executor for one run: counts the requests of each step and
    passes the step on (the engine calls `execute_model` once per step that runs anything)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_scheduled = 0

    def execute_model(self, sched: SchedulerOutput) -> Any:
        self.num_scheduled = len(sched.scheduled)
        return self.inner.execute_model(sched)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def serve(
    engine: LLMEngine,
    requests: Sequence[PaperRequest],
    on_step: Callable[[], None] | None = None,
    clock_fn: Callable[[], float] = time.process_time,
) -> dict[str, Any]:
    """Feed `requests` to `engine` at their arrival times and step it until all finish.

    The clock advances by each step's duration: simulated when the engine runs on the simulated
    executor, else measured with `clock_fn`: by default this process's CPU time, which on a CPU
    shared with other jobs is the step's own compute (wall time would measure the other jobs
    too; with one torch thread the two agree on an idle machine). When the engine is idle the
    clock jumps to the next arrival."""
    simulated = isinstance(engine.executor, SimulatedExecutor)
    probe = _StepProbe(engine.executor)
    engine.executor = probe
    clock = 0.0
    nxt = 0
    finished: dict[str, float] = {}
    batched = steps = 0
    shares: dict[str, float] = {}
    preempt0 = engine.scheduler.num_preemptions
    bm = engine.kv_cache_manager
    total = bm.num_blocks * bm.block_size
    try:
        while nxt < len(requests) or engine.has_unfinished_requests():
            if not engine.has_unfinished_requests():
                clock = max(clock, requests[nxt].arrival)
            while nxt < len(requests) and requests[nxt].arrival <= clock:
                r = requests[nxt]
                params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
                prompt = {"prompt_token_ids": [0] * r.prompt_len}
                engine.add_request(str(nxt), prompt, params, arrival_time=r.arrival)
                nxt += 1
            probe.num_scheduled = 0
            before = probe.inner.clock if simulated else clock_fn()
            outputs = engine.step()
            after = probe.inner.clock if simulated else clock_fn()
            clock += after - before
            if probe.num_scheduled:
                steps += 1
                batched += probe.num_scheduled
                stats = bm.get_stats()
                for key, value in (
                    ("filled", stats.num_filled_slots),
                    ("future", getattr(stats, "num_future_slots", 0)),  # reservations only
                    ("internal_fragmentation", stats.internal_fragmentation_slots),
                    ("free", total - stats.num_reserved_slots),
                ):
                    shares[key] = shares.get(key, 0.0) + value / total
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = clock
            if on_step is not None:
                on_step()
    finally:
        engine.executor = probe.inner
    latencies = [finished[str(i)] - r.arrival for i, r in enumerate(requests)]
    norm = [lat / r.output_len for lat, r in zip(latencies, requests)]
    return {
        "normalized_latency": sum(norm) / len(norm),
        "mean_latency": sum(latencies) / len(latencies),
        "mean_batched_requests": batched / max(steps, 1),
        "num_steps": steps,
        "duration": clock - requests[0].arrival,
        "num_preemptions": engine.scheduler.num_preemptions - preempt0,
        "kv_shares": {k: v / max(steps, 1) for k, v in shares.items()},
    }


# ---------------------------------------------------------------------------------- the sweep
def num_requests_at(rate: float, duration: float, lo: int, hi: int) -> int:
    """Requests arriving in `duration` seconds at `rate` (the paper serves fixed-length traces),
    at least `lo` (a point needs a few) and at most `hi` (an overloaded point costs steps)."""
    return max(lo, min(hi, round(rate * duration)))


def sweep(
    make_engine: Callable[[str], LLMEngine],
    workloads: dict[str, list[float]],
    policies: Sequence[str],
    num_requests: Callable[[str, float], int],
    seed: int,
    max_model_len: int,
    length_scale: float = 1.0,
    progress: bool = True,
    stop_above: float | None = None,
    keep_rates: dict[str, float] | None = None,
) -> list[PointResult]:
    """Every (workload, policy, rate) point; `make_engine(policy)` gives the engine to serve it,
    `num_requests(workload, rate)` how many requests a point serves. A policy whose normalized latency
    passed `stop_above` skips its higher rates (they are past its knee, and an overloaded point
    is the costliest to run), except each workload's `keep_rates` rate (Fig. 13's)."""
    points = [(w, p, r) for w, rates in workloads.items() for p in policies for r in sorted(rates)]
    results = []
    bar = tqdm(points, desc="paper sweep", unit="point", disable=not progress)
    engines: dict[str, LLMEngine] = {}
    over: set[tuple[str, str]] = set()  # (workload, policy) past stop_above
    for workload, policy, rate in bar:
        if (workload, policy) in over and rate != (keep_rates or {}).get(workload):
            continue
        bar.set_postfix_str(f"{workload} {policy} {rate:g} req/s")
        engine = engines.get(policy) or make_engine(policy)
        engines[policy] = engine
        n = num_requests(workload, rate)
        requests = draw_requests(workload, n, rate, seed, max_model_len, length_scale)
        out = serve(engine, requests)
        results.append(PointResult(workload, policy, rate, num_requests=n, **out))
        if stop_above is not None and out["normalized_latency"] > stop_above:
            over.add((workload, policy))
    for engine in engines.values():
        engine.shutdown()
    return results


def max_sustained_rate(points: Sequence[PointResult], bound: float) -> tuple[float, str]:
    """The rate at which normalized latency crosses `bound` (linear between swept rates), and
    how it was found: "crossing", "above-sweep" (never crossed: at least the highest rate) or
    "below-sweep" (already over at the lowest rate: 0)."""
    pts = sorted(points, key=lambda p: p.rate)
    for prev, cur in zip([None, *pts], pts):
        if cur.normalized_latency > bound:
            if prev is None:
                return 0.0, "below-sweep"
            dl = cur.normalized_latency - prev.normalized_latency
            frac = (bound - prev.normalized_latency) / dl if dl > 0 else 0.0
            return prev.rate + frac * (cur.rate - prev.rate), "crossing"
    return pts[-1].rate, "above-sweep"


def summarize(
    results: Sequence[PointResult], bound: float, batch_rates: dict[str, float]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload and policy: the sustained rate, paged's ratio to it, and the mean batch at
    the workload's Fig. 13 rate (the swept rate nearest `batch_rates[workload]`)."""
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in dict.fromkeys(r.workload for r in results):
        rows = summary.setdefault(workload, {})
        of = {
            p: [r for r in results if r.workload == workload and r.policy == p]
            for p in KV_ALLOCATIONS
        }
        of = {p: pts for p, pts in of.items() if pts}
        for policy, pts in of.items():
            rate, how = max_sustained_rate(pts, bound)
            near = min(pts, key=lambda r: abs(r.rate - batch_rates[workload]))
            rows[policy] = {
                "max_rate": rate,
                "found": how,
                "batch_rate": near.rate,
                "mean_batched_requests": near.mean_batched_requests,
            }
        if "paged" in rows:
            for row in rows.values():
                row["paged_rate_ratio"] = (
                    rows["paged"]["max_rate"] / row["max_rate"] if row["max_rate"] else None
                )
                row["paged_batch_ratio"] = (
                    rows["paged"]["mean_batched_requests"] / row["mean_batched_requests"]
                    if row["mean_batched_requests"]
                    else None
                )
    return summary

"""The server's periodic stats line (vLLM's "Avg prompt throughput" log), driven by hand.

The line is written from the engine thread's step hook once `log_interval_s` has passed; these
tests feed it stats directly, so they need neither a model nor a clock that happens to cooperate.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace

import pytest

from minivllm.engine.stats import EngineStats
from minivllm.entrypoints.metrics import ServerMetrics

ZERO = EngineStats(**{f.name: 0 for f in fields(EngineStats)})


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]


def test_the_first_window_after_start_gets_its_line(caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServerMetrics("m", log_interval_s=0.0)
    busy = replace(ZERO, num_prompt_tokens_computed=22, num_generated_tokens=6, num_running=1)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        metrics.on_step(busy, [])
    assert len(lines(caplog)) == 1
    assert "Running: 1 reqs" in lines(caplog)[0]


def test_an_idle_window_stays_quiet_and_a_young_one_waits(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="minivllm"):
        ServerMetrics("m", log_interval_s=0.0).on_step(ZERO, [])  # nothing happened
        ServerMetrics("m", log_interval_s=3600.0).on_step(
            replace(ZERO, num_generated_tokens=5), []
        )  # the interval has not passed
    assert lines(caplog) == []

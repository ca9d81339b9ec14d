"""Fault injection for the engine's fault tests: a step that fails on the path users run.

A forward hook would be the obvious place, but a hook is Python the C++ decode loop cannot run,
so registering one switches that loop off, and the default CPU decode path would go untested.
`FaultyExecutor` wraps the engine's executor instead and fails around the runner's call:
`"before_model"` (nothing computed yet) or `"after_model"` (every layer wrote its K/V, the step's
prefix-cache names are given but not final, nothing is sampled). The production executor knows
nothing of it (a test hook is not production code).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from minivllm.core.scheduler import SchedulerOutput
from minivllm.engine.llm_engine import LLMEngine
from minivllm.worker.model_runner import ModelRunnerOutput

FaultPoint = Literal["before_model", "after_model"]


class FaultInjector:
    """Raises `exc` the first time `when(sched)` holds at `point`, once."""

    def __init__(
        self,
        point: FaultPoint,
        exc: BaseException,
        when: Callable[[SchedulerOutput], bool] = lambda sched: True,
    ) -> None:
        self.point, self.exc, self.when = point, exc, when
        self.fired = False

    def check(self, point: FaultPoint, sched: SchedulerOutput) -> None:
        if not self.fired and point == self.point and self.when(sched):
            self.fired = True
            raise self.exc


class FaultyExecutor:
    """The engine's executor with a `FaultInjector` checked around each step's model call."""

    def __init__(self, inner: Any, fault: FaultInjector) -> None:
        self.inner, self.fault = inner, fault

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.fault.check("before_model", sched)
        output = self.inner.execute_model(sched)
        self.fault.check("after_model", sched)
        return output

    def __getattr__(self, name: str) -> Any:  # driver_runner, num_blocks, shutdown, ...
        return getattr(self.inner, name)


def inject_fault(engine: LLMEngine, fault: FaultInjector) -> FaultInjector:
    """Make `engine`'s steps check `fault` from now on (replacing an earlier one)."""
    clear_fault(engine)
    engine.executor = FaultyExecutor(engine.executor, fault)  # type: ignore[assignment]
    return fault


def clear_fault(engine: LLMEngine) -> None:
    """Give `engine` its own executor back."""
    if isinstance(engine.executor, FaultyExecutor):
        engine.executor = engine.executor.inner

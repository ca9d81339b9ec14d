"""Fault safety on the path users run: the C++ decode-layers replay on.

tests/engine/test_engine_faults.py injects its fault with a forward hook on a layer, and a hook turns
the replay off (`CpuDecodeLoop.applies`), so there the default CPU decode path is never the one
that fails. Here the fault is raised around the executor (tests/utils/faults.py: before the model ran, or
after every layer wrote its K/V) or by the sampler, with no hook anywhere; each test proves the
replay ran, through the very steps around the fault. The matrix is test_engine_faults.py's:
a prompt's prefill, its second chunk, a decode step that fills a block, and a copy-on-write step
of an n = 2 request, while another request holds prefix-cached blocks; each for an exception and
for Ctrl-C. Afterwards: the step named no prefix-cache block, every block is free, and the same
prompts give exactly what a fresh engine gives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from minivllm.core.scheduler import SchedulerOutput
from minivllm.engine.beam_search import BeamSearchParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.executor.abstract import UniProcExecutor
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from tests.engine.test_engine_faults import (
    GREEDY,
    HOLDER,
    VICTIM,
    cached_names,
    make_llm,
    outputs_of,
)
from tests.utils.engine_utils import assert_no_blocks_held, save_tiny_llama
from tests.utils.faults import FaultInjector, clear_fault, inject_fault

When = Callable[[SchedulerOutput], bool]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-faults-replay"))


class CountingReplay:
    """Stands in for the runner's replay, counting the decode steps it ran (not a hook: the
    runner calls it exactly as it calls the replay)."""

    def __init__(self, replay: Any) -> None:
        self.replay, self.calls = replay, 0

    def applies(self, *args: Any) -> bool:
        return bool(self.replay.applies(*args))

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.replay(*args)


def count_replays(llm: LLM) -> CountingReplay:
    runner = llm.llm_engine.executor.driver_runner  # the runner owns the replay (issue 25)
    if runner.decode_loop is None:
        pytest.skip("no C++ decode loop on this machine (see CpuDecodeLoop.supports)")
    counter = CountingReplay(runner.decode_loop)
    runner.decode_loop = counter  # type: ignore[assignment]
    return counter


class SamplingFault(FaultInjector):
    """Raises inside the engine's sampler, after the model ran, in the step `when` picks."""

    def __init__(self, engine: LLMEngine, exc: BaseException, when: When) -> None:
        super().__init__("after_model", exc, when)
        self.sched: SchedulerOutput | None = None
        self.sampler = engine.sampler
        engine.sampler = self  # type: ignore[assignment]

    def check(self, point: str, sched: SchedulerOutput) -> None:  # type: ignore[override]
        self.sched = sched  # only watches which step is running

    def __call__(self, logits: Any, meta: Any) -> Any:
        assert self.sched is not None
        if not self.fired and self.when(self.sched):
            self.fired = True
            raise self.exc
        return self.sampler(logits, meta)


# The phases, read off the step's SchedulerOutput: (engine keywords, the victim's parameters, when).
def prefill() -> When:
    return lambda s: any(item.num_new_tokens > 1 for item in s.scheduled)


def second_chunk() -> When:
    seen = [0]

    def when(s: SchedulerOutput) -> bool:
        seen[0] += any(item.num_new_tokens > 1 for item in s.scheduled)
        return seen[0] >= 2 and any(item.num_new_tokens > 1 for item in s.scheduled)

    return when


def decode_filling_a_block() -> When:
    """A decode step of both requests in which one of them fills a block."""
    return lambda s: (
        len(s.scheduled) >= 2
        and all(item.num_new_tokens == 1 for item in s.scheduled)
        and any(item.seq_len % 16 == 0 for item in s.scheduled)
    )


def copy_on_write() -> When:
    """The n = 2 victim's first decode after its fork: it copies its shared, partly filled block."""
    return lambda s: all(item.num_new_tokens == 1 for item in s.scheduled) and bool(s.block_copies)


PHASES: dict[str, tuple[dict[str, Any], SamplingParams, Callable[[], When]]] = {
    "prefill": ({}, GREEDY, prefill),
    "chunked-prefill": ({"max_num_batched_tokens": 16}, GREEDY, second_chunk),
    "decode": ({}, GREEDY, decode_filling_a_block),
    "copy-on-write": (
        {},
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8),
        copy_on_write,
    ),
}
POINTS = ("before_model", "after_model", "sampling")


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("phase", sorted(PHASES))
def test_a_failed_step_leaves_no_trace_with_the_replay_on(
    tiny_model: Path, phase: str, point: str, exc_type: type[BaseException]
) -> None:
    engine_kwargs, victim_params, make_when = PHASES[phase]
    llm = make_llm(tiny_model, **engine_kwargs)
    engine = llm.llm_engine
    assert isinstance(engine.executor, UniProcExecutor)
    replays = count_replays(llm)

    # The holder runs until it decodes (through the replay), holding its prompt's full blocks,
    # committed and named.
    engine.add_request("holder", HOLDER, GREEDY)
    for _ in range(20):
        if replays.calls:
            break
        engine.step()
    assert replays.calls > 0, "the holder's decode should have run through the replay"
    assert engine.kv_cache_manager.block_pool.cached_block_hash_to_block
    exc = exc_type("injected fault")
    fault = (
        SamplingFault(engine, exc, make_when())
        if point == "sampling"
        else FaultInjector(point, exc, make_when())  # type: ignore[arg-type]
    )
    inject_fault(engine, fault)
    engine.add_request("victim", VICTIM, victim_params)
    outputs = []
    names_before: set[tuple[int, ...]] = set()
    replays_before = 0
    for _ in range(200):  # a fault that never fires must fail the test, not hang it
        if fault.fired:
            break
        names_before, replays_before = cached_names(llm), replays.calls
        try:
            outputs += engine.step()  # an exception fails the step's requests, inside step()
        except KeyboardInterrupt:  # Ctrl-C fails them too, then reaches the caller
            assert fault.fired and exc_type is KeyboardInterrupt
    clear_fault(engine)
    assert fault.fired, "the fault's condition never held"
    if phase in ("decode", "copy-on-write") and point != "before_model":
        # The faulted step itself was a decode the replay ran, on the C++ path, before it failed.
        assert replays.calls == replays_before + 1

    assert cached_names(llm) <= names_before  # the faulted step named nothing
    if exc_type is RuntimeError:
        failed = {o.request_id: o for o in outputs if o.finished}
        assert failed.keys() == {"holder", "victim"}
        assert all(o.error and "injected fault" in o.error for o in failed.values())
        assert all(c.finish_reason == "error" for o in failed.values() for c in o.outputs)
    assert not engine.has_unfinished_requests()
    assert_no_blocks_held(llm)

    # The same prompts, on this engine (the replay still on) and on a fresh one: the same tokens.
    if point == "sampling":
        engine.sampler = fault.sampler  # type: ignore[attr-defined]
    prompts, params = [HOLDER, VICTIM], [GREEDY, victim_params]
    replays_before = replays.calls
    again = outputs_of(llm, prompts, params)  # type: ignore[arg-type]
    assert replays.calls > replays_before
    fresh = outputs_of(make_llm(tiny_model, **engine_kwargs), prompts, params)  # type: ignore[arg-type]
    assert again == fresh
    assert_no_blocks_held(llm)


def test_the_fault_injector_fires_once_at_its_point_only() -> None:
    sched = SchedulerOutput()
    fault = FaultInjector("after_model", RuntimeError("x"))
    fault.check("before_model", sched)
    with pytest.raises(RuntimeError):
        fault.check("after_model", sched)
    fault.check("after_model", sched)  # fired already: no second fault
    assert fault.fired


@pytest.mark.parametrize("point", POINTS)
def test_a_failed_beam_search_step_leaves_no_trace_with_the_replay_on(
    tiny_model: Path, point: str
) -> None:
    """A beam search's decode step, forks and copy-on-write included, fails as cleanly."""
    beam = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    llm = make_llm(tiny_model)
    engine = llm.llm_engine
    replays = count_replays(llm)
    exc = RuntimeError("injected fault")
    # The third decode step of the beams: they have forked and share blocks by then.
    decodes = [0]

    def when(s: SchedulerOutput) -> bool:
        decodes[0] += len(s.scheduled) >= 3 and all(i.num_new_tokens == 1 for i in s.scheduled)
        return decodes[0] >= 3

    fault = (
        SamplingFault(engine, exc, when) if point == "sampling" else FaultInjector(point, exc, when)  # type: ignore[arg-type]
    )
    inject_fault(engine, fault)
    engine.add_request("beams", VICTIM, beam)
    outputs = []
    for _ in range(200):
        if fault.fired:
            break
        outputs += engine.step()
    clear_fault(engine)
    assert fault.fired and replays.calls > 0
    (failed,) = [o for o in outputs if o.finished]
    assert failed.error and "injected fault" in failed.error
    assert not engine.has_unfinished_requests()
    assert_no_blocks_held(llm)
    if point == "sampling":
        engine.sampler = fault.sampler  # type: ignore[attr-defined]
    again = [b.tokens for b in llm.beam_search(VICTIM, beam)[0].sequences]
    fresh = [b.tokens for b in make_llm(tiny_model).beam_search(VICTIM, beam)[0].sequences]
    assert again == fresh
    assert_no_blocks_held(llm)

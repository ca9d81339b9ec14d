"""The step as a message: every committed step reaches the engine's step listeners, with a
read-only snapshot of the block pool; a failed step reaches none (minivllm/engine/step_listener.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from minivllm.core.scheduler import SchedulerOutput
from minivllm.sampling_params import SamplingParams
from tests.engine.test_engine_faults import GREEDY, HOLDER, VICTIM, make_llm
from tests.utils.engine_utils import assert_no_blocks_held, save_tiny_llama
from tests.utils.faults import FaultInjector, inject_fault


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-listeners"))


class Listener:
    """Keeps what each committed step published."""

    def __init__(self) -> None:
        self.steps: list[tuple[SchedulerOutput, list[int], dict[Any, tuple[int, ...]]]] = []

    def on_step(self, scheduler_output: SchedulerOutput, outputs: Any, blocks: Any) -> None:
        tables = dict(blocks.block_tables)  # read inside on_step, as the snapshot asks
        self.steps.append((scheduler_output, [s.seq_id for s in outputs.sampled], tables))


def test_listeners_hear_every_committed_step_and_no_failed_one(tiny_model: Path) -> None:
    llm = make_llm(tiny_model)
    engine = llm.llm_engine
    listener = Listener()
    engine.add_step_listener(listener)
    engine.add_request("a", HOLDER, SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    committed = len(listener.steps)
    assert committed == engine.get_stats().num_steps
    assert len(listener.steps[-1][1]) == 2  # the last step sampled for both samples
    # The fork shows in the snapshot of the step that sampled first: two tables, shared blocks.
    first_sample = next(i for i, (_, sampled, _) in enumerate(listener.steps) if sampled)
    tables = listener.steps[first_sample][2]
    assert len(tables) == 2 and len(set(tables.values())) == 1
    inject_fault(engine, FaultInjector("after_model", RuntimeError("x")))
    engine.add_request("b", VICTIM, GREEDY)
    (failed,) = engine.step()
    assert failed.error and len(listener.steps) == committed  # a failed step publishes nothing
    assert engine.get_stats().num_steps == committed
    engine.remove_step_listener(listener)
    llm.generate("x", GREEDY, use_tqdm=False)
    assert len(listener.steps) == committed
    assert_no_blocks_held(llm)

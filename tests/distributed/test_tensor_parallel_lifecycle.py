"""Tensor-parallel workers start, fail and stop cleanly: no hang, no orphan, a clear error.

Every way an engine ends must stop every worker: `LLM.shutdown()`, deleting the LLM, interpreter
exit, Ctrl-C (SIGINT to the whole process group, as a terminal sends it). A worker that is killed
or raises mid-run makes the driver raise `EngineDeadError` naming the rank and the cause, and
every later call raises at once. A size that does not split the model's heads is refused before
any process starts. (The same engine under `torchrun`, rank 0 driving and the others serving, is
tests/distributed/test_model_families_pp.py's: one launch of 4 ranks, tensor parallelism alone
and with pipeline stages.)
No test here may leave a process behind, pass or fail (`no_leftover_processes`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from minivllm import LLM, SamplingParams
from minivllm.executor.tensor_parallel import EngineDeadError
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.tp_utils import (
    assert_gone,
    fail_on_rank_one,
    live_descendants,
    no_leftover_processes,
)

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [{"prompt_token_ids": [11 + i, 300 + 7 * i, 77, 5000 + i]} for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

# A hang guard (a broken collective would otherwise wait COLLECTIVE_TIMEOUT); no timing.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield from no_leftover_processes()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=False)


def workers_of(llm: LLM) -> list[psutil.Process]:
    return [psutil.Process(w.process.pid) for w in llm.llm_engine.executor.workers]  # type: ignore[attr-defined]


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


# ---------------------------------------------------------------------------------- refusal
def test_heads_that_do_not_split_are_refused_naming_the_sizes_that_work_before_any_process(
    tmp_path: Path,
) -> None:
    """SmolLM2's shape in small: 9 query heads and 3 KV heads do not split over 2 ranks."""
    path = save_tiny_llama(
        tmp_path,
        hidden_size=72,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=144,
    )
    before = set(live_descendants())
    with pytest.raises(ValueError) as info:
        LLM(str(path), tensor_parallel_size=2)
    message = str(info.value)
    assert "9 attention heads do not divide over 2 ranks" in message
    assert "must be one of [1, 3, 9]" in message
    assert set(live_descendants()) == before  # no worker was started


# ---------------------------------------------------------------------------------- failures
def test_a_worker_killed_mid_run_is_a_clear_error_and_every_later_call_fails_fast(
    tiny: Path,
) -> None:
    llm = LLM(str(tiny), tensor_parallel_size=2, num_gpu_blocks_override=32)
    try:
        (worker,) = workers_of(llm)
        executor = llm.llm_engine.executor
        execute = executor.execute_model
        steps = []

        def kill_at_third_step(sched):
            steps.append(sched)
            if len(steps) == 3:
                worker.kill()
            return execute(sched)

        executor.execute_model = kill_at_third_step  # type: ignore[method-assign]
        with pytest.raises(
            EngineDeadError, match=rf"rank 1 \(pid {worker.pid}\) was killed by SIGKILL"
        ):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert len(steps) == 3  # it failed in the step that lost the worker, not later
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.get_stats().num_running == 0  # the failed requests were aborted
    finally:
        llm.shutdown()


def test_a_worker_that_raises_is_reported_with_its_traceback(tiny: Path) -> None:
    llm = LLM(str(tiny), tensor_parallel_size=2, num_gpu_blocks_override=32)
    try:
        (worker,) = workers_of(llm)
        with pytest.raises(EngineDeadError) as info:
            llm.llm_engine.executor.collective_rpc(fail_on_rank_one)
        assert "rank 1" in str(info.value) and "ValueError: rank one is broken" in str(info.value)
        assert_gone([worker], "the worker that raised")
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------------- ending
def test_shutdown_and_deletion_each_stop_every_worker(tiny: Path) -> None:
    llm = LLM(str(tiny), tensor_parallel_size=2, num_gpu_blocks_override=32)
    workers = workers_of(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.shutdown()
    assert_gone(workers, "after shutdown()")
    llm.shutdown()  # idempotent
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)

    llm = LLM(str(tiny), tensor_parallel_size=2, num_gpu_blocks_override=32)
    workers = workers_of(llm)
    del llm
    assert_gone(workers, "after del llm")


SCRIPT = """
import sys
from minivllm import LLM, SamplingParams

if __name__ == "__main__":  # workers are spawned: they re-import this file
    llm = LLM(sys.argv[1], tensor_parallel_size=2, num_gpu_blocks_override=32)
    print("workers", *[w.process.pid for w in llm.llm_engine.executor.workers], flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2]), ignore_eos=True)
    print("generating", flush=True)
    # many requests over a small pool: seconds of steps, so that a Ctrl-C sent at "generating"
    # still finds them running on a loaded machine
    llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 32, params, use_tqdm=False)
    print("done", flush=True)  # and exit without shutdown(): atexit must stop the workers
"""


def run_script(tmp_path: Path, model: Path, max_tokens: int, interrupt: bool) -> str:
    """Run SCRIPT in its own process group; with `interrupt`, send SIGINT to the whole group
    (a terminal's Ctrl-C) once it generates. Returns its output; checks its workers are gone."""
    script = tmp_path / "tp_script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model), str(max_tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        # A terminal's process gets SIGINT's default action; a pytest-xdist worker may ignore
        # SIGINT, and a child inherits that (Python then installs no KeyboardInterrupt handler).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    workers: list[psutil.Process] = []
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("workers"):
                workers = [psutil.Process(int(pid)) for pid in line.split()[1:]]
            if line.startswith("generating") and interrupt:
                os.killpg(proc.pid, signal.SIGINT)
                break
        lines.append(proc.communicate(timeout=120)[0])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert workers, "".join(lines)
    assert_gone(workers, "after the script ended")
    return "".join(lines)


def test_interpreter_exit_stops_every_worker(tmp_path: Path, tiny: Path) -> None:
    output = run_script(tmp_path, tiny, max_tokens=4, interrupt=False)
    assert "done" in output.splitlines()


def test_ctrl_c_stops_the_script_and_every_worker(tmp_path: Path, tiny: Path) -> None:
    output = run_script(tmp_path, tiny, max_tokens=500, interrupt=True)
    # the script's own last line, not a traceback's `done.set_result(...)`
    assert "KeyboardInterrupt" in output and "done" not in output.splitlines()

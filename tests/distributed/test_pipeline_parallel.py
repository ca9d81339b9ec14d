"""Pipeline parallelism gives the single-process engine's tokens, and fails and stops cleanly.

The decoder layers are cut into stages (vLLM's even split, or VLLM_PP_LAYER_PARTITION), each
stage on its own ranks; stage i sends each token's hidden state (and Llama's residual) to stage
i + 1 and the last stage's logits go back to the driver, which samples. Every test runs its ranks
on this CPU over gloo, spawned by the engine (or by torchrun), on tiny random models whose stages
are uneven (3 layers over 2 stages: 2 + 1), tied embeddings included (the last stage's LM head
reads the embedding table that only the first stage otherwise holds). One workload exercises
chunked prefill, preemption and prefix caching at once, and the test checks that they ran, and
that two batches were in flight at once (the step trace says which), never sharing a request.
The scheduler's rule for batches in flight is tested on its own first, without an engine.
Structured outputs (a regex, a choice, a JSON schema) give one process's text on every layout;
speculative decoding is refused by name. A killed stage fails the engine naming its rank; a size
that does not fit is refused by name before any process starts, SmolLM2 over 2 x 2 ranks
included (its 9 heads do not split over 2 tensor-parallel ranks). No test may leave a process behind (`no_leftover_processes`). The
other families' stages: tests/distributed/test_model_families_pp.py; torchrun over two nodes:
tests/distributed/test_multinode.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.distributed.pipeline import stage_sizes
from minivllm.envs import pp_layer_partition
from minivllm.executor.tensor_parallel import EngineDeadError
from tests.distributed.test_tensor_parallel import (
    ENGINE,
    MAX_TOKENS,
    greedy,
    tp_llm,
    workload,
)
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.kv_helpers import make_seq
from tests.utils.tp_utils import live_descendants, no_leftover_processes

# A hang guard (a broken send would otherwise wait COLLECTIVE_TIMEOUT); no timing.
pytestmark = pytest.mark.timeout(600)
NUMBER_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield from no_leftover_processes()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A 3-layer tied Llama (4 heads, 2 KV heads) and one process's greedy tokens for
    `workload()` under chunking, preemption and prefix hits."""
    path = save_tiny_llama(tmp_path_factory.mktemp("llama3"), num_hidden_layers=3)
    with tp_llm(path, 1, **ENGINE) as one:
        return path, greedy(one, workload())


# Structured outputs (issue 47's what-to-build 1): the grammar's bitmask is applied where the
# driver samples, on the logits the last stage sent back, and a matcher advances when its
# batch commits; a request is never in two batches in flight, so its matcher is never behind.
STRUCTURED = [
    ("Name three words:", StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{2,6}){2}")),
    ("Which parallelism?", StructuredOutputsParams(choice=["pipeline", "tensor", "data"])),
    ("A number as JSON:", StructuredOutputsParams(json=NUMBER_SCHEMA)),
]


def structured(llm: LLM) -> list[str]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)
        for _, so in STRUCTURED
    ]
    outputs = llm.generate([p for p, _ in STRUCTURED], params, use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module")
def structured_one_process(llama: tuple[Path, list[list[int]]]) -> list[str]:
    with tp_llm(llama[0], 1, **ENGINE) as one:
        return structured(one)


# ---------------------------------------------------------------------------------- the split
def test_layers_split_evenly_with_the_remainder_before_the_last_stage() -> None:
    assert stage_sizes(4, 2) == [2, 2]
    assert stage_sizes(3, 2) == [2, 1]
    assert stage_sizes(10, 4) == [2, 3, 3, 2]  # vLLM's rule: the last stage holds the LM head
    assert stage_sizes(4, 2, [1, 3]) == [1, 3]


@pytest.mark.parametrize(
    "value, message",
    [
        ("4,x", "VLLM_PP_LAYER_PARTITION must be comma-separated positive layer counts"),
        ("0,4", "VLLM_PP_LAYER_PARTITION must be comma-separated positive layer counts"),
    ],
)
def test_a_malformed_layer_partition_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", value)
    with pytest.raises(ValueError, match=message):
        pp_layer_partition()


@pytest.mark.parametrize(
    "kwargs, partition, message",
    [
        (dict(pipeline_parallel_size=0), None, "pipeline_parallel_size must be a positive"),
        (dict(pipeline_parallel_size=4), None, "pipeline_parallel_size 4 is larger than the "),
        (dict(pipeline_parallel_size=2), "1,1", r"VLLM_PP_LAYER_PARTITION 1,1 must give each"),
        (
            dict(pipeline_parallel_size=2, speculative_config={"num_speculative_tokens": 2}),
            None,
            "speculative_config is not supported with pipeline_parallel_size > 1",
        ),
    ],
)
def test_sizes_that_do_not_fit_are_refused_by_name_before_any_process(
    llama: tuple[Path, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
    kwargs: dict[str, Any],
    partition: str | None,
    message: str,
) -> None:
    if partition is not None:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    before = set(live_descendants())
    with pytest.raises(ValueError, match=message):
        LLM(str(llama[0]), **kwargs)
    assert set(live_descendants()) == before  # no worker was started


def test_smollm2_over_two_ranks_by_two_stages_is_refused_naming_its_heads_before_any_process() -> (
    None
):
    """SmolLM2 has 9 attention heads and 3 KV heads: two tensor-parallel ranks cannot split
    them, with stages or without (vLLM refuses it too: the heads must divide by the
    tensor-parallel size). Its two stages alone run: tests/distributed/test_multinode.py."""
    before = set(live_descendants())
    named = r"tensor_parallel_size 2 does not split this model: its 9 attention heads do not "
    with pytest.raises(ValueError, match=named + r"divide over 2 ranks.*must be one of \[1, 3\]"):
        LLM(None, tensor_parallel_size=2, pipeline_parallel_size=2, quantization="none")
    assert set(live_descendants()) == before  # no worker was started


# ---------------------------------------------------------------------------------- in flight
def ids(out: SchedulerOutput) -> list[int]:
    return [item.seq_id for item in out.scheduled]


def test_a_sequence_in_a_batch_in_flight_is_not_scheduled_until_its_output_is_back() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8), KVCacheManager(16, block_size=4)
    )
    a, b, c = (make_seq(i, list(range(10 * i, 10 * i + 6)), max_tokens=4) for i in (1, 2, 3))
    scheduler.add_seq(a)
    scheduler.add_seq(b)
    first = scheduler.schedule()
    assert ids(first) == [1, 2] and first.batch_id == 1  # b's first chunk: 2 of its 6 tokens
    scheduler.add_seq(c)
    second = scheduler.schedule()  # the first is still in flight: only c may run
    assert ids(second) == [3] and second.batch_id == 2
    assert scheduler.schedule().is_empty  # everyone is in flight
    scheduler.update_after_step(first)  # its output is back: a and b may run again
    a.token_ids.append(99)  # a's sampled token
    third = scheduler.schedule()
    assert ids(third) == [1, 2] and third.batch_id == 3
    assert [i.num_new_tokens for i in third.scheduled] == [1, 4]  # a's decode, b's last chunk


def test_a_sequence_in_flight_is_never_preempted_the_one_asking_is_instead() -> None:
    kv = KVCacheManager(3, block_size=4)  # a's 2 blocks and b's 1 fill the pool
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8), kv)
    a, b = make_seq(1, list(range(8)), max_tokens=4), make_seq(2, [50, 51, 52, 53], max_tokens=4)
    scheduler.add_seq(a)
    first = scheduler.schedule()
    scheduler.add_seq(b)
    second = scheduler.schedule()
    assert (ids(first), ids(second), kv.num_free_blocks) == ([1], [2], 0)
    scheduler.update_after_step(first)
    a.token_ids.append(99)  # a's decode needs a third block; b, the newest, is in flight
    third = scheduler.schedule()
    assert third.is_empty and third.preempted_seq_ids == [1]  # a waits for b's blocks
    assert kv.get_block_table(2) == second.scheduled[0].block_table  # b's K/V stays put
    scheduler.update_after_step(second)
    b.token_ids.append(98)
    fourth = scheduler.schedule()
    assert ids(fourth) == [2] and a in scheduler.waiting  # b decodes; a waits at the front


# ---------------------------------------------------------------------------------- tokens
@pytest.mark.parametrize(
    "tp, pp, partition",
    [(1, 2, None), (2, 2, None), (1, 2, "1,2")],
    ids=["2-stages", "2-ranks-x-2-stages", "uneven-partition-1-2"],
)
def test_stages_give_one_process_s_greedy_tokens_under_chunking_preemption_and_prefix_hits(
    llama: tuple[Path, list[list[int]]],
    structured_one_process: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tp: int,
    pp: int,
    partition: str | None,
) -> None:
    path, expected = llama
    if partition is not None:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    with tp_llm(path, tp, pipeline_parallel_size=pp, **ENGINE) as llm:
        first_stage_layers = 1 if partition else 2
        assert llm.llm_engine.runner.kv_cache.shape[0] == first_stage_layers  # its own layers
        executor = llm.llm_engine.executor
        execute = executor.execute_model
        chunks: list[Any] = []
        early: list[bool] = []  # per batch: stage 0 was done before the last stage's output

        def recording(sched: SchedulerOutput, **kw: Any) -> Any:
            chunks.extend(item for item in sched.scheduled if not item.sample)
            future = execute(sched, **kw)
            early.append(not future.done())  # the driver did not wait for the last stage
            return future

        executor.execute_model = recording  # type: ignore[method-assign]
        with llm.trace() as trace:
            assert greedy(llm, workload()) == expected
        stats = llm.get_stats()
        abort_while_in_flight(llm, workload(), expected)
        assert structured(llm) == structured_one_process  # a regex, a choice, a JSON schema
    assert chunks  # prompt chunks that did not reach the end of their prompt
    assert stats.num_preemptions > 0
    assert stats.num_prefix_cache_hit_tokens >= 32
    assert any(early)
    assert_batches_in_flight(trace.to_dict(), pp)


def abort_while_in_flight(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """Abort the request of the oldest batch in flight: its row is dropped when the batch comes
    back, its blocks were freed at once, and the others still get one process's tokens."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    engine.step()
    engine.step()  # batch 2 launched, batch 1 committed: batch 2 is in flight
    assert len(engine.batch_queue) == 1
    victim = engine.scheduler.seqs[engine.batch_queue[-1].sched.scheduled[0].seq_id]
    engine.abort_request(victim.request.request_id)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert victim.request.request_id in done  # its final output, aborted
    assert not engine.batch_queue and not engine.scheduler.in_flight
    for rid, tokens in done.items():
        if rid != victim.request.request_id:
            assert tokens == expected[int(rid)]


def assert_batches_in_flight(trace: dict[str, Any], pp: int) -> None:
    """Batches commit in the order they were scheduled; up to `pp` were in flight at once (the
    one committing and those after it), and never with a sequence in two of them."""
    steps = trace["steps"]
    assert trace["pipeline_parallel_size"] == pp
    assert [s["batch"] for s in steps] == list(range(1, len(steps) + 1))
    seqs = {s["batch"]: {item["seq_id"] for item in s["scheduled"]} for s in steps}
    for s in steps:
        assert len(s["in_flight"]) <= pp - 1
        assert all(b > s["batch"] for b in s["in_flight"])
        for b in s["in_flight"]:
            assert not seqs[s["batch"]] & seqs[b]
    assert sum(1 for s in steps if s["in_flight"]) >= len(steps) // 2  # the pipeline was full


# ---------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("when", ["before-stage-0", "after-stage-0"])
def test_a_killed_stage_fails_the_engine_naming_its_rank_and_leaves_no_process(
    llama: tuple[Path, list[list[int]]], when: str
) -> None:
    """Killed before the third batch's launch, the launch itself fails (stage 0 cannot hand its
    hidden states on); killed after it, while the batch is in flight, waiting for its output
    fails (or, if stage 1 had sent it already, the next launch does)."""
    path, _ = llama
    llm = LLM(str(path), pipeline_parallel_size=2, num_gpu_blocks_override=32)
    try:
        (stage1,) = [psutil.Process(w.process.pid) for w in llm.llm_engine.executor.workers]  # type: ignore[attr-defined]
        executor = llm.llm_engine.executor
        execute = executor.execute_model
        steps: list[SchedulerOutput] = []

        def kill_at_third_step(sched: SchedulerOutput, **kw: Any) -> Any:
            steps.append(sched)
            if len(steps) == 3 and when == "before-stage-0":
                stage1.kill()
            launched = execute(sched, **kw)
            if len(steps) == 3 and when == "after-stage-0":
                stage1.kill()
            return launched

        executor.execute_model = kill_at_third_step  # type: ignore[method-assign]
        prompts = [{"prompt_token_ids": [11 + i, 300, 77]} for i in range(3)]
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {stage1.pid}\) was killed"):
            greedy(llm, [p["prompt_token_ids"] for p in prompts])
        # It failed in the step that lost the stage (or, after stage 0, at the latest the next).
        assert len(steps) == 3 if when == "before-stage-0" else len(steps) in (3, 4)
    finally:
        llm.shutdown()

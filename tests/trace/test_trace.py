"""The step trace (minivllm/trace/recorder.py) is the block manager's truth at every step.

The run (tests/utils/trace_scenario.py) has a prefix-cache hit across requests, a preemption and its
recompute, an `n = 2` fork and its copy-on-write, evictions and finishes. At every recorded step
the trace must hold the paging invariants: reference counts equal the number of block tables
holding each block, free + held blocks = all blocks, each scheduled sequence holds exactly the
blocks its tokens need, and the step stays within the token budget.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM, SamplingParams
from minivllm.benchmarks.lora_workload import write_random_adapter
from minivllm.entrypoints import cli
from minivllm.lora.request import LoRARequest
from minivllm.trace import StepRecorder, render_page
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.trace_scenario import ENGINE_KWARGS, PROMPTS, make_llm, params, run_traced


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return make_llm(tiny_model)


@pytest.fixture(scope="module")
def traced(llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("trace")
    trace = run_traced(llm, out)
    assert not recorders(llm)  # detached when the `with` block ends
    return {"trace": trace, "dir": out}


def recorders(llm: LLM) -> list[object]:
    """The step recorders among the engine's step listeners."""
    return [x for x in llm.llm_engine.step_listeners if isinstance(x, StepRecorder)]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def test_the_run_shows_every_event_the_page_explains(traced: dict[str, Any]) -> None:
    steps = traced["trace"]["steps"]
    seen = {
        key
        for step in steps
        for key in ("copies", "preempted", "forked", "finished", "cache_hits", "evicted")
        if step[key]
    }
    assert seen == {"copies", "preempted", "forked", "finished", "cache_hits", "evicted"}
    # A hit on another request's blocks (not only a recompute hitting its own): shared blocks.
    first_hit = next(s for s in steps if s["cache_hits"])
    assert not any(s["preempted"] for s in steps[: first_hit["step"]])
    assert any(n > 1 for n in first_hit["ref_counts"].values())


def test_reference_counts_equal_the_tables_holding_each_block_at_every_step(
    traced: dict[str, Any],
) -> None:
    trace = traced["trace"]
    for step in trace["steps"]:
        holders = Counter(b for table in step["block_tables"].values() for b in table)
        for b in range(trace["num_blocks"]):
            assert step["ref_counts"].get(str(b), 0) == holders[b], (step["step"], b)
        for table in step["block_tables"].values():
            assert len(set(table)) == len(table)  # no block twice in one table


def test_free_and_held_blocks_add_up_to_the_pool_at_every_step(traced: dict[str, Any]) -> None:
    trace = traced["trace"]
    for step in trace["steps"]:
        assert step["num_free_blocks"] + len(step["ref_counts"]) == trace["num_blocks"]
        assert all(0 <= b < trace["num_blocks"] for b in step["cached_blocks"])
    assert trace["steps"][-1]["num_free_blocks"] == trace["num_blocks"]  # all freed at the end


def test_each_scheduled_sequence_holds_exactly_the_blocks_its_tokens_need(
    traced: dict[str, Any],
) -> None:
    trace = traced["trace"]
    bs = trace["block_size"]
    for step in trace["steps"]:
        for item in step["scheduled"]:
            seq = str(item["seq_id"])
            seq_len = item["num_computed_tokens"] + item["num_new_tokens"]
            assert len(item["block_table"]) == blocks_needed(seq_len, bs), (step["step"], seq)
            if item["seq_id"] in step["finished"]:
                assert seq not in step["block_tables"]  # finishing frees every block
            else:
                assert step["block_tables"][seq] == item["block_table"]
                assert step["num_computed_tokens"][seq] == seq_len
        for seq in step["preempted"]:
            assert str(seq) not in step["block_tables"]


def test_every_step_stays_within_the_token_budget_and_the_batch_size(
    traced: dict[str, Any],
) -> None:
    trace = traced["trace"]
    for step in trace["steps"]:
        batched = sum(item["num_new_tokens"] for item in step["scheduled"])
        assert batched == step["num_batched_tokens"] <= trace["max_num_batched_tokens"]
        assert 0 < len(step["scheduled"]) <= trace["max_num_seqs"]


def test_events_name_blocks_the_tables_hold(traced: dict[str, Any]) -> None:
    """A copy's destination is held by the writer, its source still by a sibling; a cache hit's
    blocks are the start of the admitted sequence's table and carry prefix-cache names."""
    for step in traced["trace"]["steps"]:
        tables = step["block_tables"]
        for src, dst in step["copies"]:
            assert step["ref_counts"][str(dst)] >= 1 and step["ref_counts"][str(src)] >= 1
        for hit in step["cache_hits"]:
            table = next(
                i["block_table"] for i in step["scheduled"] if i["seq_id"] == hit["seq_id"]
            )
            assert table[: len(hit["blocks"])] == hit["blocks"]
            assert hit["num_cached_tokens"] == len(hit["blocks"]) * traced["trace"]["block_size"]
            assert set(hit["blocks"]) <= set(step["cached_blocks"])
        for child in step["forked"]:
            assert any(tables[str(child)] == t for s, t in tables.items() if s != str(child))


def test_saved_trace_json_is_the_recorded_trace_and_the_page_is_self_contained(
    traced: dict[str, Any],
) -> None:
    out: Path = traced["dir"]
    assert json.loads((out / "trace.json").read_text()) == traced["trace"]
    html = (out / "index.html").read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//|url\(""", html)  # nothing to fetch
    assert html.count("</script>") == 3  # the data, the config and the script: none cut short
    sequences = traced["trace"]["sequences"]
    assert {s["request_id"] for s in sequences.values()} == {"0", "1", "2", "3"}
    assert all(len(s["tokens"]) == len(s["token_ids"]) for s in sequences.values())


def test_a_closing_script_tag_in_a_prompt_cannot_break_the_page() -> None:
    trace = {"steps": [], "sequences": {"1": {"tokens": ["</script><b>"]}}}
    html = render_page(trace)
    assert html.count("</script>") == 3
    assert "<\\/script><b>" in html


def test_a_windowed_recorder_keeps_only_the_newest_steps_and_their_sequences(
    llm: LLM, traced: dict[str, Any]
) -> None:
    recorder = StepRecorder(max_steps=5)
    recorder.attach(llm.llm_engine)
    try:
        llm.generate(PROMPTS, params(), use_tqdm=False)
    finally:
        recorder.detach(llm.llm_engine)
    last = recorder.num_recorded
    assert [s["step"] for s in recorder.steps] == list(range(last - 4, last + 1))
    window = recorder.to_dict()
    mentioned = {
        str(s)
        for step in window["steps"]
        for s in [
            *step["block_tables"],
            *(i["seq_id"] for i in step["scheduled"]),
            *step["finished"],
        ]
    }
    assert set(window["sequences"]) == mentioned  # the others are forgotten: bounded memory
    newer = recorder.snapshot(after_step=last - 2)
    assert [s["step"] for s in newer["steps"]] == [last - 1, last]
    assert recorder.snapshot(after_step=last)["steps"] == []
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        StepRecorder(max_steps=0)


def test_no_recorder_is_attached_unless_asked(llm: LLM) -> None:
    assert not recorders(llm)
    with llm.trace() as trace:
        llm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.generate("hello again", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [s["step"] for s in trace.steps] == [1, 2]  # a prefill, a decode; nothing after
    assert not recorders(llm)
    other = StepRecorder()
    with llm.trace(), pytest.raises(RuntimeError, match="already has a step recorder"):
        other.attach(llm.llm_engine)


def test_minivllm_trace_cli_writes_the_trace_and_the_page(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli-trace"
    argv = ["trace", str(tiny_model), "--prompt", "The sky is", "--prompt", "A cat",
            "--n", "2", "--max-tokens", "5", "--temperature", "0.8", "--seed", "3",
            "--block-size", "4", "--num-gpu-blocks-override", "16",
            "--attention-backend", "reference", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    trace = json.loads((out / "trace.json").read_text())
    assert trace["block_size"] == 4 and trace["num_blocks"] == 16
    assert len(trace["sequences"]) == 4  # two prompts, two samples each
    assert any(step["forked"] for step in trace["steps"])
    assert (out / "index.html").read_text().startswith("<!doctype html>")


def test_with_lora_each_row_names_its_adapter_and_slot_and_the_slots_follow_the_lru(
    tiny_model: Path, traced: dict[str, Any], tmp_path: Path
) -> None:
    """One slot, two adapters: "a" runs in slot 0 beside the base model, "b" waits for the slot
    and takes it when "a" finishes. The trace's rows and `lora_slots` say so at every step; a
    trace without LoRA has none of these fields."""
    llm = LLM(str(tiny_model), enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE_KWARGS)
    manager = llm.llm_engine.runner.lora_manager
    assert manager is not None
    a, b = (
        LoRARequest(name, i + 1, str(write_random_adapter(manager.targets, 8, tmp_path / name, i)))
        for i, name in enumerate("ab")
    )
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with llm.trace() as trace:
        llm.generate(PROMPTS, greedy, use_tqdm=False, lora_request=[a, None, b, a])
    recorded = trace.to_dict()
    assert recorded["max_loras"] == 1
    names_by_step = []
    for step in recorded["steps"]:
        rows = step["scheduled"]
        assert all((r["lora_slot"] == -1) == (r["lora_name"] is None) for r in rows)
        used = {r["lora_name"]: r["lora_slot"] for r in rows if r["lora_name"] is not None}
        assert len(used) <= 1 and all(slot == 0 for slot in used.values())
        assert set(used) <= set(step["lora_slots"].values())
        names_by_step.append(step["lora_slots"].get("0"))
    assert names_by_step[0] == "a" and names_by_step[-1] == "b"
    assert names_by_step.index("b") > max(i for i, n in enumerate(names_by_step) if n == "a")
    assert 'id="lora-head"' in render_page(recorded)
    plain = traced["trace"]
    assert "max_loras" not in plain and all("lora_slots" not in s for s in plain["steps"])
    assert all("lora_slot" not in r for s in plain["steps"] for r in s["scheduled"])

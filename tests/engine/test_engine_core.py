"""The engine core's contracts beyond token-exactness: the step as a plain message, counters that
count first admissions only, room for forks under max_num_seqs, and no global side effects."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm.core.scheduler import ScheduledSequence, SchedulerOutput
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from tests.utils.engine_utils import assert_no_blocks_held, save_tiny_llama

PROMPTS = [f"request number {i} asks about " + "paged attention " * (3 + i) for i in range(6)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-core"))


def _plain(value: Any) -> bool:
    if isinstance(value, bool | int | float | str) or value is None:
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, ScheduledSequence):
        return all(_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def test_scheduler_output_is_plain_data_that_survives_pickling(tiny_model: Path) -> None:
    llm = LLM(
        str(tiny_model), num_gpu_blocks_override=64, max_num_batched_tokens=32, max_num_seqs=8
    )
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[1], SamplingParams(n=2, temperature=1.0, max_tokens=4))
    engine.add_request("b", PROMPTS[5], SamplingParams(temperature=0, max_tokens=4))
    seen: list[SchedulerOutput] = []
    real_schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        out = real_schedule()
        seen.append(out)
        return out

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    while engine.has_unfinished_requests():
        engine.step()
    assert any(out.block_copies for out in seen), "n = 2 should have copied a block"
    for out in seen:
        assert all(_plain(getattr(out, f.name)) for f in dataclasses.fields(out)), out
        assert pickle.loads(pickle.dumps(out)) == out
    # A snapshot, not a view: the tables the runner got are not the block manager's live lists.
    tables = [s.block_table for out in seen for s in out.scheduled]
    assert all(t is not engine.kv_cache_manager._seqs.get(s) for t in tables for s in (1, 2, 3))
    assert_no_blocks_held(llm)


def test_num_cached_tokens_and_lookups_count_the_first_admission_only(tiny_model: Path) -> None:
    # 9 blocks of 16 slots for 6 growing requests: sequences are preempted and readmitted.
    llm = LLM(str(tiny_model), num_gpu_blocks_override=9, max_num_batched_tokens=64, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert all(o.num_cached_tokens == 0 for o in outs)  # nothing was cached at first admission
    assert stats.num_prefix_cache_queries == sum(len(o.prompt_token_ids) for o in outs)
    assert_no_blocks_held(llm)


def test_parallel_samples_are_admitted_with_room_for_their_forks(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_gpu_blocks_override=128, max_num_seqs=4)
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(str(i), PROMPTS[i], SamplingParams(n=3, temperature=1.0, max_tokens=6))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3  # one request's three samples at a time: a second would make six
    assert_no_blocks_held(llm)


def test_n_larger_than_max_num_seqs_is_refused(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_gpu_blocks_override=32, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"n must be at most max_num_seqs \(2\), got 3"):
        llm.llm_engine.add_request("x", PROMPTS[0], SamplingParams(n=3))
    assert_no_blocks_held(llm)


def test_the_engine_leaves_torchs_global_rng_alone(tiny_model: Path) -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    llm = LLM(str(tiny_model), num_gpu_blocks_override=32, seed=7)
    first = llm.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_tokens=8), use_tqdm=False)
    assert torch.equal(torch.get_rng_state(), state)
    # ... and its own generator makes a run reproducible: a second engine, same seed, same tokens.
    again = LLM(str(tiny_model), num_gpu_blocks_override=32, seed=7).generate(
        PROMPTS[:2], SamplingParams(temperature=1.0, max_tokens=8), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


def test_reset_prefix_cache_forgets_cached_prompts(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_gpu_blocks_override=32)
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(PROMPTS[5], params, use_tqdm=False)
    assert llm.generate(PROMPTS[5], params, use_tqdm=False)[0].num_cached_tokens == 16
    assert llm.reset_prefix_cache() is True
    assert llm.generate(PROMPTS[5], params, use_tqdm=False)[0].num_cached_tokens == 0


def test_generation_config_eos_ids_stop_and_its_defaults_apply(tmp_path: Path) -> None:
    import json

    model = save_tiny_llama(tmp_path / "m")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = LLM(str(model), num_gpu_blocks_override=32).generate(PROMPTS[2], greedy, use_tqdm=False)
    end_of_turn = first[0].outputs[0].token_ids[2]  # a token the model says third: call it an EOS
    (model / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [0, end_of_turn], "temperature": 0.0, "max_new_tokens": 10})
    )
    llm = LLM(str(model), num_gpu_blocks_override=32)
    assert llm.llm_engine.get_diff_sampling_param() == {"temperature": 0.0, "max_tokens": 10}
    assert llm.get_default_sampling_params().temperature == 0.0
    out = llm.generate(PROMPTS[2], use_tqdm=False)[0].outputs[0]  # the defaults: greedy
    assert out.token_ids == first[0].outputs[0].token_ids[:3]
    assert (out.finish_reason, out.stop_reason) == ("stop", end_of_turn)
    # ignore_eos ignores every EOS, the generation config's too.
    assert llm.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids == (
        first[0].outputs[0].token_ids
    )

"""Smoke tests of `minivllm bench throughput | memory | prefix`: each main() on a tiny workload and a
tiny random Llama, checking what the reports must satisfy. Never timing: the CPUs are shared."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from engine_utils import save_tiny_llama

from minivllm.benchmarks import memory, op_profile, prefix, sharing, threads, throughput
from minivllm.benchmarks.common import BenchRequest, length_range, random_requests


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer: loads in well under a second."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def parse(module: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return parser.parse_args(argv)


def test_length_range_accepts_fixed_and_ranges() -> None:
    assert length_range("16-256") == (16, 256)
    assert length_range("32") == (32, 32)
    with pytest.raises(argparse.ArgumentTypeError):
        length_range("256-16")


def test_random_requests_are_reproducible_and_in_range() -> None:
    a = random_requests(8, (4, 9), (2, 5), 100, seed=3, special_ids=[0, 1, 2])
    assert a == random_requests(8, (4, 9), (2, 5), 100, seed=3, special_ids=[0, 1, 2])
    assert all(4 <= len(r.prompt_token_ids) <= 9 and 2 <= r.output_len <= 5 for r in a)
    assert not {t for r in a for t in r.prompt_token_ids} & {0, 1, 2}


def test_throughput_reports_every_system_and_the_flops_fraction(
    tiny_llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "throughput.json"
    argv = ["--model", str(tiny_llama), "--num-prompts", "4", "--input-len", "8-24"]
    argv += ["--output-len", "3-6", "--peers", "hf-static", "--hf-batch-sizes", "3"]
    argv += ["--decode-roofline", "--matmul-size", "256", "--num-gpu-blocks-override", "64"]
    argv += ["--json", str(out)]
    assert throughput.main(parse(throughput, argv)) == 0
    report = json.loads(out.read_text())
    systems = {s["system"]: s for s in report["systems"]}
    assert set(systems) == {"minivllm", "hf-static (batch 3)"}
    wanted = report["workload"]["output_tokens"]
    assert all(s["output_tokens"] == wanted for s in systems.values())
    # Static batching pads every batch to its longest output: it generates at least the useful tokens.
    assert systems["hf-static (batch 3)"]["generated_tokens_incl_padding"] >= wanted
    flops = report["flops"]
    assert flops["useful_model_flops"] > 0 and flops["matmul_peak_flops_per_s"] > 0
    assert flops["fraction_of_matmul_peak"] == pytest.approx(
        flops["minivllm_flops_per_s"] / flops["matmul_peak_flops_per_s"]
    )
    assert report["decode_roofline"]["decode_steps"] > 0


def test_throughput_reports_the_matmul_floor_of_the_shapes_the_run_computed_and_each_peak_rss(
    tiny_llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "throughput.json"
    argv = ["--model", str(tiny_llama), "--num-prompts", "5", "--input-len", "8-40"]
    argv += ["--output-len", "3-9", "--peers", "hf-static,hf-cb", "--hf-batch-sizes", "2"]
    argv += ["--matmul-size", "256", "--num-gpu-blocks-override", "64", "--json", str(out)]
    assert throughput.main(parse(throughput, argv)) == 0
    report = json.loads(out.read_text())
    work, floor = report["workload"], report["matmul_floor"]
    mini = report["systems"][0]
    # Every prompt token and every output token but each request's last passed the layers once
    # (64 blocks hold the whole workload: no preemption, no recomputation); each output token
    # was one row through the LM head.
    assert floor["tokens"] == work["prompt_tokens"] + work["output_tokens"] - work["num_prompts"]
    assert floor["sampled_rows"] == work["output_tokens"]
    assert floor["steps"] == mini["steps"]
    assert floor["weight_shapes"]["layers"] == 2
    assert 0 < floor["lm_head_seconds"] < floor["seconds"] < mini["seconds"]
    assert floor["minivllm_over_floor"] == pytest.approx(mini["seconds"] / floor["seconds"])
    assert [s["system"] for s in report["systems"]] == ["minivllm", "hf-static (batch 2)", "hf-cb"]
    for system in report["systems"]:
        assert system["peak_rss_bytes"] >= system["start_rss_bytes"] > 0
        # The ceiling: how much faster than this system minivllm would be at its floor.
        assert system["speedup_at_floor"] == pytest.approx(system["seconds"] / floor["seconds"])


def test_throughput_profile_puts_every_op_in_a_group_and_finds_the_matmuls(
    tiny_llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "throughput.json"
    argv = ["--model", str(tiny_llama), "--num-prompts", "3", "--input-len", "8-24"]
    argv += ["--output-len", "3-6", "--peers", "none", "--matmul-size", "128", "--profile"]
    argv += ["--num-gpu-blocks-override", "64", "--json", str(out)]
    assert throughput.main(parse(throughput, argv)) == 0
    profile = json.loads(out.read_text())["profile"]
    groups = {g["group"]: g for g in profile["groups"]}
    assert set(groups) <= set(op_profile.GROUP_ORDER)
    assert sum(g["share"] for g in groups.values()) == pytest.approx(1.0)
    assert sum(g["seconds"] for g in groups.values()) == pytest.approx(profile["self_seconds"])
    # The default CPU backend: its decode kernel and the fused layer ops ran, and so did matmuls.
    assert {"matmul", "attention", "fused layer ops"} <= set(groups)
    ops = {o["op"] for o in profile["ops"]}
    assert "minivllm_cpu::paged_decode" in ops or "minivllm_cpu::fused_add_rms_norm" in ops
    assert [o["seconds"] for o in profile["ops"]] == sorted(
        (o["seconds"] for o in profile["ops"]), reverse=True
    )


def test_op_groups_follow_the_model() -> None:
    assert op_profile.group_of("aten::mm") == "matmul"
    assert op_profile.group_of("mkldnn::_linear_pointwise") == "matmul"
    assert op_profile.group_of("minivllm_cpu::paged_decode") == "attention"
    assert op_profile.group_of("minivllm_cpu::silu_and_mul") == "fused layer ops"
    assert op_profile.group_of("aten::copy_") == "copies"
    assert op_profile.group_of("aten::as_strided") == "bookkeeping"
    assert op_profile.group_of("aten::silu") == "elementwise"


def test_naive_allocator_never_exceeds_its_budget_and_wastes_the_over_reservation() -> None:
    requests = [BenchRequest([0] * 10, 5), BenchRequest([0] * 30, 3), BenchRequest([0] * 5, 1)]
    steps = memory.simulate_naive(requests, 128, 64, 8, 32)
    assert all(s.used <= 128 and s.running <= 2 for s in steps)
    assert all(s.token_states + s.reserved + s.fragmented == s.used for s in steps)
    # Every token computed is one step's token state: prompt + output - 1 per request, in total.
    assert steps[0].fragmented == (64 - 14) + (64 - 32)


def test_memory_shares_sum_to_one_and_paging_beats_reservation(
    tiny_llama: Path, tmp_path: Path
) -> None:
    out, png = tmp_path / "memory.json", tmp_path / "kv.png"
    argv = ["--model", str(tiny_llama), "--num-prompts", "8", "--input-len", "8-40"]
    argv += ["--output-len", "4-12", "--num-gpu-blocks-override", "24", "--max-model-len", "96"]
    argv += ["--plot", str(png), "--json", str(out)]
    assert memory.main(parse(memory, argv)) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    for name in ("minivllm", "naive"):
        for when in ("at_peak", "over_run"):
            assert sum(results[name][when].values()) == pytest.approx(1.0)
    assert results["minivllm"]["at_peak"]["reserved"] == 0.0
    assert (
        results["naive"]["over_run"]["token_states"]
        < results["minivllm"]["over_run"]["token_states"]
    )
    assert results["naive"]["peak_concurrent_requests"] <= 24 * 16 // 96
    assert (
        results["minivllm"]["peak_concurrent_requests"]
        > results["naive"]["peak_concurrent_requests"]
    )
    for step in report["per_step"]["minivllm"]:
        assert step["used"] <= report["budget_slots"]
    assert png.stat().st_size > 0


def test_prefix_sharing_lowers_prompt_tokens_and_peak_blocks(
    tiny_llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "prefix.json"
    argv = ["--model", str(tiny_llama), "--num-prompts", "4", "--system-prompt-len", "128"]
    argv += ["--suffix-len", "4-12", "--output-len", "3", "--n-prompts", "2"]
    argv += ["--n-prompt-len", "64", "--n-output-len", "4", "--num-gpu-blocks-override", "64"]
    argv += ["--json", str(out)]
    assert prefix.main(parse(prefix, argv)) == 0
    no_cache, cache, independent, shared = json.loads(out.read_text())["runs"]
    # The first request computes the 128 shared tokens; the other three hit all 8 of its blocks.
    assert cache["prompt_tokens_computed"] == no_cache["prompt_tokens_computed"] - 3 * 128
    assert cache["prefix_cache_hit_tokens"] == 3 * 128
    assert cache["peak_kv_blocks_used"] < no_cache["peak_kv_blocks_used"]
    # n=4: each prompt is computed once instead of four times.
    assert shared["prompt_tokens_computed"] * 4 == independent["prompt_tokens_computed"]
    assert shared["peak_kv_blocks_used"] < independent["peak_kv_blocks_used"]
    assert shared["output_tokens"] == independent["output_tokens"]


def test_sharing_saves_memory_in_beam_search_and_parallel_sampling(
    tiny_llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sharing.json"
    argv = ["--model", str(tiny_llama), "--workloads", "sharegpt", "--widths", "2,4"]
    argv += ["--num-prompts", "2", "--max-len", "40", "--json", str(out)]
    argv += ["--plot", str(tmp_path / "sharing.png")]
    assert sharing.main(parse(sharing, argv)) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["method"], r["width"]) for r in results] == [
        ("parallel", 2),
        ("parallel", 4),
        ("beam", 2),
        ("beam", 4),
    ]
    for r in results:
        assert 0 < r["mean_blocks_shared"] < r["mean_blocks_private"]
        assert 0 < r["saving"] < 1 and r["peak_blocks_shared"] <= r["peak_blocks_private"]
    by = {(r["method"], r["width"]): r["saving"] for r in results}
    assert by[("beam", 4)] > by[("beam", 2)]  # more beams, more of the history shared
    assert (tmp_path / "sharing.png").stat().st_size > 0


def test_threads_bench_times_every_setting_idle_and_beside_a_busy_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two of the settings: each is a fresh process that imports torch, twice (idle and busy).
    two = dict(list(threads.SETTINGS.items())[:2])
    monkeypatch.setattr(threads, "SETTINGS", two)
    out = tmp_path / "threads.json"
    assert threads.main(["--rows", "4", "--repeats", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "threads" and "load" in report["machine"]
    for machine in ("idle", "one core busy"):
        for setting in threads.SETTINGS:
            median = report[f"{machine}, {setting}: median ms"]
            mean = report[f"{machine}, {setting}: mean ms"]
            assert median > 0 and mean > 0

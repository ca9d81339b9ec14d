"""Smoke tests of `minivllm bench throughput | memory | prefix | sharing`: each main() on a tiny
workload and a tiny random Llama, checking what the reports must satisfy; and the workload generator
and the table they share. Never timing: the CPUs are shared."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from minivllm.benchmarks import memory, prefix, serve, sharing, throughput
from minivllm.benchmarks.report import print_table
from minivllm.benchmarks.workload import (
    BenchRequest,
    Exponential,
    Fixed,
    Uniform,
    draw_requests,
    length_range,
    poisson_arrivals,
    random_requests,
    token_pool,
)
from minivllm.llm import LLM
from tests.utils.engine_utils import parse_bench_args as parse
from tests.utils.engine_utils import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer: loads in well under a second."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


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


def test_length_profiles_stay_in_range_and_a_fixed_length_draws_nothing() -> None:
    rng = random.Random(0)
    assert {Uniform(3, 5).draw(rng) for _ in range(200)} == {3, 4, 5}
    assert all(1 <= Exponential(20.0, 50).draw(rng) <= 50 for _ in range(200))
    state = rng.getstate()
    assert Fixed(7).draw(rng) == 7 and rng.getstate() == state


def test_drawn_requests_share_the_prefix_and_keep_clear_of_special_and_low_ids() -> None:
    pool = token_pool(50, special_ids=[20, 21], first_id=10)
    assert min(pool) == 10 and not {20, 21} & set(pool) and max(pool) == 49
    system = [1, 2, 3]
    reqs = draw_requests(random.Random(1), 6, Uniform(2, 4), Fixed(9), pool, prefix=system)
    for r in reqs:
        assert r.prompt_token_ids[:3] == system and 5 <= len(r.prompt_token_ids) <= 7
        assert set(r.prompt_token_ids[3:]) <= set(pool) and r.output_len == 9


def test_a_pool_of_consecutive_ids_draws_what_randrange_draws() -> None:
    # The benches' workloads from before the generator was shared (randrange(100, vocab) per
    # token) are drawn again, id for id: seeds published with results still give their workload.
    old = random.Random(5)
    assert serve.random_prompts(3, 8, 1000, seed=5) == [
        [old.randrange(100, 1000) for _ in range(8)] for _ in range(3)
    ]
    rng, old = random.Random(6), random.Random(6)
    pool = token_pool(1000, first_id=100)
    assert [rng.choice(pool) for _ in range(50)] == [old.randrange(100, 1000) for _ in range(50)]


def test_poisson_arrivals_have_the_rate_s_mean_gap_and_inf_sends_at_once() -> None:
    assert poisson_arrivals(4, float("inf"), seed=0) == [0.0] * 4
    gaps = poisson_arrivals(4000, 8.0, seed=0)
    assert gaps == poisson_arrivals(4000, 8.0, seed=0)
    assert abs(sum(gaps) / len(gaps) - 1 / 8) < 0.01 and min(gaps) > 0


def test_the_table_puts_names_left_numbers_right_with_thousands_separators(
    capsys: pytest.CaptureFixture[str],
) -> None:
    print_table(["system", "tokens", "seconds"], [["minivllm", 12345, 1.5], ["hf", 7, 123.25]])
    head, rule, *rows = capsys.readouterr().out.splitlines()
    assert head.split() == ["system", "tokens", "seconds"] and set(rule) == {"-"}
    assert rows == ["minivllm  12,345    1.500", "hf             7    123.2"]


def test_throughput_reports_minivllm_alone_and_the_flops_fraction(
    tiny_llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "throughput.json"
    argv = ["--model", str(tiny_llama), "--num-prompts", "4", "--input-len", "8-24"]
    argv += ["--output-len", "3-6", "--matmul-size", "256", "--num-gpu-blocks-override", "64"]
    argv += ["--json", str(out)]
    assert throughput.main(parse(throughput, argv)) == 0
    report = json.loads(out.read_text())
    (mini,) = report["systems"]
    assert mini["system"] == "minivllm" and "token_ids" not in mini
    assert mini["output_tokens"] == report["workload"]["output_tokens"]
    assert mini["peak_rss_bytes"] >= mini["start_rss_bytes"] > 0
    flops = report["flops"]
    assert flops["useful_model_flops"] > 0 and flops["matmul_peak_flops_per_s"] > 0
    assert flops["fraction_of_matmul_peak"] == pytest.approx(
        flops["minivllm_flops_per_s"] / flops["matmul_peak_flops_per_s"]
    )


def test_throughput_with_lora_runs_each_request_under_one_of_max_loras_random_adapters(
    tiny_llama: Path,
) -> None:
    """`--lora-path random:8`: minivllm's process (in this one: `main` only adds the spawn)
    writes a rank-8 adapter of every linear, and the run loads it under max_loras ids."""
    argv = ["--model", str(tiny_llama), "--num-prompts", "6", "--input-len", "8-16"]
    argv += ["--output-len", "3", "--matmul-size", "64", "--num-gpu-blocks-override", "64"]
    argv += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    args = parse(throughput, [*argv, "--lora-path", "random:8"])
    seen: dict[str, object] = {}

    def measure(llm: LLM, *_: object) -> dict[str, object]:
        manager = llm.llm_engine.runner.lora_manager
        assert manager is not None
        seen["ids"] = sorted(manager.cpu_loras)
        seen["layers"] = {len(lora.layers) for lora in manager.cpu_loras.values()}
        return {}

    mini = throughput.minivllm_process(args, measure)
    assert mini["row"]["output_tokens"] == 6 * 3
    assert "LoRA random:8 as 2 of max_loras=2 adapters" in mini["header"]
    assert seen == {"ids": [1, 2], "layers": {2 * 7}}  # 2 layers x q, k, v, o, gate, up, down
    for bad, error in [
        ([], "--enable-lora needs --lora-path"),
        (["--lora-path", "random:x"], "R in random:R must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=error):
            throughput.main(parse(throughput, [*argv, *bad]))
    with pytest.raises(ValueError, match="--lora-path needs --enable-lora"):
        throughput.main(parse(throughput, ["--lora-path", "random:8"]))


def test_naive_allocator_never_exceeds_its_budget_and_wastes_the_over_reservation() -> None:
    requests = [BenchRequest([0] * 10, 5), BenchRequest([0] * 30, 3), BenchRequest([0] * 5, 1)]
    steps = memory.simulate_naive(requests, 128, 64, 8, 32)
    assert all(s.used <= 128 and s.running <= 2 for s in steps)
    assert all(s.token_states + s.reserved + s.fragmented == s.used for s in steps)
    # Every token computed is one step's token state: prompt + output - 1 per request, in total.
    assert steps[0].fragmented == (64 - 14) + (64 - 32)


def test_memory_plot_empty_means_no_picture() -> None:
    """`--plot ''` draws nothing (it named "." and wrote "./.png" once); unset, the default file."""
    assert parse(memory, ["--plot", ""]).plot is None
    assert parse(memory, []).plot == Path("kv_memory.png")


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


def test_a_streamed_token_of_empty_text_counts_as_the_first_token() -> None:
    """llama-server prints unused and special tokens as "": the first chunk is still the first
    token (TTFT), a later one an inter-token gap; a closing chunk with only a finish reason is not."""
    import asyncio
    import json as json_

    import httpx

    chunks = [
        {"choices": [{"text": "", "index": 0, "finish_reason": None}]},
        {"choices": [{"text": "", "index": 0, "finish_reason": None}]},
        {"choices": [{"text": "a", "index": 0, "finish_reason": None}]},
        {"choices": [{"text": "", "index": 0, "finish_reason": "length"}]},
        {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 2}},
    ]
    body = "".join(f"data: {json_.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda _: httpx.Response(200, text=body))

    async def send() -> serve.RequestResult:
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await serve.send_one(client, "m", [1, 2], 3)

    res = asyncio.run(send())
    assert res.ok and res.output_tokens == 3
    assert res.ttft > 0 and len(res.itl) == 2


def test_a_request_on_a_connection_the_server_closed_goes_once_more() -> None:
    """A kept-alive connection the server closed fails before any answer: the request never
    arrived, so bench serve sends it again; a second such failure is the request's error."""
    import asyncio

    import httpx

    body = 'data: {"choices": [{"text": "a", "index": 0}]}\n\ndata: [DONE]\n\n'
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) % 2:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, text=body)

    async def send() -> serve.RequestResult:
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await serve.send_one(client, "m", [1, 2], 1)

    res = asyncio.run(send())
    assert res.ok and len(calls) == 2 and res.status == 200


def test_a_request_the_server_never_answers_twice_is_an_error() -> None:
    import asyncio

    import httpx

    def answer(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    async def send() -> serve.RequestResult:
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await serve.send_one(client, "m", [1, 2], 1)

    res = asyncio.run(send())
    assert not res.ok and res.error.startswith("RemoteProtocolError")

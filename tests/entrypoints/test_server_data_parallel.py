"""`minivllm serve -dp 2`: two engine-core processes behind one API server (vLLM's data
parallelism, minivllm/engine/dp_client.py). One server for the module, on a tiny random Llama:
its greedy outputs equal the offline engine's, a burst spreads over both cores, prompts that share
a first KV block land on their home core, requests under a LoRA adapter (`--lora-modules`, loaded
on every core) give the offline engine's tokens for it on either core, and a killed core fails the
server by name (a 500 in OpenAI's shape, /health 503) and leaves no process once it stops. The
balancing rule, the offline refusal and the LoRA gauge over the cores are tested without a
server; the flags' ranges with every engine argument's (tests/engine/test_engine_args.py); ranks
that are themselves parallel, and ranks on another host, in tests/engine/test_dp_remote.py."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.benchmarks.lora_workload import write_random_adapter
from minivllm.engine.dp_client import PREFIX_AFFINITY_SLACK, choose_engine, prefix_home
from minivllm.engine.stats import EngineStats
from minivllm.entrypoints.metrics import ServerMetrics
from minivllm.lora.request import LoRARequest
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import RemoteServer, run_server, wait_gone

BLOCK_SIZE = 4
ENGINE_ARGS = {"max_model_len": 128, "block_size": BLOCK_SIZE, "num_gpu_blocks_override": 128}
LORA_ARGS = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
ADAPTER = "sql"  # the model name the server serves the adapter under


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-dp"))


@pytest.fixture(scope="module")
def adapter(tiny: Path) -> Path:
    """A random rank-8 PEFT adapter of every linear of the tiny model (save_tiny_llama's shapes:
    hidden 64, 4 heads and 2 KV heads of 16, MLP 128, 2 layers), written without peft, whose
    import would cost the module more than its test; alpha 64 (scale 8): a visible change."""
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32),
              "self_attn.v_proj": (64, 32), "self_attn.o_proj": (64, 64),
              "mlp.gate_proj": (64, 128), "mlp.up_proj": (64, 128), "mlp.down_proj": (128, 64)}  # fmt: skip
    targets = {f"model.layers.{i}.{m}": s for i in range(2) for m, s in shapes.items()}
    return write_random_adapter(targets, 8, tiny.parent / ADAPTER, seed=1, lora_alpha=64)


@pytest.fixture(scope="module")
def server(tiny: Path, adapter: Path) -> Iterator[RemoteServer]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    lora = ["--enable-lora", "--max-loras=1", "--max-lora-rank=8"]
    lora += ["--lora-modules", f"{ADAPTER}={adapter}"]
    with run_server([str(tiny), "-dp", "2", "--max-num-seqs", "64", *flags, *lora]) as s:
        yield s


def core_pids(server: RemoteServer) -> list[int]:
    match = re.search(r"data parallel: 2 engine cores \(pids (\d+), (\d+)\)", server.log())
    assert match, server.log()
    return [int(match[1]), int(match[2])]


def finished_per_engine(server: RemoteServer) -> list[float]:
    return [server.metric("vllm:request_success_total", engine=str(i)) for i in (0, 1)]


def complete(server: RemoteServer, prompt: Any, max_tokens: int) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(server.base_url + "/completions", json=body, timeout=60)


def complete_all(server: RemoteServer, prompts: list[Any], max_tokens: int) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: complete(server, p, max_tokens), prompts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["choices"][0]["text"] for r in responses]


# ---------------------------------------------------------------------- with the server
def test_outputs_equal_the_single_engine_greedy(server: RemoteServer, tiny: Path) -> None:
    prompts = ["Hello, my name is", "The capital of France is", "1 2 3 4 5", "Once upon"]
    served = complete_all(server, prompts, max_tokens=8)
    llm = LLM(str(tiny), **ENGINE_ARGS)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    assert served == offline
    assert server.metric("vllm:num_requests_running", engine="1") == 0  # per-core series


def test_a_burst_of_short_requests_spreads_over_both_cores(server: RemoteServer) -> None:
    before = finished_per_engine(server)
    # Two-token prompts fill no KV block: no prefix home, so only the load decides.
    complete_all(server, [[100 + i, 7] for i in range(64)], max_tokens=2)
    counts = [a - b for a, b in zip(finished_per_engine(server), before)]
    print(f"64 requests over the cores: {counts}")
    assert sum(counts) == 64 and min(counts) >= 16, counts


def test_prompts_sharing_a_first_block_land_on_its_home_core(server: RemoteServer) -> None:
    # One prefix (a whole first block) homed on each core.
    prefixes: dict[int, list[int]] = {}
    base = 200
    while len(prefixes) < 2:
        prefix = list(range(base, base + BLOCK_SIZE))
        prefixes.setdefault(prefix_home(prefix, BLOCK_SIZE, 2), prefix)  # type: ignore[arg-type]
        base += BLOCK_SIZE
    for home, prefix in sorted(prefixes.items()):
        before = finished_per_engine(server)
        hits = server.metric("vllm:prefix_cache_hits_total", engine=str(home))
        complete_all(server, [[*prefix, 300 + i, 5] for i in range(4)], max_tokens=2)
        counts = [a - b for a, b in zip(finished_per_engine(server), before)]
        assert counts[home] == 4 and counts[1 - home] == 0, (home, counts)
        assert server.metric("vllm:prefix_cache_hits_total", engine=str(home)) > hits


def test_requests_under_an_adapter_on_both_cores_give_the_offline_engine_s_tokens(
    server: RemoteServer, tiny: Path, adapter: Path
) -> None:
    """The client forwards each request's adapter to the core it picks, and every core loaded
    the adapter at start: two prompts homed on each core, each the offline engine's tokens."""
    homes: dict[int, list[list[int]]] = {0: [], 1: []}
    base = 700
    while min(len(p) for p in homes.values()) < 2:
        prompt = [*range(base, base + BLOCK_SIZE), 11, 12]
        homes[prefix_home(prompt, BLOCK_SIZE, 2)].append(prompt)  # type: ignore[index]
        base += BLOCK_SIZE
    prompts = homes[0][:2] + homes[1][:2]
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    before = finished_per_engine(server)

    def served(prompt: list[int]) -> list[int]:
        out = client.completions.create(
            model=ADAPTER, prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert out.model == ADAPTER
        return list(out.choices[0].model_extra["token_ids"])  # type: ignore[index]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(served, prompts))
    counts = [a - b for a, b in zip(finished_per_engine(server), before)]
    assert counts == [2, 2], counts  # each core ran two of them
    llm = LLM(str(tiny), **ENGINE_ARGS, **LORA_ARGS)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    lora = LoRARequest(ADAPTER, 1, str(adapter))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=lora)  # fmt: skip
    base_outs = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    llm.shutdown()
    assert got == [list(o.outputs[0].token_ids) for o in outs]
    assert got[0] != list(base_outs[0].outputs[0].token_ids)  # the adapter changed the answer
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert f'running_lora_adapters="{ADAPTER}"' in metrics  # some core's step ran it
    assert 'vllm:lora_requests_info{max_lora="1",' in metrics


def test_a_dead_core_fails_requests_by_name_and_stopping_leaves_no_process(
    server: RemoteServer,
) -> None:
    pids = core_pids(server)
    # A long request homed on core 1, killed under it: it fails by name, it does not hang.
    prefix = next(
        p
        for b in range(400, 600, BLOCK_SIZE)
        if prefix_home(p := list(range(b, b + BLOCK_SIZE)), BLOCK_SIZE, 2) == 1
    )
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(complete, server, [*prefix, 9], 120)
        deadline = time.monotonic() + 30
        while server.metric("vllm:num_requests_running", engine="1") < 1:
            assert time.monotonic() < deadline and not in_flight.done(), "it never ran on core 1"
            time.sleep(0.02)
        os.kill(pids[1], signal.SIGKILL)
        response = in_flight.result(timeout=30)
    assert response.status_code == 500, response.text
    assert f"engine core 1 (pid {pids[1]})" in response.json()["error"]["message"]
    assert wait_gone(pids[1])
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health did not turn 503"
        time.sleep(0.05)
    response = complete(server, "Hello", max_tokens=2)
    assert response.status_code == 500
    error = response.json()["error"]
    assert f"engine core 1 (pid {pids[1]})" in error["message"], error
    assert {"message", "type", "code"} <= set(error)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) in (0, -signal.SIGTERM), server.log()
    print(f"stopped in {time.monotonic() - started:.1f} s")
    assert wait_gone(pids[0])


# ---------------------------------------------------------------------- without a server
def test_choose_engine_least_loaded_ties_to_lower_index_and_home_within_slack() -> None:
    assert choose_engine([0, 0], None) == 0
    assert choose_engine([3, 1, 1], None) == 1
    assert choose_engine([0, 0], 1) == 1
    assert choose_engine([PREFIX_AFFINITY_SLACK, 0], 0) == 0  # the home keeps a small burst
    assert choose_engine([PREFIX_AFFINITY_SLACK + 1, 0], 0) == 1  # much more loaded: the least
    assert choose_engine([25, 10], 0) == 1 and choose_engine([24, 10], 0) == 0


def test_the_lora_gauge_names_the_adapters_of_every_core_s_latest_step() -> None:
    """vllm:lora_requests_info has no `engine` label: a step of core 1, which runs no adapter,
    must not hide that core 0 runs one."""
    metrics = ServerMetrics("m", data_parallel_size=2, max_loras=1)
    zero = EngineStats(**{f.name: 0 for f in fields(EngineStats)})
    idle = replace(zero, running_lora_adapters={}, waiting_lora_adapters={})

    def gauge() -> set[tuple[str, str]]:  # (running, waiting) of each sample
        (family,) = [m for m in metrics.registry.collect() if m.name == "vllm:lora_requests_info"]
        labels = [s.labels for s in family.samples]
        return {(x["running_lora_adapters"], x["waiting_lora_adapters"]) for x in labels}

    metrics.on_step(replace(idle, running_lora_adapters={"sql": 2}), [], engine=0)
    metrics.on_step(replace(idle, waiting_lora_adapters={"chat": 1}), [], engine=1)
    assert gauge() == {("sql", ""), ("sql", "chat")}
    metrics.on_step(idle, [], engine=0)  # core 0's requests finished; core 1's still waits
    assert ("", "chat") in gauge() and ("", "") not in gauge()


def test_prefix_home_needs_a_full_block_and_reads_only_the_first() -> None:
    assert prefix_home([1, 2, 3], 4, 2) is None
    assert prefix_home([1, 2, 3, 4, 9], 4, 8) == prefix_home([1, 2, 3, 4, 7, 7], 4, 8)


def test_offline_llm_refuses_data_parallel_pointing_to_serve(tiny: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("minivllm serve MODEL -dp N")):
        LLM(str(tiny), data_parallel_size=2)

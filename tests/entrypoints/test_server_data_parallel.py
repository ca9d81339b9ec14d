"""`minivllm serve -dp 2`: two engine-core processes behind one API server (vLLM's data
parallelism, minivllm/engine/dp_client.py). One server for the module, on a tiny random Llama:
its greedy outputs equal the offline engine's, a burst spreads over both cores, prompts that share
a first KV block land on their home core, and a killed core fails the server by name (a 500 in
OpenAI's shape, /health 503) and leaves no process once it stops. The balancing rule and the
refused combinations are tested without a server; the flags' ranges with every engine argument's
(tests/engine/test_engine_args.py)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.dp_client import PREFIX_AFFINITY_SLACK, choose_engine, prefix_home
from minivllm.entrypoints.cli import main
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import RemoteServer, run_server, wait_gone

BLOCK_SIZE = 4
ENGINE_ARGS = {"max_model_len": 128, "block_size": BLOCK_SIZE, "num_gpu_blocks_override": 128}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-dp"))


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[RemoteServer]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    with run_server([str(tiny), "-dp", "2", "--max-num-seqs", "64", *flags]) as s:
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


def test_prefix_home_needs_a_full_block_and_reads_only_the_first() -> None:
    assert prefix_home([1, 2, 3], 4, 2) is None
    assert prefix_home([1, 2, 3, 4, 9], 4, 8) == prefix_home([1, 2, 3, 4, 7, 7], 4, 8)


def test_offline_llm_refuses_data_parallel_pointing_to_serve(tiny: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("minivllm serve MODEL -dp N")):
        LLM(str(tiny), data_parallel_size=2)


def test_serve_refuses_data_parallel_with_tensor_parallel(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tiny), "-dp", "2", "-tp", "2"])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--tensor-parallel-size > 1" in line and "--data-parallel-size=2" in line, line

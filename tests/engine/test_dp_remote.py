"""Data parallelism across hosts, each rank itself parallel (minivllm/engine/dp_remote.py), on one
machine over loopback: a "host 0" `minivllm serve -dp 2 -dpl 1 -tp 2` runs rank 0 (an engine core
with its own tensor-parallel worker) and the API server; a "host 1" `minivllm serve --headless
-dp 2 -dpl 1 -dpr 1 -pp 2` runs rank 1, whose core dials host 0's coordinator over TCP and spawns
its own worker (its own process group, on its own port) for a second pipeline stage -- each host
builds its engine from its own flags, and the cores need not cut the model alike. One pair for
the module: greedy outputs on both cores equal the single-process engine's, and killing the
headless host's core fails its rank by name and leaves no process of that host. The coordinator's refusals
(a wrong key, a wrong DP size, a rank it runs or already has) and the GPU split are tested
without a model."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Client
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import ParallelConfig
from minivllm.engine.dp_client import prefix_home, visible_devices_per_core
from minivllm.engine.dp_remote import CoreHello, _refusal, accept_remote_cores
from minivllm.entrypoints.cli import main
from minivllm.envs import dp_authkey
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import RemoteServer, free_port, run_server

BLOCK_SIZE = 4
ENGINE_ARGS = {"max_model_len": 128, "block_size": BLOCK_SIZE, "num_gpu_blocks_override": 64}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-dp-hosts"))


@pytest.fixture(scope="module")
def hosts(tiny: Path) -> Iterator[tuple[RemoteServer, subprocess.Popen[bytes]]]:
    """Host 1 (headless, rank 1) first: its core dials until host 0 listens."""
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    dp = ["-dp", "2", "-dpl", "1", "-dpa", "127.0.0.1", "-dpp", str(port), *flags]
    log = open(tiny.parent / "headless.log", "wb")  # noqa: SIM115 (closed below)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cli = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", str(tiny)]
    headless = subprocess.Popen([*cli, "--headless", *dp, "-dpr", "1", "-pp", "2"], stdout=log,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        with run_server([str(tiny), *dp, "-tp", "2"]) as server:
            yield server, headless
    finally:
        if headless.poll() is None:
            headless.kill()
        headless.wait()
        log.close()


def complete(server: RemoteServer, prompt: Any, max_tokens: int) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(server.base_url + "/completions", json=body, timeout=60)


def homed_prompts(base: int, per_core: int) -> list[list[int]]:
    """`per_core` token prompts homed on core 0, then as many on core 1 (their first block's)."""
    homes: dict[int, list[list[int]]] = {0: [], 1: []}
    while min(len(p) for p in homes.values()) < per_core:
        prompt = [*range(base, base + BLOCK_SIZE), 7]
        homes[prefix_home(prompt, BLOCK_SIZE, 2)].append(prompt)  # type: ignore[index]
        base += BLOCK_SIZE
    return homes[0][:per_core] + homes[1][:per_core]


def finished_per_engine(server: RemoteServer) -> list[float]:
    return [server.metric("vllm:request_success_total", engine=str(i)) for i in (0, 1)]


def test_both_hosts_cores_serve_the_single_process_engines_greedy_tokens(
    hosts: tuple[RemoteServer, subprocess.Popen[bytes]], tiny: Path
) -> None:
    server, _ = hosts
    prompts = homed_prompts(100, 2)
    before = finished_per_engine(server)
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: complete(server, p, 6), prompts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    served = [r.json()["choices"][0]["text"] for r in responses]
    counts = [a - b for a, b in zip(finished_per_engine(server), before)]
    assert counts == [2, 2], counts  # each host's core ran its two
    llm = LLM(str(tiny), **ENGINE_ARGS)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    assert served == [o.outputs[0].text for o in outs]


def test_killing_the_headless_hosts_core_fails_its_rank_by_name_and_leaves_no_process(
    hosts: tuple[RemoteServer, subprocess.Popen[bytes]],
) -> None:
    server, headless = hosts
    match = re.search(r"engine core 1 \(pid (\d+) on [^)]+\) connected", server.log())
    assert match, server.log()
    core = psutil.Process(int(match[1]))
    host1 = [core, *core.children(recursive=True)]  # its core and the core's PP worker
    assert len(host1) >= 2 and core.ppid() == headless.pid, host1
    (prompt,) = homed_prompts(500, 1)[1:]
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(complete, server, prompt, 120)
        deadline = time.monotonic() + 30
        while server.metric("vllm:num_requests_running", engine="1") < 1:
            assert time.monotonic() < deadline and not in_flight.done(), "it never ran on core 1"
            time.sleep(0.02)
        core.kill()
        response = in_flight.result(timeout=30)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert {"message", "type", "code"} <= set(error) and "engine core 1 (pid" in error["message"]
    assert headless.wait(timeout=30) == 1  # it saw its core die and stopped
    _, alive = psutil.wait_procs(host1, timeout=10)
    assert not alive, alive
    # Core 0, its worker (and multiprocessing's resource tracker).
    host0 = psutil.Process(server.process.pid).children(recursive=True)
    assert len(host0) >= 2, host0
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) in (0, -signal.SIGTERM), server.log()
    _, alive = psutil.wait_procs(host0, timeout=10)
    assert not alive, alive


# ---------------------------------------------------------------------- without a model
def test_the_coordinator_drops_a_wrong_key_and_refuses_a_wrong_size_by_name() -> None:
    """A peer without the key is dropped before anything of its is unpickled (the coordinator
    keeps waiting); a core started with another --data-parallel-size is told why, and the
    server's start fails naming the field."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    parallel = ParallelConfig(1, data_parallel_size=2, data_parallel_size_local=1,
                              data_parallel_rpc_port=port)  # fmt: skip
    config = SimpleNamespace(parallel=parallel)
    answers: list[object] = []

    def dial() -> None:
        with pytest.raises(Exception, match="digest"):  # multiprocessing's AuthenticationError
            Client(("127.0.0.1", port), authkey=b"not the key")
        conn = Client(("127.0.0.1", port), authkey=dp_authkey())
        conn.send(CoreHello(1, 3, "host-b", 4242))
        answers.append(conn.recv())

    thread = threading.Thread(target=dial)
    thread.start()
    with pytest.raises(ValueError) as info:
        accept_remote_cores(config, server)  # type: ignore[arg-type]
    thread.join(10)
    server.close()
    message = str(info.value)
    assert "rank 1 on host-b was started with data_parallel_size=3" in message, message
    assert "--data-parallel-size" in message and answers == [message]


def test_a_hello_for_a_rank_the_server_runs_or_already_has_is_refused_naming_the_flag() -> None:
    taken: dict[int, Any] = {2: SimpleNamespace(name="engine core 2 (pid 7 on host-b)")}
    own = _refusal(CoreHello(1, 4, "host-c", 9), 4, 2, taken)
    assert (
        own is not None and "runs ranks 0..1 itself" in own and "--data-parallel-start-rank" in own
    )
    twice = _refusal(CoreHello(2, 4, "host-c", 9), 4, 2, taken)
    assert twice is not None and "rank 2 is already connected (engine core 2 (pid 7" in twice
    assert _refusal(CoreHello(3, 4, "host-c", 9), 4, 2, taken) is None


def test_each_local_core_takes_its_own_run_of_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,8")
    parallel = ParallelConfig(2, data_parallel_size=2)
    cuda = SimpleNamespace(parallel=parallel, resolved=SimpleNamespace(device=SimpleNamespace(type="cuda")))  # fmt: skip
    assert visible_devices_per_core(cuda, 2) == ["4,5", "6,7"]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"data_parallel_size_local=3 cores .* need 6 CUDA"):
        visible_devices_per_core(cuda, 3)  # type: ignore[arg-type]
    cpu = SimpleNamespace(parallel=parallel, resolved=SimpleNamespace(device=SimpleNamespace(type="cpu")))  # fmt: skip
    assert visible_devices_per_core(cpu, 2) == [None, None]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-dp", "2", "-dpl", "1", "-dpr", "1"], "--data-parallel-start-rank is for a --headless"),
        (["--headless", "-dp", "2", "-dpl", "0"], "--data-parallel-size-local must be at least 1"),
    ],
    ids=["start-rank-on-the-api-server", "headless-without-cores"],
)
def test_serve_refuses_a_misplaced_data_parallel_rank_by_flag(
    tiny: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tiny), *flags])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in line, line

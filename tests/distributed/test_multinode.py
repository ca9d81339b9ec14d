"""Ranks over several nodes with the engine's own launcher: vLLM's `--nnodes`, `--node-rank`,
`--master-addr`, `--master-port` and `serve --headless`, played on loopback by two invocations.

Node 0 is this test's process (the engine, rank 0), node 1 a `minivllm serve --headless` process
(rank 1); they meet at torch.distributed's TCPStore on 127.0.0.1. Two pipeline stages across them
must give one process's greedy tokens; killing node 1 must fail node 0 with an error that names
node 1's rank, answered by node 0's OpenAI server as a 500 in OpenAI's shape, and leave no
process. The same holds for torchrun's launch of `minivllm serve` over two nodes, on the bundled
SmolLM2 (whose two stages also run spawned by the engine). The combinations this launch cannot
serve are refused by name before any process starts. No test here may leave a process behind.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from minivllm import LLM, SamplingParams
from minivllm.distributed.process_group import free_loopback_port
from minivllm.entrypoints import cli
from minivllm.executor.driver import ExecutorWithExternalLauncher
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import free_port, serve_in_process, wait_until_healthy
from tests.utils.tp_utils import (
    live_descendants,
    no_leftover_processes,
    torchrun_nodes,
)

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [{"prompt_token_ids": [11 + i, 300 + 7 * i, 77, 5000 + i]} for i in range(2)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NODE_WAIT_S = 120.0  # the headless node's exit after node 0 shut down (a loaded machine)

pytestmark = pytest.mark.timeout(600)  # a hang guard, no timing


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield from no_leftover_processes()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=False)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def start_node_one(model: Path, port: int) -> subprocess.Popen[str]:
    """`minivllm serve MODEL -pp 2 --nnodes 2 --node-rank 1 ... --headless`: rank 1, no server."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "minivllm.entrypoints.cli", "serve", str(model), "-pp", "2"),
            *("--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"),
            *("--master-port", str(port), "--headless", "--num-gpu-blocks-override", "32"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def node_zero(model: Path, port: int) -> LLM:
    return LLM(
        str(model),
        pipeline_parallel_size=2,
        nnodes=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=port,
        num_gpu_blocks_override=32,
    )


def test_two_nodes_over_loopback_give_one_process_s_tokens_and_both_end(tiny: Path) -> None:
    expected = tokens(LLM(str(tiny), num_gpu_blocks_override=32).generate(PROMPTS, GREEDY))
    port = free_loopback_port()
    node_one = start_node_one(tiny, port)
    try:
        llm = node_zero(tiny, port)
        assert llm.llm_engine.executor.workers == []  # node 0 runs rank 0 only
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        llm.shutdown()
        output, _ = node_one.communicate(timeout=NODE_WAIT_S)
        assert node_one.returncode == 0, output  # node 0's Shutdown reached node 1's rank
        assert "headless node 1 of 2: ranks 1, meeting rank 0 at tcp://127.0.0.1" in output
    finally:
        node_one.kill()
        node_one.wait()


def test_killing_node_one_fails_node_zero_by_rank_and_its_server_answers_openai_s_500(
    tiny: Path,
) -> None:
    """Node 0's engine behind the OpenAI server (its engine thread steps it, as `minivllm serve`
    does); node 1 is killed at the third step of a completion. The step fails naming node 1's
    rank, the completion is a 500 in OpenAI's error shape (not a hang), /health turns 503, a
    later request fails at once, and no process is left."""
    port = free_loopback_port()
    node_one = start_node_one(tiny, port)
    try:
        llm = node_zero(tiny, port)
        executor = llm.llm_engine.executor
        execute, steps = executor.execute_model, []

        def kill_node_one_at_third_step(sched, **kwargs):  # kwargs: the batch queue's non_block
            steps.append(sched)
            if len(steps) == 3:
                node_one.kill()
                node_one.wait()
            return execute(sched, **kwargs)

        executor.execute_model = kill_node_one_at_third_step  # type: ignore[method-assign]
        body = {"prompt": PROMPTS[0]["prompt_token_ids"], "max_tokens": 8, "temperature": 0}
        with serve_in_process(llm.llm_engine) as server:
            response = httpx.post(server.base_url + "/completions", json=body, timeout=120)
            assert response.status_code == 500, response.text
            error = response.json()["error"]
            assert {"message", "type", "code"} <= set(error) and error["code"] == 500
            assert "other nodes: node 1 (rank 1)" in error["message"], error
            assert len(steps) == 3  # it failed in the step that lost the node, not later
            assert httpx.get(server.url + "/health", timeout=10).status_code == 503
            again = httpx.post(server.base_url + "/completions", json=body, timeout=30)
            assert again.status_code in (500, 503) and "error" in again.json()
        llm.shutdown()
    finally:
        node_one.kill()
        node_one.wait()


# ---------------------------------------------------------------------------------- torchrun
# The bundled SmolLM2 (30 layers: 15 a stage), dequantized at load: a GGUF file's blocks run on
# one device only.
SMOLLM2 = dict(quantization="none", num_gpu_blocks_override=32, max_model_len=128)
TEXTS = ["The capital of France is", "def fibonacci(n):"]


def test_smollm2_s_two_stages_over_two_torchrun_nodes_serving_then_killed_and_spawned(
    tmp_path: Path,
) -> None:
    """`torchrun --nnodes 2 --node-rank R --nproc-per-node 1 -m minivllm.entrypoints.cli serve
    -pp 2`, twice on loopback, one pipeline stage each, as docs/distributed.md runs it on two
    machines: the ranks meet at torchrun's rendezvous (env://), rank 0 sends its configuration
    and serves OpenAI's API, rank 1 (node 1) serves rank 0's steps. Its completions give one
    process's greedy tokens. Then node 1's rank is killed: node 1's torchrun fails, and node 0's
    next completion is a 500 in OpenAI's shape naming node 1's rank (not a hang), /health turns
    503, a later request fails at once; SIGTERM to node 0's torchrun ends its server, and no
    process is left (`torchrun_nodes` checks). Then the same two stages spawned by the engine.
    (Two tensor-parallel ranks by two stages cannot split SmolLM2's 9 heads: refused,
    tests/distributed/test_pipeline_parallel.py.)"""
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMOLLM2.items()]
    serve = ["-m", "minivllm.entrypoints.cli", "serve", "-pp", "2", *flags, f"--port={port}"]
    url = f"http://127.0.0.1:{port}"
    with torchrun_nodes(serve, nnodes=2, logs=tmp_path) as (node0, node1):
        one = LLM(None, **SMOLLM2)  # type: ignore[arg-type]  # while the nodes start
        prompts = [{"prompt_token_ids": one.get_tokenizer().encode(t)} for t in TEXTS]
        expected = tokens(one.generate(prompts, GREEDY, use_tqdm=False))
        wait_until_healthy(url, node0.agent, node0.log.read_text)
        body = dict(max_tokens=GREEDY.max_tokens, temperature=0, ignore_eos=True)
        got = [
            httpx.post(
                url + "/v1/completions",
                json=body | dict(prompt=p["prompt_token_ids"], return_token_ids=True),
                timeout=120,
            ).json()["choices"][0]["token_ids"]
            for p in prompts
        ]
        assert got == expected
        node0.rank_process()  # seen, so that its end is checked
        node1.rank_process().kill()
        assert node1.agent.wait(timeout=NODE_WAIT_S) != 0  # torchrun saw its rank die
        response = httpx.post(
            url + "/v1/completions", json=body | dict(prompt=TEXTS[0]), timeout=120
        )
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert {"message", "type", "code"} <= set(error) and error["code"] == 500
        assert "other nodes: node 1 (rank 1)" in error["message"], error
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        again = httpx.post(url + "/v1/completions", json=body | dict(prompt="x"), timeout=30)
        assert again.status_code in (500, 503) and "error" in again.json()
        node0.agent.terminate()  # torchrun passes SIGTERM on to rank 0, whose server drains
        node0.agent.wait(timeout=NODE_WAIT_S)
    stages = LLM(None, pipeline_parallel_size=2, **SMOLLM2)  # type: ignore[arg-type]
    try:
        assert tokens(stages.generate(prompts, GREEDY, use_tqdm=False)) == expected
    finally:
        stages.shutdown()


# ---------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nnodes": 2, "node_rank": 2}, r"node_rank must be in \[0, nnodes\) = \[0, 2\), got 2"),
        ({"nnodes": 3}, r"nnodes \(3\) must divide tensor_parallel_size x pipeline_parallel_"),
        ({"nnodes": 2, "node_rank": 1}, "node_rank 1 runs only its ranks.*--headless"),
        ({"nnodes": 0}, "nnodes must be"),
        ({"distributed_executor_backend": "slurm"}, "distributed_executor_backend must be one"),
    ],
)
def test_what_the_launch_cannot_serve_is_refused_by_name_before_any_process(
    tiny: Path, kwargs: dict, message: str
) -> None:
    before = set(live_descendants())
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny), pipeline_parallel_size=2, **kwargs)
    assert set(live_descendants()) == before


def test_under_torchrun_the_engine_s_own_node_flags_are_refused(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's --nnodes and --node-rank say where the ranks are; minivllm's would contradict
    them. Refused on rank 0 before it joins the group (no process group is left either)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"under torchrun, torchrun starts every rank.*nnodes=2"):
        LLM(str(tiny), pipeline_parallel_size=2, nnodes=2)


@pytest.mark.parametrize(
    ("nnodes", "per_node", "named"),
    [
        (1, 4, None),
        (2, 2, "node 1 (ranks 2, 3)"),
        (4, 1, "node 1 (rank 1), node 2 (rank 2), node 3 (rank 3)"),
        (2, 3, "ranks 3"),
    ],
)
def test_under_torchrun_rank_zero_names_the_other_nodes_ranks_from_torchrun_s_variables(
    monkeypatch: pytest.MonkeyPatch, nnodes: int, per_node: int, named: str | None
) -> None:
    """What a failure that no rank of node 0 explains names (the kill itself: the torchrun test
    above); node 0's own ranks are torchrun's to stop, rank 0 included. The last case has 3 ranks
    on node 0 and 1 on node 1 (--nproc-per-node differs)."""
    monkeypatch.setenv("GROUP_WORLD_SIZE", str(nnodes))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    executor = object.__new__(ExecutorWithExternalLauncher)  # no ranks: only the naming
    executor.world_size = 4
    assert executor.elsewhere() == named


def test_ray_backend_without_ray_is_refused_with_the_install_line(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"needs Ray, which is not installed: pip install min"):
        LLM(str(tiny), tensor_parallel_size=2, distributed_executor_backend="ray")


def test_headless_without_a_node_to_serve_is_a_usage_error(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", str(tiny), "-pp", "2", "--headless"])
    assert info.value.code == 2
    assert "--headless runs the ranks of one node of several: it needs --nnodes > 1" in (
        capsys.readouterr().err
    )

"""The Ray executor over two Ray nodes: the same tokens as one process, a dead actor named.

One Ray cluster for the module, of two nodes on this machine, each its own raylet with one CPU
and a resource of its own (`node0`, `node1`): `ray start --head`, then `ray start --address`.
Tensor parallelism of 2 needs two one-CPU bundles, which no single node holds, so the placement
group puts rank 1's actor on the other node. Greedy tokens must equal one process's; an actor
killed mid-run must fail the engine naming its rank, and the OpenAI server in front of it must
answer 500s in OpenAI's shape; shutdown must kill the actors and remove the
placement group. The cluster is ended by killing its own process groups, never by `ray stop`,
which would stop every Ray cluster of this user on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install minivllm[ray])")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.distributed.process_group import free_loopback_port  # noqa: E402
from tests.utils.engine_utils import save_tiny_llama  # noqa: E402
from tests.utils.server_utils import serve_in_process  # noqa: E402
from tests.utils.tp_utils import assert_gone  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).parent / "ray"
PROMPTS = [{"prompt_token_ids": [11 + i, 300 + 7 * i, 77, 5000 + i]} for i in range(2)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

pytestmark = pytest.mark.timeout(600)  # a hang guard, no timing


def ray_start(args: list[str], env: dict[str, str]) -> int:
    """`ray start ...` in a session of its own: its daemons (GCS, raylet, their agents and the
    actors' worker processes) inherit the process group, which is how teardown finds them."""
    proc = subprocess.Popen(
        [str(RAY), "start", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    return proc.pid


def cluster_processes(groups: list[int]) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in groups:
                found.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """Two Ray nodes on this machine; the address this process is connected to."""
    port = free_loopback_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),  # the actors import minivllm (and tests/) from here
        "HF_HUB_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    groups: list[int] = []
    try:
        groups.append(
            ray_start(
                [
                    *("--head", "--port", str(port), "--num-cpus", "1", "--temp-dir", temp),
                    *("--resources", json.dumps({"node0": 1}), "--include-dashboard", "false"),
                ],
                env,
            )
        )
        address = f"127.0.0.1:{port}"
        groups.append(
            ray_start(
                ["--address", address, "--num-cpus", "1", "--resources", json.dumps({"node1": 1})],
                env,
            )
        )
        ray.init(address=address, log_to_driver=False)
        yield address
    finally:
        ray.shutdown()
        daemons = cluster_processes(groups)
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        assert_gone(daemons + cluster_processes(groups), "after the Ray cluster was stopped")
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=False)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def resources_of(node_id: str) -> dict[str, float]:
    return next(n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id)


def test_two_ranks_on_two_ray_nodes_give_one_process_s_tokens(cluster: str, tiny: Path) -> None:
    expected = tokens(LLM(str(tiny), num_gpu_blocks_override=32).generate(PROMPTS, GREEDY))
    llm = LLM(
        str(tiny),
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        num_gpu_blocks_override=32,
    )
    executor = llm.llm_engine.executor
    (worker,) = executor.workers  # type: ignore[attr-defined]
    pg = executor.pg  # type: ignore[attr-defined]
    actor = psutil.Process(worker.pid)  # before shutdown: the pid may be gone right after
    try:
        # rank 0 is this process, on the node this driver joined (either raylet: they share the
        # machine's IP); no node has two CPUs, so rank 1 had to go to the other one
        nodes = (ray.get_runtime_context().get_node_id(), worker.node_id)
        names = {name for node in nodes for name in resources_of(node) if name.startswith("node")}
        assert names >= {"node0", "node1"}
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    finally:
        llm.shutdown()
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    assert_gone([actor], "the actor after shutdown()")


def test_a_killed_actor_fails_the_engine_naming_its_rank_and_its_server_answers_500(
    cluster: str, tiny: Path
) -> None:
    """The engine behind the OpenAI server (its engine thread steps it, as `minivllm serve`
    does); rank 1's actor is killed at the third step of a completion: the completion, and the
    next one, are 500s in OpenAI's shape naming the rank, and the actor and its placement group
    are gone."""
    llm = LLM(
        str(tiny),
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        num_gpu_blocks_override=32,
    )
    executor = llm.llm_engine.executor
    (worker,) = executor.workers  # type: ignore[attr-defined]
    actor = psutil.Process(worker.pid)
    try:
        execute, steps = executor.execute_model, []

        def kill_at_third_step(sched, **kwargs):
            steps.append(sched)
            if len(steps) == 3:
                actor.kill()
            return execute(sched, **kwargs)

        executor.execute_model = kill_at_third_step  # type: ignore[method-assign]
        body = {"prompt": PROMPTS[0]["prompt_token_ids"], "max_tokens": 8, "temperature": 0}
        named = rf"rank 1 \(Ray actor \w+, pid {worker.pid} on node .*\) died"
        with serve_in_process(llm.llm_engine) as server:
            for _ in range(2):  # the one in flight, then a new one
                response = httpx.post(server.base_url + "/completions", json=body, timeout=120)
                assert response.status_code == 500, response.text
                error = response.json()["error"]
                assert {"message", "type", "code"} <= set(error) and error["code"] == 500
                assert re.search(named, error["message"]), error
            assert len(steps) == 3  # it failed in the step that lost the actor, not later
        assert ray.util.placement_group_table(executor.pg)["state"] == "REMOVED"  # type: ignore[attr-defined]
    finally:
        llm.shutdown()
    assert_gone([actor], "the killed actor")

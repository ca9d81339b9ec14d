"""`minivllm serve --tensor-parallel-size 2` answers the official `openai` client as one rank does.

The server's engine thread steps a tensor-parallel engine exactly as it steps a single-device one.
A completion (greedy) equals the single-device engine's text, a stream delivers the same text in
chunks, every KV block is free afterwards, and when the server stops (SIGINT, as `run_server`
stops it) its worker process goes too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from minivllm import LLM, SamplingParams
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import RemoteServer, run_server
from tests.utils.tp_utils import assert_gone, no_leftover_processes

PROMPT = "The tensor-parallel server says"

# A hang guard (a broken collective would otherwise wait COLLECTIVE_TIMEOUT); no timing.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield from no_leftover_processes()


def wait_until_no_block_is_held(server: RemoteServer, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.metric("vllm:kv_cache_usage_perc") or server.metric("vllm:num_requests_running"):
        assert time.monotonic() < deadline, "the server still holds KV blocks"
        time.sleep(0.2)


@pytest.mark.slow
def test_openai_client_gets_one_rank_s_answer_streamed_and_every_block_back(
    tmp_path: Path,
) -> None:
    model = save_tiny_llama(tmp_path, tie_word_embeddings=False)
    args = ["--model", str(model), "--tensor-parallel-size", "2", "--num-gpu-blocks-override", "64"]
    with run_server(args) as server:
        workers = psutil.Process(server.process.pid).children(recursive=True)
        assert any("spawn_main" in " ".join(w.cmdline()) for w in workers)
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        completion = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=12, temperature=0
        )
        stream = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
        chunks = [c.choices[0].text for c in stream if c.choices]
        wait_until_no_block_is_held(server)
        assert "Traceback" not in server.log()
    assert_gone(workers, "after the server stopped")

    one = LLM(str(model), num_gpu_blocks_override=64)
    expected = one.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert completion.choices[0].text == expected[0].outputs[0].text
    assert len(chunks) > 1 and "".join(chunks) == completion.choices[0].text

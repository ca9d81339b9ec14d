"""The server under load: preemption with many streaming clients, the waiting bound, the API key.

The KV budget is cut to a few blocks (`--num-gpu-blocks-override`) so 64 concurrent streams cannot
all hold their blocks: the scheduler must preempt and recompute, and each stream must still produce
exactly its greedy text when run alone (the engine's oracle, through HTTP), leaking no block.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.utils.server_utils import RemoteServer, run_server

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-test-0123456789"
NUM_CLIENTS = 64
NUM_PROMPTS = 8  # each prompt is sent by NUM_CLIENTS // NUM_PROMPTS clients at once
MAX_TOKENS = 6
IGNORE_EOS = {
    "extra_body": {"ignore_eos": True}
}  # every sequence grows by MAX_TOKENS blocks' worth


@pytest.fixture(scope="module")
def server():
    # 150 blocks x 4 tokens: a sequence (~22 prompt + 6 output tokens) grows from 6 to 7 blocks,
    # so ~25 of the 64 are admitted, fill the cache, and their decodes must preempt one another.
    args = ["--num-gpu-blocks-override", "150", "--block-size", "4", "--max-model-len", "128"]
    args += ["--max-num-seqs", "64"]
    args += ["--no-enable-prefix-caching", "--max-waiting-requests", "200"]
    args += ["--log-stats-interval", "0.2"]  # the burst may last under a second
    with run_server(args, api_key=KEY) as s:
        yield s


def prompt(i: int) -> str:
    return (
        f"Here is a short story about a dog and the number {i * 7 + 3}. Once upon a time, the dog"
    )


async def stream_one(client: openai.AsyncOpenAI, text: str) -> str:
    stream = await client.completions.create(
        model=MODEL, prompt=text, max_tokens=MAX_TOKENS, temperature=0, stream=True, **IGNORE_EOS
    )
    return "".join([c.choices[0].text async for c in stream if c.choices])


def test_64_streams_with_preemption_match_their_sequential_outputs(server: RemoteServer) -> None:
    sync = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    kw = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **IGNORE_EOS}
    alone = [
        sync.completions.create(prompt=prompt(i), **kw).choices[0].text for i in range(NUM_PROMPTS)
    ]
    preempted_before = server.metric("vllm:num_preemptions_total")

    async def burst() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=server.base_url, api_key=KEY, max_retries=0, timeout=300
        )
        try:
            return await asyncio.gather(
                *[stream_one(client, prompt(i % NUM_PROMPTS)) for i in range(NUM_CLIENTS)]
            )
        finally:
            await client.close()

    texts = asyncio.run(burst())
    assert texts == [alone[i % NUM_PROMPTS] for i in range(NUM_CLIENTS)]
    assert len(set(alone)) > 1
    assert server.metric("vllm:num_preemptions_total") > preempted_before
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0  # no block leaked
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:request_success_total", finished_reason="length") >= 72
    assert "Engine: Avg prompt throughput" in server.log()  # the periodic stats line


def test_api_key_guards_v1_but_not_health(server: RemoteServer) -> None:
    url = server.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0).models.list()


def test_waiting_bound_answers_503_with_retry_after() -> None:
    args = ["--max-num-seqs", "1", "--max-waiting-requests", "1", "--max-model-len", "256"]
    with run_server(args) as s:
        body = {"prompt": "Count to ten:", "max_tokens": 2, "ignore_eos": True}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                return await asyncio.gather(
                    *[c.post("/v1/completions", json=body) for _ in range(6)]
                )

        resps = asyncio.run(burst())
        codes = sorted(r.status_code for r in resps)
        assert 200 in codes and 503 in codes, codes
        refused = next(r for r in resps if r.status_code == 503)
        assert refused.headers["retry-after"] and refused.json()["error"]["code"] == 503
        # Once the queue drains, the server takes work again.
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200

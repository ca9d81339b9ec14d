"""The OpenAI-compatible server, driven by the official `openai` client and by raw httpx.

One server (the bundled SmolLM2) serves the whole module. Greedy runs are the oracle: a stream must
add up to the non-streamed text, and a bad request must leave the server as good as before.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.utils.server_utils import RemoteServer, run_server

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with run_server(["--max-model-len", "1024", "--max-num-seqs", "32"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def wait_idle(server: RemoteServer, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once no request runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        busy = [
            v
            for k, v in m.items()
            if k.startswith(
                (
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc",
                )
            )
        ]
        if not any(busy):
            return m
        assert time.monotonic() < deadline, f"the server did not go idle: {busy}"
        time.sleep(0.2)


# ---------------------------------------------------------------------- happy paths
def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"


def test_completion_stream_adds_up_to_the_greedy_text(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}
    full = client.completions.create(**kw)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.usage.completion_tokens == 10 and full.choices[0].finish_reason == "length"
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_adds_up_to_the_greedy_text(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 10, "temperature": 0}
    full = client.chat.completions.create(**kw)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"  # the role comes first
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_chat_applies_the_models_chat_template(client: openai.OpenAI) -> None:
    from minivllm.model.loader import load_tokenizer
    from minivllm.model.resolver import resolve_model

    tok = load_tokenizer(resolve_model(None), None)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.prompt_tokens > len(tok.encode(CHAT[0]["content"])) + 4  # template tokens


def test_n2_returns_two_indexed_choices(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, n=2, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == sum(6 for _ in resp.choices)


def test_beam_search_returns_n_beams_and_width_one_is_greedy(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    prompt = "The three primary colors are"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    beam = {"use_beam_search": True, "ignore_eos": True}
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, extra_body=beam)
    assert one.choices[0].text == greedy.choices[0].text
    three = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, n=3, extra_body=beam
    )
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.text for c in three.choices}) == 3
    assert all(c.finish_reason == "length" for c in three.choices)
    assert three.usage.completion_tokens == 18
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, n=2, stream=True, extra_body=beam
    )
    texts = ["", ""]
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(texts) and texts[0] != texts[1]
    wait_idle(server)


def test_several_prompts_number_choices_prompt_major(client: openai.OpenAI) -> None:
    texts = client.completions.create(
        model=MODEL, prompt=["Hello", "Hello,"], max_tokens=3, n=2, temperature=0
    )
    ids = client.completions.create(
        model=MODEL, prompt=[[19556], [19556, 28]], max_tokens=3, n=2, temperature=0
    )
    for resp in (texts, ids):
        assert [c.index for c in resp.choices] == [0, 1, 2, 3]
        assert resp.choices[0].text == resp.choices[1].text  # greedy: the n samples agree
        assert resp.usage.prompt_tokens == 1 + 2 and resp.usage.completion_tokens == 12
    assert [c.text for c in texts.choices] == [c.text for c in ids.choices]


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    text = client.completions.create(**kw).choices[0].text
    word = text.split()[2]
    stopped = client.completions.create(**kw, stop=[word]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(word)]


def test_completion_logprobs_in_openais_format(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="Hello, my name is", max_tokens=4, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0.0
        assert top[token] == pytest.approx(max(top.values()))  # greedy took the best


def test_chat_logprobs_in_openais_format(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].token == entry.token
        assert len(entry.top_logprobs) == 2


def test_seed_makes_random_sampling_reproducible(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0}
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    assert a == b


def test_async_client_runs_concurrent_requests(server: RemoteServer) -> None:
    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        prompts = ["One", "Two", "Three", "Four"]
        resps = await asyncio.gather(
            *[
                aclient.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
                for p in prompts
            ]
        )
        await aclient.close()
        return [r.choices[0].text for r in resps]

    texts = asyncio.run(main())
    sync = openai.OpenAI(base_url=server.base_url, api_key="x")
    alone = sync.completions.create(model=MODEL, prompt="Three", max_tokens=5, temperature=0)
    assert texts[2] == alone.choices[0].text


def test_tokenize_detokenize_and_version(server: RemoteServer) -> None:
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Hello, world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    text = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert text["prompt"] == "Hello, world"
    assert httpx.get(server.url + "/version").json()["version"]


# ---------------------------------------------------------------------- hostile input
GOOD_CHAT = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
GOOD_COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
BAD_REQUESTS = [
    # (id, path, body (dict, or raw bytes), status, word the message or param must contain)
    ("bad-json", "/v1/chat/completions", b'{"model": ', 400, "JSON"),
    ("not-an-object", "/v1/completions", b"[1, 2]", 400, ""),
    ("empty-body", "/v1/completions", b"", 400, "prompt"),
    ("temperature-string", "/v1/completions", {**GOOD_COMPLETION, "temperature": "hot"}, 400, "temperature"),
    ("negative-temperature", "/v1/completions", {**GOOD_COMPLETION, "temperature": -1}, 400, "temperature"),
    ("top-p-too-big", "/v1/chat/completions", {**GOOD_CHAT, "top_p": 1.5}, 400, "top_p"),
    ("top-k-too-small", "/v1/completions", {**GOOD_COMPLETION, "top_k": -5}, 400, "top_k"),
    ("penalty-out-of-range", "/v1/completions", {**GOOD_COMPLETION, "presence_penalty": 9}, 400, "presence_penalty"),
    ("max-tokens-zero", "/v1/completions", {**GOOD_COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-huge", "/v1/completions", {**GOOD_COMPLETION, "max_tokens": 10**9}, 400, "max_tokens"),
    ("max-tokens-bool", "/v1/completions", {**GOOD_COMPLETION, "max_tokens": True}, 400, "max_tokens"),
    ("n-huge", "/v1/chat/completions", {**GOOD_CHAT, "n": 100000}, 400, "n"),
    ("n-zero", "/v1/chat/completions", {**GOOD_CHAT, "n": 0}, 400, "n"),
    ("logprobs-too-many", "/v1/completions", {**GOOD_COMPLETION, "logprobs": 50}, 400, "logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", {**GOOD_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("unknown-model", "/v1/chat/completions", {**GOOD_CHAT, "model": "gpt-5"}, 404, "model"),
    ("prompt-too-long", "/v1/completions", {**GOOD_COMPLETION, "prompt": "hello " * 1100}, 400, "1024"),
    ("empty-prompt", "/v1/completions", {**GOOD_COMPLETION, "prompt": ""}, 400, "prompt"),
    ("empty-prompt-list", "/v1/completions", {**GOOD_COMPLETION, "prompt": []}, 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", {**GOOD_COMPLETION, "prompt": [10**7]}, 400, "out of vocabulary"),
    ("seed-past-int64", "/v1/completions", {**GOOD_COMPLETION, "seed": 2**63}, 400, "seed"),
    ("seed-below-int64", "/v1/chat/completions", {**GOOD_CHAT, "seed": -(2**63) - 1}, 400, "seed"),
    ("mixed-prompt-list", "/v1/completions", {**GOOD_COMPLETION, "prompt": [1, "a"]}, 400, "prompt"),
    ("empty-messages", "/v1/chat/completions", {**GOOD_CHAT, "messages": []}, 400, "messages"),
    ("wrong-role", "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": 5, "content": "x"}]}, 400, "role"),
    ("message-without-role", "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"content": "x"}]}, 400, "role"),
    ("image-content", "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("tools-auto-not-enabled", "/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("tool-choice", "/v1/chat/completions", {**GOOD_CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
    ("json-schema", "/v1/chat/completions", {**GOOD_CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("logit-bias-range", "/v1/completions", {**GOOD_COMPLETION, "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ("logit-bias-key", "/v1/completions", {**GOOD_COMPLETION, "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("logit-bias-vocab", "/v1/chat/completions", {**GOOD_CHAT, "logit_bias": {"49152": 1}}, 400, "out-of-vocab"),
    ("allowed-token-ids-vocab", "/v1/completions", {**GOOD_COMPLETION, "allowed_token_ids": [-1]}, 400, "allowed_token_ids"),
    ("bad-words-empty", "/v1/completions", {**GOOD_COMPLETION, "bad_words": [""]}, 400, "bad_words"),
    ("suffix", "/v1/completions", {**GOOD_COMPLETION, "suffix": "end"}, 400, "suffix"),
    ("best-of", "/v1/completions", {**GOOD_COMPLETION, "best_of": 3}, 400, "best_of"),
    ("functions", "/v1/chat/completions", {**GOOD_CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ("unknown-field", "/v1/chat/completions", {**GOOD_CHAT, "frobnicate": 1}, 400, "frobnicate"),
    ("stop-empty-string", "/v1/completions", {**GOOD_COMPLETION, "stop": [""]}, 400, "stop"),
    ("min-tokens-over-max", "/v1/completions", {**GOOD_COMPLETION, "min_tokens": 5}, 400, "min_tokens"),
    ("oversized-body", "/v1/completions", b'{"prompt": "' + b"a" * 5_000_000 + b'"}', 413, "larger"),
    ("detokenize-bad-token", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("stream-options-without-stream", "/v1/completions", {**GOOD_COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("beam-with-top-p", "/v1/completions", {**GOOD_COMPLETION, "use_beam_search": True, "top_p": 0.5}, 400, "top_p"),
    ("beam-with-logprobs", "/v1/completions", {**GOOD_COMPLETION, "use_beam_search": True, "logprobs": 2}, 400, "logprobs"),
    ("beam-too-wide", "/v1/chat/completions", {**GOOD_CHAT, "use_beam_search": True, "n": 11}, 400, "n"),
    ("length-penalty-without-beams", "/v1/completions", {**GOOD_COMPLETION, "length_penalty": 2.0}, 400, "length_penalty"),
    ("chat-stream-options-stream-false", "/v1/chat/completions", {**GOOD_CHAT, "stream": False, "stream_options": {"continuous_usage_stats": True}}, 400, "stream_options"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "word"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_request_gets_an_openai_error(
    server: RemoteServer, path: str, body: dict | bytes, status: int, word: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        server.url + path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert word in f"{err['message']} {err['param']}", err


def test_chunked_body_over_the_limit_is_refused_while_reading(server: RemoteServer) -> None:
    def body():  # no Content-Length: the limit must be enforced as the bytes arrive
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=body(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_server_answers_correctly_after_hostile_requests(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    assert len(BAD_REQUESTS) >= 20
    for _, path, body, _status, _ in BAD_REQUESTS[:8]:  # again, back to back
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(server.url + path, content=content, timeout=30)
    assert httpx.get(server.url + "/health").status_code == 200
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw, stream=True)
    assert a == "".join(c.choices[0].text for c in b)
    assert "Traceback" not in server.log()


def sse_chunks(r: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent event stream, checking that it ends with [DONE]."""
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
    assert events[-1] == "[DONE]", events
    return [json.loads(e) for e in events[:-1]]


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(server: RemoteServer) -> None:
    body = {**GOOD_COMPLETION, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse_chunks(
        httpx.post(server.url + "/v1/completions", json=body | {"stream": True,
                   "stream_options": options}, timeout=60)
    )  # fmt: skip
    *token_chunks, last = chunks
    assert last["choices"] == [] and all(c["choices"] for c in token_chunks)
    usages = [c["usage"] for c in token_chunks]
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 6
    prompt = usages[0]["prompt_tokens"]
    for u, d in zip(usages, done):
        assert u == {"prompt_tokens": prompt, "completion_tokens": d, "total_tokens": prompt + d}
    # vLLM's rule: continuous_usage_stats counts only together with include_usage.
    alone = body | {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    chunks = sse_chunks(httpx.post(server.url + "/v1/completions", json=alone, timeout=60))
    assert chunks and all(c.get("usage") is None for c in chunks)


def test_chat_stream_with_both_usage_options_counts_from_the_role_chunk(
    server: RemoteServer,
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**GOOD_CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": options}
    chunks = sse_chunks(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["usage"]["completion_tokens"] == 0
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["usage"] == chunks[-1]["usage"]  # the last token's chunk: the same totals


# ---------------------------------------------------------------------- disconnects and metrics
def test_dropped_stream_aborts_and_frees_every_block(server: RemoteServer) -> None:
    before = wait_idle(server)
    aborted = 'vllm:request_success_total{finished_reason="abort",model_name="' + MODEL + '"}'
    body = {**GOOD_COMPLETION, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens in, then hang up
        assert all(line.startswith("data: ") or not line for line in got)
        usage = server.metric("vllm:kv_cache_usage_perc")
        assert usage > 0
    after = wait_idle(server)  # KV usage back to zero
    assert after[aborted] == before[aborted] + 1


def test_non_streaming_client_that_leaves_aborts_its_request(server: RemoteServer) -> None:
    before = wait_idle(server)
    aborted = 'vllm:request_success_total{finished_reason="abort",model_name="' + MODEL + '"}'
    body = {**GOOD_COMPLETION, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    after = wait_idle(server)
    assert after[aborted] == before[aborted] + 1


def test_metrics_match_what_was_sent(server: RemoteServer, client: openai.OpenAI) -> None:
    before = wait_idle(server)
    resps = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        for p in ("Alpha", "Beta gamma", "Delta epsilon zeta")
    ]
    after = wait_idle(server)
    label = '{model_name="' + MODEL + '"}'

    def delta(name: str) -> float:
        return after[name + label] - before[name + label]

    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 3 * 3
    assert delta("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in resps)
    assert delta("vllm:generation_tokens_total") == sum(r.usage.completion_tokens for r in resps)
    length = 'vllm:request_success_total{finished_reason="length",model_name="' + MODEL + '"}'
    assert after[length] - before[length] == 3
    # The per-request histograms of vLLM's v1 set, one observation per request.
    for name in (
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
    ):
        assert delta(f"vllm:{name}_count") == 3, name
    assert delta("vllm:request_prompt_tokens_sum") == sum(r.usage.prompt_tokens for r in resps)
    assert delta("vllm:request_generation_tokens_sum") == 3 * 4
    assert delta("vllm:request_params_max_tokens_sum") == 3 * 4
    assert delta("vllm:time_per_output_token_seconds_count") == 3 * 3
    assert delta("vllm:iteration_tokens_total_count") >= 4  # at least one prefill + 3 decodes
    assert delta("vllm:iteration_tokens_total_sum") >= delta("vllm:generation_tokens_total")
    info = [k for k in after if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'block_size="' in info[0] and after[info[0]] == 1.0


def test_bench_serve_reports_latencies_and_throughput(server: RemoteServer) -> None:
    import argparse

    from minivllm.benchmarks import serve as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    flags = "--num-prompts 4 --random-input-len 8 --random-output-len 4 --max-concurrency 2"
    args = parser.parse_args(["--base-url", server.url, *flags.split(), "--request-rate", "50"])
    summary = asyncio.run(bench.run(args))
    assert summary["completed"] == 4 and summary["failed"] == 0, summary["errors"]
    assert summary["total_output_tokens"] == 16 and summary["total_input_tokens"] == 32
    assert 0 < summary["median_ttft_ms"] <= summary["median_e2el_ms"]
    assert summary["p99_itl_ms"] > 0 and summary["mean_tpot_ms"] > 0
    assert summary["output_throughput"] > 0

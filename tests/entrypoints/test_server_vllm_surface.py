"""The parts of vLLM's server that operators and routers rely on: request-id headers, `/load`,
`/tokenizer_info`, `/tokenize` with token strings, `/invocations` (SageMaker's one route),
`--root-path`, `--uds`, the request log and the access log switch.

A tiny random Llama serves them: these tests are about the HTTP surface, not the answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import STARTUP_TIMEOUT_S, InProcessServer, serve_in_process


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    config = EngineArgs(
        model=str(tiny_model), max_model_len=128, block_size=4, num_gpu_blocks_override=128
    ).create_engine_config()
    with serve_in_process(
        LLMEngine(config),
        enable_request_id_headers=True,
        enable_tokenizer_info_endpoint=True,
        return_tokens_as_token_ids=True,
    ) as s:
        yield s


def test_request_id_header_echoes_the_clients_or_makes_one(server: InProcessServer) -> None:
    given = httpx.get(server.url + "/health", headers={"X-Request-Id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    made = httpx.post(server.url + "/tokenize", json={"prompt": "hi"})
    assert len(made.headers["x-request-id"]) == 32  # a uuid4, hex
    other = httpx.post(server.url + "/tokenize", json={"prompt": "hi"})
    assert other.headers["x-request-id"] != made.headers["x-request-id"]


def test_load_counts_generation_requests_in_flight(server: InProcessServer) -> None:
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    body = {"prompt": "Once", "max_tokens": 64, "ignore_eos": True, "stream": True}
    seen: list[int] = []
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as resp:
        for _ in resp.iter_lines():
            if not seen:  # the stream has started: this request is in flight
                seen.append(httpx.get(server.url + "/load").json()["server_load"])
    assert seen == [1]
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}


def test_tokenizer_info_names_the_class_and_the_template(server: InProcessServer) -> None:
    info = httpx.get(server.url + "/tokenizer_info").json()
    tok = server.engine.tokenizer
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == tok.chat_template
    json.dumps(info)  # every value is JSON


def test_tokenize_returns_token_strings(server: InProcessServer) -> None:
    out = httpx.post(
        server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}
    ).json()
    tok = server.engine.tokenizer
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    # vLLM: always in the answer, null unless asked for
    assert httpx.post(server.url + "/tokenize", json={"prompt": "Hi"}).json()["token_strs"] is None


def test_invocations_routes_by_body(server: InProcessServer) -> None:
    chat = httpx.post(
        server.url + "/invocations",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    text = httpx.post(
        server.url + "/invocations", json={"prompt": "Hi", "max_tokens": 3}, timeout=60
    )
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    neither = httpx.post(server.url + "/invocations", json={"input": "Hi"})
    assert neither.status_code == 400
    assert "messages" in neither.json()["error"]["message"]
    bad_field = httpx.post(server.url + "/invocations", json={"prompt": "Hi", "max_tokens": -1})
    assert bad_field.status_code == 400 and bad_field.json()["error"]["param"] == "max_tokens"


def test_serve_on_a_unix_socket_behind_a_root_path_with_request_log(tiny_model: Path) -> None:
    sock = Path(tempfile.mkdtemp(prefix="minivllm-uds-")) / "server.sock"
    cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", str(tiny_model)]
    cmd += ["--uds", str(sock), "--enable-log-requests", "--disable-uvicorn-access-log"]
    cmd += ["--root-path", "/llm"]
    cmd += ["--max-model-len", "128", "--num-gpu-blocks-override", "64"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60)
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                assert proc.poll() is None, "the server exited"
                try:
                    if client.get("http://uds/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the server did not start in time"
                time.sleep(0.5)
            resp = client.post("http://uds/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert resp.status_code == 200
            # The proxy strips /llm; the schema tells clients where the API is published.
            assert client.get("http://uds/openapi.json").json()["servers"] == [{"url": "/llm"}]
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        text = log.read()
    assert "Received request cmpl-" in text, text
    assert "POST /v1/completions" not in text  # uvicorn's access line is off


# ---------------------------------------------------------------------- chat request fields
TEMPLATE = (
    "{% for d in documents or [] %}[doc {{ d.title }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}{% if m.reasoning_content %} thinking={{ m.reasoning_content }}"
    "{% endif %}>{{ m.content }}{% endfor %}{{ greeting | default('') }}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tokenize_chat(server: InProcessServer, **body: object) -> httpx.Response:
    return httpx.post(server.url + "/tokenize", json=body)


def text_of(server: InProcessServer, ids: list[int]) -> str:
    return server.engine.tokenizer.decode(ids)


def test_chat_template_kwargs_documents_and_extra_message_fields_reach_the_template(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server.engine.tokenizer, "chat_template", TEMPLATE)
    messages = [{"role": "user", "content": "Hi", "reasoning_content": "short"}]
    chat = {"messages": messages, "max_tokens": 2, "chat_template_kwargs": {"greeting": "!!"}}
    ids = tokenize_chat(server, messages=messages, chat_template_kwargs={"greeting": "!!"})
    assert text_of(server, ids.json()["tokens"]) == "<user thinking=short>Hi!!<assistant>"
    resp = httpx.post(
        server.base_url + "/chat/completions",
        json={**chat, "documents": [{"title": "A", "text": "x"}]},
        timeout=60,
    )
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] == len(
        server.engine.tokenizer.encode(
            "[doc A]<user thinking=short>Hi!!<assistant>", add_special_tokens=False
        )
    )
    clash = httpx.post(
        server.base_url + "/chat/completions",
        json={**chat, "chat_template_kwargs": {"add_generation_prompt": False}},
    )
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "chat_template_kwargs"


def test_continue_final_message_leaves_the_assistant_turn_open(server: InProcessServer) -> None:
    messages = [
        {"role": "user", "content": "Tell a story."},
        {"role": "assistant", "content": "Once upon a time"},
    ]
    ids = tokenize_chat(
        server, messages=messages, add_generation_prompt=False, continue_final_message=True
    ).json()["tokens"]
    assert text_of(server, ids).endswith("Once upon a time")
    both = httpx.post(
        server.base_url + "/chat/completions",
        json={"messages": messages, "continue_final_message": True},
    )
    assert both.status_code == 400 and "continue_final_message" in both.json()["error"]["message"]


def test_chat_echo_starts_the_reply_with_the_open_assistant_message(
    server: InProcessServer,
) -> None:
    messages = [
        {"role": "user", "content": "Tell a story."},
        {"role": "assistant", "content": "Once upon a time"},
    ]
    body = {
        "messages": messages,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 5,
        "temperature": 0,
    }
    plain = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    echoed = httpx.post(
        server.base_url + "/chat/completions", json={**body, "echo": True}, timeout=60
    ).json()
    reply = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "Once upon a time" + reply
    chunks = []
    with httpx.stream(
        "POST", server.base_url + "/chat/completions", json={**body, "echo": True, "stream": True}
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                chunks.append(delta.get("content") or "")
    assert "".join(chunks) == "Once upon a time" + reply


# ---------------------------------------------------------------------- token ids in responses
def test_return_token_ids_on_completions_whole_and_streamed(server: InProcessServer) -> None:
    body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    choice = whole["choices"][0]
    prompt_ids = server.engine.tokenizer.encode("Hello there")
    assert choice["prompt_token_ids"] == prompt_ids
    assert server.engine.tokenizer.decode(choice["token_ids"]) == choice["text"]
    streamed: list[int] = []
    firsts = []
    with httpx.stream(
        "POST", server.base_url + "/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                firsts.append(ch.get("prompt_token_ids"))
                streamed += ch["token_ids"]
    assert firsts[0] == prompt_ids and all(f is None for f in firsts[1:])
    assert streamed == choice["token_ids"]
    plain = httpx.post(server.base_url + "/completions", json={**body, "return_token_ids": False})
    assert "token_ids" not in plain.json()["choices"][0]


def test_return_token_ids_on_chat_whole_and_streamed(server: InProcessServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "return_token_ids": True,
    }
    whole = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    ids = httpx.post(server.url + "/tokenize", json={"messages": body["messages"]}).json()
    assert whole["prompt_token_ids"] == ids["tokens"]
    token_ids = whole["choices"][0]["token_ids"]
    assert len(token_ids) == whole["usage"]["completion_tokens"]
    streamed: list[int] = []
    with httpx.stream(
        "POST", server.base_url + "/chat/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        events = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == ids["tokens"]
    for e in events:
        streamed += e["choices"][0]["token_ids"]
    assert streamed == token_ids


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server: InProcessServer) -> None:
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 2}
    body["return_token_ids"] = True
    choice = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()["choices"][
        0
    ]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    chat = httpx.post(
        server.base_url + "/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 1,
            "return_token_ids": True,
        },
        timeout=60,
    ).json()["choices"][0]
    tokens = [e["token"] for e in chat["logprobs"]["content"]]
    assert tokens == [f"token_id:{t}" for t in chat["token_ids"]]


def test_truncate_prompt_tokens_keeps_the_prompts_end(server: InProcessServer) -> None:
    prompt = " ".join(f"word{i}" for i in range(40))
    ids = server.engine.tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": 10}
    cut = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    same = httpx.post(
        server.base_url + "/completions",
        json={"prompt": ids[-10:], "max_tokens": 3, "temperature": 0},
        timeout=60,
    ).json()
    assert cut["usage"]["prompt_tokens"] == 10
    assert cut["choices"][0]["text"] == same["choices"][0]["text"]
    chat = httpx.post(
        server.base_url + "/chat/completions",
        json={"messages": [{"role": "user", "content": prompt}], "truncate_prompt_tokens": 7},
        timeout=60,
    )
    assert chat.json()["usage"]["prompt_tokens"] == 7
    bad = httpx.post(server.base_url + "/completions", json={**body, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


# ---------------------------------------------------------------------- prompt logprobs
SCORED = [1000 + 7 * i for i in range(11)]


def test_prompt_logprobs_field_matches_the_offline_engine(
    server: InProcessServer, tiny_model: Path
) -> None:
    from minivllm import LLM, SamplingParams

    body = {"prompt": SCORED, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}
    got = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    entries = got["choices"][0]["prompt_logprobs"]
    llm = LLM(str(tiny_model), num_gpu_blocks_override=32, max_model_len=128)
    sp = SamplingParams(prompt_logprobs=2, max_tokens=1, temperature=0)
    ref = llm.generate([{"prompt_token_ids": SCORED}], sp, use_tqdm=False)[0].prompt_logprobs
    assert ref is not None and entries[0] is None and len(entries) == len(SCORED)
    for entry, expected in zip(entries[1:], ref[1:]):
        assert expected is not None
        assert {int(t) for t in entry} == set(expected)
        for t, lp in expected.items():
            assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert entry[str(t)]["rank"] == lp.rank
    chat = httpx.post(
        server.base_url + "/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
        timeout=60,
    ).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # k = 0: the token itself


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(server: InProcessServer) -> None:
    """What EleutherAI's lm-eval sends for a log-likelihood: echo + logprobs=1 + max_tokens=1."""
    body = {"prompt": SCORED, "max_tokens": 1, "temperature": 0}
    scored = httpx.post(
        server.base_url + "/completions", json={**body, "prompt_logprobs": 1}, timeout=60
    ).json()["choices"][0]["prompt_logprobs"]
    echoed = httpx.post(
        server.base_url + "/completions", json={**body, "logprobs": 1, "echo": True}, timeout=60
    ).json()["choices"][0]["logprobs"]
    n = len(SCORED)
    assert echoed["tokens"][:n] == [f"token_id:{t}" for t in SCORED]  # an as-ids server
    assert echoed["token_logprobs"][0] is None and echoed["top_logprobs"][0] is None
    assert len(echoed["token_logprobs"]) == n + 1  # the prompt, then the one completion token
    for i in range(1, n):
        own = scored[i][str(SCORED[i])]
        assert echoed["token_logprobs"][i] == pytest.approx(own["logprob"], abs=1e-6)
        top = echoed["top_logprobs"][i]  # the top 1 and the prompt token
        assert f"token_id:{SCORED[i]}" in top and len(top) == (1 if own["rank"] == 1 else 2)
        # lm-eval's greedy check: the token's logprob is the dict's maximum
        assert (max(top.values()) == echoed["token_logprobs"][i]) == (own["rank"] == 1)
    assert echoed["text_offset"] == sorted(echoed["text_offset"])
    streamed = []
    with httpx.stream(
        "POST",
        server.base_url + "/completions",
        json={**body, "logprobs": 1, "echo": True, "stream": True},
        timeout=60,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed == echoed["token_logprobs"]


def test_logprobs_zero_gives_the_sampled_token_and_past_the_limit_is_a_400(
    server: InProcessServer,
) -> None:
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 0}
    lps = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    lps = lps["choices"][0]["logprobs"]
    assert [list(top) for top in lps["top_logprobs"]] == [[t] for t in lps["tokens"]]
    for field, value in (("logprobs", 21), ("prompt_logprobs", 21)):
        bad = httpx.post(server.base_url + "/completions", json={**body, field: value})
        assert bad.status_code == 400 and "20" in bad.json()["error"]["message"]
        assert bad.json()["error"]["param"] == field

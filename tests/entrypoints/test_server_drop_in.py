"""The last mile of drop-in: request and response fields that vLLM's own server tests (and the
clients written against vLLM) read, each held to vLLM's shape (vllm/entrypoints/openai/protocol.py
at 505805b6). A tiny random Llama with SmolLM2's tokenizer serves them: shapes, not answers."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import InProcessServer, serve_tiny_model

CHAT = [{"role": "user", "content": "Hi there"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    with serve_tiny_model(tiny_model, enable_tokenizer_info_endpoint=True) as s:
        yield s


def post(server: InProcessServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_prompt_logprobs_sit_where_vllm_puts_them_and_are_null_unless_asked(
    server: InProcessServer,
) -> None:
    plain = post(server, "/completions", {"prompt": "Hello there", "max_tokens": 2}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    asked = post(
        server, "/completions", {"prompt": "Hello there", "max_tokens": 2, "prompt_logprobs": 1}
    ).json()
    first, *rest = asked["choices"][0]["prompt_logprobs"]
    assert first is None and rest and all(1 <= len(entry) <= 2 for entry in rest)
    chat = post(server, "/chat/completions", {"messages": CHAT, "max_tokens": 2}).json()
    assert chat["prompt_logprobs"] is None  # top-level on chat, as vLLM's ChatCompletionResponse
    chat = post(
        server, "/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}
    ).json()
    assert len(chat["prompt_logprobs"]) > 1


def test_chat_logprobs_accepts_the_string_true_as_vllm_does(server: InProcessServer) -> None:
    body = {"messages": CHAT, "max_tokens": 3, "logprobs": "true", "top_logprobs": 2}
    out = post(server, "/chat/completions", body)
    assert out.status_code == 200, out.text
    assert len(out.json()["choices"][0]["logprobs"]["content"]) == 3
    assert post(server, "/chat/completions", {**body, "logprobs": "maybe"}).status_code == 400


def test_function_role_is_accepted_and_messages_carry_reasoning_content(
    server: InProcessServer,
) -> None:
    messages = [
        *CHAT,
        {"role": "function", "name": "get_weather", "content": '{"temp": 20}'},
        {"role": "assistant", "content": "Warm.", "reasoning_content": "It said 20."},
        {"role": "user", "content": "Thanks"},
    ]
    out = post(server, "/chat/completions", {"messages": messages, "max_tokens": 2})
    assert out.status_code == 200, out.text
    message = out.json()["choices"][0]["message"]
    assert "reasoning_content" in message and message["reasoning_content"] is None


def test_return_tokens_as_token_ids_per_request(server: InProcessServer) -> None:
    body = {"prompt": "Hello", "max_tokens": 3, "logprobs": 1, "temperature": 0.0}
    named = post(server, "/completions", body).json()["choices"][0]["logprobs"]["tokens"]
    assert not any(t.startswith("token_id:") for t in named)
    ids = post(server, "/completions", {**body, "return_tokens_as_token_ids": True}).json()
    assert all(t.startswith("token_id:") for t in ids["choices"][0]["logprobs"]["tokens"])
    chat = post(
        server,
        "/chat/completions",
        {"messages": CHAT, "max_tokens": 2, "logprobs": True, "return_tokens_as_token_ids": True},
    ).json()
    assert all(
        e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"]
    )


def test_tokenize_renders_tools_and_always_answers_token_strs(server: InProcessServer) -> None:
    tok = server.engine.tokenizer
    out = httpx.post(server.url + "/tokenize", json={"messages": CHAT, "tools": [TOOL]}).json()
    expected = tok.apply_chat_template(
        CHAT, tools=[TOOL], add_generation_prompt=True, tokenize=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else list(expected)
    assert out["tokens"] == expected
    assert out["token_strs"] is None
    bad = httpx.post(server.url + "/tokenize", json={"messages": CHAT, "tools": [{"x": 1}]})
    assert bad.status_code == 400  # the tools are read (as a chat completion's), not ignored


def test_tokenizer_info_added_tokens_decoder_is_a_dict_of_settings(
    server: InProcessServer,
) -> None:
    info = httpx.get(server.url + "/tokenizer_info").json()
    added = info["added_tokens_decoder"]
    assert isinstance(added, dict) and added
    for token_id, token in added.items():
        assert token_id.isdigit()
        assert isinstance(token["content"], str) and isinstance(token["special"], bool)
    assert "vocab_file" not in info  # a path on the server's disk, as vLLM leaves it out


def test_a_template_without_tool_support_is_rendered_anyway(server: InProcessServer) -> None:
    assert "tool" not in (server.engine.tokenizer.chat_template or "")  # SmolLM2's template
    # (a random model writes the forced call's JSON with endless whitespace: the grammar holds it
    # to the calls' shape, and the test only asks that the request is served, not refused)
    for choice in ("none", "required"):
        body = {"messages": CHAT, "max_tokens": 8, "tools": [TOOL], "tool_choice": choice}
        out = post(server, "/chat/completions", body)
        assert out.status_code == 200, out.text
    required = out.json()["choices"][0]["message"]
    assert required["content"].lstrip().startswith("[")  # the calls' grammar was applied
    # A tool's answer in the history is rendered too (it used to be a 400 for this template).
    history = [*CHAT, {"role": "tool", "tool_call_id": "1", "content": "sunny"}]
    out = post(server, "/chat/completions", {"messages": history, "max_tokens": 4})
    assert out.status_code == 200, out.text


def test_out_of_range_seed_names_the_field_and_pydantics_error_type(
    server: InProcessServer,
) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    for seed, kind in ((-(2**63) - 1, "greater_than_equal"), (2**63, "less_than_equal")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="x", messages=CHAT, seed=seed)  # type: ignore[arg-type]
        assert kind in err.value.message and "seed" in err.value.message


def with_defs(name: str, unit_enum: list[str]) -> dict:
    """A tool whose parameters reach a sub-schema through `$ref` (pydantic writes them so)."""
    options = {"type": "object", "properties": {"unit": {"enum": unit_enum}}, "required": ["unit"]}
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "options": {"$ref": "#/$defs/Options"}},
        "required": ["city", "options"],
        "$defs": {"Options": options},
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_tool_parameters_with_defs_and_refs_build_their_grammar(server: InProcessServer) -> None:
    from minivllm.entrypoints.protocol_structured import ChatTool
    from minivllm.entrypoints.tool_parsers.forced import required_schema

    tool = with_defs("get_weather", ["celsius", "fahrenheit"])
    schema = required_schema([ChatTool.model_validate(tool)], parallel=True)
    assert schema["$defs"] == tool["function"]["parameters"]["$defs"]  # moved to the root
    assert "$defs" in tool["function"]["parameters"]  # the request's own schema is untouched
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        body = {"messages": CHAT, "max_tokens": 40, "tools": [tool], "tool_choice": choice}
        out = post(server, "/chat/completions", body)
        assert out.status_code == 200, out.text
        message = out.json()["choices"][0]["message"]
        assert message["content"] == "" or not message.get("tool_calls")  # vLLM's "" beside calls
    clash = [tool, with_defs("get_time", ["utc"])]  # one name, two schemas: vLLM refuses it
    body = {"messages": CHAT, "max_tokens": 8, "tools": clash, "tool_choice": "required"}
    out = post(server, "/chat/completions", body)
    assert out.status_code == 400 and "has multiple schemas" in out.json()["error"]["message"]


def test_a_custom_role_reaches_the_template_as_vllm_passes_it(server: InProcessServer) -> None:
    as_text = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    as_parts = [{"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}]
    outs = [
        post(server, "/chat/completions", {"messages": m, "max_tokens": 4, "temperature": 0})
        for m in (as_text, as_parts)
    ]
    assert all(o.status_code == 200 for o in outs), outs[0].text
    texts = [o.json()["choices"][0]["message"]["content"] for o in outs]
    assert texts[0] == texts[1]
    ids = httpx.post(server.url + "/tokenize", json={"messages": as_text}).json()["tokens"]
    assert "my-custom-role" in server.engine.tokenizer.decode(ids)


def test_completions_carry_system_fingerprint_and_logit_bias_names_the_vocabulary_size(
    server: InProcessServer,
) -> None:
    out = post(server, "/completions", {"prompt": "Hi", "max_tokens": 2}).json()
    assert "system_fingerprint" in out and out["system_fingerprint"] is None
    vocab = len(server.engine.tokenizer)
    body = {"messages": CHAT, "max_tokens": 2, "logit_bias": {str(vocab + 1): 1}}
    error = post(server, "/chat/completions", body).json()["error"]["message"]
    assert str(vocab + 1) in error and str(vocab) in error


def test_a_chat_completion_has_every_field_the_client_declares(server: InProcessServer) -> None:
    """vLLM's ChatCompletionResponse sends OpenAI's service_tier and system_fingerprint as null:
    the JSON then has the keys of the client's own model (what test_invocations compares)."""
    body = {"messages": CHAT, "max_completion_tokens": 2, "temperature": 0.0}
    raw = post(server, "/chat/completions", body).json()
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    name = httpx.get(server.base_url + "/models").json()["data"][0]["id"]
    parsed = client.chat.completions.create(model=name, **body)  # type: ignore[call-overload]
    declared = {"id", "object", "created", "model", "choices", "service_tier", "usage"}
    assert declared | {"system_fingerprint"} <= set(raw)
    assert raw["service_tier"] is None and raw["system_fingerprint"] is None
    assert set(raw) <= set(parsed.model_dump()), set(raw) - set(parsed.model_dump())
    # ... and each choice the keys of the client's Choice and ChatCompletionMessage (vLLM's
    # ChatMessage sends refusal, annotations, audio, function_call as null, tool_calls as []).
    dumped = parsed.model_dump()["choices"][0]
    assert raw["choices"][0] == dumped | {"message": raw["choices"][0]["message"]}
    assert raw["choices"][0]["message"] == dumped["message"]
    assert raw["choices"][0]["message"]["tool_calls"] == []
    completion = post(server, "/completions", {"prompt": "Hi", "max_tokens": 2}).json()
    assert completion["service_tier"] is None


def test_stop_reason_names_the_stop_that_ended_a_choice(server: InProcessServer) -> None:
    """vLLM's `stop_reason` beside finish_reason: the stop token id or string, else null."""
    probe = post(server, "/completions", {"prompt": "Hi", "max_tokens": 6, "temperature": 0})
    text = probe.json()["choices"][0]["text"]
    assert probe.json()["choices"][0]["stop_reason"] is None  # a length finish
    stop = text[2:4]
    body = {"prompt": "Hi", "max_tokens": 6, "temperature": 0, "stop": [stop]}
    choice = post(server, "/completions", body).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0}
    first = post(server, "/chat/completions", body).json()["choices"][0]
    token = server.engine.tokenizer.encode(first["message"]["content"])[1]
    chat = post(server, "/chat/completions", body | {"stop_token_ids": [token]}).json()
    assert chat["choices"][0]["stop_reason"] == token
    assert chat["choices"][0]["finish_reason"] == "stop"


def test_a_model_card_s_root_is_the_model_as_the_server_was_told_it(tiny_model: Path) -> None:
    """vLLM's /v1/models: `id` the served name, `root` the --model argument (its model_path)."""
    named = "some-org/some-model"
    with serve_tiny_model(tiny_model, served_model_names=[named], model_path=str(tiny_model)) as s:
        card = httpx.get(s.base_url + "/models").json()["data"][0]
    assert (card["id"], card["root"]) == (named, str(tiny_model))
    with serve_tiny_model(tiny_model) as s:  # unnamed: the checkpoint's own name, both
        card = httpx.get(s.base_url + "/models").json()["data"][0]
    assert card["id"] == card["root"] == tiny_model.name


def test_logprobs_past_max_logprobs_are_a_400_naming_the_limit(server: InProcessServer) -> None:
    # The default --max-logprobs is vLLM's 20; -1 asks for the vocabulary (49152), past it.
    for body in (
        {"prompt": "Hi", "max_tokens": 1, "prompt_logprobs": -1},
        {"prompt": "Hi", "max_tokens": 1, "logprobs": 21},
    ):
        out = post(server, "/completions", body)
        assert out.status_code == 400, out.text
        assert "greater than max allowed: 20" in out.json()["error"]["message"]
    chat = {"messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": -1}
    out = post(server, "/chat/completions", chat)
    assert out.status_code == 400 and "sample logprobs of 49152" in out.json()["error"]["message"]
    out = post(server, "/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": -2})
    assert out.status_code == 400 and "non-negative or -1" in out.json()["error"]["message"]


@pytest.fixture(scope="module")
def whole_vocab_server(tiny_model: Path):
    with serve_tiny_model(tiny_model, engine_args={"max_logprobs": -1}) as s:
        yield s


def test_minus_one_is_the_whole_vocabulary_when_max_logprobs_allows_it(
    whole_vocab_server: InProcessServer,
) -> None:
    vocab = whole_vocab_server.engine.vocab_size
    body = {"prompt": "Hello there", "max_tokens": 1, "prompt_logprobs": -1}
    choice = post(whole_vocab_server, "/completions", body).json()["choices"][0]
    first, *rest = choice["prompt_logprobs"]
    assert first is None and rest and all(len(entry) == vocab for entry in rest)
    chat = {"messages": CHAT, "max_tokens": 1, "logprobs": "true", "top_logprobs": -1}
    out = post(whole_vocab_server, "/chat/completions", chat)
    assert out.status_code == 200, out.text
    (token,) = out.json()["choices"][0]["logprobs"]["content"]
    assert len(token["top_logprobs"]) == vocab


def test_empty_prompt_embeds_are_no_embeddings_and_others_are_refused_by_name(
    server: InProcessServer,
) -> None:
    out = post(server, "/completions", {"prompt": "Hi", "max_tokens": 1, "prompt_embeds": []})
    assert out.status_code == 200, out.text
    out = post(server, "/completions", {"prompt": "Hi", "max_tokens": 1, "prompt_embeds": "AAAA"})
    assert out.status_code == 400 and out.json()["error"]["param"] == "prompt_embeds"
    out = post(server, "/completions", {"prompt": "", "max_tokens": 1, "prompt_embeds": []})
    message = "Either prompt or prompt_embeds must be provided and non-empty."  # vLLM's words
    assert out.status_code == 400 and out.json()["error"]["message"] == message


def test_legacy_top_logprobs_start_with_the_position_s_own_token_as_vllm_orders_them(
    server: InProcessServer,
) -> None:
    # Sampled at a high temperature so that some tokens are not the top one; echo scores the
    # prompt's tokens too, which are rarely the model's top guess.
    body = {"prompt": "Say hello to the world", "max_tokens": 6, "echo": True, "logprobs": 2}
    body |= {"temperature": 2.0, "seed": 1, "return_tokens_as_token_ids": True}
    lp = post(server, "/completions", body).json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None  # the first prompt token: nothing predicts it
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]):
        assert next(iter(top)) == token and 2 <= len(top) <= 3

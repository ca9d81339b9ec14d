"""`VLLM_API_KEY` protects the server as `--api-key` does; the flag wins when both are set."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from minivllm.entrypoints.api_key import resolve_api_key
from tests.utils.server_utils import RemoteServer, run_server

ARGS = ["--max-model-len", "256"]


@pytest.fixture(scope="module")
def env_key_server() -> Iterator[RemoteServer]:
    """A server keyed by the variable alone, behind `--root-path /llm`: it serves every route
    with and without the root, so the variable's guard on the plain routes and the root path's
    routing are asked of one server."""
    with run_server([*ARGS, "--root-path", "/llm"], env={"VLLM_API_KEY": "sk-env"}) as server:
        yield server


def test_resolve_api_key_prefers_the_flag_then_the_variable() -> None:
    assert resolve_api_key("flag", {"VLLM_API_KEY": "env"}) == "flag"
    assert resolve_api_key(None, {"VLLM_API_KEY": "env"}) == "env"
    assert resolve_api_key(None, {"VLLM_API_KEY": ""}) is None
    assert resolve_api_key(None, {}) is None


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def test_vllm_api_key_variable_guards_v1_but_not_health(env_key_server: RemoteServer) -> None:
    server = env_key_server
    with pytest.raises(openai.AuthenticationError) as wrong:
        _client(server.base_url, "sk-wrong").models.list()
    assert wrong.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        _client(server.base_url, "sk-wrong").completions.create(
            model="any", prompt="Hi", max_tokens=1
        )
    right = _client(server.base_url, "sk-env")
    model = right.models.list().data[0].id
    done = right.completions.create(model=model, prompt="Hi", max_tokens=1)
    assert done.choices[0].text is not None
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key_flag_wins_over_the_variable() -> None:
    with run_server([*ARGS, "--api-key", "sk-flag"], env={"VLLM_API_KEY": "sk-env"}) as server:
        with pytest.raises(openai.AuthenticationError):
            _client(server.base_url, "sk-env").models.list()
        assert _client(server.base_url, "sk-flag").models.list().data


def test_root_path_routes_with_and_without_the_root_and_guards_both(
    env_key_server: RemoteServer,
) -> None:
    """vLLM's --root-path: a proxy may strip the root or pass it on; either way the key holds."""
    server = env_key_server
    for base in (server.url + "/v1", server.url + "/llm/v1"):
        with pytest.raises(openai.AuthenticationError):
            _client(base, "sk-wrong").models.list()
        right = _client(base, "sk-env")
        model = right.models.list().data[0].id
        chat = right.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert chat.choices[0].message.role == "assistant"
    assert httpx.get(server.url + "/llm/health").status_code == 200

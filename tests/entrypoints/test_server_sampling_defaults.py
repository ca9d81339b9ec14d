"""The model's sampling defaults (generation_config.json, through the engine's
`get_diff_sampling_param()`) apply to every field a request leaves out, as in vLLM; a value the
client sends always wins; without model defaults, the server's own (OpenAI's) apply.

The unit tests give `OpenAIServing` a stand-in engine that only answers what it reads; the last
test injects the defaults into a real engine and reads the `SamplingParams` the server hands it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from minivllm.entrypoints.serving import OpenAIServing
from minivllm.entrypoints.serving_models import BaseModelPath, OpenAIServingModels
from minivllm.sampling_params import SamplingParams
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import serve_in_process

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def serving(defaults: dict[str, Any], max_model_len: int = 64) -> OpenAIServing:
    client = SimpleNamespace(  # the facts of an `EngineClient` that the checks read
        tokenizer=None,
        max_model_len=max_model_len,
        vocab_size=256,
        get_diff_sampling_param=lambda: defaults,
        config=SimpleNamespace(model=SimpleNamespace(max_logprobs=20)),  # vLLM's default
    )
    models = OpenAIServingModels(client, [BaseModelPath("m", "m")])  # type: ignore[arg-type]
    return OpenAIServing(client, models, 8, 8)  # type: ignore[arg-type]


def params_for(s: OpenAIServing, body: str, num_prompt: int = 10) -> SamplingParams:
    req, filled = s.with_model_defaults(CompletionRequest.model_validate_json(body))
    max_tokens = s.max_tokens(req.max_tokens, num_prompt, "max_tokens", "max_tokens" in filled)
    return s.sampling_params(req, max_tokens, req.logprobs)


def test_fields_the_client_left_out_take_the_models_defaults() -> None:
    p = params_for(serving(MODEL_DEFAULTS), '{"prompt": "x", "top_p": 0.5}')
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.5, 20, 1.1)


def test_a_value_the_client_sent_wins_even_the_servers_own_default() -> None:
    body = '{"prompt": "x", "temperature": 1.0, "top_k": 0, "repetition_penalty": 1.0}'
    p = params_for(serving(MODEL_DEFAULTS), body)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 0.9, 0, 1.0)


def test_null_counts_as_left_out() -> None:
    p = params_for(serving(MODEL_DEFAULTS), '{"prompt": "x", "temperature": null}')
    assert p.temperature == 0.6


def test_without_model_defaults_the_servers_defaults_apply() -> None:
    p = params_for(serving({}), '{"prompt": "x"}')
    default = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (
        default.temperature,
        default.top_p,
        default.top_k,
        16,  # OpenAI's max_tokens for completions
    )


def test_a_default_max_tokens_is_cut_to_the_context_a_requested_one_is_refused() -> None:
    s = serving({"max_tokens": 1000}, max_model_len=64)
    assert params_for(s, '{"prompt": "x"}', num_prompt=10).max_tokens == 54
    with pytest.raises(OpenAIError, match="maximum context length") as err:
        params_for(s, '{"prompt": "x", "max_tokens": 1000}', num_prompt=10)
    assert err.value.param == "max_tokens"


def test_chat_takes_the_same_defaults() -> None:
    s = serving(MODEL_DEFAULTS)
    body = '{"messages": [{"role": "user", "content": "hi"}], "top_k": 5}'
    req, filled = s.with_model_defaults(ChatCompletionRequest.model_validate_json(body))
    assert filled == {"temperature", "top_p", "repetition_penalty"}
    assert (req.temperature, req.top_p, req.top_k) == (0.6, 0.9, 5)


def test_the_server_hands_the_engine_the_models_defaults(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    config = EngineArgs(
        model=str(model), max_model_len=64, block_size=4, num_gpu_blocks_override=64
    ).create_engine_config()
    engine = LLMEngine(config)
    monkeypatch.setattr(engine, "get_diff_sampling_param", lambda: dict(MODEL_DEFAULTS))
    with serve_in_process(engine) as server:
        sent: list[SamplingParams] = []
        engine_client = server.app.state.engine_client
        add_request = engine_client.add_request

        def spy(request_id: str, prompt: Any, params: SamplingParams, *rest: Any) -> None:
            sent.append(params)
            add_request(request_id, prompt, params, *rest)

        monkeypatch.setattr(engine_client, "add_request", spy)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_p": 0.5}
        completion = {"prompt": "hi", "max_tokens": 2, "temperature": 0.8}
        for path, body in (("/chat/completions", chat), ("/completions", completion)):
            r = httpx.post(server.base_url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
    by_field = [(p.temperature, p.top_p, p.top_k, p.repetition_penalty) for p in sent]
    assert by_field == [(0.6, 0.5, 20, 1.1), (0.8, 0.9, 20, 1.1)]

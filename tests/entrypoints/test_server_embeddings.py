"""`/v1/embeddings` on a pooling model, through the `openai` client and raw HTTP: OpenAI's shape
(float and base64), `dimensions`, `usage`, the 4xx of hostile inputs, and `/v1/models` telling a
pooling model from a generator (minivllm/entrypoints/serving_embedding.py)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.utils.engine_utils import save_tiny_llama
from tests.utils.pooling_utils import save_st_model, save_tiny_decoder, st_encode
from tests.utils.server_utils import InProcessServer, serve_tiny_model

TEXTS = ["hello world", "The capital of France is Paris."]


@pytest.fixture(scope="module")
def st_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("embed")
    base = save_tiny_decoder(root / "base", "qwen3")
    return save_st_model(root / "st", base, "lasttoken", normalize=True)


@pytest.fixture(scope="module")
def server(st_model: Path) -> Iterator[InProcessServer]:
    args = {
        "pooler_config": {"matryoshka_dimensions": [16, 32]},
        "enforce_eager": True,
        "dtype": "float32",  # held to sentence-transformers' float32 vectors
    }
    with serve_tiny_model(st_model, args, served_model_names=["embedder"]) as s:
        yield s


def test_openai_client_embeddings_equal_sentence_transformers(
    server: InProcessServer, st_model: Path
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="x")
    ref = st_encode(st_model, TEXTS)
    resp = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    ours = torch.tensor([d.embedding for d in resp.data])
    assert [d.index for d in resp.data] == [0, 1] and resp.model == "embedder"
    assert torch.nn.functional.cosine_similarity(ours, ref).min() >= 0.99999
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > 0
    # Asked for explicitly, base64 comes back as sent: float32 little-endian bytes.
    raw = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]
    torch.testing.assert_close(torch.tensor(np.stack(decoded)), ours)
    # Left unset, the client asks for base64 and decodes it itself.
    default = client.embeddings.create(model="embedder", input=TEXTS)
    torch.testing.assert_close(torch.tensor([d.embedding for d in default.data]), ours)


def test_token_ids_and_dimensions(server: InProcessServer) -> None:
    url = server.base_url + "/embeddings"
    ids = [[28120, 905], [81, 278, 265]]
    body = httpx.post(url, json={"input": ids, "dimensions": 16}, timeout=60).json()
    assert [len(d["embedding"]) for d in body["data"]] == [16, 16]
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    one = httpx.post(url, json={"input": ids[0]}, timeout=60).json()  # a flat list: one input
    assert len(one["data"]) == 1
    cut = torch.tensor(one["data"][0]["embedding"][:16])
    torch.testing.assert_close(
        torch.tensor(body["data"][0]["embedding"]), torch.nn.functional.normalize(cut, dim=0)
    )


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", "must not be empty"),
        ({"input": [[]]}, "input", "must not be empty"),
        ({"input": [10**9]}, "input", "out of vocabulary"),
        ({"input": "word " * 300}, "input", "maximum context length is 256"),
        ({"input": 5}, "input", "type="),
        ({"input": ["a", 1]}, "input", "type="),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", "type="),
        ({"input": "a", "dimensions": 0}, "dimensions", "dimensions must be at least 1"),
        ({"input": "a", "dimensions": 8}, "dimensions", "dimensions must be one of"),
        ({"input": "a", "best_of": 2}, "best_of", "Unrecognized request argument"),
        ({"input": "a", "model": "other"}, "model", "does not exist"),
    ],
)
def test_hostile_inputs_are_4xx_in_openai_shape(
    server: InProcessServer, body: dict[str, object], param: str, match: str
) -> None:
    resp = httpx.post(server.base_url + "/embeddings", json=body, timeout=60)
    assert 400 <= resp.status_code < 500, resp.text
    error = resp.json()["error"]
    assert error["param"].split(".")[0] == param, error  # a union's branch may follow: input.str
    assert match in error["message"], error
    assert server.wait_idle().num_kv_blocks == server.wait_idle().num_free_kv_blocks


def test_generation_on_a_pooling_model_is_a_400_naming_the_task(server: InProcessServer) -> None:
    for path, body in (
        ("/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        resp = httpx.post(server.base_url + path, json=body, timeout=60)
        assert resp.status_code == 400
        assert "runner='pooling' (task 'embed')" in resp.json()["error"]["message"]


def test_models_tell_a_pooling_model_from_a_generator(
    server: InProcessServer, tmp_path: Path
) -> None:
    card = httpx.get(server.base_url + "/models", timeout=10).json()["data"][0]
    assert card["task"] == "embed"
    with serve_tiny_model(save_tiny_llama(tmp_path / "lm"), {"enforce_eager": True}) as gen:
        assert httpx.get(gen.base_url + "/models", timeout=10).json()["data"][0]["task"] == (
            "generate"
        )
        resp = httpx.post(gen.base_url + "/embeddings", json={"input": "hi"}, timeout=10)
        assert resp.status_code == 404  # a generator's server has no embeddings route
        resp = httpx.post(gen.url + "/classify", json={"input": "hi"}, timeout=10)
        assert resp.status_code == 400  # vLLM's /classify is on every server: it names the task
        assert "task 'generate'" in resp.json()["error"]["message"]

"""`/score`, `/rerank`, `/v1/rerank`, `/pooling` and `/classify` on a BERT cross-encoder and a
BERT embedding model: the same numbers as `LLM.score`, sentence-transformers and transformers,
vLLM's (Jina's, Cohere's) shape, and the 4xx of hostile bodies in OpenAI's error shape
(minivllm/entrypoints/serving_score.py). The embedding model's server runs its engine in an
engine-core process of its own (minivllm/engine/core_client.py), as `minivllm serve
--engine-core-process` does: pooling requests and their outputs cross that pipe too."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from minivllm import LLM
from tests.utils.pooling_utils import save_st_model, save_tiny_bert, st_encode
from tests.utils.server_utils import InProcessServer, serve_tiny_model

QUERY = "what is the capital of france"
DOCS = ["the cat sat on the mat", "paris is the capital of france", "rome is in italy", "a"]
ARGS = {"enforce_eager": True, "dtype": "float32"}  # held to float32 references


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("ce") / "ce", num_labels=1, seed=3)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("minilm")
    return save_st_model(root / "st", save_tiny_bert(root / "base"), "mean", normalize=True)


@pytest.fixture(scope="module")
def ce_server(cross_encoder: Path) -> Iterator[InProcessServer]:
    with serve_tiny_model(cross_encoder, ARGS, served_model_names=["reranker"]) as s:
        yield s


@pytest.fixture(scope="module")
def embed_server(minilm: Path) -> Iterator[InProcessServer]:
    with serve_tiny_model(minilm, ARGS, True, served_model_names=["embedder"]) as s:
        yield s


def post(server: InProcessServer, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_score_and_rerank_equal_llm_score_on_a_cross_encoder(
    ce_server: InProcessServer, cross_encoder: Path
) -> None:
    llm = LLM(str(cross_encoder), num_gpu_blocks_override=64, **ARGS)
    offline = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    llm.shutdown()
    score = post(ce_server, "/score", {"model": "reranker", "text_1": QUERY, "text_2": DOCS})
    assert score.status_code == 200, score.text
    body = score.json()
    assert body["object"] == "list" and body["model"] == "reranker"
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    scores = [d["score"] for d in body["data"]]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(offline), atol=1e-6, rtol=0)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0

    for path in ("/rerank", "/v1/rerank"):
        rerank = post(ce_server, path, {"query": QUERY, "documents": DOCS, "top_n": 3}).json()
        results = rerank["results"]
        assert len(results) == 3
        best_first = sorted(range(len(DOCS)), key=lambda i: -offline[i])[:3]
        assert [r["index"] for r in results] == best_first
        for r in results:
            assert r["document"] == {"text": DOCS[r["index"]]}
            assert abs(r["relevance_score"] - scores[r["index"]]) < 1e-6
        assert rerank["usage"]["total_tokens"] == body["usage"]["total_tokens"]
    every = post(ce_server, "/rerank", {"query": QUERY, "documents": DOCS}).json()
    assert len(every["results"]) == len(DOCS)  # top_n unset: every document


def test_pooling_route_gives_the_classifier_s_probability(ce_server: InProcessServer) -> None:
    """/pooling on a cross-encoder: the sigmoid of the logit of an input read alone."""
    resp = post(ce_server, "/pooling", {"input": [DOCS[1]]})
    assert resp.status_code == 200, resp.text
    (data,) = resp.json()["data"]
    assert data["object"] == "pooling" and len(data["data"]) == 1
    assert 0.0 < data["data"][0] < 1.0


def test_rerank_on_an_embedding_model_is_the_cosine_of_sentence_transformers(
    embed_server: InProcessServer, minilm: Path
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = st_encode(minilm, [QUERY, *DOCS])
    cosines = torch.nn.functional.cosine_similarity(ref[:1], ref[1:])
    results = post(embed_server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
    got = {r["index"]: r["relevance_score"] for r in results["results"]}
    torch.testing.assert_close(torch.tensor([got[i] for i in range(len(DOCS))]), cosines)
    scores = post(embed_server, "/score", {"text_1": [QUERY] * 4, "text_2": DOCS}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in scores["data"]]), cosines)
    embeddings = post(embed_server, "/v1/embeddings", {"input": [QUERY, *DOCS]}).json()
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in embeddings["data"]]), ref)
    stats = embed_server.wait_idle()  # the core's, after its last step
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    resp = post(embed_server, "/classify", {"input": QUERY})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "model"
    assert "task 'embed'" in resp.json()["error"]["message"]


def test_classify_gives_transformers_probabilities_and_labels(
    ce_server: InProcessServer, cross_encoder: Path
) -> None:
    """vLLM's /classify shape; one label: the sigmoid of transformers' logit of each input."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    texts = [QUERY, *DOCS]
    resp = post(ce_server, "/classify", {"model": "reranker", "input": texts})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    assert body["model"] == "reranker" and isinstance(body["created"], int)
    tok = AutoTokenizer.from_pretrained(cross_encoder)
    hf = BertForSequenceClassification.from_pretrained(cross_encoder).eval()
    with torch.no_grad():
        logits = hf(**tok(texts, padding=True, return_tensors="pt")).logits  # [5, 1]
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert {(d["label"], d["num_classes"]) for d in body["data"]} == {("LABEL_0", 1)}
    probs = torch.tensor([d["probs"] for d in body["data"]])
    torch.testing.assert_close(probs, torch.sigmoid(logits), atol=1e-5, rtol=0)
    num_tokens = sum(len(ids) for ids in tok(texts)["input_ids"])
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


@pytest.mark.parametrize(
    ("path", "body", "param", "match"),
    [
        ("/rerank", {"query": QUERY, "documents": []}, "documents", "must not be empty"),
        ("/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents", "empty text"),
        ("/rerank", {"query": "", "documents": ["a"]}, "query", "empty text"),
        ("/rerank", {"query": QUERY, "documents": "a"}, "documents", "type="),
        ("/rerank", {"query": QUERY, "documents": ["a", 1]}, "documents", "type="),
        ("/rerank", {"documents": ["a"]}, "query", "missing required field"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n", "at least 0"),
        ("/v1/rerank", {"query": QUERY, "documents": ["word " * 300]}, "documents", "maximum"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1", "as many as"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2", "must not be empty"),
        ("/score", {"text_1": 3, "text_2": ["a"]}, "text_1", "type="),
        ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, None, "trunc"),
        ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model", "does not exist"),
        ("/score", {"text_1": "a", "text_2": "b", "n": 2}, "n", "Unrecognized"),
        ("/pooling", {"input": []}, "input", "must not be empty"),
        ("/classify", {"input": []}, "input", "must not be empty"),
        ("/classify", {"input": "word " * 300}, "input", "maximum context length"),
        ("/classify", {"input": "a", "top_n": 1}, "top_n", "Unrecognized"),
        ("/classify", {"input": "a", "model": "other"}, "model", "does not exist"),
    ],
)
def test_hostile_score_and_rerank_bodies_are_4xx_in_openai_shape(
    ce_server: InProcessServer, path: str, body: dict[str, object], param: str | None, match: str
) -> None:
    resp = post(ce_server, path, body)
    assert 400 <= resp.status_code < 500, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    if param is not None:
        assert error["param"].split(".")[0] == param, error
    assert match in error["message"], error
    assert ce_server.wait_idle().num_kv_blocks == ce_server.wait_idle().num_free_kv_blocks

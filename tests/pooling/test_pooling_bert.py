"""BERT on the pooling runner: embeddings equal sentence-transformers' `encode`, a cross-encoder's
scores equal its `CrossEncoder.predict`, a classifier's probabilities equal transformers' softmax;
whatever the batch and the attention backend (minivllm/model/models/bert.py, the
encoder-only attention of every backend, minivllm/attention/)."""

from __future__ import annotations

import json
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, PoolingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.model.resolver import resolve_pooling_dtype
from minivllm.platforms import cpu as cpu_platform
from minivllm.platforms.cpu import CpuPlatform
from tests.utils.engine_utils import assert_no_blocks_held
from tests.utils.pooling_utils import save_st_model, save_tiny_bert, save_tiny_decoder, st_encode

TEXTS = [
    "hello world",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "a",
    " ".join(f"word{i}" for i in range(12)),  # ~60 tokens, letter by letter
    "Embeddings map text to vectors.",
]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on the mat", "rome is in italy", "a"]
# float32, not the pooling default (float16, vLLM's): the tests hold it to float32 references
SMALL = {"num_gpu_blocks_override": 64, "enforce_eager": True, "dtype": "float32"}
BACKENDS = ["reference", "cpu"]


def embeddings(llm: LLM, texts: list[str]) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM's layout: a BertModel, sentence-transformers' mean pooling, no Normalize."""
    root = tmp_path_factory.mktemp("bert_mean")
    return save_st_model(root / "st", save_tiny_bert(root / "base"), "mean", normalize=False)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ms-marco-MiniLM's layout: a BertForSequenceClassification with one label."""
    return save_tiny_bert(tmp_path_factory.mktemp("bert_ce") / "ce", num_labels=1, seed=3)


@pytest.fixture(scope="module", params=BACKENDS)
def minilm_llm(request: pytest.FixtureRequest, minilm: Path) -> Iterator[LLM]:
    llm = LLM(str(minilm), attention_backend=request.param, **SMALL)
    yield llm
    llm.shutdown()


def test_bert_mean_embeddings_equal_sentence_transformers(minilm_llm: LLM, minilm: Path) -> None:
    pooler = minilm_llm.llm_engine.pooler
    assert pooler is not None and (pooler.pooling_type, pooler.causal) == ("MEAN", False)
    ours = embeddings(minilm_llm, TEXTS)
    ref = st_encode(minilm, TEXTS)
    assert ours.shape == ref.shape == (len(TEXTS), 64)
    assert F.cosine_similarity(ours, ref).min() >= 0.99999
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)  # not normalized: same length
    assert_no_blocks_held(minilm_llm)


def test_pooling_dtype_auto_is_vllm_s_float16_and_stays_near_float32(
    minilm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's `dtype="auto"` for a pooling model (vllm/config/model.py `_resolve_auto_dtype`): a
    float32 checkpoint runs in float16 on the CPU too, a bfloat16 one in bfloat16; an explicit
    dtype is kept, and a generator's "auto" is unchanged. The one deviation: a CPU that only
    emulates float16 (no AVX512-FP16 or AMX-FP16) keeps the float32 checkpoint's float32. The
    float16 run's embeddings stay within float16's rounding of sentence-transformers' float32
    ones, through the CPU backend's kernels (on AMX-BF16 tiles where the CPU has them)."""
    emulated = CpuPlatform().slow_dtype_note(torch.float16) is not None
    resolved = EngineArgs(model=str(minilm)).create_engine_config().resolved
    assert resolved.dtype == (torch.float32 if emulated else torch.float16)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_platform, "float16_matmul", lambda: False)
        assert resolve_pooling_dtype(torch.float32, torch.device("cpu")) == torch.float32
        assert resolve_pooling_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
        patch.setattr(cpu_platform, "float16_matmul", lambda: True)
        assert resolve_pooling_dtype(torch.float32, torch.device("cpu")) == torch.float16
    explicit = EngineArgs(model=str(minilm), dtype="float32").create_engine_config()
    assert explicit.resolved.dtype == torch.float32
    bf16 = tmp_path / "bf16"
    shutil.copytree(minilm, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert EngineArgs(model=str(bf16)).create_engine_config().resolved.dtype == torch.bfloat16
    generator = EngineArgs(model=str(save_tiny_decoder(tmp_path / "lm", "llama")))
    assert generator.create_engine_config().resolved.dtype == torch.float32
    llm = LLM(str(minilm), **{**SMALL, "dtype": "auto"})
    ours = embeddings(llm, TEXTS)
    llm.shutdown()
    assert F.cosine_similarity(ours, st_encode(minilm, TEXTS)).min() >= 0.9999


def test_bert_embeddings_on_the_triton_backend_equal_sentence_transformers(minilm: Path) -> None:
    """The Triton encoder kernel (in Triton's interpreter) end to end: no refusal, the same
    vectors (minivllm/attention/backends/triton_encoder_kernels.py)."""
    llm = LLM(str(minilm), attention_backend="triton", **SMALL)
    ours = embeddings(llm, TEXTS)
    llm.shutdown()
    torch.testing.assert_close(ours, st_encode(minilm, TEXTS), atol=1e-5, rtol=1e-5)


def test_bert_embeddings_do_not_depend_on_the_batch(minilm_llm: LLM) -> None:
    """Bidirectional attention sees its own prompt only: one at a time, all together or
    shuffled, every text gets the same vector."""
    together = embeddings(minilm_llm, TEXTS)
    alone = torch.cat([embeddings(minilm_llm, [t]) for t in TEXTS])
    order = list(range(len(TEXTS)))
    random.Random(0).shuffle(order)
    shuffled = embeddings(minilm_llm, [TEXTS[i] for i in order])
    torch.testing.assert_close(alone, together, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(shuffled, together[order], atol=1e-6, rtol=1e-6)


def test_encoder_prompts_run_whole_without_prefix_caching_or_kv_blocks(minilm: Path) -> None:
    """A token budget smaller than a prompt would chunk it; an encoder's must run whole, so the
    budget is raised to max_model_len and chunked prefill is off (as is the prefix cache). Its
    attention reads no cache, so it holds no KV blocks at all (num_gpu_blocks_override aside)."""
    llm = LLM(str(minilm), max_num_batched_tokens=8, max_num_seqs=2, **SMALL)
    engine = llm.llm_engine
    config = engine.config
    assert config.scheduler.enable_chunked_prefill is False
    assert config.scheduler.max_num_batched_tokens >= config.resolved.max_model_len
    assert config.cache.enable_prefix_caching is False
    assert type(engine.kv_cache_manager).__name__ == "EncoderOnlyKVCacheManager"
    assert engine.runner.kv_cache.shape[2] == 0 and llm.get_stats().num_kv_blocks == 0
    torch.testing.assert_close(embeddings(llm, TEXTS), st_encode(minilm, TEXTS), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="max_model_len"):  # too long for its positions: refused
        llm.embed({"prompt_token_ids": [2] * (engine.max_model_len + 1)}, use_tqdm=False)
    assert_no_blocks_held(llm)
    llm.shutdown()


def test_bare_bert_pools_cls_and_normalizes_like_transformers(tmp_path: Path) -> None:
    """A BertModel folder without sentence-transformers files: [CLS] of the last hidden state,
    normalized (vLLM's default for an encoder's `embed`)."""
    from transformers import AutoTokenizer, BertModel

    base = save_tiny_bert(tmp_path / "bert", seed=2)
    llm = LLM(str(base), **SMALL)
    ours = embeddings(llm, TEXTS[:3])
    llm.shutdown()
    tok = AutoTokenizer.from_pretrained(str(base))
    model = BertModel.from_pretrained(str(base)).eval()
    with torch.no_grad():
        refs = [model(**tok(t, return_tensors="pt")).last_hidden_state[0, 0] for t in TEXTS[:3]]
    ref = F.normalize(torch.stack(refs), dim=-1)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_encoder_scores_equal_crossencoder_predict(cross_encoder: Path, backend: str) -> None:
    """One logit through a sigmoid, the pair tokenized as the tokenizer pairs texts (token
    types 0 then 1): sentence-transformers' `CrossEncoder.predict` with its default activation."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import CrossEncoder

    ref = CrossEncoder(str(cross_encoder), device="cpu").predict([(QUERY, d) for d in DOCS])
    llm = LLM(str(cross_encoder), attention_backend=backend, **SMALL)
    ours = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    pairwise = [o.outputs.score for o in llm.score([QUERY] * len(DOCS), DOCS, use_tqdm=False)]
    assert_no_blocks_held(llm)
    llm.shutdown()
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), atol=1e-5, rtol=0)
    assert pairwise == ours


def test_cross_encoder_pair_token_types_change_the_score(cross_encoder: Path) -> None:
    """The token types reach the model: the same ids with every type 0 score differently."""
    llm = LLM(str(cross_encoder), **SMALL)
    tok = llm.get_tokenizer()
    enc = tok(QUERY, DOCS[0])
    typed = {"prompt_token_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"]}
    untyped = {"prompt_token_ids": enc["input_ids"]}
    (a, b) = llm.classify([typed, untyped], use_tqdm=False)
    (scored,) = llm.score(QUERY, DOCS[0], use_tqdm=False)
    llm.shutdown()
    assert a.outputs.probs == [scored.outputs.score]
    assert abs(a.outputs.probs[0] - b.outputs.probs[0]) > 1e-4


def test_classify_probs_equal_transformers_softmax(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = save_tiny_bert(tmp_path / "clf", num_labels=3, seed=4)
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        logits = torch.cat([model(**tok(t, return_tensors="pt")).logits for t in TEXTS])
    llm = LLM(str(path), **SMALL)
    probs = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    raw = llm.classify(TEXTS, PoolingParams(activation=False), use_tqdm=False)
    with pytest.raises(ValueError, match="score needs a cross-encoder"):
        llm.score(QUERY, DOCS)
    with pytest.raises(ValueError, match="embed is not supported"):
        llm.embed(TEXTS)
    llm.shutdown()
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        torch.tensor([o.outputs.probs for o in raw]), logits, atol=1e-5, rtol=0
    )


def test_token_type_ids_are_refused_when_malformed(cross_encoder: Path) -> None:
    llm = LLM(str(cross_encoder), **SMALL)
    with pytest.raises(ValueError, match="token_type_ids must be 3 values"):
        llm.classify({"prompt_token_ids": [2, 50, 3], "token_type_ids": [0, 2, 1]})
    with pytest.raises(ValueError, match="token_type_ids must be 3 values"):
        llm.classify({"prompt_token_ids": [2, 50, 3], "token_type_ids": [0, 1]})
    assert_no_blocks_held(llm)
    llm.shutdown()


def test_convert_classify_needs_a_classifier_checkpoint(minilm: Path) -> None:
    with pytest.raises(ValueError, match="convert='classify' needs a classifier checkpoint"):
        LLM(str(minilm), convert="classify", **SMALL)

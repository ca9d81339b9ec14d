"""Embedding GGUF files as llama.cpp writes them: the `bert` architecture with its WordPiece
vocabulary, and a decoder with `{arch}.pooling_type` (Qwen3-Embedding's). Each file is written by
tests/utils/llama_cpp_embed.py from a tiny random checkpoint that sentence-transformers saved, and
must embed as sentence-transformers' `encode` does on that checkpoint
(minivllm/model/quantization/gguf/: config, reader, tokenizer, loader)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM
from minivllm.model.config import UnsupportedModelError
from minivllm.model.quantization.gguf.blocks import Q8_0
from tests.pooling.test_pooling_bert import SMALL, TEXTS
from tests.utils.llama_cpp_convert import use_own_cache
from tests.utils.llama_cpp_embed import convert_bert, convert_decoder_embedding
from tests.utils.pooling_utils import save_st_model, save_tiny_bert, save_tiny_decoder, st_encode

F16 = 1


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Qwen3-Embedding's layout (a tiny Qwen3, last token, Normalize): its transformers folder
    and its sentence-transformers folder."""
    root = tmp_path_factory.mktemp("qwen3_gguf")
    base = save_tiny_decoder(root / "base", "qwen3")
    return base, save_st_model(root / "st", base, "lasttoken", normalize=True)


@pytest.fixture(scope="module", autouse=True)
def own_cache(
    tmp_path_factory: pytest.TempPathFactory, qwen3_embedding: tuple[Path, Path]
) -> Iterator[None]:
    """The converted folders go to this module's cache, not the machine's; once the tiny Qwen3
    is saved, whose tokenizer is the bundled model's, converted in the machine's cache."""
    with pytest.MonkeyPatch.context() as patch:
        use_own_cache(tmp_path_factory.mktemp("cache"), patch)
        yield


@pytest.fixture(scope="module")
def bert_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """all-MiniLM's layout (mean pooling, no Normalize) and bge's (CLS, Normalize)."""
    root = tmp_path_factory.mktemp("bert_gguf")
    return {
        "mean": save_st_model(root / "mean", save_tiny_bert(root / "b0"), "mean", False),
        "cls": save_st_model(root / "cls", save_tiny_bert(root / "b1", seed=1), "cls", True),
    }


def embed(path: Path, texts: list, **kwargs: object) -> tuple[torch.Tensor, LLM]:
    llm = LLM(str(path), **SMALL, **kwargs)
    vectors = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    llm.shutdown()
    return vectors, llm


@pytest.mark.parametrize(
    ("pooling", "quantization"), [("mean", "gguf"), ("mean", "none"), ("cls", "gguf")]
)
def test_a_bert_gguf_file_embeds_as_sentence_transformers(
    bert_models: dict[str, Path], tmp_path: Path, pooling: str, quantization: str
) -> None:
    """F32 weights, read as stored or dequantized into the converted folder: the file's
    `bert.pooling_type` pools, and the vector equals `encode`'s; normalized, as vLLM's `embed`
    is by default (the file does not say whether a Normalize module followed)."""
    folder = bert_models[pooling]
    path = convert_bert(folder, tmp_path / "bert.gguf")
    ours, llm = embed(path, TEXTS, quantization=quantization)
    pooler = llm.llm_engine.pooler
    assert pooler is not None
    assert (pooler.pooling_type, pooler.normalize, pooler.causal) == (pooling.upper(), True, False)
    ref = st_encode(folder, TEXTS)
    assert F.cosine_similarity(ours, ref).min() >= 0.99999
    torch.testing.assert_close(ours, F.normalize(ref, dim=-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("qtype", "min_cosine"), [(F16, 0.99999), (Q8_0, 0.999)])
def test_f16_and_q8_0_bert_files_run_through_the_gguf_linears(
    bert_models: dict[str, Path], tmp_path: Path, qtype: int, min_cosine: float
) -> None:
    """The converter's types: F16 weights load as floats; Q8_0 blocks stay blocks in the token
    embedding and every linear (position and token-type embeddings, norms and biases are F32).
    Q8_0 rounds each weight to 8 bits, hence the looser cosine."""
    path = convert_bert(bert_models["mean"], tmp_path / "bert.gguf", qtype=qtype)
    llm = LLM(str(path), **SMALL)
    model = llm.llm_engine.runner.model
    layer = model.model.layers[1]
    linears = [
        layer.attention.qkv_proj,
        layer.attention.output.dense,
        layer.intermediate.dense,
        layer.output.dense,
    ]
    blocks = [model.model.embeddings.word_embeddings, *linears]
    if qtype == Q8_0:
        assert all(m.qtypes == (Q8_0,) and "weight" not in m._parameters for m in blocks)
    else:
        assert not any(hasattr(m, "qtypes") for m in blocks)
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    llm.shutdown()
    ref = st_encode(bert_models["mean"], TEXTS)
    assert F.cosine_similarity(ours, ref).min() >= min_cosine


def test_the_wordpiece_tokenizer_gives_the_hf_tokenizer_s_ids(
    bert_models: dict[str, Path], tmp_path: Path
) -> None:
    """Built from the file's phantom-space vocabulary: the same ids as the checkpoint's own
    tokenizer, [CLS] ... [SEP] framing, lower-casing, accents, unknown characters and pairs."""
    from transformers import AutoTokenizer

    path = convert_bert(bert_models["mean"], tmp_path / "bert.gguf")
    llm = LLM(str(path), **SMALL)
    ours = llm.get_tokenizer()
    llm.shutdown()
    hf = AutoTokenizer.from_pretrained(str(bert_models["mean"]))
    sentences = [*TEXTS, "Héllo, WORLD!! naïve café", "日本 is far (2024)", "  "]
    for text in sentences:
        assert ours(text)["input_ids"] == hf(text)["input_ids"], text
    assert ours(TEXTS[0])["input_ids"][:1] == [hf.cls_token_id]
    pair = ours("what is the capital", "paris is the capital")
    assert pair == hf("what is the capital", "paris is the capital")


def test_a_qwen3_gguf_file_with_pooling_type_last_embeds_as_sentence_transformers(
    qwen3_embedding: tuple[Path, Path], tmp_path: Path
) -> None:
    """Qwen3-Embedding's file: a qwen3 decoder, `qwen3.pooling_type` = 3 (last) and no
    `output.weight`, runs on the pooling runner by itself: the last token, normalized."""
    from transformers import AutoTokenizer

    base, st = qwen3_embedding
    path = convert_decoder_embedding(base, tmp_path / "qwen3.gguf", "qwen3", pooling_type=3)
    tokenizer = AutoTokenizer.from_pretrained(str(st))
    ids = [{"prompt_token_ids": tokenizer(t)["input_ids"]} for t in TEXTS]
    ours, llm = embed(path, ids, skip_tokenizer_init=True)
    pooler = llm.llm_engine.pooler
    assert pooler is not None and (pooler.pooling_type, pooler.normalize) == ("LAST", True)
    ref = st_encode(st, TEXTS)
    assert F.cosine_similarity(ours, ref).min() >= 0.99999
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("value", "name"), [(0, "none"), (4, "rank")])
def test_a_pooling_type_no_pooler_runs_is_refused_by_name(
    bert_models: dict[str, Path], tmp_path: Path, value: int, name: str
) -> None:
    path = convert_bert(bert_models["mean"], tmp_path / "bert.gguf", pooling_type=value)
    refusal = rf"bert.pooling_type = {value} \({name}\) is not supported"
    allowed = r"pooling_type 1 \(mean\), 2 \(cls\), 3 \(lasttoken\)"
    with pytest.raises(UnsupportedModelError, match=f"{refusal}.*{allowed}"):
        LLM(str(path), **SMALL)


def test_a_bert_variant_s_extra_tensor_is_refused_not_skipped(
    bert_models: dict[str, Path], tmp_path: Path
) -> None:
    """ColBERT's `dense_2` projection would change every vector: the file is refused."""
    dense = {"dense_2.weight": np.zeros((16, 64), np.float32)}
    path = convert_bert(bert_models["mean"], tmp_path / "colbert.gguf", extra=dense)
    with pytest.raises(UnsupportedModelError, match=r"bert tensors \['dense_2.weight'\]"):
        LLM(str(path), **SMALL)

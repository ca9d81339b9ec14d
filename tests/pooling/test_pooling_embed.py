"""Embedding models on the pooling runner: equal to sentence-transformers' `encode`, whatever the
batch, the chunking, preemption or the prefix cache (minivllm/pooling/, the pooling runner)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from minivllm import LLM, PoolingParams, SamplingParams
from minivllm.core.scheduler import SchedulerOutput
from minivllm.sampling_params import InvalidParamError
from tests.utils.engine_utils import assert_no_blocks_held
from tests.utils.pooling_utils import save_st_model, save_tiny_decoder, st_encode

TEXTS = [
    "hello world",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "a",
    " ".join(f"word{i}" for i in range(60)),  # ~200 tokens: many chunks at a small budget
    "Embeddings map text to vectors.",
]
# float32, not the pooling default (float16, vLLM's): the tests hold it to float32 references
SMALL = {"num_gpu_blocks_override": 128, "enforce_eager": True, "dtype": "float32"}


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def embeddings(llm: LLM, texts: list[str], params: PoolingParams | None = None) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts, params, use_tqdm=False)])


@pytest.fixture(scope="module")
def qwen3_last(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-Embedding's layout: a Qwen3, last-token pooling, normalized."""
    root = tmp_path_factory.mktemp("qwen3_embed")
    base = save_tiny_decoder(root / "base", "qwen3")
    return save_st_model(root / "st", base, "lasttoken", normalize=True)


@pytest.fixture(scope="module")
def llama_mean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with sentence-transformers' mean pooling and no Normalize module."""
    root = tmp_path_factory.mktemp("llama_mean")
    base = save_tiny_decoder(root / "base", "llama", seed=1)
    return save_st_model(root / "st", base, "mean", normalize=False)


@pytest.fixture(scope="module")
def qwen3_llm(qwen3_last: Path) -> Iterator[LLM]:
    llm = LLM(str(qwen3_last), **SMALL)
    yield llm
    llm.shutdown()


def test_qwen3_last_token_embeddings_equal_sentence_transformers(
    qwen3_llm: LLM, qwen3_last: Path
) -> None:
    pooler = qwen3_llm.llm_engine.pooler
    assert pooler is not None and (pooler.pooling_type, pooler.normalize) == ("LAST", True)
    ours = embeddings(qwen3_llm, TEXTS)
    ref = st_encode(qwen3_last, TEXTS)
    assert ours.shape == ref.shape == (len(TEXTS), 64)
    assert cosines(ours, ref).min() >= 0.99999
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(TEXTS)))
    assert_no_blocks_held(qwen3_llm)  # each request's KV blocks go back when it is pooled


def test_mean_pooling_with_chunked_prefill_equals_sentence_transformers(llama_mean: Path) -> None:
    """An 8-token budget splits every prompt into chunks: MEAN pooling must still see every
    token exactly once. Prefix caching is off for MEAN (a hit has no hidden states)."""
    llm = LLM(str(llama_mean), max_num_batched_tokens=8, max_num_seqs=4, **SMALL)
    assert llm.llm_engine.config.cache.enable_prefix_caching is False
    ours = embeddings(llm, TEXTS)
    ref = st_encode(llama_mean, TEXTS)
    assert cosines(ours, ref).min() >= 0.99999
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)  # not normalized: same length
    assert_no_blocks_held(llm)
    llm.shutdown()


def test_preempted_and_aborted_prompts_leave_no_rows_behind(llama_mean: Path) -> None:
    """A chunked prompt preempted halfway is recomputed from its first token (the runner drops
    the rows it kept), and an aborted one's rows are dropped at the next step."""
    llm = LLM(str(llama_mean), max_num_batched_tokens=16, max_num_seqs=2, **SMALL)
    engine = llm.llm_engine
    runner = engine.runner
    engine.add_request("a", TEXTS[3], PoolingParams())
    engine.add_request("b", TEXTS[3] + " b", PoolingParams())
    engine.step()
    engine.step()
    seq = engine.requests["a"].seqs[0]
    assert seq.num_computed_tokens == 32 and seq.seq_id in runner.prompt_rows  # type: ignore[attr-defined]
    engine.scheduler._preempt(seq, SchedulerOutput())  # as if its blocks were needed elsewhere
    engine.abort_request("b")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert not runner.prompt_rows  # type: ignore[attr-defined]
    ref = st_encode(llama_mean, [TEXTS[3]])
    assert cosines(torch.tensor([done["a"].pooled]), ref).item() >= 0.99999
    assert_no_blocks_held(llm)
    llm.shutdown()


def test_chunking_batching_and_prefix_hits_change_nothing(qwen3_last: Path, qwen3_llm: LLM) -> None:
    """One prompt at a time, all at once, in 16-token chunks, and again from the prefix cache
    (LAST pooling keeps it: the last token is always recomputed): the same vectors."""
    batched = embeddings(qwen3_llm, TEXTS)
    alone = torch.cat([embeddings(qwen3_llm, [t]) for t in TEXTS])
    again = qwen3_llm.embed(TEXTS, use_tqdm=False)
    assert again[3].num_cached_tokens > 0
    chunked = LLM(str(qwen3_last), max_num_batched_tokens=16, max_num_seqs=2, **SMALL)
    for other in (
        alone,
        torch.tensor([o.outputs.embedding for o in again]),
        embeddings(chunked, TEXTS),
    ):
        assert cosines(batched, other).min() >= 0.99999
    chunked.shutdown()


def test_causal_lm_converted_to_embed_pools_its_hidden_states(tmp_path: Path) -> None:
    """`convert="embed"` on a plain causal LM (no sentence-transformers files): last-token
    pooling of the final norm's output, normalized, as transformers computes it; vLLM's older
    `task="embed"` means the same."""
    from transformers import AutoModel, AutoTokenizer

    path = save_tiny_decoder(tmp_path / "lm", "llama", seed=2)
    for how in ({"runner": "pooling", "convert": "embed"}, {"task": "embed"}):
        llm = LLM(str(path), **SMALL, **how)  # type: ignore[arg-type]
        ours = embeddings(llm, TEXTS[:2])
        llm.shutdown()
        tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
        with torch.no_grad():
            ref = torch.stack(
                [model(**tok(t, return_tensors="pt")).last_hidden_state[0, -1] for t in TEXTS[:2]]
            )
        assert cosines(ours, ref).min() >= 0.99999
        torch.testing.assert_close(ours.norm(dim=-1), torch.ones(2))


def test_dimensions_and_normalize_follow_the_request(tmp_path: Path, llama_mean: Path) -> None:
    """Matryoshka `dimensions` truncates, then normalizes (sentence-transformers' truncate_dim);
    a model not trained for it refuses `dimensions`, naming the field."""
    llm = LLM(str(llama_mean), pooler_config={"matryoshka_dimensions": [16, 32]}, **SMALL)
    full = embeddings(llm, TEXTS[:2])  # the files say: no Normalize module
    cut = embeddings(llm, TEXTS[:2], PoolingParams(dimensions=16, normalize=True))
    torch.testing.assert_close(cut, torch.nn.functional.normalize(full[:, :16], dim=-1))
    with pytest.raises(InvalidParamError, match="dimensions must be one of") as err:
        llm.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)
    assert err.value.param == "dimensions"
    assert_no_blocks_held(llm)
    llm.shutdown()


def test_dimensions_refused_by_a_model_without_matryoshka(qwen3_llm: LLM) -> None:
    with pytest.raises(InvalidParamError, match="matryoshka") as err:
        qwen3_llm.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    assert err.value.param == "dimensions"
    assert_no_blocks_held(qwen3_llm)


def test_score_is_the_cosine_of_the_embeddings(qwen3_llm: LLM) -> None:
    scores = qwen3_llm.score(TEXTS[0], TEXTS[:3], use_tqdm=False)
    ref = embeddings(qwen3_llm, TEXTS[:3])
    expected = cosines(ref[0:1].expand(3, -1), ref)
    assert [round(s.outputs.score, 5) for s in scores] == [round(x, 5) for x in expected.tolist()]
    pairwise = qwen3_llm.score(TEXTS[:2], TEXTS[1:3], use_tqdm=False)
    assert len(pairwise) == 2
    with pytest.raises(ValueError, match="text_1 must be one text or as many as text_2"):
        qwen3_llm.score(TEXTS[:2], TEXTS[:3], use_tqdm=False)


def test_generation_on_a_pooling_model_names_the_runner(qwen3_llm: LLM) -> None:
    with pytest.raises(ValueError, match="runner='pooling'"):
        qwen3_llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        qwen3_llm.llm_engine.add_request("x", "hi", SamplingParams(max_tokens=2))
    assert_no_blocks_held(qwen3_llm)


def test_embed_on_a_generator_names_the_runner(tmp_path: Path) -> None:
    llm = LLM(str(save_tiny_decoder(tmp_path / "lm", "llama")), **SMALL)
    assert llm.llm_engine.pooler is None  # a causal LM generates unless told otherwise
    with pytest.raises(ValueError, match="runner='generate'"):
        llm.embed("hi", use_tqdm=False)
    llm.shutdown()


def test_a_prompt_may_fill_max_model_len_and_no_more(qwen3_last: Path) -> None:
    """Nothing is generated, so a pooling prompt may be max_model_len tokens long (a generator's
    must leave room for one output token)."""
    llm = LLM(str(qwen3_last), max_model_len=32, **SMALL)
    ids = list(range(100, 132))
    assert len(llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="max_model_len is 32"):
        llm.embed({"prompt_token_ids": [*ids, 7]}, use_tqdm=False)
    cut = llm.embed([[*ids, 7]], PoolingParams(truncate_prompt_tokens=32), use_tqdm=False)
    assert cut[0].prompt_token_ids == [*ids[1:], 7]
    assert_no_blocks_held(llm)
    llm.shutdown()

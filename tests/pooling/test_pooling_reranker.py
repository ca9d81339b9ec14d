"""An LLM reranker served as vLLM serves Qwen3-Reranker: a `Qwen3ForCausalLM` checkpoint loaded
with `hf_overrides` as a classifier whose head is its LM head's "yes" row minus its "no" row
(minivllm/model/hf_overrides.py, minivllm/model/models/adapters.py). Its scores equal transformers'
sigmoid(logit_yes - logit_no) at the prompt's last token, batched and chunked; overrides it does
not support are refused by name."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from minivllm import LLM
from minivllm.engine.arg_utils import EngineArgs
from minivllm.model.config import UnsupportedModelError
from minivllm.model.hf_overrides import parse_hf_overrides
from minivllm.model.models.registry import config_from_hf_dict
from tests.utils.engine_utils import assert_no_blocks_held
from tests.utils.pooling_utils import save_tiny_decoder
from tests.utils.tp_utils import no_leftover_processes

_no_leftover_processes = contextlib.contextmanager(no_leftover_processes)

# Qwen3-Reranker's template (vLLM's examples/offline_inference/qwen3_reranker.py).
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = f"{PREFIX}<Instruct>: {INSTRUCT}\n<Query>: What is the capital of China?\n"
DOCS = [
    f"<Document>: {d}{SUFFIX}"
    for d in ("The capital of China is Beijing.", "Gravity is a force.", "a", "yes or no")
]
ARCH = "Qwen3ForSequenceClassification"
QWEN3_RERANKER = {
    "architectures": [ARCH],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
# Every prompt is ~90 tokens: in chunks of at most 32, several prompts in one step.
# float32, not the pooling default (float16, vLLM's): the scores are held to float32 logits
CHUNKED = {
    "num_gpu_blocks_override": 64,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 4,
    "dtype": "float32",
}


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-Reranker-4B's layout: a Qwen3ForCausalLM with its own (untied) LM head."""
    return save_tiny_decoder(tmp_path_factory.mktemp("qwen3_rr") / "rr", tie_word_embeddings=False)


def hf_last_logits(path: Path, prompts: list[str]) -> tuple[torch.Tensor, object]:
    """transformers' float32 logits at each prompt's last token: [N, vocab], and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [model(tok(p, return_tensors="pt")["input_ids"]).logits[0, -1] for p in prompts]
    return torch.stack(rows), tok


@pytest.fixture(scope="module")
def expected_scores(reranker: Path) -> torch.Tensor:
    """transformers' P(yes) of each (QUERY, DOCS[i]) prompt: [len(DOCS)]."""
    logits, tok = hf_last_logits(reranker, [QUERY + d for d in DOCS])
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")  # type: ignore[attr-defined]
    return torch.sigmoid(logits[:, yes] - logits[:, no])  # = softmax([no, yes])[1]


def scores(llm: LLM) -> torch.Tensor:
    return torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)])


def test_qwen3_reranker_scores_equal_transformers_yes_no_sigmoid(
    reranker: Path, expected_scores: torch.Tensor
) -> None:
    llm = LLM(str(reranker), hf_overrides=QWEN3_RERANKER, **CHUNKED)
    pooler = llm.llm_engine.pooler
    assert pooler is not None
    assert (pooler.task, pooler.pooling_type, pooler.hidden_size) == ("classify", "LAST", 1)
    ours = scores(llm)
    assert_no_blocks_held(llm)
    llm.shutdown()
    torch.testing.assert_close(ours, expected_scores, atol=1e-5, rtol=0)
    assert ours.std() > 1e-3  # the documents are told apart


@pytest.mark.timeout(600)  # a hang guard for a broken collective; no timing
def test_two_ranks_score_as_transformers(reranker: Path, expected_scores: torch.Tensor) -> None:
    """Pooling under tensor parallelism: every rank reads the head's two rows whole from the
    checkpoint (the vocabulary-parallel LM head would hold them on different ranks), and the
    pooled last-token state is the same on both ranks after the row-parallel all-reduce."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_no_leftover_processes())
        llm = LLM(
            str(reranker),
            hf_overrides=QWEN3_RERANKER,
            tensor_parallel_size=2,
            cpu_kv_cache_space=0.01,
            dtype="float32",
            max_num_batched_tokens=32,
            max_num_seqs=4,
        )
        stack.callback(llm.shutdown)
        torch.testing.assert_close(scores(llm), expected_scores, atol=1e-5, rtol=0)


def test_single_token_classifier_is_the_sigmoid_of_its_logit(tmp_path: Path) -> None:
    """bge-reranker-v2-gemma's form: one token, its logit as it is (method no_post_processing),
    here on a model whose LM head is tied to its embedding."""
    path = save_tiny_decoder(tmp_path / "tied", seed=2)
    overrides = {**QWEN3_RERANKER, "classifier_from_token": ["yes"], "method": "no_post_processing"}
    del overrides["is_original_qwen3_reranker"]
    llm = LLM(str(path), hf_overrides=overrides, num_gpu_blocks_override=64, dtype="float32")
    prompts = [QUERY + d for d in DOCS[:2]]
    probs = torch.tensor([o.outputs.probs for o in llm.classify(prompts, use_tqdm=False)])
    llm.shutdown()
    logits, tok = hf_last_logits(path, prompts)
    yes = tok.convert_tokens_to_ids("yes")  # type: ignore[attr-defined]
    torch.testing.assert_close(probs, torch.sigmoid(logits[:, [yes]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({**QWEN3_RERANKER, "num_labels": 3}, r"keys \['num_labels'\] are not supported"),
        ({**QWEN3_RERANKER, "classifier_from_token": ["yes"]}, "must name 2 tokens"),
        ({**QWEN3_RERANKER, "architectures": ["GemmaForSequenceClassification"]}, "architectures"),
        ({**QWEN3_RERANKER, "method": "no_post_processing"}, "method must be one of"),
        ({**QWEN3_RERANKER, "classifier_from_token": "yes"}, "list of token strings"),
        ('{"architectures": ', "must be a JSON object"),
    ],
)
def test_unsupported_hf_overrides_are_refused_by_name(overrides: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_hf_overrides(overrides)  # type: ignore[arg-type]


def test_overrides_that_do_not_fit_the_checkpoint_are_refused_before_loading(
    reranker: Path,
) -> None:
    unknown_token = {**QWEN3_RERANKER, "classifier_from_token": ["no", "not-a-token-xyz"]}
    with pytest.raises(ValueError, match=r"\['not-a-token-xyz'\] not in the tokenizer"):
        EngineArgs(model=str(reranker), hf_overrides=unknown_token).create_engine_config()
    with pytest.raises(ValueError, match="needs runner='pooling', got runner='generate'"):
        args = EngineArgs(model=str(reranker), hf_overrides=QWEN3_RERANKER, runner="generate")
        args.create_engine_config()
    overrides = parse_hf_overrides(QWEN3_RERANKER)
    assert overrides is not None
    with pytest.raises(ValueError, match="built from a Qwen3ForCausalLM checkpoint, got Llama"):
        overrides.apply({"architectures": ["LlamaForCausalLM"]})
    # A converted checkpoint with a trained `score` of its own is not this model: refused.
    own_head = {**json.loads((reranker / "config.json").read_text()), "architectures": [ARCH]}
    with pytest.raises(UnsupportedModelError, match="own score head is not supported"):
        config_from_hf_dict(own_head)

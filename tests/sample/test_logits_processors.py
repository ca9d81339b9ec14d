"""The logits processors vLLM's clients use beside the sampler's own: `allowed_token_ids`,
`bad_words` and `logit_bias`, each one step of the sampler's ordered pipeline, applied to its
request's row only (minivllm/sample/logits_processors.py)."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sample.logits_processors import apply_bad_words, apply_logit_bias
from minivllm.sample.metadata import SamplingMetadata, SamplingRow
from tests.utils.engine_utils import save_tiny_llama

PROMPTS = [[1000 + i for i in range(9)], [5, 17, 923, 40, 8812, 77]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-processors"))
    return LLM(str(model), num_gpu_blocks_override=64, max_model_len=256)


def generate(llm: LLM, **params: object) -> list[list[int]]:
    sp = SamplingParams(max_tokens=12, ignore_eos=True, **params)  # type: ignore[arg-type]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_allowed_token_ids_are_all_a_row_may_sample(llm: LLM) -> None:
    allowed = [11, 500, 2024, 30000]
    for out in generate(llm, allowed_token_ids=allowed, temperature=1.0, seed=3):
        assert set(out) <= set(allowed)


def test_logit_bias_moves_one_rows_tokens_only(llm: LLM) -> None:
    free = generate(llm, temperature=0)
    forced = generate(llm, temperature=0, logit_bias={777: 100.0})
    assert all(set(out) == {777} for out in forced)
    banned = generate(llm, temperature=0, logit_bias={free[0][0]: -100.0})
    assert banned[0][0] != free[0][0]
    # A neighbour without a bias in the same batch keeps its tokens.
    sp = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)] * 2
    sp[0] = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, logit_bias={777: 100.0})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    assert list(outs[1].outputs[0].token_ids) == free[1]


def test_bad_words_never_appear(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    free = generate(llm, temperature=0)
    word = tok.decode(free[0][2:4])  # a two-token stretch of the free output
    out = generate(llm, temperature=0, bad_words=[word])[0]
    pairs = {tuple(out[i : i + 2]) for i in range(len(out) - 1)}
    assert tuple(free[0][2:4]) not in pairs
    assert out[:2] == free[0][:2]  # nothing changes before the word would start


def test_bad_words_ban_the_last_token_only_after_the_rest() -> None:
    row = SamplingRow(SamplingParams(), [1], [5, 6], bad_words_token_ids=[[6, 9], [7, 9], [4]])
    meta = SamplingMetadata.from_rows([row], 16, "cpu")
    logits = apply_bad_words(torch.zeros(1, 16), meta)
    assert torch.isinf(logits[0, 9]) and torch.isinf(logits[0, 4])  # [6, 9] follows 6; [4] always
    assert torch.isfinite(logits[0, [0, 1, 2, 3, 5, 6, 7, 8]]).all()


def test_logit_bias_adds_its_values_on_its_row() -> None:
    rows = [
        SamplingRow(SamplingParams(logit_bias={3: 2.5, 7: -1.0}), [1], []),
        SamplingRow(SamplingParams(), [1], []),
    ]
    meta = SamplingMetadata.from_rows(rows, 8, "cpu")
    logits = apply_logit_bias(torch.zeros(2, 8), meta)
    expected = torch.zeros(2, 8)
    expected[0, 3], expected[0, 7] = 2.5, -1.0
    assert torch.equal(logits, expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {5: 100.5}}, r"logit_bias values must be in \[-100, 100\], got 100.5"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"bad_words": ["ok", ""]}, "bad_words must be a list of non-empty strings"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_out_of_vocab_ids_are_refused_by_the_engine(llm: LLM) -> None:
    engine = llm.llm_engine
    for kwargs in ({"logit_bias": {49152: 1.0}}, {"allowed_token_ids": [1, 49152]}):
        with pytest.raises(ValueError, match="out-of-vocab token id 49152"):
            engine.add_request("x", [1, 2], SamplingParams(**kwargs))  # type: ignore[arg-type]
        assert not engine.requests

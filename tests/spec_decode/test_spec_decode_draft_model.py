"""Speculative decoding with a draft model: its own paged KV cache, greedy exactness, sampling.

The draft is the tiny target with noise added to its layers' weights: it agrees with the target
often but not always, so every verification keeps some drafts and rejects others. With the target
as its own draft every draft is kept. Greedy output must equal greedy output without speculation
under preemption, chunked prefill (the draft's catch-up is chunked too), prefix caching and n > 1;
sampled drafts travel with their probabilities q, and the tokens kept are distributed as plain
sampling draws them (chi-square). Every block of both caches returns when requests end.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config.speculative import SpeculativeConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.model.errors import ModelNotFoundError
from minivllm.spec_decode.draft_model_proposer import DraftModelProposer, _common_prefix
from tests.utils.engine_utils import assert_no_blocks_held, save_tiny_llama

K = 4
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 30, 31],  # shares 16 tokens
    [40, 41, 42, 43, 44],
    list(range(100, 140)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


def noisy_copy(model: Path, out: Path, scale: float, seed: int = 1) -> Path:
    """`model` with Gaussian noise of std `scale` added to every decoder-layer weight."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".layers." in name:
                p.add_(torch.randn_like(p) * scale)
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model / name, out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("draft-spec")
    target = save_tiny_llama(root / "target")
    return target, noisy_copy(target, root / "draft", 0.005)


@pytest.fixture(scope="module")
def reference(models: tuple[Path, Path]) -> Any:
    return _outputs(_llm(models[0]))


def _llm(model: Path, **kwargs: Any) -> LLM:
    defaults = {"skip_tokenizer_init": True, "cpu_kv_cache_space": 0.05}
    return LLM(str(model), **(defaults | kwargs))


def _spec(draft: Path, **fields: Any) -> dict[str, Any]:
    return {"model": str(draft), "num_speculative_tokens": K} | fields


def _outputs(llm: LLM, params: SamplingParams = GREEDY, prompts: list[list[int]] = PROMPTS) -> Any:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(outputs: Any) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def _assert_same_tokens_and_logprobs(got: Any, want: Any) -> None:
    assert _tokens(got) == _tokens(want)
    for g, w in zip((c for o in got for c in o.outputs), (c for o in want for c in o.outputs)):
        for dg, dw in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert list(dg) == list(dw)
            for t in dg:
                assert dg[t].logprob == pytest.approx(dw[t].logprob, abs=1e-4)


def _proposer(llm: LLM) -> DraftModelProposer:
    speculator = llm.llm_engine.speculator
    assert speculator is not None and isinstance(speculator.proposer, DraftModelProposer)
    return speculator.proposer


def assert_draft_cache_empty(llm: LLM) -> None:
    proposer = _proposer(llm)
    assert not proposer.cached
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks


# ---------------------------------------------------------------------------- greedy is exact
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"num_gpu_blocks_override": 16, "block_size": 4, "max_num_seqs": 4},  # preempts
        {"max_num_batched_tokens": 8, "max_num_seqs": 4, "block_size": 4},  # chunks both models
    ],
    ids=["default", "preemption", "chunked-prefill"],
)
def test_greedy_output_with_a_draft_model_equals_greedy_output_without(
    models: tuple[Path, Path], reference: Any, engine_kwargs: dict[str, Any]
) -> None:
    target, draft = models
    llm = _llm(target, speculative_config=_spec(draft), **engine_kwargs)
    _assert_same_tokens_and_logprobs(_outputs(llm), reference)
    stats = llm.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if "num_gpu_blocks_override" in engine_kwargs:
        assert stats.num_preemptions > 0
    assert_no_blocks_held(llm)
    assert_draft_cache_empty(llm)


def test_the_target_as_its_own_draft_keeps_every_draft(
    models: tuple[Path, Path], reference: Any
) -> None:
    target, _ = models
    llm = _llm(target, speculative_config=_spec(target))
    _assert_same_tokens_and_logprobs(_outputs(llm), reference)
    stats = llm.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert_draft_cache_empty(llm)


def test_prefix_hits_and_parallel_samples_with_a_draft_model(
    models: tuple[Path, Path], reference: Any
) -> None:
    """A second round of the same prompts is served from the target's prefix cache while the
    draft catches up on its own; n = 3 greedy samples each speculate on their own."""
    target, draft = models
    llm = _llm(target, speculative_config=_spec(draft, disable_by_batch_size=12))
    _outputs(llm)
    again = _outputs(llm)
    assert sum(o.num_cached_tokens or 0 for o in again) > 0
    _assert_same_tokens_and_logprobs(again, reference)
    n3 = _outputs(llm, SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True))
    assert _tokens(n3) == [t for t in _tokens(reference) for _ in range(3)]
    assert_no_blocks_held(llm)
    assert_draft_cache_empty(llm)


def test_a_gguf_draft_runs_on_its_own_blocks(models: tuple[Path, Path], tmp_path: Path) -> None:
    """A .gguf draft (Q8_0 blocks, run as stored) of a float target: greedy stays exact."""
    from tests.utils.gguf_utils import tiny_llama_gguf

    path = tiny_llama_gguf(tmp_path / "draft.gguf")
    folder = EngineArgs(model=str(path)).create_engine_config().resolved.source.path
    target = save_tiny_llama(
        tmp_path / "t", vocab_size=_vocab_size(folder), max_position_embeddings=256
    )
    plain = _outputs(_llm(target), GREEDY, [p[:6] for p in PROMPTS])
    llm = _llm(target, speculative_config=_spec(path))
    assert llm.llm_engine.config.draft is not None
    assert llm.llm_engine.config.draft.quantization == "gguf"
    _assert_same_tokens_and_logprobs(_outputs(llm, GREEDY, [p[:6] for p in PROMPTS]), plain)
    assert llm.get_stats().spec_decode_num_draft_tokens > 0
    assert_draft_cache_empty(llm)


def _vocab_size(folder: Path) -> int:
    import json

    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


# ---------------------------------------------------------------------------- sampling
def test_sampled_drafts_travel_with_q_and_keep_the_distribution(tmp_path: Path) -> None:
    """300 seeded samples at temperature 1, with and without a draft model (another random model
    of the same vocabulary) whose drafts are drawn from its own q: the 4th output token, which
    the drafts cover (the last token never is a draft: it is a bonus), has the same distribution
    (chi-square, 8 tokens: 7 degrees of freedom). A draft taken as the argmax of q while q is
    passed on fails this test (p ~ 1e-25), as does any q that is not what the draft was drawn
    from."""
    target = save_tiny_llama(tmp_path / "v8", vocab_size=8, initializer_range=0.05)
    draft = save_tiny_llama(tmp_path / "v8-draft", vocab_size=8, initializer_range=0.05, seed=7)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2]] * 300
    params = [
        SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=i) for i in range(300)
    ]
    counts = []
    for spec in (None, _spec(draft, disable_by_batch_size=300)):
        llm = _llm(target, speculative_config=spec, max_num_seqs=300, max_num_batched_tokens=4096)
        with_q: list[bool] = []
        if spec is not None:
            proposer = _proposer(llm)
            proposer.propose_drafts = _recording_q(proposer.propose_drafts, with_q)  # type: ignore[method-assign]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens = torch.tensor([o.outputs[0].token_ids[3] for o in outs])
        counts.append(torch.bincount(tokens, minlength=8).float())
        if spec is not None:
            stats = llm.get_stats()
            assert with_q and all(with_q)
            assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
            assert_draft_cache_empty(llm)
    a, b = counts
    keep = (a + b) > 0
    stat = (((a - b) ** 2) / (a + b))[keep].sum()
    p = float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2), stat / 2))
    assert p > 1e-4, (a, b, p)


def _recording_q(propose: Any, with_q: list[bool]) -> Any:
    def spy(wanted: Any) -> Any:
        drafts = propose(wanted)
        with_q.extend(d.probs is not None for d in drafts if d.token_ids)
        return drafts

    return spy


# ---------------------------------------------------------------------------- ends and failures
def test_an_abort_frees_the_blocks_of_both_caches(models: tuple[Path, Path]) -> None:
    target, draft = models
    llm = _llm(target, speculative_config=_spec(draft))
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    for _ in range(3):
        engine.step()
    assert _proposer(llm).cached
    engine.abort_request([str(i) for i in range(len(PROMPTS))])
    assert_draft_cache_empty(llm)  # at once, not at the next step
    engine.step()
    assert_no_blocks_held(llm)


def test_a_failing_draft_model_costs_its_drafts_not_the_requests(
    models: tuple[Path, Path], reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft = models
    llm = _llm(target, speculative_config=_spec(draft))
    runner = _proposer(llm).runner
    calls = {"n": 0}
    run = runner.execute_model

    def fail_every_third(sched: Any) -> Any:
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("injected")
        return run(sched)

    monkeypatch.setattr(runner, "execute_model", fail_every_third)
    _assert_same_tokens_and_logprobs(_outputs(llm), reference)
    assert llm.get_stats().spec_decode_num_accepted_tokens > 0
    assert_no_blocks_held(llm)
    assert_draft_cache_empty(llm)


def test_a_full_draft_cache_drops_the_least_recent_sequence_not_the_step(
    models: tuple[Path, Path], reference: Any
) -> None:
    """With room in the draft's pool for about one sequence, sequences take turns in it (those
    that find no room draft nothing that step); output stays exact."""
    target, draft = models
    llm = _llm(target, speculative_config=_spec(draft), block_size=4)
    proposer = _proposer(llm)
    proposer.kv = type(proposer.kv)(12, 4, enable_prefix_caching=False)
    _assert_same_tokens_and_logprobs(_outputs(llm), reference)
    assert llm.get_stats().spec_decode_num_accepted_tokens > 0
    assert_draft_cache_empty(llm)


def test_common_prefix() -> None:
    a = list(range(200))
    assert _common_prefix(a, [*a, 5]) == 200
    assert _common_prefix(a, a[:150] + [0] * 60) == 150
    assert _common_prefix(a, [1, *a[1:]]) == 0  # a difference in the head is found too
    assert _common_prefix([], a) == 0


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"method": "draft_model", "num_speculative_tokens": 2},
            "speculative_config.model must name the draft model",
        ),
        (
            {"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "speculative_config.draft_tensor_parallel_size must be 1",
        ),
        (
            {"model": "d", "num_speculative_tokens": 2, "quantization": "awq"},
            "speculative_config.quantization must be one of [None, 'gguf', 'none'], got 'awq'",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "quantization": "gguf"},
            "speculative_config.quantization is a draft model's field",
        ),
    ],
)
def test_invalid_draft_settings_are_refused_naming_the_field(config: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.parse(config)
    assert str(info.value).startswith(message)


def test_a_model_makes_the_method_draft_model() -> None:
    config = SpeculativeConfig.parse({"model": "some/draft", "num_speculative_tokens": 3})
    assert config is not None and config.method == "draft_model" and config.uses_draft_model
    old = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 3})
    assert old is not None and old.method == "ngram" and old.model is None


def test_a_draft_of_another_vocabulary_is_refused_before_any_weight_loads(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    target, _ = models
    other = save_tiny_llama(tmp_path / "v8", vocab_size=8)
    args = EngineArgs(model=str(target), speculative_config=_spec(other))
    with pytest.raises(ValueError, match="its vocab_size 8 differs from the target model's 49152"):
        args.create_engine_config()
    short = save_tiny_llama(tmp_path / "short", max_position_embeddings=64)
    args = EngineArgs(model=str(target), speculative_config=_spec(short))
    with pytest.raises(ValueError, match=r"its 64 positions are fewer than max_model_len \(1024\)"):
        args.create_engine_config()
    missing = EngineArgs(model=str(target), speculative_config=_spec(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError):
        missing.create_engine_config()


def test_drafting_is_seen_in_numbers_not_only_in_speed(models: tuple[Path, Path]) -> None:
    """The per-position acceptance counts add up, and later positions accept no more often."""
    target, draft = models
    llm = _llm(target, speculative_config=_spec(draft))
    _outputs(llm)
    stats = llm.get_stats()
    per_pos = np.array(stats.spec_decode_num_accepted_tokens_per_pos)
    assert per_pos.sum() == stats.spec_decode_num_accepted_tokens
    assert (np.diff(per_pos) <= 0).all()


@pytest.mark.slow
def test_smollm2_drafted_by_its_own_q4_1_blocks_keeps_float32_greedy_output() -> None:
    """The real model: float32 SmolLM2 (its GGUF dequantized at load) drafted by the same file
    run on its Q4_1 blocks, a draft that reads a sixth of the bytes. Greedy output equals the
    float32 model's without speculation, and the quantized draft is kept most of the time."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = {"quantization": "none", "cpu_kv_cache_space": 0.02, "max_model_len": 128}
    plain = LLM(**engine).generate(prompts, params, use_tqdm=False)
    spec = {"model": str(_bundled_gguf()), "num_speculative_tokens": 4}
    llm = LLM(speculative_config=spec, **engine)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(plain)
    stats = llm.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0.5 * stats.spec_decode_num_draft_tokens
    assert llm.llm_engine.config.draft is not None
    assert llm.llm_engine.config.draft.quantization == "gguf"
    assert_no_blocks_held(llm)
    assert_draft_cache_empty(llm)


def _bundled_gguf() -> Path:
    from minivllm.model.resolver import bundled_model_path

    return bundled_model_path()

"""Gemma 2 and Gemma 3 (text) give transformers' logits and greedy tokens, through the registry.

Each is a random tiny checkpoint built with transformers' `Gemma2Config` / `Gemma3TextConfig`
and `save_pretrained`, with every feature the families have switched on and made to matter:
layers that alternate a window of 8 with global attention, attention-score soft-capping (Gemma 2;
a cap of 2 that most scores pass), final-logit soft-capping, `query_pre_attn_scalar` unlike
head_dim, (1 + w) norms perturbed off 0, Gemma 3's q/k norms and its two RoPE bases (the
global one with linear scaling). The embeddings are drawn small: Gemma multiplies them by
sqrt(hidden_size), and a tied LM head over large embeddings would only repeat the last token.

- logits through the paged cache, in chunks, match transformers' (reference and CPU backends);
- the engine's greedy tokens equal transformers' `generate` under a KV pool small enough to
  preempt, chunked prefill and shared prefixes with prefix caching, every block returned;
- a model that mixes windowed and global layers runs on the hybrid KV cache (a block table per
  group of layers: the global group keeps every block, the windowed ones free what left their
  window; tests/engine/test_engine_hybrid_kv.py has the rest), an all-windowed one on the
  sliding-window manager, exact either way;
- what does not run is refused by name: another activation, bidirectional attention.

(llama.cpp's gemma2 / gemma3 GGUF files of the same models: tests/model/test_model_gguf_gemma.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm.attention.selector import get_attention_backend
from minivllm.core.kv_cache_coordinator import HybridKVCacheCoordinator
from minivllm.core.sliding_window_manager import SlidingWindowKVCacheManager
from minivllm.model.config import UnsupportedModelError
from minivllm.model.loader import load_model
from minivllm.model.models.registry import supported_architectures
from minivllm.model.resolver import resolve_model
from minivllm.sampling_params import SamplingParams
from tests.utils.engine_utils import checked_llm, hf_greedy
from tests.utils.paged import paged_logits

WINDOW = 8
SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,  # the scale is 24 ** -0.5, not head_dim's 16 ** -0.5
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.5,
    sliding_window=WINDOW,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
# family -> (transformers' config class, model class, overrides of SHAPE)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(layer_types=LAYERS, attn_logit_softcapping=2.0, final_logit_softcapping=8.0),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            layer_types=LAYERS,
            final_logit_softcapping=8.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            },
        ),
    ),
}


def save_gemma(tmp: Path, family: str, **extra: Any) -> tuple[Any, Path]:
    """The family's random tiny model, in float32 with eager attention (transformers' own
    soft-capping path), and the folder `save_pretrained` wrote it to."""
    import transformers

    config_name, model_name, overrides = FAMILIES[family]
    config = getattr(transformers, config_name)(**(SHAPE | overrides | extra))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)  # (1 + w): w off its initial 0
            if "embed_tokens" in name:
                p.mul_(0.03)  # x sqrt(64) = 8 in the model: the layers still dominate
    hf.save_pretrained(tmp, safe_serialization=True)
    return hf, tmp


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    family = request.param
    hf, path = save_gemma(tmp_path_factory.mktemp(family), family)
    return family, hf, path, engine_prompts(hf)  # the oracle's tokens, computed once


def test_the_registry_lists_gemma_2_and_3() -> None:
    assert {"Gemma2ForCausalLM", "Gemma3ForCausalLM"} <= set(supported_architectures())


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_paged_logits_in_chunks_match_transformers(gemma: Any, backend: str) -> None:
    family, hf, path, _ = gemma
    model = load_model(
        resolve_model(path), get_attention_backend(backend), torch.float32, torch.device("cpu")
    )
    assert type(model).__name__ == FAMILIES[family][1]
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows == [WINDOW, None, WINDOW]
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert expected.abs().max() <= 8.0  # the final cap holds
    for chunks in ([40], [7, 1, 20, 1, 11]):
        got = paged_logits(model, ids.tolist(), chunk_sizes=chunks, block_size=4)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def engine_prompts(hf: Any) -> tuple[list[list[int]], list[int], list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 256, (13,), generator=gen).tolist()  # prefix-cache hits
    prompts = [
        (shared if i % 2 == 0 else []) + torch.randint(3, 256, (n,), generator=gen).tolist()
        for i, n in enumerate(range(3, 30, 5))
    ]
    max_tokens = [8 + i % 5 for i in range(len(prompts))]
    expected = [hf_greedy(hf, p, m, None) for p, m in zip(prompts, max_tokens)]
    assert sum(len(set(e)) for e in expected) > 3 * len(expected)  # not one repeated token
    return prompts, max_tokens, expected


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_greedy_tokens_equal_transformers_under_preemption_chunks_and_prefix_hits(
    gemma: Any, backend: str
) -> None:
    """A mixed model keeps a block table per group of layers (global; window; window), each
    block one layer's: 30 blocks of 4 slots for 6 requests of up to 54 tokens preempt (one
    request of 56 needs 14 global blocks and 7 per windowed group); 16-token budgets chunk the
    prompts; the watcher of tests/engine/test_engine_hybrid_kv.py checks each group's blocks per step."""
    from tests.engine.test_engine_hybrid_kv import GroupWatcher

    _, _, path, (prompts, max_tokens, expected) = gemma
    with checked_llm(
        model=str(path),
        skip_tokenizer_init=True,
        attention_backend=backend,
        block_size=4,
        num_gpu_blocks_override=30,
        max_model_len=56,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        enable_prefix_caching=True,
    ) as llm:
        engine = llm.llm_engine
        assert isinstance(engine.kv_cache_manager, HybridKVCacheCoordinator)
        watcher = GroupWatcher()
        engine.add_step_listener(watcher)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv_cache_manager.get_stats().prefix_cache_hits > 0
        assert engine.kv_cache_manager.num_free_blocks == 30
    assert watcher.peak_windowed_decoding <= WINDOW // 4 + 1


def test_an_all_windowed_gemma_frees_out_of_window_blocks_and_stays_exact(
    tmp_path: Path,
) -> None:
    hf, path = save_gemma(tmp_path, "gemma3", layer_types=["sliding_attention"] * 3)
    prompts, max_tokens, expected = engine_prompts(hf)
    with checked_llm(
        model=str(path), skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=24,
        max_model_len=56, max_num_batched_tokens=16, max_num_seqs=6, enable_prefix_caching=True,
    ) as llm:  # fmt: skip
        manager = llm.llm_engine.kv_cache_manager
        assert isinstance(manager, SlidingWindowKVCacheManager)
        assert manager.sliding_window == WINDOW
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_older_config_spellings_read_as_transformers_5_s() -> None:
    """transformers 4's Gemma 3 configs: `rope_theta`, `rope_local_base_freq`, `rope_scaling`
    and `sliding_window_pattern` in place of `rope_parameters` and `layer_types`."""
    from minivllm.model.models.registry import config_from_hf_dict

    old = SHAPE | dict(
        architectures=["Gemma3ForCausalLM"], rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=2,
        num_hidden_layers=4,
    )  # fmt: skip
    config = config_from_hf_dict(old)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2  # type: ignore[attr-defined]
    assert (config.rope_theta, config.rope_local_base_freq) == (1e6, 1e4)  # type: ignore[attr-defined]
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.qk_norm and config.tie_word_embeddings


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["sliding_attention"]}, "layer_types must name one of"),
    ],
)
def test_what_gemma_code_does_not_run_is_refused_by_name(
    fields: dict[str, Any], named: str
) -> None:
    from minivllm.model.models.registry import config_from_hf_dict

    with pytest.raises((UnsupportedModelError, ValueError), match=named):
        config_from_hf_dict(SHAPE | {"architectures": ["Gemma2ForCausalLM"]} | fields)

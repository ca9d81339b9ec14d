"""Qwen2, Qwen3, Mistral, Phi-3, Mixtral and Qwen3-MoE give transformers' greedy tokens, each
through the registry.

Each family is a random tiny checkpoint built with transformers' own config class and
`save_pretrained`, loaded from its safetensors folder by minivllm's `LLM`: the registry picks the
class from `architectures`, the weight loader maps (and for Phi-3 splits) the tensors, and the
engine's greedy tokens must equal transformers' `generate`, token for token, in float32 on the
CPU. The same holds on the default CPU path (compiled kernels, and the C++ decode replay where
the model is Llama's math) and on the plain reference path. What the code does not run (a
sliding window shorter than max_model_len, Phi-3's longrope, an unknown architecture) is refused
by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm.model.errors import UnsupportedArchitectureError
from minivllm.sampling_params import SamplingParams
from tests.utils.engine_utils import checked_llm, hf_greedy

SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.2,  # peaked next-token distributions: no near-ties in greedy decoding
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# family -> (transformers' config class, model class, overrides of SHAPE)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3-hd32": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral-no-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "mistral-window-past-max-len": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(sliding_window=256),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict()),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            head_dim=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
    ),
}


def save_family(tmp: Path, family: str, seed: int = 0, **extra: Any) -> tuple[Any, Path]:
    """The family's random tiny model (norms and biases perturbed off their initial 1 and 0, so
    that those paths count) and the folder `save_pretrained` wrote it to."""
    import transformers

    config_name, model_name, overrides = FAMILIES[family]
    config = getattr(transformers, config_name)(**(SHAPE | overrides | extra))
    torch.manual_seed(seed)
    hf = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp, safe_serialization=True)
    return hf, tmp


def prompts_and_oracle(hf: Any, count: int = 4) -> tuple[list[list[int]], list[int], list[Any]]:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (5 + 9 * i,), generator=gen).tolist() for i in range(count)]
    max_tokens = [6 + 3 * i for i in range(count)]
    expected = [hf_greedy(hf, p, m, None) for p, m in zip(prompts, max_tokens)]
    return prompts, max_tokens, expected


def greedy(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def family_llm(path: Path, **kwargs: Any) -> Any:
    return checked_llm(model=str(path), skip_tokenizer_init=True, cpu_kv_cache_space=0.01, **kwargs)


# A pool of 24 blocks of 4 tokens for ~45 blocks' worth of requests (preemption), 12 tokens a
# step (chunked prefill), and two prompts that begin with a third's first 12 tokens (prefix hits).
SMALL_ENGINE = dict(
    block_size=4, num_gpu_blocks_override=24, max_num_batched_tokens=12, max_num_seqs=6
)


def small_engine_workload(hf: Any) -> tuple[list[list[int]], list[int], list[Any]]:
    """`prompts_and_oracle`'s four prompts and two more that begin with the fourth's first 12
    tokens, with transformers' tokens: through SMALL_ENGINE it preempts, chunks and hits."""
    prompts, max_tokens, expected = prompts_and_oracle(hf)
    shared = [[*prompts[3][:12], 7, 8, 9], [*prompts[3][:12], 250]]
    prompts, max_tokens = prompts + shared, [*max_tokens, 10, 12]
    expected += [hf_greedy(hf, p, m, None) for p, m in zip(shared, max_tokens[4:])]
    return prompts, max_tokens, expected


@pytest.fixture(scope="module")
def saved_family(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[Path, tuple[list[list[int]], list[int], list[Any]]]]:
    """The family's saved model and `small_engine_workload` with transformers' tokens, made once
    for the module (both backends' tests read them; the oracle is most of a test's time)."""
    made: dict[str, tuple[Path, tuple[list[list[int]], list[int], list[Any]]]] = {}

    def get(family: str) -> tuple[Path, tuple[list[list[int]], list[int], list[Any]]]:
        if family not in made:
            hf, path = save_family(tmp_path_factory.mktemp(family), family)
            made[family] = (path, small_engine_workload(hf))
        return made[family]

    return get


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_greedy_tokens_equal_transformers(
    saved_family: Callable[[str], Any], family: str, backend: str
) -> None:
    """transformers' greedy tokens through a small KV pool that preempts, chunked prefill and
    shared prefixes, every block returned."""
    path, (prompts, max_tokens, expected) = saved_family(family)
    with family_llm(path, attention_backend=backend, max_model_len=64, **SMALL_ENGINE) as llm:
        model = llm.llm_engine.runner.model
        assert type(model).__name__ == FAMILIES[family][1].replace("Mistral", "Llama")
        assert greedy(llm, prompts, max_tokens) == expected
        stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hit_tokens >= 8


def test_the_cpu_decode_replay_runs_llama_s_math_only_and_qwen2_stays_exact(
    tmp_path: Path,
) -> None:
    """The C++ decode loop replays Llama's layers; Qwen2's q/k/v bias and Qwen3's q/k norms are
    not in it, so those models decode in Python (and stay exact); Phi-3 is Llama's math, so
    where the replay runs at all (oneDNN-packed weights or the AVX-512 skinny GEMM), it runs."""
    from minivllm.worker.cpu_decode_loop import CpuDecodeLoop

    hf, path = save_family(tmp_path / "qwen2", "qwen2-tied")
    prompts, max_tokens, expected = prompts_and_oracle(hf)
    with family_llm(path, max_model_len=256) as llm:  # the default: the CPU backend, compiled
        runner = llm.llm_engine.runner
        assert runner.decode_loop is None
        assert greedy(llm, prompts, max_tokens) == expected
    _, qwen3 = save_family(tmp_path / "qwen3", "qwen3-hd32")
    with family_llm(qwen3, max_model_len=256) as llm:
        assert llm.llm_engine.runner.decode_loop is None
    _, phi3 = save_family(tmp_path / "phi3", "phi3")
    with family_llm(phi3, max_model_len=256) as llm:
        model = llm.llm_engine.runner.model
        assert (llm.llm_engine.runner.decode_loop is not None) == CpuDecodeLoop.supports(model)


def write_config(tmp: Path, **fields: Any) -> Path:
    (tmp / "config.json").write_text(json.dumps(SHAPE | fields))
    return tmp


def load_config_of(path: Path) -> Any:
    from minivllm.model.loader import load_config
    from minivllm.model.resolver import resolve_model

    return load_config(resolve_model(path))


def test_an_unknown_architecture_is_refused_naming_it_and_the_supported_ones(
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path, architectures=["GemmaForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="GemmaForCausalLM") as err:
        load_config_of(path)
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"):
        assert name in str(err.value)


@pytest.mark.parametrize("family", ["mistral-no-window", "phi3"])
def test_a_sliding_window_shorter_than_the_context_gives_transformers_tokens(
    tmp_path: Path, family: str
) -> None:
    """A window of 8 under prompts of 5-32 tokens: the backends mask outside it and the KV cache
    manager frees what falls out (test_engine_sliding_window.py goes further, for Mistral)."""
    hf, path = save_family(tmp_path, family, sliding_window=8)
    prompts, max_tokens, expected = prompts_and_oracle(hf)
    with family_llm(path, max_model_len=256) as llm:
        assert {layer.self_attn.sliding_window for layer in llm.llm_engine.model.model.layers} == {
            8
        }
        assert greedy(llm, prompts, max_tokens) == expected


def test_a_window_that_is_off_is_no_window_and_mixed_layer_kinds_are_refused(
    tmp_path: Path,
) -> None:
    """Qwen2 writes a window it does not use unless `use_sliding_window`, and then only from
    layer `max_window_layers` on: a window per layer group is refused by name."""
    off = write_config(
        tmp_path, architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=8
    )
    assert load_config_of(off).sliding_window is None
    mixed = write_config(
        tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=8,
        layer_types=["full_attention", "sliding_attention"],
    )  # fmt: skip
    with pytest.raises(
        UnsupportedArchitectureError, match="mixed sliding and full attention layers: unsupported"
    ):
        load_config_of(mixed)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            dict(rope_scaling=dict(type="longrope", short_factor=[1.0], long_factor=[1.0])),
            "longrope",
        ),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_phi3_rope_variants_that_do_not_run_are_refused_by_name(
    tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    path = write_config(tmp_path, architectures=["Phi3ForCausalLM"], **fields)
    with pytest.raises(UnsupportedArchitectureError, match=named):
        load_config_of(path)


def test_the_registry_builds_the_class_it_names(tmp_path: Path) -> None:
    from minivllm.model.models.qwen3 import Qwen3ForCausalLM
    from minivllm.model.models.registry import MODELS, model_class

    config = load_config_of(write_config(tmp_path, architectures=["Qwen3ForCausalLM"]))
    assert model_class(config) is Qwen3ForCausalLM
    for architecture in MODELS:
        config.architecture = architecture
        assert issubclass(model_class(config), torch.nn.Module)

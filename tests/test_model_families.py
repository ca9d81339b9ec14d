"""Qwen2, Qwen3, Mistral and Phi-3 give transformers' greedy tokens, each through the registry.

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
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import checked_llm, hf_greedy

from minivllm.model.errors import SlidingWindowNotSupportedError, UnsupportedArchitectureError
from minivllm.sampling_params import SamplingParams

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
    return checked_llm(
        model=str(path), skip_tokenizer_init=True, cpu_kv_cache_space=0.01, **kwargs
    )


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_greedy_tokens_equal_transformers(tmp_path: Path, family: str, backend: str) -> None:
    hf, path = save_family(tmp_path, family)
    prompts, max_tokens, expected = prompts_and_oracle(hf)
    with family_llm(path, attention_backend=backend, max_model_len=256) as llm:
        model = llm.llm_engine.runner.model
        assert type(model).__name__ == FAMILIES[family][1].replace("Mistral", "Llama")
        assert greedy(llm, prompts, max_tokens) == expected

"""Tiny random base models and PEFT adapters of them, and transformers + peft as the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from minivllm.lora.request import LoRARequest
from tests.model.test_model_families import SHAPE
from tests.utils.engine_utils import hf_greedy

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> peft LoraConfig's fields: attention-only, MLP-only, all linears with rsLoRA; ranks 4-16.
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
    "mlp": dict(r=4, lora_alpha=8, target_modules=MLP),
    "all": dict(r=16, lora_alpha=32, target_modules=ATTENTION + MLP, use_rslora=True),
}


def save_base(folder: Path, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A random 2-layer Llama or Qwen2 (q/k/v biases), saved with `save_pretrained`."""
    import transformers

    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    }[family]
    config = getattr(transformers, config_cls)(
        **(SHAPE | {"tie_word_embeddings": False} | overrides)
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def load_base(folder: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def save_adapter(base: Path, folder: Path, seed: int, **lora_fields: Any) -> Path:
    """A PEFT adapter of `base` with random A and B (`init_lora_weights=False`: B is not zero,
    so the adapter changes the output), saved as peft saves it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_fields)
    get_peft_model(load_base(base), config).save_pretrained(str(folder))
    return folder


def save_adapters(base: Path, root: Path) -> dict[str, LoRARequest]:
    """The three adapters of ADAPTERS, as LoRARequests with ids 1, 2, 3."""
    return {
        name: LoRARequest(name, i + 1, str(save_adapter(base, root / name, seed=10 + i, **fields)))
        for i, (name, fields) in enumerate(ADAPTERS.items())
    }


def peft_greedy(
    base: Path, lora: LoRARequest | None, prompts: list[list[int]], max_tokens: list[int]
) -> list[list[int]]:
    """transformers' greedy tokens of the base model with the adapter (peft's `PeftModel`)."""
    from peft import PeftModel

    model = load_base(base)
    if lora is not None:
        model = PeftModel.from_pretrained(model, lora.lora_path).eval()
    return [hf_greedy(model, p, m, None) for p, m in zip(prompts, max_tokens)]

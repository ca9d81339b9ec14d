"""Read a PEFT LoRA folder into host tensors, refusing by name what minivllm cannot serve.

vLLM's `LoRAModel.from_local_checkpoint` (vllm/lora/models.py). A folder saved by peft's
`save_pretrained` holds:

    adapter_config.json         r, lora_alpha, target_modules, use_rslora, use_dora, modules_to_save
    adapter_model.safetensors   base_model.model.<module>.lora_A.weight  [r, in]
                                base_model.model.<module>.lora_B.weight  [out, r]

where <module> is the transformers name of a linear (`model.layers.3.self_attn.q_proj`). A
linear's delta is `scale * (x @ Aᵀ) @ Bᵀ`, with `scale = lora_alpha / r`, or `lora_alpha / √r`
under rank-stabilized LoRA (`use_rslora`, Kalajdzievski 2023).

Each adapter is checked against the model it will run on (`targets`: every adaptable module's
transformers name and its (in, out) sizes), so that a folder of another base model, a truncated
file, or a feature the punica ops do not compute (DoRA's magnitude, an embedding's adapter, a
fully trained `modules_to_save` copy, a bias) is refused here, when the request is added, with an
error naming what is wrong, and never half-applied.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm.lora.errors import LoRAFileError, LoRAShapeError, UnsupportedLoRAError
from minivllm.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's prefix before the transformers module name
EMBEDDING_MODULES = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class LoRALayerWeights:
    """One adapted linear's A and B, as peft stores them (transformers' [out, in] convention)."""

    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out, r]


@dataclass(frozen=True)
class LoRAModel:
    """An adapter read and checked, in host memory: what the manager copies into a slot."""

    lora_int_id: int
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    layers: dict[str, LoRALayerWeights]  # transformers module name -> its A and B

    @property
    def num_bytes(self) -> int:
        return sum(
            w.lora_a.numel() * w.lora_a.element_size() + w.lora_b.numel() * w.lora_b.element_size()
            for w in self.layers.values()
        )


def read_adapter_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAFileError(f"LoRA adapter {folder}: {CONFIG_FILE} is missing")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAFileError(
            f"LoRA adapter {folder}: {CONFIG_FILE} is not valid JSON ({exc})"
        ) from exc
    if not isinstance(config, dict):
        raise LoRAFileError(f"LoRA adapter {folder}: {CONFIG_FILE} is not a JSON object")
    return config


def check_adapter_config(config: Mapping[str, Any], folder: Path, max_lora_rank: int) -> None:
    """Refuse, by field, what the punica ops do not compute."""
    where = f"LoRA adapter {folder}"
    if config.get("peft_type", "LORA") != "LORA":
        raise UnsupportedLoRAError(
            f"{where}: peft_type must be 'LORA', got {config['peft_type']!r}"
        )
    if config.get("use_dora"):
        raise UnsupportedLoRAError(f"{where}: use_dora=True (DoRA) is not supported")
    if config.get("modules_to_save"):
        raise UnsupportedLoRAError(
            f"{where}: modules_to_save={config['modules_to_save']!r} is not supported (fully "
            "trained copies of modules cannot be swapped per request)"
        )
    if config.get("bias", "none") != "none":
        raise UnsupportedLoRAError(f"{where}: bias={config['bias']!r} is not supported ('none')")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise UnsupportedLoRAError(f"{where}: {pattern} is not supported (one r and alpha)")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UnsupportedLoRAError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise UnsupportedLoRAError(
            f"{where}: rank r={rank} is above max_lora_rank={max_lora_rank}; raise max_lora_rank"
        )
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for name in names:
        if name in EMBEDDING_MODULES:
            raise UnsupportedLoRAError(
                f"{where}: target_modules includes {name!r}; embedding and LM-head adapters are "
                "not supported"
            )


def lora_scale(config: Mapping[str, Any]) -> float:
    rank = config["r"]
    alpha = config.get("lora_alpha", 8)  # peft's default
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def read_adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        other = " (only adapter_model.safetensors is read)" if any(folder.glob("*.bin")) else ""
        raise LoRAFileError(f"LoRA adapter {folder}: {WEIGHTS_FILE} is missing{other}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoRAFileError(
            f"LoRA adapter {folder}: {WEIGHTS_FILE} is truncated or corrupt: {exc}"
        ) from exc


def load_peft_adapter(
    request: LoRARequest,
    targets: Mapping[str, tuple[int, int]],  # transformers module name -> (in, out) of the model
    max_lora_rank: int,
    dtype: torch.dtype,
) -> LoRAModel:
    """The adapter of `request.lora_path`, checked against the model's `targets`."""
    folder = Path(request.lora_path).expanduser()
    if not folder.is_dir():
        raise LoRAFileError(f"LoRA adapter {request.lora_name!r}: {folder} is not a folder")
    config = read_adapter_config(folder)
    check_adapter_config(config, folder, max_lora_rank)
    rank, where = config["r"], f"LoRA adapter {folder}"
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in read_adapter_tensors(folder).items():
        name = key.removeprefix(PREFIX)
        if "lora_embedding_" in name or name.split(".")[-2:-1] in (["lm_head"], ["embed_tokens"]):
            raise UnsupportedLoRAError(f"{where}: {key} is an embedding adapter (not supported)")
        if "lora_magnitude_vector" in name:
            raise UnsupportedLoRAError(f"{where}: {key} is a DoRA magnitude (not supported)")
        for part in ("lora_A", "lora_B"):
            if name.endswith(f".{part}.weight"):
                module = name.removesuffix(f".{part}.weight")
                pairs.setdefault(module, {})[part] = tensor
                break
        else:
            raise UnsupportedLoRAError(f"{where}: tensor {key} is not a LoRA A or B weight")
    if not pairs:
        raise LoRAFileError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    layers: dict[str, LoRALayerWeights] = {}
    for module, pair in sorted(pairs.items()):
        if module not in targets:
            raise UnsupportedLoRAError(
                f"{where}: target module {module!r} is not a linear of this model that LoRA can "
                "adapt (q/k/v/o_proj, gate/up/down_proj of its decoder layers)"
            )
        if set(pair) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(pair)).pop()
            raise LoRAFileError(f"{where}: {module}.{missing}.weight is missing")
        a, b = pair["lora_A"], pair["lora_B"]
        size_in, size_out = targets[module]
        if tuple(a.shape) != (rank, size_in) or tuple(b.shape) != (size_out, rank):
            raise LoRAShapeError(
                f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but "
                f"this model needs ({rank}, {size_in}) and ({size_out}, {rank}) at r={rank} "
                "(an adapter of another base model?)"
            )
        layers[module] = LoRALayerWeights(a.to(dtype), b.to(dtype))
    return LoRAModel(request.lora_int_id, rank, lora_scale(config), layers)

"""Loading a GGUF file's weights as they are stored: blocks stay blocks (vLLM's GGUF loader).

Each checkpoint tensor is read from the memory-mapped file once and copied to its layer:

- a linear layer (or the untied LM head) all of whose checkpoint tensors are quantized gets a
  `GGUFLinearMethod` and their bytes, as parts in row order (`gguf.py`); q/k rows are put in
  HuggingFace's order first (`unpermute_qk`: whole rows move, blocks are untouched);
- a quantized embedding gets a `GGUFEmbeddingMethod`; a tied LM head shares its buffer;
- F32 / F16 / BF16 tensors (the norms, or a whole F16 file) and a fused layer that mixes plain and
  quantized tensors load as plain weights through the layers' own weight loaders.

Any other GGML type is refused by name (tensor and type) before anything is allocated; the same
file then runs with `quantization="none"`, which dequantizes every type the `gguf` library knows.
Tensor parallelism splits weights by rows and columns that need not fall on block boundaries,
so a quantized model runs on one device.

Tier: model. It imports leaves and core.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn

from minivllm.model.config import LlamaConfig
from minivllm.model.errors import UnsupportedQuantizationError
from minivllm.model.gguf import GGUFReadError, hf_name, open_gguf, unpermute_qk
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.quantization.gguf import (
    GGUFConfig,
    GGUFEmbeddingMethod,
    GGUFLinearMethod,
    merge_parts,
)
from minivllm.model.quantization.gguf_blocks import (
    BLOCK_LAYOUTS,
    PLAIN_TYPES,
    TYPE_NAMES,
    dequantize,
)
from minivllm.model.weights import check_checkpoint, target_of

# The fused layers' checkpoint tensors, in the order of their rows.
_FUSED_PARTS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
}


def read_tensors(path: Path, config: LlamaConfig) -> tuple[dict[str, torch.Tensor], GGUFConfig]:
    """Every tensor the model loads, under HuggingFace names: uint8 blocks [rows, row_bytes]
    (q/k rows unpermuted) or float32 for plain types; and each tensor's GGML type."""
    reader = open_gguf(path)
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, int] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        qtype = int(t.tensor_type)
        if qtype not in BLOCK_LAYOUTS and qtype not in PLAIN_TYPES:
            supported = sorted([*TYPE_NAMES.values(), *PLAIN_TYPES.values()])
            raise UnsupportedQuantizationError(
                f"{path.name}: tensor {t.name} is stored as {t.tensor_type.name}, which minivllm "
                f"does not run natively (it runs {', '.join(supported)}); pass "
                f"quantization='none' (--quantization none) to dequantize it at load"
            )
        try:  # a view of the memory-mapped file: the layer's buffer is the only copy made
            data = np.asarray(t.data, dtype=np.uint8 if qtype in BLOCK_LAYOUTS else np.float32)
        except (ValueError, OSError) as exc:
            raise GGUFReadError(
                f"cannot read tensor {t.name} of {path} (truncated?): {exc}"
            ) from exc
        with warnings.catch_warnings():  # read-only: nothing writes to it, every loader copies
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.from_numpy(data.reshape(data.shape[0], -1) if data.ndim > 1 else data)
        tensors[name] = unpermute_qk(name, rows, config)
        types[name] = qtype
    return tensors, GGUFConfig(types)


def logical_shape(name: str, tensor: torch.Tensor, quant: GGUFConfig) -> tuple[int, ...]:
    if not quant.is_quantized(name):
        return tuple(tensor.shape)
    block, size = BLOCK_LAYOUTS[quant.tensor_types[name]]
    return (tensor.shape[0], tensor.shape[1] // size * block)


def _checkpoint_names(module_name: str) -> list[str]:
    """The checkpoint tensors that feed a module, in its rows' order (q, k, v; gate, up)."""
    prefix, _, leaf = module_name.rpartition(".")
    fused = _FUSED_PARTS.get(f"{prefix.rpartition('.')[2]}.{leaf}")
    if fused is None:
        return [f"{module_name}.weight"]
    return [f"{prefix}.{part}.weight" for part in fused]


def _quantize_layer(
    layer: nn.Module, names: list[str], tensors: dict[str, torch.Tensor], quant: GGUFConfig
) -> None:
    """Give `layer` a GGUF method and the blocks of its checkpoint tensors, part by part."""
    qtypes = [quant.tensor_types[n] for n in names]
    parts = merge_parts(qtypes, [tensors[n].shape[0] for n in names])
    GGUFLinearMethod().create_weights(
        layer, parts, logical_shape(names[0], tensors[names[0]], quant)[1]
    )
    pending = iter(names)
    for i, part in enumerate(parts):
        rows: list[torch.Tensor] = []
        while sum(r.shape[0] for r in rows) < part.rows:
            rows.append(tensors[next(pending)])
        getattr(layer, f"qweight_{i}").copy_(torch.cat(rows))


def _tie_quantized_head(model: LlamaForCausalLM) -> None:
    """The tied LM head multiplies by the embedding's very blocks (one buffer, two layers)."""
    head, embed = model.lm_head, model.model.embed_tokens
    del head._parameters["weight"]
    head.qtypes = embed.qtypes
    head.register_buffer("qweight_0", cast(torch.Tensor, embed.qweight_0))
    head.quant_method = GGUFLinearMethod()


def load_gguf_weights(
    model: LlamaForCausalLM, tensors: dict[str, torch.Tensor], quant: GGUFConfig
) -> None:
    """Load the tensors of `read_tensors` into `model`: layers whose tensors are all quantized
    keep their blocks; everything else is loaded as float32 through the layers' weight loaders."""
    config = model.config
    check_checkpoint(config, {n: logical_shape(n, t, quant) for n, t in tensors.items()})
    blocks: set[str] = set()
    for module_name, module in model.named_modules():
        tied_head = module_name == "lm_head" and config.tie_word_embeddings
        if not hasattr(module, "weight_loader") or tied_head:
            continue
        names = _checkpoint_names(module_name)
        if all(quant.is_quantized(n) for n in names):
            _quantize_layer(module, names, tensors, quant)
            blocks.update(names)
            if module_name == "model.embed_tokens":
                module.embedding_method = GGUFEmbeddingMethod(config_dtype(model))
    if config.tie_word_embeddings and hasattr(model.model.embed_tokens, "qtypes"):
        _tie_quantized_head(model)
    for name, tensor in tensors.items():
        if name in blocks:
            continue
        if quant.is_quantized(name):  # a fused layer that mixes plain and quantized tensors
            tensor = dequantize(tensor, quant.tensor_types[name])
        target, shard = target_of(name)
        module_name, _, param_name = target.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, param_name)
        loader = getattr(module, "weight_loader", None)  # None: the norms, copied whole
        if loader is not None:
            loader(param, tensor, *shard)
        else:
            param.data.copy_(tensor)


def config_dtype(model: nn.Module) -> torch.dtype:
    """The model's activation dtype: that of its float parameters (the norms at least)."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())

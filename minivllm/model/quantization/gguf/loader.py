"""Loading a GGUF file's weights as they are stored: blocks stay blocks (vLLM's GGUF loader).

Each checkpoint tensor is read from the memory-mapped file once, under its HuggingFace name and in
HuggingFace's layout (`hf_tensors` in gguf.py: q/k rows unpermuted, whole rows moving, blocks
untouched; an expert stack as one tensor per expert; a Phi-3 fused tensor as its parts, cut by
rows), and copied to its layer:

- a linear layer (or the untied LM head) all of whose checkpoint tensors are quantized gets a
  `GGUFLinearMethod` and their bytes, as parts in row order (`gguf.py`);
- a MoE layer's experts, all quantized, each weight of one type, get a `GGUFMoEMethod`
  (`gguf_moe.py`); experts of mixed types (an older per-expert file can have them) are
  dequantized at load, with a log line naming the layer;
- a quantized embedding gets a `GGUFEmbeddingMethod`; a tied LM head shares its buffer;
- F32 / F16 / BF16 tensors (the norms, a router, or a whole F16 file) and a fused layer that mixes
  plain and quantized tensors load as plain weights through the layers' own weight loaders (the
  model's `load_weights` where it has one: Gemma's and the MoE models', which check by name that
  every parameter is fed; Llama's tensor list is checked before anything is copied otherwise).

Any other GGML type is refused by name (tensor and type) before anything is allocated; the same
file then runs with `quantization="none"`, which dequantizes every type the `gguf` library knows.
Tensor parallelism splits weights by rows and columns that need not fall on block boundaries,
so a quantized model runs on one device.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn

from minivllm.model.config import LlamaConfig
from minivllm.model.errors import CorruptCheckpointError, UnsupportedQuantizationError
from minivllm.model.layers.fused_moe import FusedMoE
from minivllm.model.layers.linear import VocabParallelEmbedding
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.quantization.gguf.blocks import (
    BLOCK_LAYOUTS,
    PLAIN_TYPES,
    TYPE_NAMES,
    dequantize,
)
from minivllm.model.quantization.gguf.linear import (
    GGUFConfig,
    GGUFEmbeddingMethod,
    GGUFLinearMethod,
    GGUFPart,
    merge_parts,
)
from minivllm.model.quantization.gguf.moe import GGUFMoEMethod, moe_parts
from minivllm.model.quantization.gguf.reader import GGUFReadError, hf_name, hf_tensors
from minivllm.model.quantization.gguf.tensor_table import read_tensor_table
from minivllm.model.weights import check_checkpoint, target_of

logger = logging.getLogger("minivllm")

# The fused layers' checkpoint tensors, in the order of their rows.
_FUSED_PARTS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
}


def read_tensors(path: Path, config: LlamaConfig) -> tuple[dict[str, torch.Tensor], GGUFConfig]:
    """Every tensor the model loads, under HuggingFace names (`hf_tensors`: one per expert, a
    Phi-3 fused tensor as its parts): uint8 blocks [rows, row_bytes] (q/k rows unpermuted) or
    float32 for plain types; and each tensor's GGML type."""
    try:  # the tensor table only: the metadata was read once, when the file was converted
        table = read_tensor_table(path)
    except (ValueError, OSError) as exc:
        raise GGUFReadError(f"cannot read GGUF file {path} (truncated or corrupt?): {exc}") from exc
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, int] = {}
    for t in table:
        if hf_name(t.name, config.architecture) is None:
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
            rows = torch.from_numpy(data)  # [(E,) rows, row_bytes or columns], or [columns]
        for name, part in hf_tensors(t.name, rows, config):
            tensors[name] = part
            types[name] = qtype
    return tensors, GGUFConfig(types)


def logical_shape(name: str, tensor: torch.Tensor, quant: GGUFConfig) -> tuple[int, ...]:
    if not quant.is_quantized(name):
        return tuple(tensor.shape)
    block, size = BLOCK_LAYOUTS[quant.tensor_types[name]]
    return (tensor.shape[0], tensor.shape[1] // size * block)


def _checkpoint_names(model: nn.Module, module_name: str) -> list[str]:
    """The checkpoint tensors that feed a module, in its rows' order (q, k, v; gate, up): the
    model's own answer where its checkpoint names are not its modules' (BERT's)."""
    own = getattr(model, "checkpoint_names", None)
    if own is not None:
        return list(own(module_name))
    prefix, _, leaf = module_name.rpartition(".")
    fused = _FUSED_PARTS.get(f"{prefix.rpartition('.')[2]}.{leaf}")
    if fused is None:
        return [f"{module_name}.weight"]
    return [f"{prefix}.{part}.weight" for part in fused]


def _check_shapes(
    module_name: str, names: list[str], tensors: dict[str, torch.Tensor], quant: GGUFConfig,
    rows: int, columns: int,
) -> None:  # fmt: skip
    """The tensors' rows, stacked, must be the layer's `rows`, and each `columns` wide."""
    shapes = [logical_shape(n, tensors[n], quant) for n in names]
    if sum(s[0] for s in shapes) != rows or any(s[1] != columns for s in shapes):
        raise CorruptCheckpointError(
            f"{module_name}: tensors {names} have shapes {shapes}, the layer is {(rows, columns)}"
        )


def _copy_parts(
    buffers: list[torch.Tensor], parts: list[GGUFPart], rows: list[torch.Tensor]
) -> None:
    """Copy checkpoint tensors (blocks, in row order) into the buffers of their parts."""
    pending = iter(rows)
    for buffer, part in zip(buffers, parts):
        chunk: list[torch.Tensor] = []
        while sum(r.shape[0] for r in chunk) < part.rows:
            chunk.append(next(pending))
        buffer.copy_(torch.cat(chunk))


def _quantize_layer(
    module_name: str,
    layer: nn.Module,
    names: list[str],
    tensors: dict[str, torch.Tensor],
    quant: GGUFConfig,
) -> None:
    """Give `layer` a GGUF method and the blocks of its checkpoint tensors, part by part."""
    rows, columns = cast(torch.Tensor, layer.weight).shape  # [out, in], still on the layer
    _check_shapes(module_name, names, tensors, quant, rows, columns)
    parts = merge_parts(
        [quant.tensor_types[n] for n in names], [tensors[n].shape[0] for n in names]
    )
    GGUFLinearMethod().create_weights(
        layer, parts, logical_shape(names[0], tensors[names[0]], quant)[1]
    )
    buffers = [getattr(layer, f"qweight_{i}") for i in range(len(parts))]
    _copy_parts(buffers, parts, [tensors[n] for n in names])


def _quantize_experts(
    module_name: str, op: FusedMoE, tensors: dict[str, torch.Tensor], quant: GGUFConfig
) -> set[str]:
    """Give a fused MoE op a GGUF method and its experts' blocks (gguf_moe.py), where every
    expert's three tensors are blocks and each of gate, up and down has one type for all experts
    (llama.cpp's stacked tensors do). Returns the tensors taken; none where the experts are
    dequantized at load instead (and so loaded by the model's weight loader), which is logged."""
    names = {
        part: [f"{module_name}.{e}.{part}.weight" for e in range(op.num_experts)]
        for part in ("gate_proj", "up_proj", "down_proj")
    }
    every = [n for part in names.values() for n in part]
    if not any(quant.is_quantized(n) for n in every):
        return set()
    types = {part: {quant.tensor_types.get(n, -1) for n in ns} for part, ns in names.items()}
    why = ""
    if not all(quant.is_quantized(n) for n in every):
        why = "some are blocks, some plain floats"
    elif any(len(t) > 1 for t in types.values()):  # only per-expert (older) files can say so
        found = {part: sorted(TYPE_NAMES[t] for t in ts) for part, ts in types.items()}
        why = f"the experts of one weight are of several types {found}"
    if why:
        logger.warning(
            "%s: the experts are dequantized at load to the model's dtype: %s (the GGUF MoE "
            "method runs one type per weight for all experts)", module_name, why,
        )  # fmt: skip
        return set()
    hidden, inner = op.w13_weight.shape[2], op.w2_weight.shape[2]  # H, I (this op's)
    for e in range(op.num_experts):
        gate_up = [names["gate_proj"][e], names["up_proj"][e]]
        _check_shapes(module_name, gate_up, tensors, quant, 2 * inner, hidden)
        _check_shapes(module_name, [names["down_proj"][e]], tensors, quant, hidden, inner)
    (gate,), (up,), (down,) = (types[p] for p in ("gate_proj", "up_proj", "down_proj"))
    w13, w2 = merge_parts([gate, up], [inner, inner]), [GGUFPart(down, hidden)]
    GGUFMoEMethod().create_weights(op, w13, w2)
    for e in range(op.num_experts):
        rows = [tensors[names["gate_proj"][e]], tensors[names["up_proj"][e]]]
        _copy_parts([q[e] for _, q in moe_parts(op, "w13")], w13, rows)
        _copy_parts([q[e] for _, q in moe_parts(op, "w2")], w2, [tensors[names["down_proj"][e]]])
    return set(every)


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
    """Load the tensors of `read_tensors` into `model`: layers (and MoE experts) whose tensors
    are all quantized keep their blocks; everything else is loaded as float through the layers'
    own weight loaders, by the model's `load_weights` where it has one (Gemma's four norms a
    layer and the MoE models' experts are not Llama's tensor list, which is checked otherwise)."""
    config = model.config
    own_loader = hasattr(model, "load_weights")  # checks that every parameter is fed, by name
    if not own_loader:
        check_checkpoint(config, {n: logical_shape(n, t, quant) for n, t in tensors.items()})
    blocks: set[str] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            blocks |= _quantize_experts(module_name, module, tensors, quant)
            continue
        tied_head = module_name == "lm_head" and config.tie_word_embeddings
        if not hasattr(module, "weight_loader") or tied_head:
            continue
        names = _checkpoint_names(model, module_name)
        if all(quant.is_quantized(n) for n in names):
            _quantize_layer(module_name, module, names, tensors, quant)
            blocks.update(names)
            if type(module) is VocabParallelEmbedding:  # the input embedding (not a head)
                module.embedding_method = GGUFEmbeddingMethod(config_dtype(model))
    if config.tie_word_embeddings and hasattr(model.model.embed_tokens, "qtypes"):
        _tie_quantized_head(model)
    rest: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in blocks:
            continue
        if quant.is_quantized(name):  # a fused layer that mixes plain and quantized tensors
            tensor = dequantize(tensor, quant.tensor_types[name])
        rest[name] = tensor
    if own_loader:
        model.load_weights(rest)  # type: ignore[operator]
        return
    for name, tensor in rest.items():
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

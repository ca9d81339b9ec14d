"""What the C++ decode loop covers, declared as data, and the check that holds a model to it.

The C++ decode loop (minivllm/worker/cpu_decode_loop.py) is a second implementation of a Llama
decode step; like a CUDA graph in vLLM, it may replay a model only where it computes exactly what
the Python loop computes. This module says where that is.

What it covers is declared once, as data, here (`COVERED_MODELS`, `BODY`, `LAYER`,
`LAYER_WITH_LORA`): the model classes, by exact class; every module of the body and of a decoder
layer, by path and exact class; the tensors each holds (those the C++ loop reads, no other); and,
for a custom op, the CPU forward the C++ loop reproduces. `not_covered` holds a model to that
declaration, and to the values the declared forwards read (no bias, no sliding window, one scale and one eps for every
layer, weights in a layout the C++ loop multiplies), and returns None or the first reason it
differs, naming the module and the feature. The rule is closed: whatever is not declared falls
back. A subclass (even one that only overrides a method), a forward replaced on an instance, a
submodule the declaration does not list (an adapter beside a linear, a wrapper of another class
in its place), a tensor the loop does not read (a bias), a custom op on another forward: each
keeps the model on its Python loop, so a layer feature added to the model in Python runs there
without a line here, and the C++ loop learns it only when both are written.

LoRA is declared (`LAYER_WITH_LORA`): a model whose four linears per layer the LoRA manager
wrapped (minivllm/lora/layers.py, vLLM's `BaseLayerWithLoRA`) holds each wrapper, with its stacked
A and B and its scales, in the linear's place and the linear below it as `base_layer`; the C++
loop adds each slice's Punica delta after the base product with the kernels the wrappers call on
the CPU backend (`lora_shrink`, `lora_expand`), reading each row's adapter slot from the
`LoRAMapping` all the wrappers share, which the runner sets before every step. Wrappers running
another backend's kernels (the reference's grouped matmuls round differently) keep the Python
loop. Tensor parallel LoRA keeps it too, with every tensor-parallel model.

The reason is logged once, at debug level, on the "minivllm" logger, when the runner builds the
loop (tests/worker/test_decode_loop_coverage.py plants each kind of feature and holds the answer
to the Python loop's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from minivllm.attention.abstract import AttentionBackend
from minivllm.cpu import ops as cpu_ops
from minivllm.cpu.op_forwards import (
    column_parallel_linear_forward_cpu,
    rms_norm_forward_cpu,
    rotary_embedding_forward_cpu,
    row_parallel_linear_forward_cpu,
    silu_and_mul_forward_cpu,
)
from minivllm.cpu.ops import skinny_gemm_fast
from minivllm.lora.layers import (
    BaseLinearLayerWithLoRA,
    ColumnParallelLinearWithLoRA,
    LoRAMapping,
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
)
from minivllm.model.layers.layernorm import RMSNorm, SiluAndMul
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from minivllm.model.models.phi3 import Phi3ForCausalLM
from minivllm.model.quantization.gguf.linear import GGUFLinearMethod


# ---------------------------------------------------------------------------------- what it covers
@dataclass(frozen=True)
class Covered:
    """One module the C++ loop replays."""

    # Its exact class (or one of these exact classes): a subclass may compute something else.
    cls: type[nn.Module] | tuple[type[nn.Module], ...]
    # Its own parameters, buffers and tensor attributes (a tuple of tensors is one): those the
    # C++ loop reads.
    tensors: tuple[str, ...] = ()
    # A custom op's CPU forward (op_forwards.py), the one whose kernels the C++ loop calls.
    cpu_forward: Callable[..., Any] | None = None
    # Called as a module by the C++ loop's Python side too (the embedding): whatever it is, and
    # whatever its subtree holds, runs as in the Python loop.
    in_python: bool = False


# The model classes whose decode step it replays, by exact class. Phi-3's only adds how its
# checkpoint is read (`packed_checkpoint`); Mistral is `LlamaForCausalLM` (the registry's map).
COVERED_MODELS: tuple[type[nn.Module], ...] = (LlamaForCausalLM, Phi3ForCausalLM)

# The body (`model.model`), by path; its layers are each held to `LAYER`.
BODY: dict[str, Covered] = {
    "": Covered(LlamaModel),
    "embed_tokens": Covered(VocabParallelEmbedding, in_python=True),
    "layers": Covered(nn.ModuleList),
    "norm": Covered(RMSNorm, ("weight",), rms_norm_forward_cpu),
    "rotary_emb": Covered(RotaryEmbedding, ("cos_sin",), rotary_embedding_forward_cpu),
}

# A decoder layer, by path: Llama's, module for module. A linear holds its `weight` (plain, or
# prepacked for oneDNN), or, under a `GGUFLinearMethod`, that method's block buffers instead.
LAYER: dict[str, Covered] = {
    "": Covered(LlamaDecoderLayer),
    "input_layernorm": Covered(RMSNorm, ("weight",), rms_norm_forward_cpu),
    "self_attn": Covered(LlamaAttention),
    "self_attn.qkv_proj": Covered(
        QKVParallelLinear, ("weight",), column_parallel_linear_forward_cpu
    ),
    "self_attn.o_proj": Covered(RowParallelLinear, ("weight",), row_parallel_linear_forward_cpu),
    "post_attention_layernorm": Covered(RMSNorm, ("weight",), rms_norm_forward_cpu),
    "mlp": Covered(LlamaMLP),
    "mlp.gate_up_proj": Covered(
        ColumnParallelLinear, ("weight",), column_parallel_linear_forward_cpu
    ),
    "mlp.down_proj": Covered(RowParallelLinear, ("weight",), row_parallel_linear_forward_cpu),
    "mlp.act_fn": Covered(SiluAndMul, (), silu_and_mul_forward_cpu),
}

# A decoder layer whose linears carry LoRA adapters (the LoRA manager wraps all four before the
# runner builds the loop): each linear's path holds its wrapper, with the stacked A and B of every
# adapter slot and the slots' scales, and the linear itself, as `LAYER` declares it, below it as
# `base_layer`. A fused q/k/v or gate/up is one slice per part of the checkpoint's modules, or one
# slice where the checkpoint stores it fused (Phi-3: `ColumnParallelLinearWithLoRA`).
LORA_TENSORS = ("lora_a_stacked", "lora_b_stacked", "scales")
LORA_WRAPPERS: dict[str, Covered] = {
    "self_attn.qkv_proj": Covered(
        (MergedQKVParallelLinearWithLoRA, ColumnParallelLinearWithLoRA), LORA_TENSORS
    ),
    "self_attn.o_proj": Covered(RowParallelLinearWithLoRA, LORA_TENSORS),
    "mlp.gate_up_proj": Covered(
        (MergedColumnParallelLinearWithLoRA, ColumnParallelLinearWithLoRA), LORA_TENSORS
    ),
    "mlp.down_proj": Covered(RowParallelLinearWithLoRA, LORA_TENSORS),
}
LAYER_WITH_LORA: dict[str, Covered] = {
    **LAYER,
    **LORA_WRAPPERS,
    **{f"{path}.base_layer": LAYER[path] for path in LORA_WRAPPERS},
}

# The four linears of a layer, in the op's order.
LINEARS_PER_LAYER = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


# ---------------------------------------------------------------------------------- the check
def not_covered(model: nn.Module, backend: AttentionBackend) -> str | None:
    """None where the C++ loop computes exactly what `model`'s Python loop computes for a decode
    step; otherwise the first reason it does not, naming the module and the feature."""
    if type(model) not in COVERED_MODELS:
        names = ", ".join(cls.__name__ for cls in COVERED_MODELS)
        return f"the model is {type(model).__qualname__}; the C++ loop covers {names}, exactly"
    model = cast("LlamaForCausalLM", model)
    if backend.name != "cpu":
        return f"the attention backend is {backend.name!r}; the C++ loop calls the CPU's kernels"
    if model.tp.world_size != 1:
        return "tensor parallelism: each layer's two all-reduces run in Python"
    if reason := replaced_methods(model, "the model"):
        return reason
    body = model.model
    if reason := check_modules(body, "model", BODY, own_subtrees=("layers",)):
        return reason
    # The op's activations are float32 or bfloat16: a float16 model (a GGUF file's blocks under
    # --dtype half) keeps its Python loop.
    if body.norm.weight.dtype not in (torch.float32, torch.bfloat16):
        return (
            f"model.norm.weight is {body.norm.weight.dtype}; the C++ loop runs float32 or bfloat16"
        )
    mapping = lora_mapping(model)
    declared = LAYER if mapping is None else LAYER_WITH_LORA
    for i, layer in enumerate(body.layers):
        name = f"model.layers.{i}"
        if reason := check_modules(layer, name, declared) or check_values(
            layer, name, body, backend
        ):
            return reason
        for path in LINEARS_PER_LAYER:
            op, where = layer.get_submodule(path), f"{name}.{path}"
            if mapping is not None:
                if reason := check_lora(op, where, mapping):
                    return reason
                op, where = op.get_submodule("base_layer"), f"{where}.base_layer"
            if reason := check_linear(op, where):
                return reason
    return None


def check_modules(
    root: nn.Module, name: str, declared: dict[str, Covered], own_subtrees: tuple[str, ...] = ()
) -> str | None:
    """`root` holds exactly the declared modules, each as declared (`check_module`); below a path
    in `own_subtrees`, or a module the loop calls in Python, nothing is looked at here."""
    seen = set()
    skipped = [*own_subtrees]
    for path, module in root.named_modules():
        if any(path.startswith(f"{top}.") for top in skipped):
            continue
        where = f"{name}.{path}" if path else name
        covered = declared.get(path)
        if covered is None:
            return f"{where} ({type(module).__qualname__}) is a module the C++ loop does not know"
        seen.add(path)
        if covered.in_python:
            skipped.append(path)
        elif reason := check_module(module, where, covered):
            return reason
    if missing := sorted(declared.keys() - seen):
        return f"{name}.{missing[0]} is missing"
    return None


def check_module(module: nn.Module, where: str, covered: Covered) -> str | None:
    """`module` is of the declared class, runs the declared forward, holds the declared tensors
    and no other, and replaces none of its class's methods."""
    classes = covered.cls if isinstance(covered.cls, tuple) else (covered.cls,)
    if type(module) not in classes:
        names = " or ".join(cls.__qualname__ for cls in classes)
        return (
            f"{where} is {type(module).__qualname__}, not {names}: the C++ "
            "loop knows classes exactly, and a subclass may compute something else"
        )
    if reason := replaced_methods(module, where):
        return reason
    tensors = set(covered.tensors)
    if isinstance(module, LinearBase) and type(module.quant_method) is GGUFLinearMethod:
        qtypes: tuple[int, ...] = getattr(module, "qtypes", ())
        tensors = {f"qweight_{i}" for i in range(len(qtypes))}  # `gguf_parts`
    held = {n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None}
    held |= {n for n, value in vars(module).items() if is_tensors(value)}
    if extra := sorted(held - tensors):
        return f"{where}.{extra[0]} is a tensor the C++ loop does not read"
    if missing := sorted(tensors - held):
        return f"{where} has no {missing[0]}"
    if covered.cpu_forward is not None:
        forward = getattr(module, "_forward_method", None)
        if not (
            isinstance(forward, functools.partial)
            and forward.func is covered.cpu_forward
            and forward.args == (module,)
            and not forward.keywords
        ):
            runs = getattr(forward, "func", forward)
            return (
                f"{where} runs {getattr(runs, '__qualname__', runs)}, not "
                f"{covered.cpu_forward.__qualname__}, whose kernels the C++ loop calls"
            )
    return None


def is_tensors(value: object) -> bool:
    """A tensor, or a tuple of them (a LoRA wrapper's stacked A and B, one per slice)."""
    if isinstance(value, tuple):
        return bool(value) and all(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def replaced_methods(module: nn.Module, where: str) -> str | None:
    """A method of the module's class that the instance replaces (`layer.forward = ...`)."""
    for attr in vars(module):
        if callable(getattr(type(module), attr, None)):
            return f"{where}.{attr} is replaced on the instance"
    return None


def check_values(
    layer: nn.Module, where: str, body: LlamaModel, backend: AttentionBackend
) -> str | None:
    """The values the declared forwards read that the C++ loop takes once for every layer (the
    first layer's scale and heads, the final norm's eps) or does not take at all (a window)."""
    layer = cast("LlamaDecoderLayer", layer)
    attn, first = layer.self_attn, cast("LlamaDecoderLayer", body.layers[0]).self_attn
    if attn.backend is not backend:
        return f"{where}.self_attn attends through another backend than the step's"
    # The C++ loop calls paged_decode, which has no window (paged_decode_sliding has).
    if attn.sliding_window is not None:
        return f"{where}.self_attn has a sliding window"
    heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    if heads != (first.num_heads, first.num_kv_heads, first.head_dim) or (
        attn.q_size != attn.num_heads * attn.head_dim
        or attn.kv_size != attn.num_kv_heads * attn.head_dim
    ):
        return (
            f"{where}.self_attn's heads differ from model.layers.0's, or its sizes from its heads"
        )
    if attn.scale != first.scale:
        return f"{where}.self_attn.scale differs from model.layers.0's"
    for norm in ("input_layernorm", "post_attention_layernorm"):
        if getattr(layer, norm).eps != body.norm.eps:
            return f"{where}.{norm}.eps differs from model.norm's"
    return None


def check_linear(op: nn.Module, where: str) -> str | None:
    """A linear the C++ loop multiplies as its CPU forward does: no bias, one device, and its
    weight prepacked for oneDNN, GGUF blocks, or plain float32 where the skinny GEMM is fast."""
    op = cast("ColumnParallelLinear | RowParallelLinear", op)
    if op.bias is not None:  # the tensor check has refused a registered one already
        return f"{where}.bias is a bias, which the C++ loop does not add"
    if op.tp.world_size != 1:
        return f"{where} is split over {op.tp.world_size} ranks"
    if op.quant_method is not None:
        if type(op.quant_method) is not GGUFLinearMethod:
            return f"{where} is quantized by {type(op.quant_method).__qualname__}"
        return None
    weight = op.weight
    if weight.is_mkldnn:
        return None
    if weight.dtype != torch.float32 or not skinny_gemm_fast():
        return (
            f"{where}.weight is plain {weight.dtype}: the C++ loop multiplies plain weights by "
            "the skinny GEMM, in float32 where it has its AVX-512 path"
        )
    return None


def check_lora(op: nn.Module, where: str, mapping: LoRAMapping) -> str | None:
    """A LoRA wrapper (of a declared class: `check_module` held it) whose delta the C++ loop adds
    as its forward does: from the rows' slots every wrapper shares, by the CPU library's kernels."""
    op = cast("BaseLinearLayerWithLoRA", op)
    if op.mapping is not mapping:
        return f"{where} reads another row -> slot map than model.layers.0's linears"
    if (mapping.ops.shrink, mapping.ops.expand) != (cpu_ops.lora_shrink, cpu_ops.lora_expand):
        return (
            f"{where} runs the {mapping.ops.name!r} shrink / expand, not the CPU library's, which "
            "the C++ loop calls"
        )
    return None


# ---------------------------------------------------------------------------------- the weights
def decoder_layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    return cast("list[LlamaDecoderLayer]", list(model.model.layers))


def lora_mapping(model: LlamaForCausalLM) -> LoRAMapping | None:
    """The row -> slot map the model's LoRA wrappers share, where its linears are wrapped (the
    first layer's qkv_proj says; `not_covered` holds every linear to it)."""
    first = decoder_layers(model)[0].get_submodule(LINEARS_PER_LAYER[0])
    return first.mapping if isinstance(first, BaseLinearLayerWithLoRA) else None

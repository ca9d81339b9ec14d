"""A Llama decode step's decoder layers as one C++ loop: what CUDA graphs do for vLLM, on a CPU.

This is not a capture of the model but a second
implementation of Llama's decoder loop, in C++ (`cpu_decode_layers.cpp`), held bit for bit to the
Python one (tests/worker/test_kernels_cpu_decode_loop.py), which stays the specification.

Why it exists: a decode step runs each layer on 1-64 token rows, so each of its ~10 kernels is
short, and between two of them Python does the layer's bookkeeping (module calls, custom-op
dispatch, views, the wrappers' checks). vLLM removes the host from a GPU's decode step by
replaying a captured CUDA graph; a CPU has no such graph, so `cpu_decode_layers.cpp` does the
host's part in C++, calling the same kernels as `LlamaModel.forward` with every custom op on its
CPU forward (minivllm/cpu/op_forwards.py), in the same order and on the same layouts.
docs/performance.md has what it saves.

Like a CUDA graph in vLLM, it is built and run by the model runner (`ModelRunner.build_decode_loop`,
from the class the CPU platform names in `decode_loop_cls`); the model does not know it exists.

What it covers is declared once, as data, below (`COVERED_MODELS`, `BODY`, `LAYER`,
`LAYER_WITH_LORA`): the model classes, by exact class; every module of the body and of a decoder
layer, by path and exact class; the tensors each holds (those the C++ loop reads, no other); and,
for a custom op, the CPU forward the C++ loop reproduces. `not_covered` holds a model to that declaration, and to the
values the declared forwards read (no bias, no sliding window, one scale and one eps for every
layer, weights in a layout the C++ loop multiplies), and returns None or the first reason it
differs, naming the module and the feature. The rule is closed: whatever is not declared falls
back. A subclass (even one that only overrides a method), a forward replaced on an instance, a
submodule the declaration does not list (an adapter beside a linear, a wrapper of another class
in its place), a tensor the loop does not read (a bias), a custom op on another forward: each
keeps the model on its Python loop, so a layer feature added to the model in
Python runs there without a line here, and the C++ loop learns it only when both are written.

LoRA is declared (`LAYER_WITH_LORA`): a model whose four linears per layer the LoRA manager
wrapped (minivllm/lora/layers.py, vLLM's `BaseLayerWithLoRA`) holds each wrapper, with its stacked
A and B and its scales, in the linear's place and the linear below it as `base_layer`; the C++
loop adds each slice's Punica delta after the base product with the kernels the wrappers call on
the CPU backend (`lora_shrink`, `lora_expand`), reading each row's adapter slot from the
`LoRAMapping` all the wrappers share, which the runner sets before every step. Wrappers running
another backend's kernels (the reference's grouped matmuls round differently) keep the Python
loop. Tensor parallel LoRA keeps it too, with every tensor-parallel model.

The reason is logged once, at debug level, on the "minivllm" logger, when the runner builds the
loop (tests/worker/test_decode_loop_coverage.py plants each kind of feature and holds the answer to the
Python loop's).

The check runs when the runner builds the loop, after the weights are loaded and every custom op
dispatched, as vLLM captures its graphs once the model is ready: a change made to the model after
that must build it again (`ModelRunner.build_decode_loop`). Then, per step, `applies` takes the
C++ call only where the whole of the step is what it does:

- a step of decodes only, planned by the CPU attention backend (every row a work item of its
  paged kernel);
- on plain float32 weights, at most `SKINNY_GEMM_MAX_ROWS` rows (above that the linears go to
  MKL); a GGUF model, fewer rows than `MINIVLLM_CPU_GGUF_GEMM_ROWS` where that is set (from
  there its linears dequantize and run one GEMM);
- no forward hook on the model, its body or their modules, nor a global one: a hook is Python,
  and a user who registers one on a layer expects it to run (vLLM's CUDA graphs skip hooks;
  here they turn the C++ call off).

Every other step runs the Python loop, and `enforce_eager=True` (vLLM's flag, `--enforce-eager`)
keeps every step there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from minivllm.attention.abstract import AttentionBackend, AttentionMetadata
from minivllm.attention.backends.cpu import CpuPlan
from minivllm.cpu import ops as cpu_ops
from minivllm.cpu.op_forwards import (
    column_parallel_linear_forward_cpu,
    gguf_dot,
    gguf_gemm_rows,
    rms_norm_forward_cpu,
    rotary_embedding_forward_cpu,
    row_parallel_linear_forward_cpu,
    silu_and_mul_forward_cpu,
)
from minivllm.cpu.ops import SKINNY_GEMM_MAX_ROWS, skinny_gemm_fast
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
from minivllm.model.quantization.gguf.linear import GGUFLinearMethod, gguf_parts

logger = logging.getLogger("minivllm")


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

# A GGUF part's products (`gguf_dot`) as the op numbers them (cpu_decode_layers.cpp `kDot*`): the
# ops gguf_linear, gguf_linear_bf16, gguf_linear_int8.
DOT_CODES = {"float32": 0, "bf16": 1, "int8": 2}

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


def linear_weights(op: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
    """A linear's tensors and their GGML types (-1: plain), under its LoRA wrapper if it has one:
    its one weight (an MKLDNN tensor where
    `prepack_linear` packed it for oneDNN), or the GGUF block parts a quantized layer holds."""
    if isinstance(op, BaseLinearLayerWithLoRA):
        op = op.base_layer
    if getattr(op, "quant_method", None) is not None:
        parts = gguf_parts(op)
        return [q for _, q in parts], [qtype for qtype, _ in parts]
    return [cast("torch.Tensor", op.weight)], [-1]


def layer_weights(layer: LlamaDecoderLayer) -> list[tuple[list[torch.Tensor], list[int]]]:
    """A layer's six weight slots in the op's order (input norm, qkv, o, post-attention norm,
    gate_up, down), each its tensors and their GGML types."""
    qkv, o, gate_up, down = (linear_weights(layer.get_submodule(n)) for n in LINEARS_PER_LAYER)
    norms: list[tuple[list[torch.Tensor], list[int]]] = [
        ([layer.input_layernorm.weight], [-1]),
        ([layer.post_attention_layernorm.weight], [-1]),
    ]
    return [norms[0], qkv, o, norms[1], gate_up, down]


def linears(model: LlamaForCausalLM) -> list[nn.Module]:
    """Every decoder layer's four linears, below their LoRA wrappers where they have them."""
    ops = [layer.get_submodule(n) for layer in decoder_layers(model) for n in LINEARS_PER_LAYER]
    return [op.base_layer if isinstance(op, BaseLinearLayerWithLoRA) else op for op in ops]


def all_linears_packed(model: LlamaForCausalLM) -> bool:
    """Whether every decoder layer's linear takes any number of rows in the C++ loop: each holds
    GGUF blocks (gguf_linear) or a weight prepacked for oneDNN (prepack_linear)."""
    return all(op.quant_method is not None or op.weight.is_mkldnn for op in linears(model))


# ---------------------------------------------------------------------------------- the loop
class CpuDecodeLoop:
    """`LlamaForCausalLM.forward` for a decode step: the embedding, then the layers and the final
    norm as one `decode_layers` op call."""

    @classmethod
    def build(cls, model: nn.Module, backend: AttentionBackend) -> CpuDecodeLoop | None:
        """The loop for `model`, where it covers it (`not_covered`); None otherwise, the reason
        logged once, at debug level."""
        reason = not_covered(model, backend)
        if reason is not None:
            logger.debug("decode steps run the Python loop: %s", reason)
            return None
        return cls(cast("LlamaForCausalLM", model))

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether the C++ loop covers `model` with its own attention backend."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not layers:
            return False
        return not_covered(model, layers[0].self_attn.backend) is None

    def __init__(self, model: LlamaForCausalLM) -> None:
        body = model.model
        layers = decoder_layers(model)
        self.embed_tokens = body.embed_tokens
        self.rotary_emb = body.rotary_emb
        self.final_norm = body.norm
        # Six slots per layer, in the op's order, flattened: `parts` says how many tensors each
        # slot takes, `qtypes` each tensor's GGML type. The C++ loop calls oneDNN on a packed
        # linear weight, the skinny GEMM on a plain one and on GGUF blocks the gguf_linear op of
        # each part's products (`dots`: its type's `gguf_dot`, in `DOT_CODES`), as each linear's
        # CPU forward does (`op_linear` in minivllm/cpu/op_forwards.py).
        slots = [slot for layer in layers for slot in layer_weights(layer)]
        self.weights = [w for tensors, _ in slots for w in tensors]
        self.qtypes = [t for _, types in slots for t in types]
        self.parts = [len(tensors) for tensors, _ in slots]
        self.dots = [DOT_CODES[gguf_dot(t)] if t >= 0 else 0 for t in self.qtypes]
        # From this many rows a GGUF linear's CPU forward dequantizes and runs one GEMM (opt-in),
        # which the C++ loop does not: such a step stays in Python.
        self.gguf_gemm_rows = gguf_gemm_rows() if any(t >= 0 for t in self.qtypes) else None
        self.packed = all_linears_packed(model)
        # LoRA (`LAYER_WITH_LORA`): per linear, layer by layer, its slices' stacked A and B and
        # its scales, the same tensors the wrappers hold (the manager copies an adapter into a
        # slot in place); each step's row -> slot map is read from `mapping` at the call.
        self.mapping = lora_mapping(model)
        ops = [layer.get_submodule(n) for layer in layers for n in LINEARS_PER_LAYER]
        wrappers = [op for op in ops if isinstance(op, BaseLinearLayerWithLoRA)]  # all, or none
        self.lora_a = [a for op in wrappers for a in op.lora_a_stacked]  # each [L, R, in]
        self.lora_b = [b for op in wrappers for b in op.lora_b_stacked]  # each [L, out_i, R]
        self.lora_scales = [op.scales for op in wrappers]  # each [L]
        self.lora_slices = [len(op.lora_a_stacked) for op in wrappers]
        attention = layers[0].self_attn
        self.scale = attention.scale
        self.num_heads = attention.num_heads
        # Whose forward hooks the C++ loop would skip: the model's and its body's (the LM head runs
        # outside the replay, in `compute_logits`, hooks and all). Their hook dicts, gathered once:
        # registering or removing a hook changes a dict in place, so each step asks `any` of this
        # list, in C, rather than walking ~400 modules' attributes in Python.
        self.modules = [model, *body.modules()]
        self.hook_dicts = [
            hooks for m in self.modules for hooks in (m._forward_hooks, m._forward_pre_hooks)
        ]

    def applies(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether this step is one the C++ loop runs: decodes only, few enough for the skinny
        GEMM and the GGUF tiles (the Python loop's choices at every linear), planned by the CPU
        backend, and no forward hook on a layer, which the Python loop runs and this call would
        skip."""
        return (
            meta.is_decode_only
            and (num_tokens <= SKINNY_GEMM_MAX_ROWS or self.packed)
            and (self.gguf_gemm_rows is None or num_tokens < self.gguf_gemm_rows)
            and isinstance(meta.plan, CpuPlan)
            and not self.hooked()
        )

    def hooked(self) -> bool:
        """Whether a forward hook is registered on the body or any module in it, or globally:
        a user's probe on a layer keeps working. Asked every step: a walk over the modules' hook
        dicts, small beside the step."""
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return True
        return any(self.hook_dicts)

    def __call__(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]  after the final norm
        plan = meta.plan
        assert isinstance(plan, CpuPlan)  # `applies` checked it
        embeds = self.embed_tokens(input_ids)  # [T, hidden_size]; becomes the residual
        # Each row's adapter slot, int64 [T]; None where no row has one: the wrappers skip LoRA.
        mapping = self.mapping
        token_slots = mapping.token_slots if mapping is not None and mapping.has_lora else None
        return torch.ops.minivllm_cpu.decode_layers(
            embeds,
            positions,
            self.rotary_emb.cos_sin,
            kv_caches,
            plan.block_tables,
            plan.seq_lens,
            plan.rows,
            meta.slot_mapping,
            self.weights,
            self.final_norm.weight,
            self.final_norm.eps,
            self.scale,
            self.num_heads,
            self.lora_a,
            self.lora_b,
            self.lora_scales,
            self.lora_slices,
            token_slots,
            self.qtypes,
            self.parts,
            self.dots,
        )

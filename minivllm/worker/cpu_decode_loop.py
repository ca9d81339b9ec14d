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

What it covers is declared, as data, in minivllm/worker/cpu_decode_coverage.py (`not_covered`): a
model it does not cover, or covers only in part, keeps every step on its Python loop.

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

import logging
from typing import cast

import torch
from torch import nn

from minivllm.attention.abstract import AttentionBackend, AttentionMetadata
from minivllm.attention.backends.cpu import CpuPlan
from minivllm.cpu.op_forwards import (
    gguf_dot,
    gguf_gemm_rows,
)
from minivllm.cpu.ops import GGUF_AMX_MIN_ROWS, SKINNY_GEMM_MAX_ROWS, gguf_amx_applies
from minivllm.lora.layers import (
    BaseLinearLayerWithLoRA,
)
from minivllm.model.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from minivllm.model.quantization.gguf.linear import gguf_parts
from minivllm.worker.cpu_decode_coverage import (
    LINEARS_PER_LAYER,
    decoder_layers,
    lora_mapping,
    not_covered,
)

logger = logging.getLogger("minivllm")


# A GGUF part's products (`gguf_dot`) as the op numbers them (cpu_decode_layers.cpp `kDot*`): the
# ops gguf_linear, gguf_linear_bf16, gguf_linear_int8; and "int8" on AMX tiles from
# GGUF_AMX_MIN_ROWS rows where `gguf_amx_applies` to the type (gguf_linear_amx: the same outputs).
DOT_CODES = {"float32": 0, "bf16": 1, "int8": 2}
DOT_INT8_AMX = 3


def dot_code(qtype: int) -> int:
    """The C++ loop's code for a GGUF part of `qtype`: its `gguf_dot`, and the AMX tiles for as
    many rows as the Python path takes them (`minivllm.cpu.ops.gguf_linear`)."""
    dot = gguf_dot(qtype)
    if dot == "int8" and gguf_amx_applies(GGUF_AMX_MIN_ROWS, qtype):
        return DOT_INT8_AMX
    return DOT_CODES[dot]


# ---------------------------------------------------------------------------------- the weights
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
        self.dots = [dot_code(t) if t >= 0 else 0 for t in self.qtypes]
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

"""A Llama decode step's decoder layers as one C++ loop: what CUDA graphs do for vLLM, on a CPU.

This is not a capture of the model but a second implementation of Llama's decoder loop, in C++
(`cpu_decode_layers.cpp`), held bit for bit to the Python one; it knows Llama's module layout
(`LINEARS_PER_LAYER`) and refuses every other model (`CpuDecodeLoop.build`), which then runs its
Python loop: a family with math of its own (Qwen2's q/k/v bias, Qwen3's q/k norms: `llama_math`) as
much as a model that is not a Llama at all.

A decode step runs each layer on 1-64 token rows, so each of its ~10 kernels is short, and between
two of them Python does the layer's bookkeeping: module calls, custom-op dispatch, views, the
wrappers' checks. That host work costs about the same at every row count, so it weighs most on
the smallest steps (the Performance page, docs/performance.md, has the measurement). vLLM
removes the host from a GPU's decode step by replaying a captured CUDA graph; a CPU has no such
graph, so `cpu_decode_layers.cpp` does the host's part in C++ instead. It calls the same kernels
as `LlamaModel.forward` with every custom op on its CPU forward (minivllm/cpu/op_forwards.py),
in the same order and on the same layouts, so its result is bit for bit the Python loop's; that
loop stays the specification (tests/test_kernels_cpu_decode_loop.py holds the two equal).

Like a CUDA graph in vLLM, it is built and run by the model runner (`ModelRunner.build_decode_loop`,
from the class the CPU platform names in `decode_loop_cls`); the model does not know it exists.

It applies where the whole of a step is what the C++ loop knows how to do:

- the CPU attention backend (the op attends through its plan: every row is a work item of the
  paged kernel) and every custom op on its CPU forward (`custom_ops="all"`);
- one device: with tensor parallelism, each layer's two all-reduces happen in Python;
- Llama's math in every layer (`llama_math`: Llama's layer and attention classes, no q/k norm),
  no biases, no sliding window, and weights that every linear holds prepacked for oneDNN (`prepack_linear` in
  minivllm/cpu/op_forwards.py: float32 wherever oneDNN is built in, bfloat16 where the CPU has
  bf16 dot products; the C++ loop then calls oneDNN on them, as the Python path does) or as a
  GGUF file's blocks (the loop calls `gguf_linear` on each part, with the same products), or
  plain float32 weights on a CPU where the skinny GEMM runs its AVX-512 path;
- a step of decodes only; on plain weights with at most `SKINNY_GEMM_MAX_ROWS` rows, since above
  that the linears go to MKL;
- no forward hook on the model, its body or their modules: a hook is Python, and a user who
  registers one on a layer expects it to run (vLLM's CUDA graphs skip hooks; here they turn the
  C++ call off).

Every other step runs the Python loop, and `enforce_eager=True` (vLLM's flag, `--enforce-eager`)
keeps every step there.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from minivllm.attention.abstract import AttentionBackend, AttentionMetadata
from minivllm.attention.backends.cpu import CpuPlan
from minivllm.cpu.ops import SKINNY_GEMM_MAX_ROWS, skinny_gemm_fast
from minivllm.model.custom_op import CustomOp
from minivllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def decoder_layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    return cast("list[LlamaDecoderLayer]", list(model.model.layers))


LINEARS_PER_LAYER = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def linear_weights(op: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
    """A linear's tensors and their GGML types (-1: plain): its one weight (an MKLDNN tensor where
    `prepack_linear` packed it for oneDNN), or the GGUF block parts a quantized layer holds."""
    if getattr(op, "quant_method", None) is not None:
        from minivllm.model.quantization.gguf.linear import gguf_parts

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
    return [layer.get_submodule(n) for layer in decoder_layers(model) for n in LINEARS_PER_LAYER]


def all_linears_packed(model: LlamaForCausalLM) -> bool:
    """Whether every decoder layer's linear takes any number of rows in the C++ loop: each holds
    GGUF blocks (gguf_linear) or a weight prepacked for oneDNN (prepack_linear)."""
    return all(op.quant_method is not None or op.weight.is_mkldnn for op in linears(model))


def llama_math(model: LlamaForCausalLM) -> bool:
    """Whether every decoder layer is Llama's own, with Llama's attention: a family that brings
    its own layer or attention (Qwen3's q/k norms) computes something the C++ loop does not.
    Phi-3 qualifies (only its checkpoint's layout differs), and so does Mistral."""
    return (
        all(
            type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention
            for layer in decoder_layers(model)
        )
        and not model.config.qk_norm
    )


class CpuDecodeLoop:
    """`LlamaForCausalLM.forward` for a decode step: the embedding, then the layers and the final
    norm as one `decode_layers` op call."""

    @classmethod
    def build(cls, model: nn.Module, backend: AttentionBackend) -> CpuDecodeLoop | None:
        """The loop for `model`, where it runs it exactly as its Python loop does: a Llama, the
        CPU attention backend, and the other conditions of `supports`; None otherwise."""
        if backend.name != "cpu" or not isinstance(model, LlamaForCausalLM):
            return None
        return cls(model) if cls.supports(model) else None

    def __init__(self, model: LlamaForCausalLM) -> None:
        body = model.model
        layers = decoder_layers(model)
        self.embed_tokens = body.embed_tokens
        self.rotary_emb = body.rotary_emb
        self.final_norm = body.norm
        # Six slots per layer, in the op's order, flattened: `parts` says how many tensors each
        # slot takes, `qtypes` each tensor's GGML type. The C++ loop calls oneDNN on a packed
        # linear weight, the skinny GEMM on a plain one and gguf_linear on GGUF blocks, as each
        # linear's CPU forward does (`op_linear` in minivllm/cpu/op_forwards.py).
        slots = [slot for layer in layers for slot in layer_weights(layer)]
        self.weights = [w for tensors, _ in slots for w in tensors]
        self.qtypes = [t for _, types in slots for t in types]
        self.parts = [len(tensors) for tensors, _ in slots]
        self.bf16_dot = False
        if any(t >= 0 for t in self.qtypes):
            from minivllm.cpu.op_forwards import gguf_dot

            self.bf16_dot = gguf_dot() == "bf16"
        self.packed = all_linears_packed(model)
        attention = layers[0].self_attn
        self.scale = attention.scale
        self.num_heads = attention.num_heads
        # Whose forward hooks the C++ loop would skip: the model's and its body's (the LM head runs
        # outside the replay, in `compute_logits`, hooks and all).
        self.modules = [model, *body.modules()]

    @staticmethod
    def supports(model: LlamaForCausalLM) -> bool:
        """Whether the model is one the C++ loop runs exactly as `LlamaModel.forward` does."""
        config = model.config
        layer = decoder_layers(model)[0]
        return (
            llama_math(model)
            and model.tp.world_size == 1
            and all(
                op.dispatched_to == "cpu"
                for op in model.model.modules()
                if isinstance(op, CustomOp)
            )
            # The op's activations are float32 or bfloat16: a float16 model (a GGUF file's blocks
            # under --dtype half) keeps its Python loop.
            and model.model.norm.weight.dtype in (torch.float32, torch.bfloat16)
            and not config.attention_bias
            and not config.qkv_bias
            and not config.mlp_bias
            # The C++ loop calls paged_decode, which has no window (paged_decode_sliding has).
            and all(layer.self_attn.sliding_window is None for layer in decoder_layers(model))
            and (
                all_linears_packed(model)
                or (
                    layer.self_attn.qkv_proj.quant_method is None
                    and layer.self_attn.qkv_proj.weight.dtype == torch.float32
                    and skinny_gemm_fast()
                )
            )
        )

    def applies(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether this step is one the C++ loop runs: decodes only, few enough for the skinny
        GEMM (the Python loop's choice at every linear), planned by the CPU backend, and no
        forward hook on a layer, which the Python loop runs and this call would skip."""
        return (
            meta.is_decode_only
            and (num_tokens <= SKINNY_GEMM_MAX_ROWS or self.packed)
            and isinstance(meta.plan, CpuPlan)
            and not self.hooked()
        )

    def hooked(self) -> bool:
        """Whether a forward hook is registered on the body or any module in it, or globally:
        a user's probe on a layer keeps working. Asked every step: a walk over the modules' hook
        dicts, small beside the step."""
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

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
            self.qtypes,
            self.parts,
            self.bf16_dot,
        )

"""The CPU's forward of each custom op: the model's math, computed by minivllm/cpu/.

Each function below is registered (`register_forward`) for the op class whose `forward_native`
it replaces when the CPU platform runs `custom_ops="all"`; it computes the same result, and the
tests hold it there (tests/model/test_model_llama.py, greedy token-exact against transformers). What
each one buys (the Performance page, docs/performance.md, has the measurements and their
commands):

- **Linears** (`ColumnParallelLinear`, `QKVParallelLinear`, `RowParallelLinear`): where oneDNN
  is built in, each weight is replaced at load by itself in oneDNN's blocked layout
  (`prepack_linear`; vLLM's CPU build packs the same way), and oneDNN runs every row count on it:
  MKL packs its operands again on every call, oneDNN once, at load. The layer holds the packed
  weight only: a plain copy beside it would cost the linears' size again (425 MB for SmolLM2 in
  float32) for the skinny GEMM's small lead at a handful of float32 rows. `forward_native` and
  `state_dict()` read it back plain, exactly. bfloat16 weights are packed where the CPU has bf16
  dot-product instructions (AVX512-BF16, AMX): MKL's bf16 `aten::mm` does not use them, oneDNN
  does; float16 weights where it has AVX512-FP16 or AMX-FP16, for the same reason. A
  prefill-only float16 layer (an encoder's, `LinearBase.prefill_only`) on a CPU with AMX-BF16
  but no AMX-FP16 runs on the AMX-BF16 tiles instead, its weight split exactly into two bfloat16
  (f16_amx.py), with BERT's epilogues in the tile kernel's. oneDNN's
  output is token-major. A weight oneDNN does not pack (no oneDNN, float16 on other CPUs) stays
  plain: up to `SKINNY_GEMM_MAX_ROWS` float32 rows go to the skinny GEMM (`cpu_skinny_gemm.cpp`,
  which streams the weight once; token-major rows), more to MKL as (W · xᵀ)ᵀ, the operand order
  MKL runs faster than `F.linear`'s, whose result is a transposed ("feature-major") view that the
  fused ops, RoPE and the CPU attention backend read as it is.
- **RMSNorm, SiLU·mul, RoPE**: one fused pass over memory each (`cpu_layernorm.cpp`,
  `cpu_activation_rope.cpp`), where plain PyTorch runs a chain of ops (RMSNorm alone is eight),
  each a full pass over the activation: bytes moved, not arithmetic done.
- **BERT's sublayer ends** (`BertIntermediate`, `BertSelfOutput`, `BertOutput`): the GEMM's
  epilogue does the elementwise work (what PyTorch's inductor does on CPUs with the same oneDNN
  op): GELU inside the up projection, and the residual add inside the output projections, so
  neither the FFN's [T, I] activation nor the sum is another pass over memory. oneDNN's post-ops
  compute in float32 on the accumulator, before the one rounding to the output's dtype. On the
  float16 tiles the post-LayerNorm after the residual add runs in the kernel too.
- **LM head**: the largest matmul of a small model's step (113 MB for SmolLM2). An untied head
  is packed as the linears are and runs on oneDNN. A tied head (SmolLM2's) is the embedding's
  table, whose lookup reads plain rows, so it stays plain, held once for both: up to
  `SKINNY_GEMM_MAX_ROWS` sampled float32 rows go to the skinny GEMM, which leads oneDNN at few
  rows, more (and a bfloat16 tied head's rows) to MKL in slices of `LM_HEAD_ROWS` vocabulary rows:
  on a weight far larger than the caches MKL ran the slices faster than one call, with the same
  results.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from minivllm.cpu import ops as cpu_ops
from minivllm.cpu.f16_amx import f16_amx_applies, f16_amx_linear, f16_amx_pack
from minivllm.envs import cpu_gguf_dot, cpu_gguf_gemm_rows
from minivllm.model.custom_op import register_forward
from minivllm.model.layers.layernorm import RMSNorm, SiluAndMul
from minivllm.model.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.models.bert import BertIntermediate, BertSelfOutput
from minivllm.model.quantization.gguf.linear import gguf_parts

LM_HEAD_ROWS = 1024  # vocabulary rows per MKL matmul of a plain LM-head weight


# ---------------------------------------------------------------------------------- linears
def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [M, in] -> [M, out]  feature-major: a transposed view
    """`F.linear(x, weight, bias)` as (W · xᵀ)ᵀ, the operand order MKL runs faster here."""
    y = torch.mm(weight, x.t()).t()
    return y if bias is None else y + bias


def cpu_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [M, in] -> [M, out]
    """Decode's few float32 rows through the skinny GEMM (token-major rows); more through `linear`."""
    if cpu_ops.skinny_gemm_applies(x, weight):
        y = cpu_ops.skinny_gemm(x, weight)
        return y if bias is None else y + bias
    return linear(x, weight, bias)


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether a linear's `weight` is prepacked for oneDNN and runs there: float32 wherever oneDNN
    is built in; bfloat16 where the CPU also has bf16 dot-product instructions (AVX512-BF16 or AMX),
    which oneDNN's bf16 GEMM uses and MKL's `aten::mm` does not; float16 where it has AVX512-FP16
    or AMX-FP16 (a pooling model's default dtype, vLLM's): there oneDNN returns token-major rows,
    which BERT's fused epilogues and the encoder attention kernel read, where MKL's float16
    product is a transposed view that every later op reads strided."""
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    if weight.dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_linear(op: ColumnParallelLinear | RowParallelLinear | ParallelLMHead) -> None:
    """Replace a linear's (or an untied LM head's) weight by itself in oneDNN's blocked layout,
    where `onednn_packs`: `op.weight` becomes a Parameter holding an MKLDNN tensor, and the plain
    one is freed, so the layer holds its weight once. What reads it plain gets it back exactly
    (`to_dense()`): `forward_native` (`linear` in minivllm/model/layers/linear.py) and
    `state_dict()` (`dense_state_dict`). A tied head stays plain: the embedding's lookup reads rows
    of the same table, which the blocked layout does not give without unpacking all of it."""
    if op.quant_method is not None:
        return  # a GGUF file's blocks, multiplied as they are
    weight = op.weight  # [out, in]
    if op.prefill_only and not weight.is_mkldnn and f16_amx_applies(weight):
        # float16 on AMX-BF16 tiles (f16_amx.py); the plain weight stays for forward_native. A
        # plain attribute, not a buffer: `Module.to(dtype)` must not cast the bfloat16 tiles.
        op.f16_amx_weight = f16_amx_pack(weight.detach())
        return
    tied = isinstance(op, ParallelLMHead) and op.tied
    # weight.is_mkldnn: packed by an earlier dispatch already
    if not weight.is_mkldnn and not tied and onednn_packs(weight):
        with torch.no_grad():
            # 64 rows is the hint oneDNN plans its blocking for; any row count runs on the result.
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        op.weight = nn.Parameter(packed, requires_grad=False)
        op.register_state_dict_post_hook(dense_state_dict)


def dense_state_dict(
    op: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, local_metadata: object
) -> None:
    """`state_dict()` of a packed layer: its weight as the checkpoint holds it, a dense tensor."""
    name = prefix + "weight"
    if state_dict[name].is_mkldnn:
        state_dict[name] = state_dict[name].to_dense()


def packed_linear(
    x: torch.Tensor,  # [M, in]  either layout
    packed: torch.Tensor,  # [out, in]  in oneDNN's layout, from `prepack_linear`
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [M, out]  new, token-major
    """x · Wᵀ (+ b) by oneDNN on the prepacked weight, accumulating in float32."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def op_linear(
    op: ColumnParallelLinear | RowParallelLinear, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:  # [M, in] -> [M, out]
    if op.quant_method is not None:
        return gguf_linear_cpu(op, x, bias)
    if hasattr(op, "f16_amx_weight"):  # float16 on AMX-BF16 tiles (prepack_linear)
        return f16_amx_linear(x, amx_pack(op), op.weight.shape[0], bias)
    if op.weight.is_mkldnn:  # [out, in] in oneDNN's layout (prepack_linear): every row count
        return packed_linear(x, op.weight, bias)
    return cpu_linear(x, op.weight, bias)


# The GGML types whose default CPU product is the 8-bit integer dot where the library has one
# (`cpu_ops.gguf_has_int8_dot()`: AVX-512 builds on a CPU with AVX512-VNNI, and every AVX2 build,
# where it is the "float32" product too): the K-quants Q4_K, Q5_K, Q6_K, whose integer code dots
# each super-block in registers at decode's rows and applies the sub-block scales to int32 sums;
# Q8_0, whose bytes are dotted where they lie; and Q4_0, Q4_1 (the bundled SmolLM2), whose blocks
# are dotted in registers at decode's rows and on AMX tiles from 16 rows (whole-block integer
# sums, cpu_gguf_amx32.h): faster than their bf16 dot at one row, 32 and thousands
# (docs/performance.md, "Q4_0 and Q4_1 on whole-block sums"). On the bundled model the 8-bit dot
# changes a chat answer's knife-edge first token where the bf16 dot keeps the dequantized model's;
# llama.cpp's q4_1 x q8_1 answers as the 8-bit dot does (8-bit activations, not a kernel fault:
# the same page, "Understood"), and `MINIVLLM_CPU_GGUF_DOT=bf16` keeps the other.
# Q5_0 and Q5_1 keep the float32 tiles (or the bf16 dot): not measured.
# cpu_gguf_gemm.cpp's header has the reasoning; benchmarks/gguf_small_m.py times the three dots
# side by side.
INT8_BY_DEFAULT = frozenset({2, 3, 8, 12, 13, 14})


@functools.cache
def gguf_dot(qtype: int) -> str:
    """The quantized GEMM's products for weights of GGML type `qtype`, "bf16", "float32" or
    "int8": MINIVLLM_CPU_GGUF_DOT for every type where it is set, else (auto) "int8" for the
    K-quants, Q8_0, Q4_0 and Q4_1 (`INT8_BY_DEFAULT`) where the library has 8-bit dots, and for
    the others bf16 on a CPU with AVX512-BF16 (twice the products a cycle; within 2^-8 of
    float32's each, as llama.cpp's 8-bit activations are within theirs), else "float32". Read once per process and type.
    "float32" is the library's own product: float32 on AVX-512 and generic builds, 8-bit integer
    dots on the AVX2 build (`cpu_ops.gguf_dot_kind()`); "int8" is the AVX2 build's code, with
    AVX512-VNNI's instructions on AVX-512 builds (cpu_gguf_gemm_avx2.cpp). A kind this CPU or
    build lacks is refused by name."""
    choice = cpu_gguf_dot()
    if choice == "bf16" and not cpu_ops.gguf_has_bf16_dot():
        raise ValueError("MINIVLLM_CPU_GGUF_DOT=bf16, but this CPU has no AVX512-BF16")
    if choice == "int8" and not cpu_ops.gguf_has_int8_dot():
        raise ValueError(
            "MINIVLLM_CPU_GGUF_DOT=int8, but this build has no 8-bit dots (AVX2, or AVX-512 "
            "on a CPU with AVX512-VNNI)"
        )
    if choice != "auto":
        return choice
    if qtype in INT8_BY_DEFAULT and cpu_ops.gguf_has_int8_dot():
        return "int8"
    return "bf16" if cpu_ops.gguf_has_bf16_dot() else "float32"


@functools.cache
def gguf_gemm_rows() -> int | None:
    """MINIVLLM_CPU_GGUF_GEMM_ROWS, read once per process: None (the default) keeps every row
    count on the batch-invariant tiles."""
    return cpu_gguf_gemm_rows()


def gguf_linear_cpu(
    op: ColumnParallelLinear | RowParallelLinear | ParallelLMHead,
    x: torch.Tensor,  # [M, in]  either layout
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [M, out]
    """x · Wᵀ (+ b) for a layer holding GGUF blocks: each part through the quantized GEMM with its
    type's products (`gguf_dot`), which dequantizes inside the product (`GGUFLinearMethod.apply`
    is its specification)."""
    # Opt-in (MINIVLLM_CPU_GGUF_GEMM_ROWS): many token rows dequantize and run one dense GEMM, as
    # vLLM's GGUF path does past its batch bound (`_fused_mul_mat_gguf`). Off by default, because
    # the tiles are batch-invariant and the GEMM's sums are not the tiles': a request's tokens
    # would depend on how many other rows shared its step.
    rows = gguf_gemm_rows()
    linear = (
        cpu_ops.gguf_linear_dequantized
        if rows is not None and x.shape[0] >= rows
        else cpu_ops.gguf_linear
    )
    dense = linear is cpu_ops.gguf_linear_dequantized
    outs = []
    for qtype, q in gguf_parts(op):
        dot = gguf_dot(qtype)
        if dense and dot == "int8":
            dot = "float32"  # the dense GEMM multiplies float32 rows
        outs.append(linear(x.float(), q, qtype, dot))
    y = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).to(x.dtype)
    return y if bias is None else y + bias


@register_forward(ColumnParallelLinear, "cpu", process_weights_after_loading=prepack_linear)
def column_parallel_linear_forward_cpu(op: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    return op_linear(op, x, op.bias)  # QKVParallelLinear too, its subclass


@register_forward(RowParallelLinear, "cpu", process_weights_after_loading=prepack_linear)
def row_parallel_linear_forward_cpu(op: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    if op.tp.world_size == 1:  # no partial sums to reduce: the bias rides in the GEMM (BERT's)
        return op_linear(op, x, op.bias if op.reduce_results else None)
    partial = op_linear(op, x, None)
    return op.reduce(partial) if op.reduce_results else partial


def onednn_linear(layer: object) -> bool:
    """Whether `layer` is a plain linear holding a oneDNN-packed weight (`prepack_linear`),
    whose GEMM a fused epilogue may take over: not a LoRA wrapper, not GGUF blocks."""
    return (
        isinstance(layer, (ColumnParallelLinear, RowParallelLinear))
        and layer.quant_method is None
        and layer.weight.is_mkldnn
    )


def amx_f16_linear(layer: object) -> bool:
    """Whether `layer` is a plain linear whose float16 weight `prepack_linear` packed for AMX-BF16
    tiles (f16_amx.py), whose epilogue the tile kernel's may take over."""
    return (
        isinstance(layer, (ColumnParallelLinear, RowParallelLinear))
        and layer.quant_method is None
        and hasattr(layer, "f16_amx_weight")
    )


def amx_pack(layer: nn.Module) -> torch.Tensor:  # the tiles `prepack_linear` packed
    pack = layer.f16_amx_weight
    assert isinstance(pack, torch.Tensor)
    return pack


@register_forward(BertIntermediate, "cpu")
def bert_intermediate_forward_cpu(op: BertIntermediate, hidden: torch.Tensor) -> torch.Tensor:
    """gelu(x · Wᵀ + b) in one oneDNN call: GELU as the GEMM's post-op ("none": erf, as F.gelu)."""
    dense = op.dense
    if amx_f16_linear(dense):
        return f16_amx_linear(
            hidden, amx_pack(dense), dense.weight.shape[0], dense.bias, None, op.approximate
        )
    if not onednn_linear(dense):
        return op.forward_native(hidden)
    return torch.ops.mkldnn._linear_pointwise(
        hidden.contiguous(), dense.weight, dense.bias, "gelu", [], op.approximate
    )  # [T, I]


@register_forward(BertSelfOutput, "cpu")  # BertOutput too, its subclass
def bert_output_forward_cpu(
    op: BertSelfOutput,
    hidden: torch.Tensor,  # [T, in]
    residual: torch.Tensor,  # [T, hidden_size]
) -> torch.Tensor:  # [T, hidden_size]
    """LayerNorm(x · Wᵀ + b + residual): the residual add as the GEMM's binary post-op."""
    dense = op.dense
    # Over several ranks the residual comes after the all-reduce of partial sums: unfused.
    if amx_f16_linear(dense) and dense.tp.world_size == 1:
        n, norm = dense.weight.shape[0], op.LayerNorm
        affine_f16 = norm.weight is not None and norm.weight.dtype == torch.float16
        if affine_f16 and norm.bias is not None:  # the LayerNorm in the tile kernel too
            return f16_amx_linear(hidden, amx_pack(dense), n, dense.bias, residual, None, norm)
        return norm(f16_amx_linear(hidden, amx_pack(dense), n, dense.bias, residual))
    if not onednn_linear(dense) or dense.tp.world_size > 1:
        return op.forward_native(hidden, residual)
    y = torch.ops.mkldnn._linear_pointwise.binary(
        hidden.contiguous(), residual.contiguous(), dense.weight, dense.bias, "add"
    )
    return op.LayerNorm(y)


# ---------------------------------------------------------------------------------- elementwise
@register_forward(RMSNorm, "cpu")
def rms_norm_forward_cpu(
    op: RMSNorm,
    x: torch.Tensor,  # [T, hidden]  either layout
    residual: torch.Tensor | None = None,  # [T, hidden]  token-major
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        return cpu_ops.rms_norm(x, op.weight, op.eps)
    # In place: x (a sublayer's fresh output, in the layout its linear gave it) becomes the
    # normalised rows, residual the sum.
    cpu_ops.fused_add_rms_norm(x, residual, op.weight, op.eps)
    return x, residual


@register_forward(SiluAndMul, "cpu")
def silu_and_mul_forward_cpu(op: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
    return cpu_ops.silu_and_mul(x)  # [T, 2 * I] -> [T, I], in x's layout


@register_forward(RotaryEmbedding, "cpu")
def rotary_embedding_forward_cpu(
    op: RotaryEmbedding,
    positions: torch.Tensor,  # int64 [T]
    x: torch.Tensor,  # [T, heads, head_dim]  a view of the qkv output, either layout
) -> torch.Tensor:  # x itself, rotated in place
    cpu_ops.rotary_embedding(positions, x, op.cos_sin)
    return x


# ---------------------------------------------------------------------------------- LM head
@register_forward(ParallelLMHead, "cpu", process_weights_after_loading=prepack_linear)
def lm_head_forward_cpu(head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
    """[S, R] logits of this rank's vocabulary rows, in the weight's dtype, for hidden [S, h]."""
    if head.quant_method is not None:
        return gguf_linear_cpu(head, hidden, None)
    weight = head.weight  # [R, hidden]  in oneDNN's layout where prepacked (an untied head)
    if weight.is_mkldnn:
        return packed_linear(hidden, weight)
    if cpu_ops.skinny_gemm_applies(hidden, weight):  # a tied head's few sampled rows
        return cpu_ops.skinny_gemm(hidden, weight)
    local_t = torch.empty(weight.shape[0], hidden.shape[0], dtype=weight.dtype)  # [R, S]
    for start in range(0, weight.shape[0], LM_HEAD_ROWS):
        rows = slice(start, start + LM_HEAD_ROWS)
        torch.mm(weight[rows], hidden.t(), out=local_t[rows])
    return local_t.t()

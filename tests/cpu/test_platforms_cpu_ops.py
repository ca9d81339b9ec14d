"""The CPU's bfloat16 linears (minivllm/cpu/op_forwards.py): oneDNN on a prepacked weight; and BERT's
sublayer ends, whose GELU and residual add ride in that GEMM as post-ops.

`packed_linear` is held to `F.linear` computed in float32 on the same bf16 inputs (exact products,
a float32 sum): oneDNN sums the products in float32 too and rounds the result to bf16 once, so the
tolerance is half a bf16 ulp of the output (2^-8 relative, bias included: it is added before the
rounding) plus a float32 sum's error, scaled by sqrt(K) and the operands' magnitude. Shapes cover
1 row (decode), the 64 rows the packing is planned for, more, and N/K that are not multiples of
oneDNN's 16/32-wide blocks.

Where the CPU has no bf16 dot-product instructions the weights are not packed and the linears keep
MKL; the tests of the packed path are skipped there, the dispatch test checks that fallback.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.cpu.f16_amx import f16_amx_applies
from minivllm.cpu.op_forwards import onednn_packs, packed_linear
from minivllm.distributed.parallel_state import SINGLE_DEVICE
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.model.models.bert import BertConfig, BertIntermediate, BertOutput
from minivllm.platforms.cpu import CpuPlatform

BF16_HW = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
FP16_HW = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported()
needs_bf16_hw = pytest.mark.skipif(not BF16_HW, reason="no AVX512-BF16/AMX: bf16 stays on MKL")

SHAPES = [(1, 960, 576), (3, 5, 15), (7, 17, 40), (64, 3072, 576), (130, 576, 1536)]  # M, N, K


def randn(*shape: int, seed: int) -> torch.Tensor:  # bf16, the model's weights and activations
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def assert_bf16_linear_close(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> None:
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())  # [M, N]
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    sum_error = 1e-6 * (x.shape[1] ** 0.5 + 1) * x.abs().max().item() * w.abs().max().item() * 8
    bound = ref.abs() * 2**-8 + sum_error  # half a bf16 ulp of each output, plus the sum's error
    excess = ((y.float() - ref).abs() - bound).max().item()
    assert excess <= 0, f"error exceeds the bound by {excess:.3g}"


@needs_bf16_hw
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_packed_linear_matches_f_linear_in_float32(m: int, n: int, k: int, with_bias: bool) -> None:
    x, w = randn(m, k, seed=1), randn(n, k, seed=2)
    b = randn(n, seed=3) if with_bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    assert_bf16_linear_close(packed_linear(x, packed, b), x, w, b)


@needs_bf16_hw
def test_packed_linear_reads_a_feature_major_input() -> None:
    """A linear's input may be another op's transposed ("feature-major") output."""
    x = randn(96, 6, seed=4).t()  # [6, 96]  stored as [96, 6]
    w = randn(40, 96, seed=5)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    assert_bf16_linear_close(packed_linear(x, packed), x, w, None)


def build_ops(dtype: torch.dtype) -> list[torch.nn.Module]:
    tp = SINGLE_DEVICE
    ops: list[torch.nn.Module] = [
        ColumnParallelLinear(64, [48, 48], bias=True, tp=tp),
        QKVParallelLinear(64, 16, num_heads=4, num_kv_heads=2, bias=False, tp=tp),
        RowParallelLinear(96, 64, bias=True, tp=tp),
        ParallelLMHead(300, 64, tp=tp),
    ]
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for op in ops:
            for p in op.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
    return [op.to(dtype) for op in ops]


@pytest.mark.parametrize("rows", [5, 9, 70])  # float32: the skinny GEMM, then oneDNN
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_cpu_dispatch_packs_weights_and_keeps_each_op_s_result(
    dtype: torch.dtype, rows: int
) -> None:
    """Dispatched to the CPU, each linear and the LM head packs its weight exactly where oneDNN
    runs it (float32 wherever oneDNN is built in, bf16 and float16 where it has the hardware),
    and computes what its `forward_native` does, to the dtype's rounding, at every row count."""
    platform = CpuPlatform()
    for op in build_ops(dtype):
        x = torch.randn(rows, op.weight.shape[1], generator=torch.Generator().manual_seed(7))
        x = x.to(dtype)
        packs = onednn_packs(op.weight)
        with torch.no_grad():
            expected = op.forward_native(x).float()
            assert op.dispatch_forward(platform.device_type)
            got = op(x)
        hardware = {torch.float32: True, torch.bfloat16: BF16_HW, torch.float16: FP16_HW}[dtype]
        assert (
            packs is hardware and op.weight.is_mkldnn is packs
        )  # packed: in the plain one's place
        assert got.dtype == dtype and got.shape == expected.shape
        tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
        scale = expected.abs().max().item()
        assert (got.float() - expected).abs().max().item() <= tol * scale


@pytest.mark.parametrize(
    ("dtype", "prefill_only"),
    [
        (torch.float32, False),
        (torch.bfloat16, False),
        (torch.float16, False),
        (torch.float16, True),
    ],
)
def test_bert_sublayer_ends_fuse_gelu_and_the_residual_add_into_onednn(
    dtype: torch.dtype, prefill_only: bool
) -> None:
    """BERT's up projection + GELU, and its output projection + residual add + LayerNorm, on the
    CPU: the elementwise work rides in oneDNN's GEMM as post-ops (on the float32 accumulator)
    wherever the weight is packed, and the result is `forward_native`'s: float32 to the sums'
    rounding; bfloat16 and float16 within one ulp of the output, which native rounds twice (the GEMM's result,
    then the GELU's or the sum's) where the fused op rounds once. A prefill-only float16 layer (an
    encoder's) runs on AMX-BF16 tiles where `f16_amx_applies`, epilogues in the tile kernel, with
    the same result; its plain weight stays for `forward_native`."""
    config = BertConfig.from_hf_dict(
        {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
         "num_attention_heads": 4, "hidden_act": "gelu"}
    )  # fmt: skip
    up = BertIntermediate(config, SINGLE_DEVICE)
    down = BertOutput(96, 64, 1e-12, SINGLE_DEVICE)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for op in (up, down):
            for p in op.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    up, down = up.to(dtype), down.to(dtype)
    up.dense.prefill_only = down.dense.prefill_only = prefill_only
    x = torch.randn(70, 64, generator=gen).to(dtype)  # [T, hidden]
    with torch.no_grad():
        expected = down.forward_native(up.forward_native(x), x).float()
        tiles = prefill_only and f16_amx_applies(up.dense.weight)
        packs = onednn_packs(up.dense.weight) and not tiles
        for op in (up, down, up.dense, down.dense):
            assert op.dispatch_forward("cpu")
        assert up.dense.weight.is_mkldnn is packs and down.dense.weight.is_mkldnn is packs
        assert hasattr(up.dense, "f16_amx_weight") is tiles
        assert hasattr(down.dense, "f16_amx_weight") is tiles
        got = down(up(x), x)
    assert got.dtype == dtype and got.shape == expected.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}[dtype]  # LN: ~1
    assert (got.float() - expected).abs().max().item() <= tol * expected.abs().max().item()

"""The fused MoE op: its reference against a per-token loop and transformers' MoE blocks, and every
fast forward (the CPU's, the Triton kernel in the interpreter) against the reference.

Oracles, from the most independent:
- a per-token, per-expert loop over separate gate/up/down matrices, with routing written out
  from the definition (softmax, top-k, renormalise): holds `fused_experts_native`'s grouping,
  the stacked layout and the weight loaders;
- transformers' own `MixtralSparseMoeBlock` and `Qwen3MoeSparseMoeBlock` on the same weights
  (loaded through the checkpoint's per-expert names), with `norm_topk_prob` both ways: holds
  each family's routing order;
- the reference, for the CPU forward and the Triton kernel (in the interpreter on small shapes,
  with the interpreter's tiles and a GPU's); a compile-only test builds every launch variant for
  sm_90 without a GPU, and the `gpu`-marked test runs the compiled kernel (`make test-gpu`).

Tolerance (float32): every path computes the same products in float32 and differs from another
only in summation order (the grouping, oneDNN's or Triton's blocking), a few ulps of the output's
scale at these widths; `atol=rtol=1e-5` leaves an order of magnitude of room for that and none
for a wrong expert or weight, which moves an output by its own scale. bfloat16: the paths round
the intermediate activations at different points (the reference and the CPU's after each
matmul, the interpreted Triton kernel not at all: it widens to float32, as the GGUF kernel
does), a few bfloat16 ulps (2^-8 relative) of the output's scale, so `rtol=2e-2` and
`atol=2e-2 * max|reference|`: an output near zero keeps the rounding of the terms it cancels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from minivllm.distributed.parallel_state import TensorParallelGroup
from minivllm.model.layers.fused_moe import (
    FusedMoE,
    SparseMoeBlock,
    expert_target_of,
    fused_experts_native,
    select_experts,
    sort_by_expert,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def assert_close(got: torch.Tensor, expected: torch.Tensor, bf16: bool = False) -> None:
    if bf16:  # of the output's scale: a sum that cancels keeps its terms' rounding
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(got, expected, atol=2e-2 * scale, rtol=2e-2)
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def random_experts(e: int, h: int, i: int, seed: int) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert tensors in Mixtral's names: w1/w3 [I, H], w2 [H, I]."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for expert in range(e):
        for name, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            weights[f"experts.{expert}.{name}.weight"] = torch.randn(shape, generator=g) / 4
    return weights


def load_op(op: FusedMoE, weights: dict[str, torch.Tensor], prefix: str = "m.") -> None:
    """Each checkpoint tensor through `expert_target_of` and the op's weight loader."""
    for name, tensor in weights.items():
        found = expert_target_of(prefix + name)
        assert found is not None, name
        target, shard = found
        op.weight_loader(getattr(op, target.rpartition(".")[2]), tensor, *shard)


def make_op(e: int, k: int, h: int, i: int, renormalize: bool, seed: int = 0) -> FusedMoE:
    op = FusedMoE(e, k, h, i, renormalize)
    load_op(op, random_experts(e, h, i, seed))
    return op


def per_token_loop(
    weights: dict[str, torch.Tensor], x: torch.Tensor, logits: torch.Tensor, k: int, renorm: bool
) -> torch.Tensor:  # [T, H]
    """The definition, one token and one chosen expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = logits[t].float().softmax(-1)  # [E]
        chosen = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:k]
        total = sum(probs[e] for e in chosen) if renorm else 1.0
        for e in chosen:
            w1, w3, w2 = (weights[f"experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
            y = w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t]))
            out[t] += probs[e] / total * y
    return out


def inputs(t: int, h: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)


# ---------------------------------------------------------------------------------- reference
@pytest.mark.parametrize(("t", "e", "k"), [(1, 4, 2), (7, 4, 1), (9, 8, 2), (5, 3, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_equals_the_per_token_loop(t: int, e: int, k: int, renormalize: bool) -> None:
    h, i = 16, 24
    weights = random_experts(e, h, i, seed=t)
    op = FusedMoE(e, k, h, i, renormalize)
    load_op(op, weights)
    x, logits = inputs(t, h, e, seed=e)
    assert_close(op(x, logits), per_token_loop(weights, x, logits, k, renormalize))


def test_expert_names_of_both_families_map_to_the_stacked_parameters() -> None:
    mixtral = "model.layers.3.block_sparse_moe.experts.5.w3.weight"
    qwen = "model.layers.0.mlp.experts.11.down_proj.weight"
    p = "model.layers.3.block_sparse_moe.experts."
    assert expert_target_of(mixtral) == (p + "w13_weight", ("w3", 5))
    assert expert_target_of(qwen) == ("model.layers.0.mlp.experts.w2_weight", ("w2", 11))
    assert expert_target_of("model.layers.0.mlp.gate.weight") is None
    assert expert_target_of("model.layers.0.mlp.gate_proj.weight") is None  # a dense MLP's


def test_sort_by_expert_groups_every_assignment_once_in_token_order() -> None:
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    order, counts = sort_by_expert(ids, 4)
    assert order.tolist() == [1, 2, 3, 5, 0, 4]  # expert 0: t0j1, t1j0; 1: t1j1, t2j1; 2: ...
    assert counts.tolist() == [2, 2, 2, 0]


def test_tensor_parallel_ranks_partial_sums_add_up_to_the_whole() -> None:
    e, k, h, i = 4, 2, 16, 24
    weights = random_experts(e, h, i, seed=3)
    x, logits = inputs(6, h, e, seed=4)
    whole = make_op(e, k, h, i, True, seed=3)(x, logits)
    parts = []
    for rank in range(2):
        op = FusedMoE(e, k, h, i, True, tp=TensorParallelGroup(rank=rank, world_size=2))
        load_op(op, weights)
        assert op.w13_weight.shape == (e, i, h) and op.w2_weight.shape == (e, h, i // 2)
        parts.append(op(x, logits))
    assert_close(parts[0] + parts[1], whole)


# ---------------------------------------------------------------------------------- routing
def hf_block(
    family: str, e: int, k: int, h: int, i: int, norm_topk_prob: bool
) -> tuple[Any, SparseMoeBlock]:
    """transformers' MoE block of `family` and the matching SparseMoeBlock, same weights."""
    import transformers

    config: Any
    hf: Any
    if family == "mixtral":
        config = transformers.MixtralConfig(
            hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k
        )
        hf = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
        ours = SparseMoeBlock(h, e, k, i, renormalize=True)
    else:
        config = transformers.Qwen3MoeConfig(
            hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k,
            norm_topk_prob=norm_topk_prob,
        )  # fmt: skip
        hf = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
        ours = SparseMoeBlock(h, e, k, i, norm_topk_prob, weights_dtype=None)
    g = torch.Generator().manual_seed(e * 10 + k)
    with torch.no_grad():
        hf.gate.weight.copy_(torch.randn(e, h, generator=g))
        hf.experts.gate_up_proj.copy_(torch.randn(e, 2 * i, h, generator=g) / 4)
        hf.experts.down_proj.copy_(torch.randn(e, h, i, generator=g) / 4)
    # Our block is loaded from the checkpoint's per-expert names, as a model file would be.
    names = ("gate_proj", "up_proj", "down_proj") if family == "qwen3_moe" else ("w1", "w3", "w2")
    ours.gate.weight_loader(ours.gate.weight, hf.gate.weight.detach())
    weights = {}
    for expert in range(e):
        gate, up = hf.experts.gate_up_proj[expert].detach().chunk(2)
        for name, w in zip(names, (gate, up, hf.experts.down_proj[expert].detach())):
            weights[f"experts.{expert}.{name}.weight"] = w
    load_op(ours.experts, weights)
    return hf, ours


@pytest.mark.parametrize(
    ("family", "norm_topk_prob"), [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]
)
def test_block_equals_transformers_moe_block(family: str, norm_topk_prob: bool) -> None:
    e, k, h, i, t = 8, 2, 32, 16, 11
    hf, ours = hf_block(family, e, k, h, i, norm_topk_prob)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x.unsqueeze(0)).squeeze(0)
        _, hf_weights, hf_ids = hf.gate(x)
        weights, ids = ours.experts.route(ours.gate(x))
        got = ours(x)
    assert torch.equal(ids, hf_ids)
    assert_close(weights, hf_weights)
    assert_close(got, expected)


def test_routing_softmaxes_over_all_experts_before_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = logits.softmax(-1)[0]
    assert ids.tolist() == [[0, 1]]
    assert_close(weights[0], probs[:2])  # not renormalised: sums below 1
    weights, _ = select_experts(logits, 2, renormalize=True)
    assert_close(weights[0], probs[:2] / probs[:2].sum())


def test_qwen3_routing_rounds_weights_to_the_activations_dtype() -> None:
    logits = torch.randn(3, 4).bfloat16()
    assert select_experts(logits, 2, True).__getitem__(0).dtype == torch.float32  # Mixtral's
    op = FusedMoE(4, 2, 8, 8, True, weights_dtype=None)  # Qwen3-MoE's
    assert op.route(logits)[0].dtype == torch.bfloat16


# ---------------------------------------------------------------------------------- the CPU path
@pytest.mark.parametrize(("t", "e", "k"), [(1, 4, 2), (13, 8, 2), (40, 4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_forward_equals_reference(t: int, e: int, k: int, dtype: torch.dtype) -> None:
    import minivllm.cpu.moe  # noqa: F401  registers the forward

    h, i = 32, 48
    op = make_op(e, k, h, i, True, seed=t).to(dtype)
    x, logits = (v.to(dtype) for v in inputs(t, h, e, seed=t + 1))
    expected = op(x, logits)
    assert op.dispatch_forward("cpu") and op.dispatched_to == "cpu"
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        assert op.packed_experts is not None  # the oneDNN path, not the fall-back to the reference
    assert_close(op(x, logits), expected, bf16=dtype == torch.bfloat16)


# ---------------------------------------------------------------------------------- Triton
triton_moe = pytest.importorskip("minivllm.model.layers.triton_fused_moe", exc_type=ImportError)


@pytest.mark.parametrize(("t", "e", "k"), [(1, 4, 2), (9, 4, 2), (33, 8, 2), (6, 3, 3)])
def test_align_block_size_pads_each_expert_to_whole_blocks(t: int, e: int, k: int) -> None:
    ids = torch.randint(0, e, (t, k), generator=torch.Generator().manual_seed(t))
    sorted_ids, expert_ids, num_post_padded = triton_moe.moe_align_block_size(ids, e, 4)
    used = sorted_ids[: int(num_post_padded)]
    real = used[used < t * k]
    assert sorted(real.tolist()) == list(range(t * k))  # every assignment exactly once
    assert bool((sorted_ids[int(num_post_padded) :] == t * k).all())
    for block, expert in enumerate(expert_ids[: int(num_post_padded) // 4].tolist()):
        rows = used[4 * block : 4 * block + 4]
        rows = rows[rows < t * k].long()
        assert rows.numel() > 0 and bool((ids.flatten()[rows] == expert).all())


@pytest.mark.parametrize(("t", "e", "k"), [(1, 4, 2), (9, 4, 2), (21, 8, 2), (5, 3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_grouped_gemm_equals_reference(t: int, e: int, k: int, dtype: torch.dtype) -> None:
    h, i = 32, 80  # N of the second GEMM and K of the first cross one 64-wide tile
    op = make_op(e, k, h, i, True, seed=t).to(dtype)
    x, logits = (v.to(dtype) for v in inputs(t, h, e, seed=t + 2))
    weights, ids = op.route(logits)
    expected = fused_experts_native(x, op.w13_weight, op.w2_weight, weights, ids)
    got = triton_moe.fused_experts_triton(x, op.w13_weight, op.w2_weight, weights, ids)
    assert_close(got, expected, bf16=dtype == torch.bfloat16)


def test_triton_grouped_gemm_with_a_gpu_s_tiles_equals_reference() -> None:
    e, k, h, i, t = 4, 2, 48, 40, 70  # 140 assignments: the prefill tiles (BLOCK_M 64)
    op = make_op(e, k, h, i, False, seed=5)
    x, logits = inputs(t, h, e, seed=6)
    weights, ids = op.route(logits)
    expected = fused_experts_native(x, op.w13_weight, op.w2_weight, weights, ids)
    tiles = triton_moe.moe_tiles(t * k, torch.float32, interpreted=False)
    got = triton_moe.fused_experts_triton(x, op.w13_weight, op.w2_weight, weights, ids, tiles)
    assert_close(got, expected)


def test_triton_forward_is_the_op_s_cuda_forward() -> None:
    op = make_op(4, 2, 16, 16, True)
    assert op.dispatch_forward("cuda") and op.dispatched_to == "cuda"
    x, logits = inputs(3, 16, 4, seed=0)
    assert_close(op(x, logits), op.forward_native(x, logits))


# ======================================================================== compile-only, sm_90
def compile_all_variants() -> list[dict[str, Any]]:
    """Build every launch variant (float32 / bfloat16 × decode / prefill tiles × each of the two
    GEMMs) for sm_90 at Mixtral-8x7B's widths, with CPU tensors standing in for the GPU's (the
    driver is `Sm90Driver`, which only names the target)."""
    import triton

    from tests.attention.test_attention_triton_launch import Sm90Driver, resource_usage

    if not torch.cuda.is_available():
        triton.runtime.driver.set_active(Sm90Driver())
    e, h, i = 8, 4096, 14336
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for assignments in (2, 600):
            tiles = triton_moe.moe_tiles(assignments, dtype, interpreted=False)
            ids = torch.empty(assignments + e * tiles["BLOCK_M"], dtype=torch.int32)
            for gemm, (n, k, per_token, mul) in {
                "w13": (2 * i, h, 2, False),
                "w2": (h, i, 1, True),
            }.items():
                a = torch.empty(assignments, k, dtype=dtype)
                w = torch.empty(e, n, k, dtype=dtype)
                c = torch.empty(assignments, n, dtype=dtype if gemm == "w13" else torch.float32)
                kernel = triton_moe.fused_moe_kernel.warmup(
                    a, w, c, torch.empty(assignments), ids, ids, ids, n, k, assignments,
                    a.stride(0), w.stride(0), w.stride(1), c.stride(0),
                    A_ROWS_PER_TOKEN=per_token, MUL_ROUTED_WEIGHT=mul,
                    DOT_16BIT=dtype != torch.float32, grid=(1, 1), **tiles,
                )  # fmt: skip
                usage = resource_usage(kernel.asm["cubin"])
                rows.append(dict(
                    variant=f"{gemm} {str(dtype).removeprefix('torch.')} a{assignments}",
                    regs=usage["REG"], spill_bytes=usage["STACK"] + usage["LOCAL"],
                ))  # fmt: skip
    return rows


@pytest.mark.slow
def test_every_variant_compiles_for_sm90_without_spills() -> None:
    """8 sm_90 builds in a process of their own (this one runs the kernel interpreted)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    # The worker is started as a script, so its sys.path starts at tests/: name this checkout.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    table = "\n".join(
        f"{r['variant']:<20} regs {r['regs']:>3}  spills {r['spill_bytes']} B" for r in rows
    )
    print("\nsm_90 builds:\n" + table)
    assert len(rows) == 8
    assert not [r for r in rows if r["spill_bytes"]], f"variants that spill:\n{table}"


# ================================================================================ a real GPU
@pytest.mark.gpu
def test_compiled_triton_moe_matches_reference_on_cuda(request: pytest.FixtureRequest) -> None:
    """Decode- and prefill-sized batches at widths that are no multiple of any tile. bfloat16
    rounds the intermediate activations and the output: 2^-6 relative room."""
    from tests.attention.test_attention_gpu import require_compiled_cuda

    require_compiled_cuda(request.config)
    assert not triton_moe.INTERPRETED
    e, k, h, i = 8, 2, 1000, 1400
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2**-6)):
        op = make_op(e, k, h, i, True, seed=7).to("cuda", dtype)
        for t in (1, 5, 300):
            x, logits = (v.to("cuda", dtype) for v in inputs(t, h, e, seed=t))
            weights, ids = op.route(logits)
            expected = fused_experts_native(x, op.w13_weight, op.w2_weight, weights, ids)
            got = triton_moe.fused_experts_triton(x, op.w13_weight, op.w2_weight, weights, ids)
            torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


if __name__ == "__main__":  # the compile-only test's worker
    print(json.dumps(compile_all_variants()))

"""Microbenchmark: the fused CPU layer ops on the layout the CPU linears return, at SmolLM2's sizes.

On a CPU, `parallel_layers.linear` returns (W · xᵀ)ᵀ, a feature-major view ([T, N] stored as a
contiguous [N, T]). For each op this times three ways of applying it to such an output:

- `feature-major`: the fused op on the view as it is (what the model does now);
- `copy + rows`: `.contiguous()` first, then the fused op on token-major rows (what it did before);
- `plain`: the op's plain-PyTorch formula on the view (the model's `forward_native`).

Sizes are SmolLM2-135M's: hidden 576, intermediate 1536, 9 query + 3 KV heads of 64. Not a test
(no timing is asserted anywhere); run it as

    python benchmarks/cpu_layer_layouts.py [--tokens 32 300] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minivllm.benchmarks.machine import timed_us
from minivllm.benchmarks.report import print_table
from minivllm.cpu import ops as cpu_ops

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64
EPS = 1e-5
LAYOUTS = ("feature-major", "copy + rows", "plain")


def median_us(fn: Callable[[], object]) -> float:
    """Median microseconds of one call (the microbenchmarks' timer: runs of at least 50 ms each)."""
    return timed_us(fn, min_s=0.05)[0]


def linear_output(tokens: int, features: int, dtype: torch.dtype) -> torch.Tensor:  # [T, N]
    """A feature-major [T, features] output, as `parallel_layers.linear` returns it."""
    x = torch.randn(tokens, HIDDEN, dtype=dtype)
    w = torch.randn(features, HIDDEN, dtype=dtype) / HIDDEN**0.5
    return torch.mm(w, x.t()).t()


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def bench_silu_and_mul(tokens: int, dtype: torch.dtype) -> dict[str, float]:
    x = linear_output(tokens, 2 * INTERMEDIATE, dtype)  # gate_up: [T, 2 * I]
    return {
        "feature-major": median_us(lambda: cpu_ops.silu_and_mul(x)),
        "copy + rows": median_us(lambda: cpu_ops.silu_and_mul(x.contiguous())),
        "plain": median_us(lambda: F.silu(x[:, :INTERMEDIATE]) * x[:, INTERMEDIATE:]),
    }


def bench_fused_add_rms_norm(tokens: int, dtype: torch.dtype) -> dict[str, float]:
    x = linear_output(tokens, HIDDEN, dtype)  # o_proj or down_proj: [T, hidden]
    residual = torch.randn(tokens, HIDDEN, dtype=dtype)  # [T, hidden]
    weight = torch.ones(HIDDEN, dtype=dtype)

    def plain() -> torch.Tensor:
        return rms_norm_formula(x + residual, weight)  # the add, then the norm

    return {  # in place: x keeps being a normalized row, so repeated calls stay in range
        "feature-major": median_us(lambda: cpu_ops.fused_add_rms_norm(x, residual, weight, EPS)),
        "copy + rows": median_us(
            lambda: cpu_ops.fused_add_rms_norm(x.contiguous(), residual, weight, EPS)
        ),
        "plain": median_us(plain),
    }


def bench_rotary_embedding(tokens: int, dtype: torch.dtype) -> dict[str, float]:
    qk = (HEADS + KV_HEADS) * HEAD_DIM
    qkv = linear_output(tokens, qk + KV_HEADS * HEAD_DIM, dtype)  # [T, (9 + 2 * 3) * 64]
    positions = torch.arange(tokens) * 7 % 2048  # int64 [T]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    emb = torch.outer(torch.arange(2048).float(), inv_freq).repeat(1, 2)  # [2048, head_dim]
    cos_sin = torch.stack((emb.cos(), emb.sin()))  # [2, 2048, head_dim]
    cos, sin = cos_sin[:, positions].to(dtype).unsqueeze(2)  # each [T, 1, head_dim], per step

    def view(t: torch.Tensor) -> torch.Tensor:  # [T, heads, head_dim] of the qk part
        return t[:, :qk].view(tokens, HEADS + KV_HEADS, HEAD_DIM)

    def plain() -> torch.Tensor:
        x = view(qkv)
        half = HEAD_DIM // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return {
        "feature-major": median_us(lambda: cpu_ops.rotary_embedding(positions, view(qkv), cos_sin)),
        "copy + rows": median_us(
            lambda: cpu_ops.rotary_embedding(positions, view(qkv.contiguous()), cos_sin)
        ),
        "plain": median_us(plain),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 300])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    benches = {
        "silu_and_mul": bench_silu_and_mul,
        "fused_add_rms_norm": bench_fused_add_rms_norm,
        "rotary_embedding": bench_rotary_embedding,
    }
    print(f"threads: {torch.get_num_threads()}, times in us (median of 7 runs)")
    rows = []
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for tokens in args.tokens:
            for name, bench in benches.items():
                t = bench(tokens, dtype)
                rows.append([name, dtype_name, tokens, *(f"{t[k]:.1f}" for k in LAYOUTS)])
    print_table(["op", "dtype", "T", *LAYOUTS], rows)


if __name__ == "__main__":
    main()

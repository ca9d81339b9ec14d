"""`TritonBackend`: PagedAttention with fused Triton kernels (the CUDA default).

The same contract as the reference backend (`minivllm.attention.backends.reference`, the specification),
computed without gathering the context: the kernels in `triton_kernels.py` follow each request's
block table key by key (the paper's §4.1 PagedAttention kernel) with an online softmax. The step's
work list and the tile sizes are decided in `triton_plan.py`; this file turns them into launches.

Which kernel serves which rows of a batch (see docs/architecture.md for the step around it):
- `write_kv`: the cache-write kernel, always.
- requests with one new token (decodes, in decode-only and mixed batches): the two-stage split-KV
  decode kernel (flash-decoding). Decode reads the whole context to produce one row per head, so
  it is bandwidth-bound and needs the parallelism of splitting the context; with one split the
  first stage writes the output and the merge is not launched.
- requests with several new tokens (prefill, chunked prefill, prefix-cache hits): the
  prefill/extend kernel, over a flat list of the query blocks that exist.
- a layer's sliding window is a run-time argument of both attention kernels: they start each
  key range at the first key its rows can see and mask the rest (one compiled kernel for all);
  so is its soft-cap (Gemma 2), applied to each tile's scores before the mask.
- an encoder's attention (`attend_encoder`, no cache): the variable-length bidirectional kernel of
  `triton_encoder_kernels.py`, over the step's own keys and values, with the prefill kernel's tiles.

Every launch is a `KernelLaunch` value (kernel, grid, arguments, settings) built by the functions
below: the backend runs them, and the compile-only test compiles the very same values for sm_90
without a GPU, so what it checks is what a launch would run. Launches happen under the device of
their tensors (`device_guard`): Triton launches on the *current* CUDA device, which for tensors
on `cuda:1` would otherwise be device 0 and an illegal memory access.

Without CUDA the kernels run on CPU tensors in Triton's interpreter. Importing this module turns
the interpreter on when CUDA is absent and `TRITON_INTERPRET` is unset, so that
`get_attention_backend("triton")` works on a laptop with no setup (slowly: it is for tests).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.attention.abstract import AttentionMetadata
from minivllm.attention.backends.triton_plan import (
    KernelTiles,
    LayerPlan,
    LayerShape,
    TritonPlan,
    check_grid,
    decode_num_splits,
    kernel_tiles,
    make_triton_plan,
    prefill_settings,
    write_kv_settings,
)

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Triton picks interpreter or compiler when a kernel is decorated with `@triton.jit`, by
    # reading this variable; so it must be set before `triton_kernels` is imported below.
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
except ImportError as e:
    raise ImportError(
        'the "triton" attention backend needs Triton: pip install "minivllm[triton]"'
    ) from e

from minivllm.attention.backends import triton_decode_kernels as D
from minivllm.attention.backends import triton_encoder_kernels as E
from minivllm.attention.backends import triton_kernels as K
from minivllm.attention.backends.triton_kernels import INTERPRETED

LOG2E = 1.4426950408889634  # the kernels use exp2: exp(x) = exp2(x · log2 e)


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch as a value: what `TritonBackend` runs, and what the compile test builds."""

    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple[Any, ...]  # run-time arguments: tensors, strides, counts
    settings: dict[str, Any]  # constexprs, num_warps, num_stages

    def __call__(self) -> Any:
        return self.kernel[self.grid](*self.args, **self.settings)


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make `device` the current CUDA device for the launches inside (a no-op on CPU)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda" or INTERPRETED:
        return 1  # the interpreter runs one program at a time
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


# ===================================================================================== launches


def write_kv_launch(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim], the cache's dtype, head_dim contiguous
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]
    tiles: KernelTiles,
) -> KernelLaunch:
    num_tokens, num_kv_heads, head_dim = key.shape
    settings = write_kv_settings(head_dim, k_cache.shape[1], tiles)
    grid = (triton.cdiv(num_tokens, settings["BLOCK_T"]), num_kv_heads)
    args = (
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
    )  # fmt: skip
    return KernelLaunch(K.write_kv_kernel, check_grid(grid), args, settings)


def attend_launches(
    query: torch.Tensor,  # [T, num_heads, head_dim], head_dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, num_heads, head_dim], written by the launches
    meta: AttentionMetadata,
    layer: LayerPlan,
    scale: float,
    sliding_window: int | None = None,
    softcap: float = 0.0,
) -> list[KernelLaunch]:
    """The launches of one layer's attention: prefill blocks, decode stage 1, decode stage 2.

    Each appears only when it has work: a decode-only step has no prefill launch, a step without
    decodes no decode launches, and one KV split no merge.
    """
    num_kv_heads = k_cache.shape[2]
    qk_scale = scale * LOG2E
    window = K.NO_WINDOW if sliding_window is None else sliding_window
    # The kernels' scores are in the log2 domain (× log2 e), and cap · tanh(x / cap) commutes
    # with that scaling once the cap is scaled too. A float argument: no recompilation per cap.
    cap = float(softcap) * LOG2E
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    launches = []
    args: tuple[Any, ...]
    num_q_blocks = layer.q_blocks.shape[0]
    if num_q_blocks:
        args = (
            query, k_cache, v_cache, out,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            layer.q_blocks,
            qk_scale, window, cap,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            meta.block_tables.stride(0), *cache_strides,
        )  # fmt: skip
        grid = check_grid((num_q_blocks, num_kv_heads))
        launches.append(KernelLaunch(K.paged_prefill_kernel, grid, args, layer.prefill))
    num_decodes = layer.decode_seqs.shape[0]
    if num_decodes:
        # With one split stage 1 writes `out` itself; the partial buffers are then not read, and
        # `out` stands in for them so that every pointer argument is a tensor.
        part_out = out if layer.part_out is None else layer.part_out
        part_lse = out if layer.part_lse is None else layer.part_lse
        # Between (row, split) pairs and between heads; none depends on the split count.
        part_strides = (part_out.stride(-3), part_out.stride(-2), part_lse.stride(-2))
        args = (
            query, k_cache, v_cache, out, part_out, part_lse, layer.decode_seqs,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            layer.num_splits, qk_scale, window, cap,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            meta.block_tables.stride(0), *cache_strides, *part_strides,
        )  # fmt: skip
        grid = check_grid((num_decodes, num_kv_heads, layer.num_splits))
        launches.append(KernelLaunch(D.paged_decode_split_kernel, grid, args, layer.decode_split))
        if layer.num_splits > 1:
            args = (
                part_out, part_lse, out, layer.decode_seqs, meta.query_start_loc, layer.num_splits,
                out.stride(0), out.stride(1), *part_strides,
            )  # fmt: skip
            grid = check_grid((num_decodes, query.shape[1]))
            launches.append(
                KernelLaunch(D.paged_decode_merge_kernel, grid, args, layer.decode_merge)
            )
    return launches


def encoder_launch(
    query: torch.Tensor,  # [T, num_heads, head_dim], head_dim contiguous
    key: torch.Tensor,  # [T, num_kv_heads, head_dim], head_dim contiguous
    value: torch.Tensor,  # [T, num_kv_heads, head_dim], head_dim contiguous
    out: torch.Tensor,  # [T, num_heads, head_dim], written by the launch
    meta: AttentionMetadata,
    plan: TritonPlan,
    tiles: KernelTiles,
    scale: float,
    upcast: bool,
) -> KernelLaunch:
    """The one launch of an encoder layer's attention: every query block of every request."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    settings = prefill_settings(num_heads, num_kv_heads, head_dim, 1, tiles, upcast)
    del settings["BLOCK_SIZE"]  # no cache, no blocks
    q_blocks = plan.encoder_q_blocks(meta, settings["BLOCK_Q"])
    args = (
        query, key, value, out, meta.query_start_loc, q_blocks, scale * LOG2E,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), out.stride(0), out.stride(1),
    )  # fmt: skip
    grid = check_grid((q_blocks.shape[0], num_kv_heads))
    return KernelLaunch(E.encoder_attention_kernel, grid, args, settings)


# ===================================================================================== backend


class TritonBackend:
    """PagedAttention with Triton kernels: cache write, paged prefill/extend, split-KV decode."""

    name = "triton"

    def __init__(self, num_splits: int | None = None, gpu_tiles: bool | None = None) -> None:
        # `num_splits` fixes the decode kernel's KV split count (the tests use it to reach empty
        # and multiple splits); None picks it per step from the GPU's size (`decode_num_splits`).
        # `gpu_tiles` picks the sm_90 tile sizes (None: when the kernels are compiled); tests set
        # it in the interpreter to run the tiles a GPU runs.
        if num_splits is not None and not 1 <= num_splits <= 256:
            raise ValueError(f"num_splits must be in [1, 256], got {num_splits}")
        if not INTERPRETED and not torch.cuda.is_available():
            raise RuntimeError(
                "the Triton kernels were compiled for a GPU (Triton was set up with "
                f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}) but there is no CUDA "
                "device. To run them on CPU, set TRITON_INTERPRET=1 before Python starts (before "
                "anything imports triton); or use attention_backend='reference'."
            )
        self.num_splits = num_splits
        self.gpu_tiles = not INTERPRETED if gpu_tiles is None else gpu_tiles

    def plan(self, meta: AttentionMetadata, block_size: int) -> TritonPlan:
        """The step's work list (decode rows, flattened query blocks), shared by all layers."""
        return make_triton_plan(meta, num_sms(meta.seq_lens.device), self.num_splits)

    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None:
        _check_inputs(k_cache, v_cache, key, value, slot_mapping)
        if key.shape[0] == 0:
            return
        # The kernel copies bits; a dtype change (float32 activations into a bfloat16 cache) is
        # done here, exactly as the reference's `.to` does it.
        key = _last_dim_contiguous(key.to(k_cache.dtype))
        value = _last_dim_contiguous(value.to(v_cache.dtype))
        tiles = kernel_tiles(self.gpu_tiles, key.shape[2], k_cache.dtype)
        launch = write_kv_launch(key, value, k_cache, v_cache, slot_mapping.contiguous(), tiles)
        with device_guard(k_cache.device):
            launch()

    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # the layer's: key j seen from p iff p - W < j <= p
        softcap: float = 0.0,  # > 0: each score becomes softcap * tanh(score / softcap)
    ) -> torch.Tensor:  # [T, num_heads, head_dim], query.dtype
        _check_inputs(k_cache, v_cache, query, meta=meta)
        query = _last_dim_contiguous(query)
        # The interpreter's float32 -> bfloat16 cast truncates (a GPU rounds to nearest), which
        # doubles the error; there the kernels write float32 and torch rounds.
        interp_bf16 = INTERPRETED and query.dtype == torch.bfloat16
        out_dtype = torch.float32 if interp_bf16 else query.dtype
        out = torch.empty(query.shape, dtype=out_dtype, device=query.device)
        if query.shape[0] == 0 or meta.num_seqs == 0:
            return out.to(query.dtype)
        plan = meta.plan if isinstance(meta.plan, TritonPlan) else self.plan(meta, k_cache.shape[1])
        layer = plan.for_layer(self.layer_shape(query, k_cache))
        launches = attend_launches(
            query, k_cache, v_cache, out, meta, layer, scale, sliding_window, softcap
        )
        with device_guard(query.device):
            for launch in launches:
                launch()
        return out.to(query.dtype)

    def attend_encoder(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]  the step's own, never cached
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,  # query_start_loc: each request's rows, its whole prompt
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim], query.dtype
        query, key, value = (_last_dim_contiguous(x) for x in (query, key, value))
        if query.shape[1] % key.shape[1] != 0:
            raise ValueError(
                f"num_heads ({query.shape[1]}) must be a multiple of num_kv_heads ({key.shape[1]})"
            )
        for t in (key, value, meta.query_start_loc):
            if t.device != query.device:
                raise ValueError(
                    f"every input must be on the query's {query.device}, got {t.device}"
                )
        interp_bf16 = INTERPRETED and query.dtype == torch.bfloat16  # as in `attend`
        out = torch.empty(
            query.shape, dtype=torch.float32 if interp_bf16 else query.dtype, device=query.device
        )
        if query.shape[0] == 0:
            return out.to(query.dtype)
        plan = meta.plan if isinstance(meta.plan, TritonPlan) else self.plan(meta, 1)
        tiles = kernel_tiles(self.gpu_tiles, query.shape[2], query.dtype)
        launch = encoder_launch(query, key, value, out, meta, plan, tiles, scale, INTERPRETED)
        with device_guard(query.device):
            launch()
        return out.to(query.dtype)

    def layer_shape(self, query: torch.Tensor, k_cache: torch.Tensor) -> LayerShape:
        return LayerShape(
            num_heads=query.shape[1],
            num_kv_heads=k_cache.shape[2],
            head_dim=query.shape[2],
            block_size=k_cache.shape[1],
            dtype=query.dtype,
            gpu_tiles=self.gpu_tiles,
            # A cache narrower than the query (kv_cache_dtype="bfloat16" under float32 weights)
            # is widened on load, so the dots run in the query's float32.
            upcast=INTERPRETED or query.dtype != k_cache.dtype,
        )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_inputs(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *tensors: torch.Tensor,
    meta: AttentionMetadata | None = None,
) -> None:
    """What the kernels assume and would otherwise get silently wrong (or crash the GPU on)."""
    if k_cache.dim() != 4 or k_cache.stride(-1) != 1:
        raise ValueError(
            "the KV cache must be [num_blocks, block_size, num_kv_heads, head_dim] with head_dim "
            f"contiguous, got shape {tuple(k_cache.shape)} strides {k_cache.stride()}"
        )
    # K and V are addressed with one set of strides.
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "k_cache and v_cache must have the same shape and strides, got "
            f"{tuple(k_cache.shape)}{k_cache.stride()} and {tuple(v_cache.shape)}{v_cache.stride()}"
        )
    if not INTERPRETED and not k_cache.is_cuda:
        raise ValueError("the compiled Triton kernels need CUDA tensors, got a CPU KV cache")
    # One launch reads all of these; a tensor on another GPU is an illegal address there.
    others = list(tensors)
    if meta is not None:
        others += [meta.query_start_loc, meta.seq_lens, meta.block_tables]
    for t in [v_cache, *others]:
        if t.device != k_cache.device:
            raise ValueError(
                f"every input must be on the KV cache's {k_cache.device}, got {t.device}"
            )
    if meta is None:
        return
    query = tensors[0]
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if query.dtype != k_cache.dtype and query.dtype != torch.float32:
        raise ValueError(
            f"a {k_cache.dtype} KV cache needs {k_cache.dtype} or float32 queries (kv_cache_dtype "
            f"narrower than float32 weights), got {query.dtype}"
        )


__all__ = [
    "INTERPRETED",
    "KernelLaunch",
    "KernelTiles",
    "TritonBackend",
    "attend_launches",
    "decode_num_splits",
    "device_guard",
    "encoder_launch",
    "kernel_tiles",
    "write_kv_launch",
]

"""`TritonBackend`: PagedAttention with fused Triton kernels (the CUDA default).

The same contract as the reference backend (`minivllm.attention.reference`, the specification),
computed without gathering the context: the kernels in `triton_kernels.py` follow each request's
block table key by key (the paper's §4.1 PagedAttention kernel) with an online softmax. This file
chooses their tile sizes (one helper, `kernel_tiles`) and launches them.

Which kernel serves which batch:
- `write_kv`: the cache-write kernel, always.
- `attend` when every request has exactly one new token (`meta.max_query_len == 1`): the two-stage
  split-KV decode kernel (flash-decoding). Decode reads the whole context to produce one row per
  head, so it is bandwidth-bound and needs the parallelism of splitting the context.
- `attend` otherwise (prefill, chunked prefill, prefix-cache hits, and *mixed* batches with
  decodes among prompt chunks): the prefill/extend kernel for every request. A decode row there
  costs one pass over its context with its GQA group packed into one tile: the same bytes as the
  decode kernel, without the split. Sending a mixed batch's decode rows to the decode kernel would
  need the metadata split on the host every step (a device sync); vLLM's unified attention makes
  the same choice of one kernel for mixed batches.

Without CUDA the kernels run on CPU tensors in Triton's interpreter. Importing this module turns
the interpreter on when CUDA is absent and `TRITON_INTERPRET` is unset, so that
`get_attention_backend("triton")` works on a laptop with no setup (slowly: it is for tests).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from minivllm.attention import AttentionMetadata

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

from minivllm.attention import triton_kernels as K

# True when the kernels above were decorated under the interpreter (they run on CPU, via numpy).
INTERPRETED = not isinstance(K.write_kv_kernel, triton.runtime.jit.JITFunction)
LOG2E = 1.4426950408889634  # the kernels use exp2: exp(x) = exp2(x · log2 e)

# ======================================================================================= tiles


@dataclass(frozen=True)
class KernelTiles:
    """Tile sizes and launch settings of all kernels, chosen in one place (`kernel_tiles`)."""

    write_block_t: int  # tokens per program of the cache write
    prefill_block_m: int  # query rows per prefill program (= tokens × padded GQA group)
    prefill_block_n: int  # keys per inner-loop tile of the prefill kernel
    prefill_warps: int
    prefill_stages: int
    decode_block_n: int  # keys per inner-loop tile of decode stage 1
    decode_warps: int
    decode_stages: int


def kernel_tiles(on_gpu: bool, head_dim: int, dtype: torch.dtype) -> KernelTiles:
    """The tile sizes for a GPU (H100/H200 class, sm_90) or for Triton's CPU interpreter.

    Interpreter: each program and each loop iteration is a round of Python and numpy calls, so a
    few large tiles keep the CPU test suite fast; registers and shared memory do not exist there.

    GPU (starting points reasoned from sm_90's limits, not yet autotuned on hardware):
    - prefill is compute-bound: 128 query rows × 64 keys with 8 warps keeps the tensor cores busy
      while Q (128×128×2 B = 32 KiB) and 3 pipeline stages of K and V (3 × 2 × 16 KiB) fit in the
      228 KiB of shared memory per SM; head dims above 128 halve both tiles to stay there.
    - decode is bandwidth-bound, so what matters is bytes in flight: 64 keys × 128 dims × 2 B =
      16 KiB per K or V tile, 3 stages of cp.async prefetch, 4 warps; split-KV
      (`decode_num_splits`) supplies the parallelism that a small tile does not.
    - float32 has no tensor-core path at IEEE precision: its dots are FMA loops whose registers
      grow with the tile (a 128×64 float32 tile compiles to a 2 MB cubin), so it gets small tiles.
      float32 is for parity, not for speed.
    """
    if not on_gpu:
        return KernelTiles(
            write_block_t=128, prefill_block_m=128, prefill_block_n=128,
            prefill_warps=4, prefill_stages=1, decode_block_n=256,
            decode_warps=4, decode_stages=1,
        )  # fmt: skip
    if dtype == torch.float32:
        return KernelTiles(
            write_block_t=16, prefill_block_m=32, prefill_block_n=32,
            prefill_warps=4, prefill_stages=2, decode_block_n=32,
            decode_warps=4, decode_stages=2,
        )  # fmt: skip
    if head_dim <= 128:
        return KernelTiles(
            write_block_t=16, prefill_block_m=128, prefill_block_n=64,
            prefill_warps=8, prefill_stages=3, decode_block_n=64,
            decode_warps=4, decode_stages=3,
        )  # fmt: skip
    return KernelTiles(
        write_block_t=16, prefill_block_m=64, prefill_block_n=32,
        prefill_warps=4, prefill_stages=2, decode_block_n=32,
        decode_warps=4, decode_stages=2,
    )  # fmt: skip


def decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int
) -> int:
    """How many KV splits flash-decoding uses: enough programs to fill the GPU, no more.

    ~4 programs per SM keeps the tail (the last, partly filled wave) under a quarter of the run;
    a split shorter than two key tiles would spend as much on its partial output as on its keys.
    Under the interpreter `num_sms` is 1, which gives one split: the fewest programs.
    """
    wanted = triton.cdiv(4 * num_sms, max(1, num_seqs * num_kv_heads))
    useful = triton.cdiv(max(1, max_seq_len), 2 * block_n)
    return max(1, min(wanted, useful, 64))


def _pad(n: int, at_least: int = 1) -> int:
    """Next power of two >= n: tile extents must be powers of two; the extra lanes are masked."""
    return max(at_least, triton.next_power_of_2(n))


# ====================================================================== launch settings
# Keyword arguments (constexprs, num_warps, num_stages) of each kernel launch. They are functions
# of the shapes only, so the compile-only test compiles exactly what a GPU launch would.


def write_kv_launch(head_dim: int, block_size: int, dtype: torch.dtype, on_gpu: bool) -> dict:
    tiles = kernel_tiles(on_gpu, head_dim, dtype)
    return dict(
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=_pad(head_dim), BLOCK_T=tiles.write_block_t
    )


def prefill_launch(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    on_gpu: bool,
) -> dict:
    tiles = kernel_tiles(on_gpu, head_dim, dtype)
    group = num_heads // num_kv_heads
    group_pad = _pad(group)
    # Rows of a tile are BLOCK_Q tokens × the padded GQA group; tl.dot needs at least 16 rows.
    block_q = max(tiles.prefill_block_m // group_pad, triton.cdiv(16, group_pad))
    return dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, D_PAD=_pad(head_dim, 16), BLOCK_N=tiles.prefill_block_n,
        UPCAST=not on_gpu, num_warps=tiles.prefill_warps, num_stages=tiles.prefill_stages,
    )  # fmt: skip


def decode_launch(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    on_gpu: bool,
    num_splits: int,
) -> tuple[dict, dict]:
    """Launch settings of stage 1 (split) and stage 2 (merge)."""
    tiles = kernel_tiles(on_gpu, head_dim, dtype)
    group = num_heads // num_kv_heads
    split = dict(
        GROUP=group, GROUP_PAD=_pad(group, 16), NUM_SPLITS=num_splits, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, D_PAD=_pad(head_dim, 16), BLOCK_N=tiles.decode_block_n,
        UPCAST=not on_gpu, num_warps=tiles.decode_warps, num_stages=tiles.decode_stages,
    )  # fmt: skip
    merge = dict(
        NUM_SPLITS=num_splits, SPLITS_PAD=_pad(num_splits), HEAD_DIM=head_dim,
        D_PAD=_pad(head_dim, 16),
    )  # fmt: skip
    return split, merge


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or INTERPRETED:
        return 1  # the interpreter runs one program at a time
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


# ===================================================================================== backend


class TritonBackend:
    """PagedAttention with Triton kernels: cache write, paged prefill/extend, split-KV decode."""

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        # `num_splits` fixes the decode kernel's KV split count (the tests use it to reach empty
        # and multiple splits); None picks it per call from the GPU's size (`decode_num_splits`).
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

    def plan(self, meta: AttentionMetadata, block_size: int) -> None:
        return None  # the kernels read the metadata directly

    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None:
        _check_inputs(k_cache, v_cache)
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        # The kernel copies bits; a dtype change (float32 activations into a bfloat16 cache) is
        # done here, exactly as the reference's `.to` does it.
        key = _last_dim_contiguous(key.to(k_cache.dtype))
        value = _last_dim_contiguous(value.to(v_cache.dtype))
        launch = write_kv_launch(head_dim, k_cache.shape[1], k_cache.dtype, not INTERPRETED)
        grid = (triton.cdiv(num_tokens, launch["BLOCK_T"]), num_kv_heads)
        K.write_kv_kernel[grid](
            key, value, k_cache, v_cache, slot_mapping.contiguous(), num_tokens,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            **launch,
        )  # fmt: skip

    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim], query.dtype
        _check_inputs(k_cache, v_cache, query)
        query = _last_dim_contiguous(query)
        # The interpreter's float32 -> bfloat16 cast truncates (a GPU rounds to nearest), which
        # doubles the error; there the kernels write float32 and torch rounds.
        interp_bf16 = INTERPRETED and query.dtype == torch.bfloat16
        out_dtype = torch.float32 if interp_bf16 else query.dtype
        out = torch.empty(query.shape, dtype=out_dtype, device=query.device)
        if query.shape[0] == 0 or meta.num_seqs == 0:
            return out.to(query.dtype)
        if meta.is_decode_only:
            self._decode(query, k_cache, v_cache, meta, scale, out)
        else:
            self._prefill(query, k_cache, v_cache, meta, scale, out)
        return out.to(query.dtype)

    def _prefill(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [T, num_heads, head_dim], written (query's dtype or float32)
    ) -> None:
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        launch = prefill_launch(
            num_heads, num_kv_heads, head_dim, block_size, query.dtype, not INTERPRETED
        )
        # (request, query-token block, KV head); blocks past a request's query_len exit at once.
        grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, launch["BLOCK_Q"]), num_kv_heads)
        K.paged_prefill_kernel[grid](
            query, k_cache, v_cache, out,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale * LOG2E,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            meta.block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            **launch,
        )  # fmt: skip

    def _decode(
        self,
        query: torch.Tensor,  # [B, num_heads, head_dim], one new token per request
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [B, num_heads, head_dim], written (query's dtype or float32)
    ) -> None:
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        num_seqs = meta.num_seqs
        on_gpu = not INTERPRETED
        block_n = kernel_tiles(on_gpu, head_dim, query.dtype).decode_block_n
        num_splits = self.num_splits or decode_num_splits(
            num_seqs, num_kv_heads, meta.max_seq_len, _num_sms(query.device), block_n
        )
        split_launch, merge_launch = decode_launch(
            num_heads, num_kv_heads, head_dim, block_size, query.dtype, on_gpu, num_splits
        )
        # Stage 1's output, stage 2's input: tiny next to the KV cache it summarises.
        part_out = torch.empty(  # [B, num_heads, num_splits, head_dim]
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(  # [B, num_heads, num_splits]
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        K.paged_decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
            query, k_cache, v_cache, part_out, part_lse,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale * LOG2E,
            query.stride(0), query.stride(1),
            meta.block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            **split_launch,
        )  # fmt: skip
        K.paged_decode_merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, meta.query_start_loc,
            out.stride(0), out.stride(1),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            **merge_launch,
        )  # fmt: skip


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_inputs(
    k_cache: torch.Tensor, v_cache: torch.Tensor, query: torch.Tensor | None = None
) -> None:
    """What the kernels assume and would otherwise get silently wrong."""
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
    if query is None:
        return
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} must match the KV cache dtype {k_cache.dtype}")


__all__ = ["KernelTiles", "TritonBackend", "kernel_tiles"]

"""The Triton backend's per-step work list and tile sizes: what to launch, decided once per step.

Everything the kernels need beyond the tensors is derived from the step's `AttentionMetadata` and
the layer's shape, and is the same in every layer. So the model runner asks the backend for a
`TritonPlan` once per step (`TritonBackend.plan`, stored in `meta.plan`), and each layer reads it.
The plan holds:

- which requests have exactly one new token (**decode rows**: decodes, and one-token prompt
  chunks, which are the same computation). They go to the split-KV decode kernels in every batch,
  mixed ones included, so a long context gets the parallelism of splitting in a mixed step too;
- the **query blocks** of the requests with several new tokens, flattened into one list: the
  prefill grid is `(query blocks, KV heads)` over the blocks that exist, like vLLM's unified
  Triton attention, instead of `requests × blocks of the longest query × KV heads`, where a batch
  of 64 decodes and one 1,984-token chunk launched ~98% programs with nothing to do. The long
  list is grid dimension 0, the one CUDA allows up to 2**31 - 1 (the others stop at 65,535);
- per layer shape (`LayerPlan`, filled by the step's first layer): the tile sizes, the KV split
  count, and the decode kernels' partial-output buffers, allocated once per step, not per layer.

A decode-only step (`max_query_len == 1`) is planned without reading the metadata back from the
device; any other step copies `query_start_loc` and `seq_lens` to the host once (one sync per
step, not per layer). Plain Python, no Triton: see docs/architecture.md for where the plan sits
in a step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from minivllm.attention.abstract import AttentionMetadata

# CUDA's grid limits: x up to 2**31 - 1 blocks, y and z up to 65,535.
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_SPLITS = 64  # more splits than this only adds merge work: 4 programs per SM are enough


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int, at_least: int = 1) -> int:
    """Tile extents must be powers of two; the extra lanes are masked."""
    return max(at_least, 1 << max(0, n - 1).bit_length())


def check_grid(grid: tuple[int, ...]) -> tuple[int, ...]:
    """A launch grid that CUDA accepts, or a ValueError naming the dimension (never a bad launch)."""
    for dim, (size, limit) in enumerate(zip(grid, MAX_GRID)):
        if not 0 <= size <= limit:
            raise ValueError(f"grid dimension {dim} must be in [0, {limit}], got {size}")
    return grid


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
    (Tests also run the GPU tiles in the interpreter, `TritonBackend(gpu_tiles=True)`, to reach
    the splits and tile edges a GPU sees.)

    GPU (starting points reasoned from sm_90's limits, not yet autotuned on hardware; the
    compile-only test reports each variant's registers, spills and shared memory):
    - prefill is compute-bound: 128 query rows × 64 keys with 8 warps keeps the tensor cores busy
      while Q (128×128×2 B = 32 KiB) and 3 pipeline stages of K and V (3 × 2 × 16 KiB) fit in the
      228 KiB of shared memory per SM; head dims above 128 halve both tiles to stay there.
    - decode is bandwidth-bound, so what matters is bytes in flight: 64 keys × 128 dims × 2 B =
      16 KiB per K or V tile, 3 stages of cp.async prefetch, 4 warps; split-KV
      (`decode_num_splits`) supplies the parallelism that a small tile does not.
    - float32 has no tensor-core path at IEEE precision: its dots are FMA loops whose registers
      grow with the tile (a 128×64 float32 tile compiles to a 2 MB cubin), so it gets small tiles,
      spread over 8 warps (at 4 warps both kernels hit 255 registers and spill). float32 is for
      parity, not for speed.
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
            prefill_warps=8, prefill_stages=2, decode_block_n=32,
            decode_warps=8, decode_stages=2,
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
    num_rows: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int
) -> int:
    """How many KV splits flash-decoding uses: enough programs to fill the GPU, no more.

    ~4 programs per SM keeps the tail (the last, partly filled wave) under a quarter of the run;
    a split shorter than two key tiles would spend as much on its partial output as on its keys.
    Under the interpreter `num_sms` is 1, which gives one split: the fewest programs.
    """
    wanted = cdiv(4 * num_sms, max(1, num_rows * num_kv_heads))
    useful = cdiv(max(1, max_seq_len), 2 * block_n)
    return max(1, min(wanted, useful, MAX_SPLITS))


# ====================================================================== launch settings
# Keyword arguments (constexprs, num_warps, num_stages) of each kernel launch. They are functions
# of the layer's shape only, never of the batch, so one compiled variant serves every step.


def write_kv_settings(head_dim: int, block_size: int, tiles: KernelTiles) -> dict:
    return dict(
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        D_PAD=next_power_of_2(head_dim),
        BLOCK_T=tiles.write_block_t,
    )


def prefill_settings(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, tiles: KernelTiles,
    upcast: bool,
) -> dict:  # fmt: skip
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    # Rows of a tile are BLOCK_Q tokens × the padded GQA group; tl.dot needs at least 16 rows.
    block_q = max(tiles.prefill_block_m // group_pad, cdiv(16, group_pad))
    return dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim, 16), BLOCK_N=tiles.prefill_block_n,
        UPCAST=upcast, num_warps=tiles.prefill_warps, num_stages=tiles.prefill_stages,
    )  # fmt: skip


def decode_settings(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, tiles: KernelTiles,
    upcast: bool, num_splits: int,
) -> tuple[dict, dict]:  # fmt: skip
    """Settings of stage 1 (split) and stage 2 (merge). The split count itself is a run-time
    argument; only whether there is one split (`DIRECT`) is fixed, and the merge's padded width
    (64 lanes, more only for a larger count fixed by hand)."""
    group = num_heads // num_kv_heads
    group_pad, d_pad = next_power_of_2(group, 16), next_power_of_2(head_dim, 16)
    # The accumulator is [GROUP_PAD, D_PAD] float32. Past 64 × 128 (MQA: 128 query heads on one
    # KV head) 4 warps hold it only with spills (255 registers on sm_90); 8 warps halve it.
    warps = tiles.decode_warps if group_pad * d_pad <= 64 * 128 else max(8, tiles.decode_warps)
    split = dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_N=tiles.decode_block_n, UPCAST=upcast, DIRECT=num_splits == 1,
        num_warps=warps, num_stages=tiles.decode_stages,
    )  # fmt: skip
    # One padded width for every count the backend picks (masked lanes cost no memory traffic),
    # so a server never compiles the merge again as its load changes.
    merge = dict(
        SPLITS_PAD=next_power_of_2(max(num_splits, MAX_SPLITS)), HEAD_DIM=head_dim, D_PAD=d_pad,
        num_warps=4 if d_pad <= 128 else 8,  # a [64, D_PAD] float32 tile in registers
    )  # fmt: skip
    return split, merge


# ====================================================================================== plan


@dataclass(frozen=True)
class LayerShape:
    """What the launch settings depend on besides the step: the same in every layer of a model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    gpu_tiles: bool  # the sm_90 tiles (compiled kernels, or tests of them in the interpreter)
    upcast: bool  # float32 after loading: the interpreter's, or a cache narrower than the query


@dataclass
class LayerPlan:
    """The step's launches for one layer shape; built by the first layer, reused by the rest."""

    tiles: KernelTiles
    prefill: dict  # prefill kernel settings
    q_blocks: torch.Tensor  # int32 [NB, 2]  (request, block index) of every query block
    decode_seqs: torch.Tensor  # int32 [D]  the step's decode rows (the plan's, shared)
    num_splits: int  # KV splits of the decode rows (a run-time kernel argument)
    decode_split: dict  # stage 1 settings
    decode_merge: dict  # stage 2 settings
    part_out: torch.Tensor | None  # float32 [D, num_splits, num_heads, head_dim]; None: 1 split
    part_lse: torch.Tensor | None  # float32 [D, num_splits, num_heads]


@dataclass
class TritonPlan:
    """One step's work list for the Triton kernels: built once, read by every layer."""

    num_seqs: int
    decode_seqs: torch.Tensor  # int32 [D]  requests with one new token (decode-only step: all B)
    decode_max_seq_len: int  # longest context among them: bounds the useful KV splits
    prompts: list[tuple[int, int]]  # (request, query_len) of each request with >1 new tokens
    num_sms: int  # streaming multiprocessors to fill (1 in the interpreter)
    num_splits: int | None  # a fixed KV split count (tests), or None: chosen per layer shape
    layers: dict[LayerShape, LayerPlan] = field(default_factory=dict)
    # An encoder's query blocks, by BLOCK_Q: every request's rows (single-row ones too), since
    # the encoder kernel serves all of them; built by the first encoder layer, reused by the rest.
    encoder_blocks: dict[int, torch.Tensor] = field(default_factory=dict)

    def encoder_q_blocks(self, meta: AttentionMetadata, block_q: int) -> torch.Tensor:
        """int32 [NB, 2]: (request, block index) of every query block of every request."""
        if block_q not in self.encoder_blocks:
            query_lens = meta.query_start_loc.diff().tolist()  # one host copy per step
            every = [(i, q) for i, q in enumerate(query_lens) if q > 0]
            device = self.decode_seqs.device
            self.encoder_blocks[block_q] = flatten_query_blocks(every, block_q, device)
        return self.encoder_blocks[block_q]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seqs.shape[0])

    def for_layer(self, shape: LayerShape) -> LayerPlan:
        if shape not in self.layers:
            self.layers[shape] = self._plan_layer(shape)
        return self.layers[shape]

    def _plan_layer(self, s: LayerShape) -> LayerPlan:
        tiles = kernel_tiles(s.gpu_tiles, s.head_dim, s.dtype)
        prefill = prefill_settings(
            s.num_heads, s.num_kv_heads, s.head_dim, s.block_size, tiles, s.upcast
        )
        num_splits = self.num_splits or decode_num_splits(
            self.num_decodes, s.num_kv_heads, self.decode_max_seq_len, self.num_sms,
            tiles.decode_block_n,
        )  # fmt: skip
        split, merge = decode_settings(
            s.num_heads, s.num_kv_heads, s.head_dim, s.block_size, tiles, s.upcast, num_splits
        )
        device = self.decode_seqs.device
        part_out = part_lse = None
        if num_splits > 1 and self.num_decodes:
            # Stage 1's output, stage 2's input: tiny next to the KV cache it summarises.
            part_out = torch.empty(
                (self.num_decodes, num_splits, s.num_heads, s.head_dim),
                dtype=torch.float32, device=device,
            )  # fmt: skip
            part_lse = torch.empty(
                (self.num_decodes, num_splits, s.num_heads), dtype=torch.float32, device=device
            )
        return LayerPlan(
            tiles=tiles,
            prefill=prefill,
            q_blocks=flatten_query_blocks(self.prompts, prefill["BLOCK_Q"], device),
            decode_seqs=self.decode_seqs,
            num_splits=num_splits,
            decode_split=split,
            decode_merge=merge,
            part_out=part_out,
            part_lse=part_lse,
        )


def flatten_query_blocks(
    prompts: list[tuple[int, int]], block_q: int, device: torch.device
) -> torch.Tensor:  # int32 [NB, 2]: (request, block index within its new tokens)
    """Every query block of the step, once: ceil(query_len / block_q) per prompt request."""
    if not prompts:
        return torch.empty((0, 2), dtype=torch.int32, device=device)
    reqs = torch.tensor([r for r, _ in prompts], dtype=torch.int32)
    counts = torch.tensor([cdiv(q, block_q) for _, q in prompts])
    seqs = torch.repeat_interleave(reqs, counts)  # [NB]
    # Block index within its request: position in the list minus where its request's run starts.
    starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    idx = (torch.arange(int(counts.sum())) - starts).to(torch.int32)
    return torch.stack([seqs, idx], dim=1).to(device)


def make_triton_plan(
    meta: AttentionMetadata, num_sms: int, num_splits: int | None = None
) -> TritonPlan:
    """The step's work list from its metadata: decode rows, prompt requests, nothing per layer."""
    device = meta.seq_lens.device
    num_seqs = meta.num_seqs
    if meta.is_decode_only:
        # Every request has at most one new token: all are decode rows, and the kernels skip
        # a padded request with none. No device-to-host copy.
        return TritonPlan(
            num_seqs=num_seqs,
            decode_seqs=torch.arange(num_seqs, dtype=torch.int32, device=device),
            decode_max_seq_len=meta.max_seq_len,
            prompts=[],
            num_sms=num_sms,
            num_splits=num_splits,
        )
    # One copy to the host for the whole step (every layer reuses what it decides).
    host = torch.cat([meta.query_start_loc, meta.seq_lens]).tolist()
    starts, seq_lens = host[: num_seqs + 1], host[num_seqs + 1 :]
    query_lens = [b - a for a, b in itertools.pairwise(starts)]
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    return TritonPlan(
        num_seqs=num_seqs,
        decode_seqs=torch.tensor(decodes, dtype=torch.int32).to(device),
        decode_max_seq_len=max((seq_lens[i] for i in decodes), default=0),
        prompts=[(i, q) for i, q in enumerate(query_lens) if q > 1],
        num_sms=num_sms,
        num_splits=num_splits,
    )


__all__ = [
    "KernelTiles",
    "LayerPlan",
    "LayerShape",
    "TritonPlan",
    "check_grid",
    "decode_num_splits",
    "kernel_tiles",
    "make_triton_plan",
    "prefill_settings",
]

"""`CpuBackend`: PagedAttention on CPUs, with a compiled paged decode kernel (the CPU default).

Decode is where a CPU engine spends its attention time: every step, every running request reads
its whole context to produce one token. The reference backend gathers that context into a padded
contiguous tensor before `scaled_dot_product_attention`, so each key and value crosses memory three
times. This backend sends decode rows to `cpu_kernels.cpp`, which follows each request's block
table and reads each key and value once (the paper's §4.1 kernel); measured on SmolLM2 at 64
requests x 256 tokens of context, decode attention drops from ~8 ms to ~2 ms per layer.

Everything else is the reference backend's: the cache write (`index_copy_`) and prompt chunks
(gather + SDPA, where the gather is paid once for many query rows and SDPA runs as matmuls). vLLM's
CPU backend splits the work the same way.

The kernel is compiled on first use with `torch.utils.cpp_extension` (about 15 s, then cached
under ~/.cache/minivllm/torch_extensions). Compiling needs a C++ compiler and `ninja`; where the
build fails, `get_attention_backend("auto")` logs why and falls back to the reference backend.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from minivllm.attention import AttentionMetadata
from minivllm.attention.reference import (
    PromptChunk,
    ReferenceBackend,
    attend_prompt_chunk,
    plan_prompt_chunks,
    query_lens_of,
)

logger = logging.getLogger("minivllm")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")

# Compiler flags per SIMD level PyTorch detected on this CPU: the kernel's loops are vectorized by
# the compiler, so it must be told which instructions it may use (and no more than the CPU has).
SIMD_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


class CpuKernelUnavailable(RuntimeError):
    """The C++ decode kernel could not be built or loaded on this machine."""


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja wheel installs it next to this interpreter, which
    is not on PATH when a virtual environment is used without being activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load_cpu_kernels() -> None:
    """Compile (first time) and load `cpu_kernels.cpp`; registers `torch.ops.minivllm_cpu`."""
    from minivllm.model.gguf import cache_root  # the one cache folder of minivllm

    try:
        from torch.utils.cpp_extension import load
    except ImportError as e:  # pragma: no cover - part of every torch build
        raise CpuKernelUnavailable(str(e)) from e
    _put_ninja_on_path()
    simd = torch.backends.cpu.get_cpu_capability()
    # One build per SIMD level and torch version: a home folder shared by different machines
    # must never hand an AVX-512 build to an AVX2 CPU.
    build_dir = cache_root() / "torch_extensions" / f"cpu_kernels-{simd}-torch{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("compiling the CPU attention kernel into %s (once, ~15 s)", build_dir)
    try:
        load(
            name="minivllm_cpu_kernels",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-ffast-math", "-fopenmp", *SIMD_FLAGS.get(simd, [])],
            extra_ldflags=["-lm", "-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # a missing compiler or ninja, or a failed build
        raise CpuKernelUnavailable(
            f"could not build the CPU attention kernel ({type(e).__name__}: {e}); it needs a C++ "
            'compiler and ninja (pip install ninja), or use attention_backend="reference"'
        ) from e


def paged_decode(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int32 [B]
    token_rows: torch.Tensor,  # int64 [B]  each request's query row
    scale: float,
    out: torch.Tensor,  # float32 [T, num_heads, head_dim]  rows token_rows are written
) -> None:
    """Decode attention of one query row per request over its paged context (the C++ kernel)."""
    load_cpu_kernels()
    torch.ops.minivllm_cpu.paged_decode(
        out, query.contiguous(), k_cache, v_cache, block_tables, seq_lens, token_rows, scale
    )


@dataclass
class CpuPlan:
    """A step's attention work, built once in the first layer and reused by the others."""

    decode_rows: torch.Tensor  # int64 [D]  rows of the flat batch that are decodes
    decode_block_tables: torch.Tensor  # int32 [D, max_blocks]
    decode_seq_lens: torch.Tensor  # int32 [D]
    prompt_chunks: list[PromptChunk]


def make_cpu_plan(meta: AttentionMetadata, block_size: int) -> CpuPlan:
    query_lens, _ = query_lens_of(meta)
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    idx = torch.tensor(decodes, dtype=torch.long)
    return CpuPlan(
        decode_rows=meta.query_start_loc[idx].long(),
        decode_block_tables=meta.block_tables[idx].contiguous(),
        decode_seq_lens=meta.seq_lens[idx].contiguous(),
        prompt_chunks=plan_prompt_chunks(meta, block_size),
    )


class CpuBackend(ReferenceBackend):
    """The reference backend with decodes computed by the compiled paged decode kernel."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        load_cpu_kernels()  # fail at construction, not in the middle of a step

    def plan(self, meta: AttentionMetadata, block_size: int) -> CpuPlan:  # type: ignore[override]
        return make_cpu_plan(meta, block_size)

    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        plan = meta.plan
        if not isinstance(plan, CpuPlan):  # called without the runner: build it for this call
            plan = make_cpu_plan(meta, k_cache.shape[1])
        out = torch.empty(query.shape, dtype=torch.float32)  # the kernel accumulates in float32
        if plan.decode_rows.numel():
            paged_decode(
                query,
                k_cache,
                v_cache,
                plan.decode_block_tables,
                plan.decode_seq_lens,
                plan.decode_rows,
                scale,
                out,
            )
        for chunk in plan.prompt_chunks:
            attend_prompt_chunk(query, k_cache, v_cache, chunk, scale, out)
        return out.to(query.dtype)

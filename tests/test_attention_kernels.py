"""The Triton kernels against the reference backend, in Triton's CPU interpreter.

The parity grid is pairwise, not a cartesian product: every pair of values of any two factors
(mode × heads × dtype × head_dim × block_size) appears in at least one case, which catches the
bugs that need two factors to meet (e.g. GQA 3:1 with head_dim 80 masking) in 20 cases instead
of 240. Every case also runs several requests of different lengths in one call, with the lengths
that probe block edges: 1, block_size − 1, block_size, block_size + 1 and a few hundred.
tests/test_attention_gpu.py runs the same grid on a GPU with the kernels compiled.

Also here: exact cache writes, and a compile-only check that every kernel compiles for sm_90
(Hopper: H100/H200) to a cubin, with no GPU, in a subprocess without the interpreter.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import zlib
from dataclasses import dataclass

import pytest
import torch
from test_attention_reference import TOLERANCES, batch_shape, make_paged_batch

from minivllm.attention import get_attention_backend
from minivllm.attention.reference import ReferenceBackend
from minivllm.attention.triton import INTERPRETED, TritonBackend

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass(frozen=True)
class ParityCase:
    mode: str  # decode | decode_split | prefill | extend | mixed (see `batch_shape`)
    heads: tuple[int, int]  # (query heads, KV heads): MHA, GQA 2:1, 3:1, 8:1
    dtype: torch.dtype
    head_dim: int  # 64, and 80 (not a power of two: masked lanes)
    block_size: int
    num_splits: int | None = None  # decode kernel's KV splits; None = the backend's choice

    @property
    def id(self) -> str:
        h, hkv = self.heads
        dt = str(self.dtype).removeprefix("torch.")
        splits = f"-s{self.num_splits}" if self.num_splits else ""
        return f"{self.mode}-{h}q{hkv}kv-{dt}-d{self.head_dim}-bs{self.block_size}{splits}"


# Pairwise covering grid over mode(5) × heads(4) × dtype(3) × head_dim(2) × block_size(2):
# every (mode, heads) pair once, the other factors chosen so that every pair of values of any
# two factors occurs (checked by test_parity_grid_covers_every_pair).
PARITY_GRID = [
    ParityCase("decode", (4, 4), F16, 64, 16, 1),
    ParityCase("decode", (4, 2), BF16, 80, 16, 1),
    ParityCase("decode", (6, 2), F32, 80, 32, 1),
    ParityCase("decode", (8, 1), F32, 80, 16),
    ParityCase("decode_split", (4, 4), F16, 64, 32, 3),
    ParityCase("decode_split", (4, 2), BF16, 64, 32, 5),
    ParityCase("decode_split", (6, 2), F32, 80, 32, 16),
    ParityCase("decode_split", (8, 1), F32, 64, 16, 4),
    ParityCase("prefill", (4, 4), F32, 80, 16),
    ParityCase("prefill", (4, 2), F16, 64, 16),
    ParityCase("prefill", (6, 2), F32, 80, 32),
    ParityCase("prefill", (8, 1), BF16, 64, 16),
    ParityCase("extend", (4, 4), BF16, 64, 16),
    ParityCase("extend", (4, 2), F32, 64, 32),
    ParityCase("extend", (6, 2), F16, 64, 16),
    ParityCase("extend", (8, 1), F16, 80, 32),
    ParityCase("mixed", (4, 4), F16, 64, 32),
    ParityCase("mixed", (4, 2), F32, 64, 32),
    ParityCase("mixed", (6, 2), BF16, 64, 32),
    ParityCase("mixed", (8, 1), F16, 80, 16),
]
GRID_FACTORS = {
    "mode": ["decode", "decode_split", "prefill", "extend", "mixed"],
    "heads": [(4, 4), (4, 2), (6, 2), (8, 1)],
    "dtype": [F32, F16, BF16],
    "head_dim": [64, 80],
    "block_size": [16, 32],
}


def check_attend_parity(case: ParityCase, device: str) -> float:
    """Write K/V and attend with both backends on the same batch; returns the max abs error."""
    h, hkv = case.heads
    seq_lens, query_lens = batch_shape(case.mode, case.block_size)
    b = make_paged_batch(
        seq_lens, query_lens, h, hkv, case.head_dim, case.block_size, case.dtype, device,
        seed=zlib.crc32(case.id.encode()),
    )  # fmt: skip
    # Q, K and V as views of one fused projection output, as the model produces them: the kernels
    # must honour the token stride rather than assume contiguous inputs.
    qkv = torch.cat([b.query, b.key, b.value], dim=1)  # [T, h + 2 * hkv, head_dim]
    query, key, value = qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]
    ref, tri = ReferenceBackend(), TritonBackend(num_splits=case.num_splits)
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    ref.write_kv(key, value, ref_k, ref_v, b.meta.slot_mapping)
    tri.write_kv(key, value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    assert torch.equal(b.k_cache, ref_k) and torch.equal(b.v_cache, ref_v)
    expected = ref.attend(query, ref_k, ref_v, b.meta, b.scale)
    out = tri.attend(query, b.k_cache, b.v_cache, b.meta, b.scale)
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out, expected, **TOLERANCES[case.dtype])
    return float((out.float() - expected.float()).abs().max())


def check_write_kv_exact(dtype: torch.dtype, device: str) -> None:
    """Cache writes are bit-exact, and a -1 slot leaves its (and every unwritten) slot untouched."""
    b = make_paged_batch([5, 40, 17], [5, 33, 1], 4, 2, 80, 16, dtype, device, seed=7)
    slots = b.meta.slot_mapping.clone()
    slots[::4] = -1
    k_before, v_before = b.k_cache.clone(), b.v_cache.clone()
    TritonBackend().write_kv(b.key, b.value, b.k_cache, b.v_cache, slots)
    kept = slots >= 0
    flat = (-1, 2, 80)  # the cache viewed as [slots, num_kv_heads, head_dim]
    assert torch.equal(b.k_cache.view(flat)[slots[kept]], b.key[kept])
    assert torch.equal(b.v_cache.view(flat)[slots[kept]], b.value[kept])
    untouched = torch.ones(b.k_cache.view(flat).shape[0], dtype=torch.bool, device=device)
    untouched[slots[kept]] = False
    assert torch.equal(b.k_cache.view(flat)[untouched], k_before.view(flat)[untouched])
    assert torch.equal(b.v_cache.view(flat)[untouched], v_before.view(flat)[untouched])


# ================================================================ CPU, Triton's interpreter

interpreter_only = pytest.mark.skipif(
    not INTERPRETED,
    reason="Triton compiles for the GPU in this session: tests/test_attention_gpu.py runs the grid",
)


@interpreter_only
@pytest.mark.parametrize("case", PARITY_GRID, ids=lambda c: c.id)
def test_triton_matches_reference_on_the_parity_grid(case: ParityCase) -> None:
    check_attend_parity(case, "cpu")


@interpreter_only
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_triton_write_kv_is_exact_and_skips_minus_one(dtype: torch.dtype) -> None:
    check_write_kv_exact(dtype, "cpu")


@interpreter_only
def test_triton_write_kv_casts_like_the_reference() -> None:
    """float32 K/V into a bfloat16 cache: the same rounding as the reference's `.to`."""
    b = make_paged_batch([9, 20], [9, 4], 2, 2, 64, 16, F32, seed=5)
    caches = [(b.k_cache.to(BF16), b.v_cache.to(BF16)) for _ in range(2)]
    for backend, (kc, vc) in zip((ReferenceBackend(), TritonBackend()), caches):
        backend.write_kv(b.key, b.value, kc, vc, b.meta.slot_mapping)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@interpreter_only
def test_triton_decode_default_splits_match_reference() -> None:
    """The backend's own split choice (num_splits=None) on a decode batch."""
    check_attend_parity(ParityCase("decode", (4, 2), BF16, 64, 16), "cpu")


def test_parity_grid_covers_every_pair() -> None:
    names = list(GRID_FACTORS)
    for a, b in itertools.combinations(names, 2):
        seen = {(getattr(c, a), getattr(c, b)) for c in PARITY_GRID}
        missing = set(itertools.product(GRID_FACTORS[a], GRID_FACTORS[b])) - seen
        assert not missing, f"no parity case has ({a}, {b}) in {sorted(map(str, missing))}"


def test_triton_backend_is_registered_as_triton() -> None:
    backend = get_attention_backend("triton")
    assert isinstance(backend, TritonBackend) and backend.name == "triton"


def test_importing_the_backend_turns_on_the_interpreter_without_cuda() -> None:
    """A user on CPU sets nothing: importing the backend switches Triton's interpreter on."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernels are compiled, not interpreted")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import os, minivllm.attention.triton as t; print(os.environ['TRITON_INTERPRET'], t.INTERPRETED)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1", "True"]


ERRORS_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # as if Triton were not installed
    try:
        import minivllm.attention.triton
    except ImportError as e:
        print("ImportError:", e)
    del sys.modules["triton"]
    import minivllm.attention.triton as t
    try:
        t.TritonBackend()
    except RuntimeError as e:
        print("RuntimeError:", e)
    """
)


def test_backend_errors_say_what_to_do() -> None:
    """No Triton: how to install it. Interpreter explicitly off without CUDA: how to turn it on."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA, compiled kernels are the normal case")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run(
        [sys.executable, "-c", ERRORS_SCRIPT], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    import_error, runtime_error = run.stdout.strip().splitlines()
    assert 'pip install "minivllm[triton]"' in import_error
    assert "TRITON_INTERPRET=1" in runtime_error and "no CUDA" in runtime_error


# ====================================================================== compile-only, sm_90

# Runs in a fresh interpreter with TRITON_INTERPRET=0: under the interpreter `@triton.jit` returns
# an InterpretedFunction, which cannot be compiled. The launch settings are the backend's own
# (`*_launch(on_gpu=True)`), so what compiles here is what an H100/H200 would launch.
COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from minivllm.attention import triton as backend, triton_kernels as K

    POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                "slot_mapping_ptr": "*i64", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    TY = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

    def compile_for_sm90(fn, dtype, launch):
        options = {k: launch.pop(k) for k in ("num_warps", "num_stages") if k in launch}
        signature = {}
        for p in fn.params:
            if p.is_constexpr:
                signature[p.name] = "constexpr"
            elif p.name.endswith("_ptr"):
                signature[p.name] = POINTERS.get(p.name, "*" + TY[dtype])
            else:
                signature[p.name] = "fp32" if p.name == "qk_scale" else "i32"
        src = ASTSource(fn, signature, launch)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

    results = []
    for dtype, (h, hkv, d, bs) in json.loads(sys.argv[1]):
        dtype = getattr(torch, dtype)
        split, merge = backend.decode_launch(h, hkv, d, bs, dtype, True, 4)
        for fn, launch in [
            (K.write_kv_kernel, backend.write_kv_launch(d, bs, dtype, True)),
            (K.paged_prefill_kernel, backend.prefill_launch(h, hkv, d, bs, dtype, True)),
            (K.paged_decode_split_kernel, split),
            (K.paged_decode_merge_kernel, merge),
        ]:
            kernel = compile_for_sm90(fn, dtype, dict(launch))
            results.append([fn.__name__, str(dtype), sorted(kernel.asm), len(kernel.asm["cubin"])])
    print(json.dumps(results))
    """
)

# Every kernel for every dtype, at the benchmark's shape (GQA 8:1, head_dim 128) in 16 bits, and
# at GQA 3:1 with head_dim 80 (masked lanes) in float32. Split across two processes: two cores.
COMPILE_SHARDS = [
    [["bfloat16", [32, 4, 128, 16]], ["float32", [6, 2, 80, 16]]],
    [["float16", [32, 4, 128, 16]]],
]


def test_every_kernel_compiles_to_a_cubin_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "0"  # set, so that importing the backend leaves it off
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the current default; silences Triton's warning
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(shard)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for shard in COMPILE_SHARDS
    ]
    compiled = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        compiled += json.loads(stdout.strip().splitlines()[-1])
    assert len(compiled) == 4 * 3
    for name, dtype, stages, cubin_bytes in compiled:
        assert "ptx" in stages and "cubin" in stages, (name, dtype, stages)
        assert cubin_bytes > 0, (name, dtype)

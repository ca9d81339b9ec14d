"""The environment variables minivllm reads (vLLM keeps its own in `vllm/envs.py`).

`MINIVLLM_CACHE`: the one folder where minivllm keeps what it makes once and reuses (GGUF models
converted to safetensors, the compiled CPU kernels). Like `VLLM_CACHE_ROOT`, it defaults to a
`minivllm` folder under `$XDG_CACHE_HOME`, else `~/.cache`.

`MINIVLLM_CPU_GGUF_DOT`: how the CPU multiplies a GGUF model's quantized weights: `auto` (the
default, per block type: `int8` for the K-quants, Q8_0, Q4_0 and Q4_1 where the library has
8-bit dots, and for the other types bf16 dot products where the CPU has AVX512-BF16, else
float32), or one kind for every type: `bf16`, `float32` (products exact in float32, half as many
a cycle) or `int8` (x rounded to 8-bit blocks and 8-bit integer dots, as llama.cpp's CPU backend:
the AVX2 build's own product, and on AVX-512 builds AVX512-VNNI's); a kind the CPU lacks is
refused.
docs/concepts/quantization.md says what each costs.

`MINIVLLM_CPU_GGUF_GEMM_ROWS`: off by default; a number N makes a CPU step of N or more token rows
(a long prompt's chunk) dequantize each GGUF weight and run a dense GEMM, which is faster for long
prompts but gives those rows other float sums than smaller steps (no longer batch-invariant).

`MINIVLLM_CPU_AMX`: `1` (the default) lets the int8 product of the K-quants and of Q4_0 to Q5_1
run prefill-sized calls on Intel AMX tiles where the CPU has AMX-INT8
(minivllm/cpu/csrc/cpu_gguf_amx.cpp and cpu_gguf_amx32.h, whose outputs equal the AVX512-VNNI
kernel's bit for bit); `0` keeps every call on AVX512-VNNI. Read on every call, so a test may
compare the two in one process.

`MINIVLLM_CPU_ISA`: which instruction-set level of the CPU kernels a process runs: `auto` (the
default: the best this CPU has), `reference`, `generic`, `avx2`, `avx512` or `avx512_bf16`; read
by minivllm/cpu/isa.py, which refuses a level the CPU lacks.

`VLLM_PP_LAYER_PARTITION` (vLLM's name): how many decoder layers each pipeline stage holds, as a
comma-separated list ("4,4" or "3,5"), one positive count per stage, summing to the model's
layers; unset: the even split (minivllm/distributed/pipeline.py). Read on the driver only, before
any process starts, and sent to every rank.

`VLLM_ALLOW_RUNTIME_LORA_UPDATING` (vLLM's name): "1" or "true" adds the server's
/v1/load_lora_adapter and /v1/unload_lora_adapter routes (minivllm/entrypoints/serving_models.py);
unset, they do not exist (404), as in vLLM, which allows it for local development only.

`MINIVLLM_DP_AUTHKEY`: the shared secret of data parallelism across hosts: an engine core that
dials the API server's host (`--data-parallel-address`, `--data-parallel-rpc-port`) must prove
it holds the same key (multiprocessing's HMAC challenge) before anything is unpickled. Unset: a
fixed default, which only keeps out strangers by accident; set it on every host when the port is
reachable by anyone but your hosts (minivllm/engine/dp_remote.py).

This module imports nothing of minivllm, so any module may import it without creating a cycle
(tests/test_package_layout.py holds the package's import graph acyclic).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where minivllm caches what it builds: `$MINIVLLM_CACHE`, else `$XDG_CACHE_HOME/minivllm`,
    else `~/.cache/minivllm`. Read on every call, so a test may point it at a temporary folder."""
    if os.environ.get("MINIVLLM_CACHE"):
        return Path(os.environ["MINIVLLM_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "minivllm"


CPU_GGUF_DOTS = ("auto", "bf16", "float32", "int8")


def cpu_gguf_dot() -> str:
    """`$MINIVLLM_CPU_GGUF_DOT`, one of CPU_GGUF_DOTS (default auto); any other value is refused."""
    value = os.environ.get("MINIVLLM_CPU_GGUF_DOT", "auto").strip().lower() or "auto"
    if value not in CPU_GGUF_DOTS:
        raise ValueError(
            f"MINIVLLM_CPU_GGUF_DOT must be one of {', '.join(CPU_GGUF_DOTS)}, got {value!r}"
        )
    return value


def cpu_gguf_gemm_rows() -> int | None:
    """`$MINIVLLM_CPU_GGUF_GEMM_ROWS` as a row count, or None when unset or 0 (off)."""
    value = os.environ.get("MINIVLLM_CPU_GGUF_GEMM_ROWS", "").strip() or "0"
    if not value.isdigit():
        raise ValueError(
            f"MINIVLLM_CPU_GGUF_GEMM_ROWS must be a whole number of token rows (0: off), got {value!r}"
        )
    return int(value) or None


def cpu_amx() -> bool:
    """`$MINIVLLM_CPU_AMX`: "1" (default) or "0"; any other value is refused."""
    value = os.environ.get("MINIVLLM_CPU_AMX", "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"MINIVLLM_CPU_AMX must be 0 or 1, got {value!r}")
    return value == "1"


def pp_layer_partition() -> list[int] | None:
    """`$VLLM_PP_LAYER_PARTITION` as layer counts per stage ("4,4" -> [4, 4]); None when unset.
    A count that is not a positive whole number is refused here; that the counts fit the model
    is checked against its config (`pipeline.stage_layers`)."""
    value = os.environ.get("VLLM_PP_LAYER_PARTITION", "").strip()
    if not value:
        return None
    parts = [p.strip() for p in value.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            "VLLM_PP_LAYER_PARTITION must be comma-separated positive layer counts, one per "
            f"pipeline stage (e.g. '4,4'), got {value!r}"
        )
    return [int(p) for p in parts]


def allow_runtime_lora_updating() -> bool:
    """`$VLLM_ALLOW_RUNTIME_LORA_UPDATING` as vLLM reads it: "1" or "true" (any case) is on."""
    value = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
    return value in ("1", "true")


def dp_authkey() -> bytes:
    """`$MINIVLLM_DP_AUTHKEY` as bytes; unset or empty: the fixed default (see above)."""
    return (os.environ.get("MINIVLLM_DP_AUTHKEY") or "minivllm-data-parallel").encode()

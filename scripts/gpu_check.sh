#!/usr/bin/env bash
# The prepared GPU check of the Triton kernels (issue 18), for a session that is lent a CUDA GPU:
# one script, one call, about 5 minutes on an H200. `make gpu-check` runs it with the project's
# venv; on a bare GPU machine whose python3 already has torch and triton (the lent H200s do), run
#   PYTHON=python3 bash scripts/gpu_check.sh
# Every step's output goes to $OUT (default bench-out/gpu-check/), one file per step, and summary.txt
# says which steps failed. The exit status is non-zero if any step failed. Record the numbers on
# docs/gpu.md ("Measured on a GPU").
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-bench-out/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled, never interpreted (the GPU tests fail if it is set)
export TRITON_DEFAULT_FP_FUSION=1
failed=0

step() {  # step NAME COMMAND...: run, keep its output under $OUT/NAME.txt, note its status
  local name=$1
  shift
  echo "=== $name: $*"
  "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.txt"
  echo "$name: exit $rc" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || failed=1
}

: >"$OUT/summary.txt"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# 1. The GPU suite compiled (parity grid, >2**31-element cache, padded rows, engine end to end,
#    registers/spills/shared memory as loaded), then the sm_90 compile-only report.
# Compiling the kernel variants is most of the suite's time: spread it over 4 workers if
# pytest-xdist is there (the lent H200s have it).
parallel=()
"$PY" -c "import xdist" 2>/dev/null && parallel=(-n 4)
step 1-gpu-suite "$PY" -m pytest -q -m gpu tests -rA -p no:cacheprovider --timeout=900 "${parallel[@]}"
step 1-compile-report "$PY" -m pytest -q tests/attention/test_attention_triton_launch.py -rA \
  -p no:cacheprovider -k sm90
# 2. Overheads: first-call (compile) time by context length, a chunk with and without 64
#    decodes, host time per tiny decode call.
step 2-overhead "$PY" benchmarks/kernels.py --overhead
# 3. Decode bandwidth against the device's copy bandwidth; exits 1 if it misses >= 85 %.
step 3-bench-quick "$PY" benchmarks/kernels.py --quick

echo "=== summary"
cat "$OUT/summary.txt"
exit "$failed"

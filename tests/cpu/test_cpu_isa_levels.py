"""The engine end to end at this process's instruction-set level, with two threads as users run it.

`make test` runs this file and the kernel parity files (the `cpu_isa` marker) once in its main pass,
at the machine's best level, and once more per lower level the CPU can execute
(`MINIVLLM_CPU_ISA=avx2`, with PyTorch's and oneDNN's own kernels held to AVX2 too: an AVX2 machine
as closely as an AVX-512 one can be), so that code compiled for a CPU the author does not have
is built and run before a user's machine does it (minivllm/cpu/isa.py).

Threads: pytest's workers run one thread each (tests/conftest.py), which runs every parallel
region of the kernels inline on the calling thread. A region whose workers call ATen loses the
caller's `InferenceMode` there and fails only with a second thread, so these tests take two.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from minivllm.cpu.build import loaded_level
from minivllm.cpu.isa import selected_level
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from tests.utils.engine_utils import hf_greedy, save_tiny_llama
from tests.utils.server_utils import run_server

pytestmark = pytest.mark.cpu_isa

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
]


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_library_loaded_is_the_level_asked_for() -> None:
    level = selected_level()
    if level.build is None:
        pytest.skip("MINIVLLM_CPU_ISA=reference loads no library")
    assert loaded_level() == level


def top5_agreement(a: list, b: list) -> tuple[int, int]:
    """vLLM's check_logprobs_close, counted: tokens equal until the first divergence, where each
    side's token must be in the other's top 5. Returns (equal tokens, tokens compared)."""
    equal = compared = 0
    for x, y in zip(a, b):
        for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)):
            compared += 1
            if s != t:
                assert t in x.logprobs[i] and s in y.logprobs[i], (i, x.token_ids, y.token_ids)
                break
            equal += 1
    return equal, compared


def test_the_bundled_model_on_its_blocks_is_close_to_its_dequantized_self(
    smollm2_gguf: Path, two_threads: None
) -> None:
    """The bug this file exists for: every request of a GGUF model failed on AVX2 CPUs."""
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=5, ignore_eos=True)
    outs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(str(smollm2_gguf), quantization=quantization, cpu_kv_cache_space=0.25)
        outs[quantization] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert all(
            o.finish_reason == "length" and len(o.token_ids) == 16 for o in outs[quantization]
        )
    equal, compared = top5_agreement(outs["gguf"], outs["none"])
    print(f"{selected_level().name}: {equal} of {compared} tokens equal to quantization='none'")


def test_a_float32_llama_is_token_exact_with_transformers(
    tmp_path: Path, two_threads: None
) -> None:
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "llama", hidden_size=256, intermediate_size=512)
    llm = LLM(str(path), cpu_kv_cache_space=0.25)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12, None)


def test_the_server_answers_chat_and_completions() -> None:
    with run_server(["--cpu-kv-cache-space", "0.25"], env={"OMP_NUM_THREADS": "2"}) as server:
        chat = httpx.post(
            server.base_url + "/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8},
            timeout=120,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"]
        completion = httpx.post(
            server.base_url + "/completions",
            json={"prompt": "The capital of France is", "max_tokens": 8},
            timeout=120,
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"]

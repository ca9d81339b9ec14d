"""The engine end to end at this process's instruction-set level, with two threads as users run it.

`make test` runs this file and the kernel parity files (the `cpu_isa` marker) once in its main pass,
at the machine's best level, and once more per lower level the CPU can execute
(`MINIVLLM_CPU_ISA=avx2`, with PyTorch's and oneDNN's own kernels held to AVX2 too: an AVX2 machine
as closely as an AVX-512 one can be), so that code compiled for a CPU the author does not have
is built and run before a user's machine does it (minivllm/cpu/isa.py).

Threads: pytest's workers run one thread each (tests/conftest.py), which runs every parallel
region of the kernels inline on the calling thread. A region whose workers call ATen loses the
caller's `InferenceMode` there and fails only with a second thread, so these tests take two.

The float32 engine against transformers and the server are in test_cpu_isa_levels_serving.py, a
file of their own, so that `--dist loadfile` can give them the other worker of a pass than this
file's two loads of the bundled model (one file of all three was most of each lower level's pass,
on one worker, while the other finished the kernel files and waited).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from minivllm.cpu.build import loaded_level
from minivllm.cpu.isa import selected_level
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams

pytestmark = pytest.mark.cpu_isa

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
]
# A chat turn whose first answer token sits on a knife's edge: in the dequantized model "The"
# leads "L" by 0.08 nats, and 8-bit activations (the int8 dot here, and llama.cpp's own q4_1 x q8_1
# on the same file) answer "L'Étoile, la Marseillaise," instead of "The capital of France is Paris."
# Closeness as vLLM judges it must hold there too: each side's token in the other's top 5.
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


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
        prompts: list = [*PROMPTS, {"prompt_token_ids": llm.apply_chat_template(CHAT, True)}]
        outs[quantization] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert all(
            o.finish_reason == "length" and len(o.token_ids) == 16 for o in outs[quantization]
        )
    equal, compared = top5_agreement(outs["gguf"], outs["none"])
    print(f"{selected_level().name}: {equal} of {compared} tokens equal to quantization='none'")

"""The float32 engine and the server at this process's instruction-set level, with two threads.

The other half of tests/cpu/test_cpu_isa_levels.py (which says why two threads, and how `make test`
runs the `cpu_isa` files again at each lower level): a random float32 Llama is transformers'
tokens, token for token, and `minivllm serve` answers chat and completions with the bundled model.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from tests.cpu.test_cpu_isa_levels import PROMPTS
from tests.utils.engine_utils import hf_greedy, save_tiny_llama
from tests.utils.server_utils import run_server

pytestmark = pytest.mark.cpu_isa


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

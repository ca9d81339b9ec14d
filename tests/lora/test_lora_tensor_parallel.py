"""LoRA over two tensor-parallel ranks is token-exact with transformers + peft, adapter by adapter.

Each rank reads the whole adapter from the same folder and keeps its shard in a slot, cut as the
base weights are (vLLM's column- and row-parallel LoRA layers, minivllm/lora/layers.py): a
column-parallel B by the rank's output rows, per slice of the fused q/k/v and gate/up; a
row-parallel A by the rank's input columns, its partial delta summed in the base layer's one
all-reduce. The base is a Qwen2 (q/k/v biases) with one KV head, so both ranks hold the same
replicated KV head and take the same rows of k_proj's and v_proj's B. One engine, two ranks
spawned over gloo on this CPU, a mixed batch of the base model and two adapters (attention-only,
and all linears with rsLoRA); a bad adapter is refused by name on every rank and the group serves
on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from minivllm.llm import LLM
from minivllm.lora.errors import LoRAFileError
from minivllm.lora.request import LoRARequest
from tests.lora.lora_utils import ADAPTERS, peft_greedy, save_adapter, save_base
from tests.lora.test_lora_engine import greedy, prompts_for
from tests.utils.tp_utils import no_leftover_processes

pytestmark = pytest.mark.timeout(600)  # a hang guard for a broken collective; no timing


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield from no_leftover_processes()


def test_two_ranks_give_each_request_peft_s_greedy_tokens_for_its_adapter(tmp_path: Path) -> None:
    base = save_base(tmp_path / "base", "qwen2", num_key_value_heads=1)
    attn = LoRARequest(
        "attn", 1, str(save_adapter(base, tmp_path / "attn", 10, **ADAPTERS["attn"]))
    )
    full = LoRARequest("all", 2, str(save_adapter(base, tmp_path / "all", 12, **ADAPTERS["all"])))
    order: list[LoRARequest | None] = [None, attn, full, attn, full, None]
    prompts = prompts_for(len(order))
    max_tokens = [4] * len(order)
    expected: list[list[int]] = [[] for _ in order]
    for lora in (None, attn, full):  # peft's tokens of each request, under its own adapter
        mine = [i for i, r in enumerate(order) if r == lora]
        tokens = peft_greedy(base, lora, [prompts[i] for i in mine], [max_tokens[i] for i in mine])
        for i, t in zip(mine, tokens):
            expected[i] = t
    llm = LLM(
        str(base),
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        skip_tokenizer_init=True,
        max_model_len=64,
        cpu_kv_cache_space=0.01,
    )
    try:
        missing = LoRARequest("missing", 3, str(tmp_path / "no-such-adapter"))
        with pytest.raises(LoRAFileError, match="no-such-adapter is not a folder"):
            llm.llm_engine.add_lora(missing)
        got = greedy(llm, prompts, max_tokens, order)
    finally:
        llm.shutdown()
    assert got == expected

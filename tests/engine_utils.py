"""Helpers for engine tests: building LLMs that are checked for leaked KV blocks, and HF greedy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from minivllm.llm import LLM


def assert_no_blocks_held(llm: LLM) -> None:
    """Every block is free again (evictable prefix-cache blocks count as free)."""
    stats = llm.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, stats
    assert not llm.llm_engine.requests


@contextmanager
def checked_llm(**kwargs: Any) -> Iterator[LLM]:
    llm = LLM(**kwargs)
    yield llm
    assert_no_blocks_held(llm)


def hf_greedy(
    model: Any, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None
) -> list[int]:
    """transformers' greedy `generate` for one unpadded prompt: the oracle. With
    `eos_token_id=None` it never stops early (the engine's `ignore_eos`)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            min_new_tokens=max_new_tokens if eos_token_id is None else 0,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
        )
    return out[0, len(prompt_ids) :].tolist()

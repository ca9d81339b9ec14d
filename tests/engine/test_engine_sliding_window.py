"""A model whose every layer has a sliding window, end to end, against transformers' Mistral.

Mistral is Llama's math plus a sliding window on every layer; transformers' `MistralForCausalLM`
with `sliding_window=W` is the oracle. The window reaches minivllm as the attention layers'
`sliding_window` attribute (the model-families work will set it from the checkpoint's config; here
the config class carries it for the test), and the engine finds it there, so the KV cache manager
frees the blocks no query can see again: logits through the paged cache, chunked, match, and so
do greedy tokens under chunking, preemption and prefix caching, with every block returned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from minivllm import SamplingParams
from minivllm.attention.selector import get_attention_backend
from minivllm.core.sliding_window_manager import SlidingWindowKVCacheManager
from minivllm.model.loader import load_model
from minivllm.model.models.llama import LlamaAttention
from minivllm.model.resolver import resolve_model
from tests.model.test_model_llama import BASE, save_tiny_llama
from tests.utils.engine_utils import checked_llm, hf_greedy
from tests.utils.paged import paged_logits

WINDOW = 11  # smaller than the prompts, not a multiple of the block size
OVERRIDES = dict(num_key_value_heads=2, initializer_range=0.5)


def tiny_pair(tmp: Path) -> tuple[MistralForCausalLM, MistralForCausalLM, Path]:
    """(HF Mistral with the window, the same weights without it, the saved checkpoint)."""
    llama, path = save_tiny_llama(tmp, OVERRIDES)
    models = []
    for window in (WINDOW, None):
        kwargs: dict[str, Any] = {**BASE, **OVERRIDES}
        cfg = MistralConfig(**kwargs, sliding_window=window, head_dim=32)
        cfg._attn_implementation = "eager"
        hf = MistralForCausalLM(cfg).float().eval()
        hf.load_state_dict(llama.state_dict())
        models.append(hf)
    models[0].save_pretrained(path, safe_serialization=True)  # a Mistral checkpoint, window and all
    return models[0], models[1], path


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_windowed_logits_match_transformers_mistral_in_chunks(tmp_path: Path, backend: str) -> None:
    hf, hf_global, path = tiny_pair(tmp_path)
    model = load_model(
        resolve_model(path), get_attention_backend(backend), torch.float32, torch.device("cpu")
    )
    for module in model.modules():
        if isinstance(module, LlamaAttention):
            module.sliding_window = WINDOW  # what a windowed model's layers carry
    ids = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        unwindowed = hf_global(ids[None]).logits[0]
    assert (expected - unwindowed).abs().max() > 1e-2  # the window changes the answer
    for chunks in ([60], [7, 1, 20, 1, 31]):
        got = paged_logits(model, ids.tolist(), chunk_sizes=chunks, block_size=4)
        # float32 rounding only, on logits of up to ~15 (initializer_range=0.5)
        torch.testing.assert_close(got, expected, atol=3e-4, rtol=1e-4)


@pytest.mark.parametrize("caching", [True, False])
def test_engine_frees_out_of_window_blocks_and_matches_greedy_mistral(
    tmp_path: Path, caching: bool
) -> None:
    hf, hf_global, path = tiny_pair(tmp_path)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 512, (20,), generator=gen).tolist()  # prefix-cache hits
    prompts = [
        (shared if i % 3 == 0 else []) + torch.randint(0, 512, (n,), generator=gen).tolist()
        for i, n in enumerate(range(5, 50, 6))
    ]
    max_tokens = [10 + i % 15 for i in range(len(prompts))]
    expected = [hf_greedy(hf, p, m, None) for p, m in zip(prompts, max_tokens)]
    assert expected != [hf_greedy(hf_global, p, m, None) for p, m in zip(prompts, max_tokens)]
    with checked_llm(
        model=str(path),
        skip_tokenizer_init=True,
        block_size=4,
        num_gpu_blocks_override=24,  # 96 slots for 8 requests of up to 91 tokens
        max_model_len=96,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        enable_prefix_caching=caching,
    ) as llm:
        engine = llm.llm_engine
        assert isinstance(engine.kv_cache_manager, SlidingWindowKVCacheManager)
        assert engine.kv_cache_manager.sliding_window == WINDOW
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert engine.kv_cache_manager.num_free_blocks == 24


def test_the_cpu_decode_replay_refuses_a_windowed_model(tmp_path: Path) -> None:
    """The C++ decode loop calls paged_decode, which has no window: such a model stays in Python."""
    from minivllm.worker.cpu_decode_loop import CpuDecodeLoop

    _, path = save_tiny_llama(tmp_path, OVERRIDES)
    model = load_model(
        resolve_model(path), get_attention_backend("cpu"), torch.float32, torch.device("cpu")
    )
    if not CpuDecodeLoop.supports(model):
        pytest.skip("the C++ decode loop does not run this model on this CPU even without a window")
    model.model.layers[1].self_attn.sliding_window = WINDOW  # type: ignore[union-attr]
    assert not CpuDecodeLoop.supports(model)


def test_the_trace_records_window_freed_entries_as_null_and_holds_no_placeholder(
    tmp_path: Path,
) -> None:
    """A freed entry's placeholder id names a block another sequence may hold: the trace writes
    it as null, counts no ref for it, and the page draws it as freed (docs/trace.md)."""
    _, _, path = tiny_pair(tmp_path)
    with checked_llm(
        model=str(path), skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=24,
        max_model_len=96,
    ) as llm:  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        with llm.trace() as recorder:
            llm.generate([{"prompt_token_ids": list(range(1, 21))}], params, use_tqdm=False)
        steps = recorder.steps
    ((seq, last_table),) = steps[-2]["block_tables"].items()  # the step before the finish
    # 48 tokens computed in blocks of 4; the next query (at 48) sees keys from 48 - 11 + 1 = 38:
    # the 9 blocks before block 38 // 4 are freed, the 3 from it on are held
    assert last_table[:9] == [None] * 9 and None not in last_table[9:] and len(last_table) == 12
    for step in steps:
        held = {b for t in step["block_tables"].values() for b in t if b is not None}
        assert set(map(int, step["ref_counts"])) == held
    page_path = recorder.save(tmp_path / "trace")
    last = steps[-2]["step"]  # the last step before the finish freed everything
    from minivllm.trace.screenshot import launch_browser

    with launch_browser() as browser:
        tab = browser.new_page()
        errors: list[str] = []
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.goto(f"{page_path.resolve().as_uri()}#step={last}")
        tab.wait_for_selector("#grid .block")
        outside = tab.locator("#tables .lblock.outside").count()
        owners = tab.locator("#grid .block[data-block='0']").get_attribute("data-owners")
    assert errors == []
    assert outside == 9
    assert owners == (seq if 0 in last_table else "")


@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_speculation_over_a_window_keeps_greedy_and_frees_every_block(
    tmp_path: Path, proposer: str
) -> None:
    """Drafts take lookahead slots past the window's edge and give the rejected ones back; the
    blocks that leave the window are freed all the same. The draft model is the same weights
    without the window: it agrees while every key is inside the window, then less often."""
    hf, hf_global, path = tiny_pair(tmp_path / "target")
    draft = tmp_path / "draft"
    hf_global.save_pretrained(draft, safe_serialization=True)
    spec: dict[str, Any] = {"num_speculative_tokens": 3}
    spec |= {"model": str(draft)} if proposer == "draft_model" else {"prompt_lookup_min": 1}
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (6, 15, 30)]
    expected = [hf_greedy(hf, p, 40, None) for p in prompts]
    with checked_llm(
        model=str(path), skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=24,
        max_model_len=96, max_num_batched_tokens=16, max_num_seqs=8, speculative_config=spec,
    ) as llm:  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        stats = llm.get_stats()
        assert stats.spec_decode_num_accepted_tokens > 0
        assert isinstance(llm.llm_engine.kv_cache_manager, SlidingWindowKVCacheManager)

"""A step that fails or is interrupted leaves nothing behind (issue: a failed step poisoned the
prefix cache with blocks whose K/V was never written).

The fault is injected with a forward hook on a decoder layer, in the middle of the model's run:
during a prompt's prefill, a chunked prefill, a decode and a copy-on-write step, while another
request holds prefix-cached blocks. Afterwards: the step added no prefix-cache name, every block
is free, and the same prompts give exactly what a fresh engine gives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from minivllm.attention.abstract import AttentionMetadata
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from tests.utils.engine_utils import assert_no_blocks_held, save_tiny_llama

PREFIX = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)
HOLDER = PREFIX + " and then it slept"  # holds the shared prefix's cached blocks
# Long enough that its prefill, its second prompt chunk and its decodes each fill new blocks:
# a step that fails there is exactly the step that would have named never-written blocks.
VICTIM = PREFIX + (
    " while seven purple elephants were dancing in the moonlight, a small green frog counted"
    " the stars above the quiet river and sang an old song about the mountains far away"
)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-faults"))


def make_llm(model: Path, **kwargs: Any) -> LLM:
    kwargs = {"num_gpu_blocks_override": 64, "max_num_seqs": 8} | kwargs
    return LLM(str(model), **kwargs)


class Fault:
    """Raises `exc` in decoder layer 0's forward the first time `when(meta, call)` holds."""

    def __init__(
        self, llm: LLM, exc: BaseException, when: Callable[[AttentionMetadata, int], bool]
    ):
        self.exc, self.when, self.calls, self.fired = exc, when, 0, False
        layer = llm.llm_engine.model.model.layers[0]
        self.handle = layer.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: tuple, output: Any) -> None:
        meta = next(a for a in args if isinstance(a, AttentionMetadata))  # the step's metadata
        self.calls += 1
        if not self.fired and self.when(meta, self.calls):
            self.fired = True
            raise self.exc


def cached_names(llm: LLM) -> set[tuple[int, ...]]:
    return {
        k.all_token_ids()
        for k in llm.llm_engine.kv_cache_manager.block_pool.cached_block_hash_to_block
    }


def outputs_of(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


# The phases: (engine keywords, the victim's parameters, when the fault fires).
def _prefill(meta: AttentionMetadata, call: int) -> bool:
    return meta.max_query_len > 1


def _second_chunk(meta: AttentionMetadata, call: int) -> bool:
    _second_chunk.seen = getattr(_second_chunk, "seen", 0) + int(meta.max_query_len > 1)  # type: ignore[attr-defined]
    return meta.max_query_len > 1 and _second_chunk.seen >= 2  # type: ignore[attr-defined]


def _decode(meta: AttentionMetadata, call: int) -> bool:
    """A decode step of both requests in which one of them fills a block."""
    fills_a_block = bool((meta.seq_lens % 16 == 0).any())
    return meta.max_query_len == 1 and meta.num_seqs >= 2 and fills_a_block


def _first_decode(meta: AttentionMetadata, call: int) -> bool:
    return meta.max_query_len == 1 and meta.num_seqs >= 2


PHASES = {
    "prefill": ({}, GREEDY, _prefill),
    "chunked-prefill": ({"max_num_batched_tokens": 16}, GREEDY, _second_chunk),
    "decode": ({}, GREEDY, _decode),
    # n = 2: the victim's first decode after its fork copies its shared, partly filled last block.
    "copy-on-write": (
        {},
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8),
        _first_decode,
    ),
}


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("phase", sorted(PHASES))
def test_a_failed_step_leaves_no_trace(
    tiny_model: Path, phase: str, exc_type: type[BaseException]
) -> None:
    engine_kwargs, victim_params, when = PHASES[phase]
    _second_chunk.seen = 0  # type: ignore[attr-defined]
    llm = make_llm(tiny_model, **engine_kwargs)
    engine = llm.llm_engine
    copies: list[list[tuple[int, int]]] = []
    real_copy_blocks = engine.runner.copy_blocks
    engine.runner.copy_blocks = lambda c: (copies.append(list(c)), real_copy_blocks(c))[1]  # type: ignore[method-assign]

    # The holder runs until it decodes, holding its prompt's full blocks, committed and named.
    engine.add_request("holder", HOLDER, GREEDY)
    while not engine.kv_cache_manager.block_pool.cached_block_hash_to_block:
        engine.step()
    engine.step()
    fault = Fault(llm, exc_type("injected fault"), lambda m, c: False)
    engine.add_request("victim", VICTIM, victim_params)
    outputs = []
    names_before: set[tuple[int, ...]] = set()
    fault.when = when  # armed only now: the holder's own prefill is not the target
    for _ in range(200):  # a fault that never fires must fail the test, not hang it
        if fault.fired:
            break
        names_before = cached_names(llm)
        copies.clear()
        try:
            outputs += engine.step()  # an exception fails the step's requests, inside step()
        except KeyboardInterrupt:  # Ctrl-C fails them too, then reaches the caller
            assert fault.fired and exc_type is KeyboardInterrupt
    fault.handle.remove()
    assert fault.fired, "the fault's condition never held"

    # The faulted step named nothing: every name was there before it ran.
    assert cached_names(llm) <= names_before
    if phase == "copy-on-write":
        assert copies and copies[0], "the faulted step should have carried a copy-on-write copy"
    if exc_type is RuntimeError:
        failed = {o.request_id: o for o in outputs if o.finished}
        assert failed.keys() == {"holder", "victim"}
        assert all(o.error and "injected fault" in o.error for o in failed.values())
        assert all(c.finish_reason == "error" for o in failed.values() for c in o.outputs)
    assert not engine.has_unfinished_requests()
    assert_no_blocks_held(llm)

    # The same prompts, on this engine and on a fresh one: the same tokens.
    prompts, params = [HOLDER, VICTIM], [GREEDY, victim_params]
    again = outputs_of(llm, prompts, params)  # type: ignore[arg-type]
    fresh = outputs_of(make_llm(tiny_model, **engine_kwargs), prompts, params)  # type: ignore[arg-type]
    assert again == fresh
    assert_no_blocks_held(llm)


def test_ctrl_c_in_generate_reaches_the_caller_as_keyboard_interrupt(tiny_model: Path) -> None:
    llm = make_llm(tiny_model)
    fault = Fault(llm, KeyboardInterrupt(), lambda meta, call: call == 3)
    with pytest.raises(KeyboardInterrupt) as info:
        llm.generate([HOLDER, VICTIM], GREEDY, use_tqdm=False)
    assert type(info.value) is KeyboardInterrupt
    fault.handle.remove()
    assert_no_blocks_held(llm)
    assert outputs_of(llm, [VICTIM], GREEDY) == outputs_of(make_llm(tiny_model), [VICTIM], GREEDY)

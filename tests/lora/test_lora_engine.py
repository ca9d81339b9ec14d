"""Many adapters in one batch are token-exact with transformers + peft, each request with its own.

A base model (Llama; Qwen2 for q/k/v biases) and three PEFT adapters made by peft itself
(attention-only r=8, MLP-only r=4, all linears r=16 under rsLoRA), served by one engine with
fewer device slots (max_loras=2) and fewer host copies (max_cpu_loras=2) than adapters, a KV pool
small enough to preempt, a token budget small enough to chunk prompts, and prompts that share
prefixes: every request's greedy tokens equal peft's for its adapter (or transformers' for the
base model), no step carries more than max_loras adapters, and every block comes back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm import BeamSearchParams
from minivllm.core.scheduler import SchedulerOutput
from minivllm.llm import LLM
from minivllm.lora.errors import LoRADisabledError
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams
from minivllm.worker.cpu_decode_loop import CpuDecodeLoop
from tests.engine.test_beam_search import TOL, reference_best
from tests.engine.test_engine_faults_replay import CountingReplay
from tests.lora.lora_utils import load_base, peft_greedy, save_adapters, save_base
from tests.utils.engine_utils import assert_no_blocks_held, checked_llm

# 24 blocks of 4 tokens for more than that many blocks' worth of requests (preemption), 12 tokens
# a step (chunked prefill).
SMALL_ENGINE = dict(
    block_size=4, num_gpu_blocks_override=24, max_num_batched_tokens=12, max_num_seqs=6
)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)


def prompts_for(count: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (5 + 4 * i,), generator=gen).tolist() for i in range(count)]


def lora_llm(path: Path, **kwargs: Any) -> Any:
    defaults = dict(skip_tokenizer_init=True, max_model_len=64, cpu_kv_cache_space=0.01)
    return checked_llm(model=str(path), **(defaults | LORA | kwargs))


def greedy(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int], loras: list[LoRARequest | None]
) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    return [list(o.outputs[0].token_ids) for o in outs]


class AdaptersPerStep:
    """A step listener: the most distinct adapters any step carried."""

    def __init__(self) -> None:
        self.most = 0

    def on_step(self, sched: SchedulerOutput, *_: Any) -> None:
        ids = {s.lora_request.lora_int_id for s in sched.scheduled if s.lora_request}
        self.most = max(self.most, len(ids))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, LoRARequest]]:
    root = tmp_path_factory.mktemp("lora-llama")
    base = save_base(root / "base", "llama")
    return base, save_adapters(base, root)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_mixed_batch_of_base_and_three_adapters_equals_peft_under_preemption_and_chunking(
    llama: tuple[Path, dict[str, LoRARequest]], backend: str
) -> None:
    base, adapters = llama
    order: list[LoRARequest | None] = [None, *adapters.values()] * 2
    prompts = prompts_for(len(order))
    shared = prompts[-1][:12]  # two more prompts share a prefix, under two adapters
    prompts += [[*shared, 7, 8, 9], [*shared, 250]]
    order += [adapters["attn"], adapters["all"]]
    max_tokens = [6 + (i % 4) * 2 for i in range(len(prompts))]
    expected = [
        peft_greedy(base, lora, [p], [m])[0] for p, m, lora in zip(prompts, max_tokens, order)
    ]
    watcher = AdaptersPerStep()
    with lora_llm(base, attention_backend=backend, **SMALL_ENGINE) as llm:
        runner = llm.llm_engine.runner
        # each backend's own shrink / expand: punica.py, or cpu_lora_punica.cpp
        assert runner.lora_manager.mapping.ops.name == backend
        # On the CPU backend the decode-only steps run the C++ decode loop, LoRA deltas and all.
        covered = backend == "cpu" and CpuDecodeLoop.supports(runner.model)
        assert (runner.decode_loop is not None) is covered
        counter = CountingReplay(runner.decode_loop)
        if covered:
            runner.decode_loop = counter
        llm.llm_engine.add_step_listener(watcher)
        assert greedy(llm, prompts, max_tokens, order) == expected
        stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert watcher.most == 2  # max_loras, with three adapters waiting
    assert (counter.calls > 0) is covered


def test_the_same_prompt_under_two_adapters_gives_each_adapter_s_answer(
    llama: tuple[Path, dict[str, LoRARequest]],
) -> None:
    """And the prefix cache serves neither from the other's blocks: the cache key holds the
    adapter (a 16-token prompt has 3 full blocks of 4 that would otherwise be hits)."""
    base, adapters = llama
    prompt = prompts_for(4)[3][:17]
    attn, mlp = adapters["attn"], adapters["mlp"]
    want = {name: peft_greedy(base, lora, [prompt], [8])[0] for name, lora in adapters.items()}
    want["base"] = peft_greedy(base, None, [prompt], [8])[0]
    assert len({tuple(v) for v in want.values()}) == 4  # the adapters do change the answer
    with lora_llm(base, attention_backend="reference", block_size=4) as llm:
        for lora, name in [(attn, "attn"), (mlp, "mlp"), (None, "base"), (attn, "attn")]:
            assert greedy(llm, [prompt], [8], [lora]) == [want[name]]
        stats = llm.get_stats()
    # Only the second "attn" run hits: its first (17 - 1) // 4 = 4 blocks, 16 tokens.
    assert stats.num_prefix_cache_hit_tokens == 16


def test_a_qwen2_base_with_q_k_v_biases_and_its_adapters_equal_peft(tmp_path: Path) -> None:
    base = save_base(tmp_path / "base", "qwen2")
    adapters = save_adapters(base, tmp_path)
    order = [None, *adapters.values()]
    prompts, max_tokens = prompts_for(4, seed=3), [8, 8, 8, 8]
    expected = [peft_greedy(base, lora, [p], [8])[0] for p, lora in zip(prompts, order)]
    with lora_llm(base, **SMALL_ENGINE) as llm:
        assert greedy(llm, prompts, max_tokens, order) == expected


def test_n_greater_than_one_runs_every_sample_under_the_request_s_adapter(
    llama: tuple[Path, dict[str, LoRARequest]],
) -> None:
    base, adapters = llama
    prompt = prompts_for(2)[1]
    expected = peft_greedy(base, adapters["all"], [prompt], [6])[0]
    params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
    with lora_llm(base, attention_backend="reference", **SMALL_ENGINE) as llm:
        (out,) = llm.generate(
            {"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=adapters["all"]
        )
    assert [list(o.token_ids) for o in out.outputs] == [expected] * 3


def test_aborted_requests_release_their_blocks_and_adapter_slots(
    llama: tuple[Path, dict[str, LoRARequest]],
) -> None:
    base, adapters = llama
    with lora_llm(base, attention_backend="reference", **SMALL_ENGINE) as llm:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        for i, lora in enumerate(adapters.values()):
            engine.add_request(str(i), {"prompt_token_ids": prompts_for(3)[i]}, params, None, lora)
        for _ in range(3):
            engine.step()
        assert len(engine.scheduler.active_lora_ids()) == 2  # the third waits for a slot
        engine.abort_request(["0", "1", "2"])
        engine.step()
        assert engine.scheduler.active_lora_ids() == set()
        assert_no_blocks_held(llm)
        # The freed slots serve the next requests.
        prompt = prompts_for(1)[0]
        assert greedy(llm, [prompt], [5], [adapters["mlp"]]) == peft_greedy(
            base, adapters["mlp"], [prompt], [5]
        )


def test_an_adapter_without_enable_lora_is_refused_by_name_and_the_engine_serves_on(
    llama: tuple[Path, dict[str, LoRARequest]],
) -> None:
    base, adapters = llama
    with checked_llm(model=str(base), skip_tokenizer_init=True, max_model_len=64,
                     cpu_kv_cache_space=0.01) as llm:  # fmt: skip
        with pytest.raises(LoRADisabledError, match="enable_lora=True"):
            greedy(llm, [[5, 6, 7]], [3], [adapters["attn"]])
        assert len(greedy(llm, [[5, 6, 7]], [3], [None])[0]) == 3


def test_a_lora_model_s_decode_steps_run_the_cpp_loop_where_the_base_model_s_do(
    llama: tuple[Path, dict[str, LoRARequest]],
) -> None:
    """The C++ decode loop declares the LoRA wrappers (`LAYER_WITH_LORA`): a LoRA model takes it
    wherever the same model without LoRA does, and every decode step of a request under an
    adapter runs there, with peft's tokens."""
    base, adapters = llama
    with checked_llm(model=str(base), skip_tokenizer_init=True, max_model_len=64,
                     cpu_kv_cache_space=0.01) as plain:  # fmt: skip
        covered = CpuDecodeLoop.supports(plain.llm_engine.runner.model)
        assert (plain.llm_engine.runner.decode_loop is not None) is covered
    with lora_llm(base) as llm:
        runner = llm.llm_engine.runner
        assert runner.backend.name == "cpu" and (runner.decode_loop is not None) is covered
        counter = CountingReplay(runner.decode_loop)
        if covered:
            runner.decode_loop = counter
        prompt = prompts_for(1)[0]
        assert greedy(llm, [prompt], [6], [adapters["all"]]) == peft_greedy(
            base, adapters["all"], [prompt], [6]
        )
    assert counter.calls == (5 if covered else 0)  # one prefill step, then five decode steps


def test_slots_and_host_copies_evict_the_least_recently_used_adapter(
    llama: tuple[Path, dict[str, LoRARequest]],
) -> None:
    """One device slot and two host copies for three adapters: each step's adapter takes the
    slot, the host LRU drops the oldest, and an adapter read again from its folder (or copied
    back into the slot) still gives peft's tokens."""
    base, adapters = llama
    prompt = prompts_for(2)[1]
    with lora_llm(base, attention_backend="reference", max_loras=1, max_cpu_loras=2) as llm:
        manager = llm.llm_engine.runner.lora_manager
        assert manager is not None
        for name in ["attn", "mlp", "all", "attn"]:
            lora = adapters[name]
            assert greedy(llm, [prompt], [5], [lora]) == peft_greedy(base, lora, [prompt], [5])
            assert dict(manager.slots) == {lora.lora_int_id: 0}
        # attn was re-read after "all" pushed it out of host memory; mlp is now the oldest gone.
        assert list(manager.cpu_loras) == [
            adapters["all"].lora_int_id,
            adapters["attn"].lora_int_id,
        ]


def test_beam_search_runs_every_beam_under_the_request_s_adapter(
    llama: tuple[Path, dict[str, LoRARequest]],
) -> None:
    """`LLM.beam_search(..., lora_request=)`: the beams forked from a request keep its adapter,
    so the best beams are those of the peft model (the independent beam reference of
    tests/engine/test_beam_search.py, on peft's forward), not the base model's."""
    from peft import PeftModel

    base, adapters = llama
    prompt = prompts_for(2)[1]
    peft = PeftModel.from_pretrained(load_base(base), adapters["attn"].lora_path).eval()
    want = reference_best(peft, prompt, width=2, steps=4)
    assert want != pytest.approx(reference_best(load_base(base), prompt, 2, 4), abs=TOL)
    with lora_llm(base, attention_backend="cpu") as llm:
        out = llm.beam_search(
            {"prompt_token_ids": prompt},
            BeamSearchParams(2, max_tokens=4, ignore_eos=True),
            lora_request=adapters["attn"],
        )
        assert_no_blocks_held(llm)
    assert [b.cum_logprob for b in out[0].sequences] == pytest.approx(want, abs=TOL)

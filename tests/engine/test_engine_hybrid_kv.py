"""Gemma 2 and 3 on the hybrid KV cache: the windowed layers' blocks are freed, the global layers'
kept, and the tokens stay transformers' greedy ones.

The tiny checkpoints of tests/model/test_model_gemma.py (layers: window 8, global, window 8) in blocks
of 4 slots run on `HybridKVCacheCoordinator`: three KV cache groups of one layer each, one pool.
A step listener checks every committed step: a sequence's global group holds every block of it,
each windowed group at most the window behind the step's chunk, ceil((W - 1 + chunk) / 4) + 1
blocks (W / 4 + 1 on a decode), whatever the generation's length. Layouts with two layers a
group (Gemma 2 of 4 layers, Gemma 3's 3:1 of 8) hold each layer to its own cache slot and its
group's tables, under preemption and chunking. Parallel samples and beams fork in every group;
an abort and a failed step leave every block in the pool and no name behind; the Triton kernels
(in the interpreter) and the engine-core process run it too; the trace and `bench memory` show
the groups. What does not run on it is refused by name: speculative decoding, and a
max_model_len that one request cannot hold in the pool.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM, BeamSearchParams, SamplingParams
from minivllm.core.kv_cache_coordinator import HybridBlockPoolSnapshot, HybridKVCacheCoordinator
from minivllm.core.scheduler import SchedulerOutput
from minivllm.engine.step_listener import StepOutputs
from minivllm.worker.hybrid_model_runner import HybridModelRunner
from tests.model.test_model_gemma import WINDOW, engine_prompts, save_gemma
from tests.utils.engine_utils import assert_no_blocks_held, checked_llm, hf_greedy
from tests.utils.faults import FaultInjector, clear_fault, inject_fault

BS = 4
LONG = dict(
    skip_tokenizer_init=True,
    block_size=BS,
    max_model_len=128,
    max_num_batched_tokens=16,
    max_num_seqs=8,
)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf, path = save_gemma(tmp_path_factory.mktemp(request.param), request.param)
    return hf, path


class GroupWatcher:
    """After every step: the global group holds ceil(computed / 4) blocks of each sequence, each
    windowed group at most ceil((W - 1 + chunk) / 4) + 1, W / 4 + 1 after a decode."""

    def __init__(self) -> None:
        self.peak_global = self.peak_windowed = self.peak_windowed_decoding = 0
        self.chunk: dict[int, int] = {}  # seq_id -> its last step's new tokens

    def on_step(self, sched: SchedulerOutput, outputs: StepOutputs, blocks: Any) -> None:
        assert isinstance(blocks, HybridBlockPoolSnapshot) and len(blocks.other_groups) == 2
        self.chunk |= {item.seq_id: item.num_new_tokens for item in sched.scheduled}
        for seq_id, table in blocks.block_tables.items():
            computed = outputs.seqs[seq_id].num_computed_tokens
            assert len(table) == -(-computed // BS) and seq_id not in blocks.num_skipped_blocks
            self.peak_global = max(self.peak_global, len(table))
            chunk = self.chunk.get(seq_id, 16)  # a fork not yet run: its parent's, a budget
            for group in blocks.other_groups:
                held = len(group.block_tables[seq_id]) - group.num_skipped_blocks.get(seq_id, 0)
                assert held <= -(-(WINDOW - 1 + chunk) // BS) + 1, (seq_id, chunk, held)
                self.peak_windowed = max(self.peak_windowed, held)
                if chunk == 1:
                    self.peak_windowed_decoding = max(self.peak_windowed_decoding, held)
        assert blocks.num_free_blocks + len(blocks.ref_counts) == blocks.num_blocks


def watched(llm: LLM) -> GroupWatcher:
    assert isinstance(llm.llm_engine.kv_cache_manager, HybridKVCacheCoordinator)
    watcher = GroupWatcher()
    llm.llm_engine.add_step_listener(watcher)
    return watcher


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_long_generation_keeps_the_window_in_the_windowed_groups_only(
    gemma: Any, backend: str
) -> None:
    """99 tokens computed: the global group ends with 25 blocks, each windowed group never holds
    more than 3 (W / 4 + 1) while decoding, and the tokens are transformers'."""
    hf, path = gemma
    prompt = list(range(3, 13))
    expected = hf_greedy(hf, prompt, 90, None)
    with checked_llm(model=str(path), attention_backend=backend, num_gpu_blocks_override=48, **LONG) as llm:  # fmt: skip
        watcher = watched(llm)
        runner = llm.llm_engine.runner
        assert isinstance(runner, HybridModelRunner) and runner.kv_cache.shape[0] == 1
        assert runner.decode_loop is None  # the C++ loop has no window
        params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == expected
    assert watcher.peak_global == 25
    assert watcher.peak_windowed_decoding == WINDOW // BS + 1 == 3
    assert watcher.peak_windowed == 3  # the 10-token prompt's blocks 0..2 too


def test_parallel_samples_and_beams_fork_in_every_group(gemma: Any) -> None:
    from tests.engine.test_beam_search import TOL, reference_best, score_tokens

    hf, path = gemma
    prompt = list(range(20, 31))
    with checked_llm(model=str(path), num_gpu_blocks_override=64, **LONG) as llm:
        watched(llm)
        greedy = SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
        expected = hf_greedy(hf, prompt, 20, None)
        assert [list(c.token_ids) for c in out.outputs] == [expected] * 3
        (beams,) = llm.beam_search(
            [{"prompt_token_ids": prompt}], BeamSearchParams(3, max_tokens=12, ignore_eos=True)
        )
        want = reference_best(hf, prompt, 3, 12)
        assert [b.cum_logprob for b in beams.sequences] == pytest.approx(want, abs=TOL)
        for beam in beams.sequences:
            assert beam.cum_logprob == pytest.approx(score_tokens(hf, beam.tokens, 11), abs=TOL)


def test_an_abort_and_a_failed_step_leave_every_block_and_no_name_behind(gemma: Any) -> None:
    hf, path = gemma
    prompts, max_tokens, expected = engine_prompts(hf)
    with checked_llm(model=str(path), num_gpu_blocks_override=64, **LONG) as llm:
        engine = llm.llm_engine
        manager = engine.kv_cache_manager
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        engine.add_request("aborted", {"prompt_token_ids": prompts[5]}, params)
        for _ in range(12):
            engine.step()
        assert manager.num_held_blocks()[1] > 0
        engine.abort_request("aborted")
        engine.step()
        assert_no_blocks_held(llm)
        # A step that fails after the model wrote its K/V, as a prompt chunk names full blocks.
        names_before = set(manager.block_pool.cached_block_hash_to_block)
        fault = inject_fault(
            engine,
            FaultInjector(
                "after_model",
                RuntimeError("injected"),
                lambda s: any(i.num_new_tokens > 4 for i in s.scheduled),
            ),
        )
        engine.add_request("failed", {"prompt_token_ids": prompts[4]}, params)
        outs = engine.step()
        assert fault.fired and outs[0].error == "RuntimeError: injected"
        assert set(manager.block_pool.cached_block_hash_to_block) == names_before
        assert_no_blocks_held(llm)
        clear_fault(engine)
        greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_a_repeated_prompt_hits_the_cache_in_every_group(gemma: Any) -> None:
    hf, path = gemma
    prompt = list(range(40, 70))
    with checked_llm(model=str(path), num_gpu_blocks_override=64, **LONG) as llm:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        # The windowed groups freed the prompt's first blocks during the first request: their
        # names are kept, and the last blocks before the hit are all a windowed query needs.
        second = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 28)
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        assert list(first.outputs[0].token_ids) == hf_greedy(hf, prompt, 30, None)


def test_triton_kernels_in_the_interpreter_run_the_hybrid_cache(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    hf, path = save_gemma(tmp_path, "gemma2")
    prompts = [list(range(3, 14)), list(range(50, 59))]
    expected = [hf_greedy(hf, p, 14, None) for p in prompts]
    with checked_llm(model=str(path), attention_backend="triton", num_gpu_blocks_override=48, **LONG) as llm:  # fmt: skip
        watched(llm)
        params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_the_engine_core_process_runs_the_hybrid_cache(tmp_path: Path) -> None:
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.core_client import AsyncMPClient, EngineCoreClient

    hf, path = save_gemma(tmp_path, "gemma3")
    prompt = list(range(3, 15))
    expected = hf_greedy(hf, prompt, 24, None)
    config = EngineArgs(model=str(path), num_gpu_blocks_override=48, **LONG).create_engine_config()  # type: ignore[arg-type]
    client = AsyncMPClient(EngineCoreClient(config, torch_threads=1))

    async def run() -> list[int]:
        client.start()
        out: asyncio.Queue[Any] = asyncio.Queue()
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        client.add_request("r", {"prompt_token_ids": prompt}, params, out)
        while True:
            item = await asyncio.wait_for(out.get(), timeout=120)
            assert not isinstance(item, BaseException), item
            if item.finished:
                return list(item.outputs[0].token_ids)

    try:
        assert asyncio.run(run()) == expected
        stats = client.stats  # the core's, after its last step
        assert stats.num_free_kv_blocks == stats.num_kv_blocks == 48
    finally:
        client.shutdown()


def test_speculation_on_the_hybrid_cache_keeps_greedy_and_a_windowed_draft_is_refused(
    gemma: Any,
) -> None:
    """n-gram drafts of one token's match (they fire at most steps) take lookahead slots in every
    group and give the rejected ones back, under preemption; a draft model with windowed layers
    would need groups of its own and is refused by name."""
    hf, path = gemma
    prompts = [list(range(3, 13)), list(range(40, 47)), [*range(3, 13), 99, 98]]
    expected = [hf_greedy(hf, p, 60, None) for p in prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with checked_llm(model=str(path), speculative_config=spec, num_gpu_blocks_override=48, **LONG) as llm:  # fmt: skip
        watcher = watched(llm)
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        stats = llm.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.num_preemptions > 0
    assert watcher.peak_windowed <= -(-(WINDOW - 1 + 16) // BS) + 1
    draft = {"model": str(path), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="a draft model with sliding-window layers"):
        LLM(str(path), speculative_config=draft, num_gpu_blocks_override=48, **LONG)


def test_what_cannot_run_on_the_hybrid_cache_is_refused_by_name(gemma: Any) -> None:
    _, path = gemma
    # One request of 128 tokens needs 32 global blocks and 2 x 7 windowed ones (a window of 8
    # behind a 16-token chunk); 40 blocks hold 104 tokens (26 + 14), and an unset max_model_len
    # is lowered to that.
    with pytest.raises(ValueError, match=r"max_model_len \(128\) .* \(104 tokens in 40 blocks"):
        LLM(str(path), num_gpu_blocks_override=40, **LONG)
    llm = LLM(str(path), num_gpu_blocks_override=40, **(LONG | {"max_model_len": None}))
    assert llm.llm_engine.max_model_len == 104


def test_the_trace_draws_every_groups_table_and_the_windowed_groups_freed_entries(
    tmp_path: Path,
) -> None:
    """The trace keeps a table per group (`group_block_tables` beside `block_tables`), a
    window-freed entry as null, and the reference counts of every group's blocks; the page
    draws a row per group, the freed entries as freed (docs/trace.md)."""
    _, path = save_gemma(tmp_path / "model", "gemma2")
    with checked_llm(model=str(path), num_gpu_blocks_override=48, **LONG) as llm:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        with llm.trace() as recorder:
            llm.generate([{"prompt_token_ids": list(range(3, 23))}], params, use_tqdm=False)
    trace = recorder.to_dict()
    assert trace["kv_cache_groups"] == [
        {"sliding_window": None, "layers": [1]},
        {"sliding_window": WINDOW, "layers": [0]},
        {"sliding_window": WINDOW, "layers": [2]},
    ]
    step = trace["steps"][-2]  # the last before the finish: 48 tokens computed
    ((seq, table),) = step["block_tables"].items()
    assert len(table) == 12 and None not in table
    for group in step["group_block_tables"]:
        # The query at 47 saw keys 40..47: blocks 10 and 11, the 10 before freed.
        assert group[seq][:10] == [None] * 10 and None not in group[seq][10:]
    for s in trace["steps"]:
        tables = [s["block_tables"], *s["group_block_tables"]]
        held = [b for g in tables for t in g.values() for b in t if b is not None]
        assert sorted(map(int, s["ref_counts"])) == sorted(held)  # one group's each
    page_path = recorder.save(tmp_path / "trace")
    from minivllm.trace.screenshot import launch_browser

    with launch_browser() as browser:
        tab = browser.new_page()
        errors: list[str] = []
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.goto(f"{page_path.resolve().as_uri()}#step={step['step']}")
        tab.wait_for_selector("#grid .block")
        rows = tab.locator("#tables .seqrow").evaluate_all("rs => rs.map(r => r.dataset.group)")
        outside = tab.locator("#tables .lblock.outside").count()
        windowed_block = step["group_block_tables"][0][seq][10]
        owners = tab.locator(f"#grid .block[data-block='{windowed_block}']").get_attribute(
            "data-owners"
        )
    assert errors == []
    assert rows == ["0", "1", "2"] and outside == 20 and owners == seq


def test_bench_memory_reports_each_groups_peak(tmp_path: Path) -> None:
    """`minivllm bench memory` on four requests of 40 tokens out: the windowed groups' peaks stay
    at their windows (4 sequences x at most ceil((8 - 1 + 32) / 4) + 1 blocks), below the global's."""
    from minivllm.benchmarks import memory
    from tests.utils.engine_utils import parse_bench_args

    _, path = save_gemma(tmp_path / "model", "gemma3")
    out = tmp_path / "memory.json"
    argv = ["--model", str(path), "--skip-tokenizer-init", "--num-prompts", "4"]
    argv += ["--input-len", "8-20", "--output-len", "40", "--num-gpu-blocks-override", "64"]
    argv += ["--max-model-len", "96", "--block-size", "4", "--max-num-batched-tokens", "32"]
    argv += ["--max-num-seqs", "4", "--plot", str(tmp_path / "kv.png"), "--json", str(out)]
    assert memory.main(parse_bench_args(memory, argv)) == 0
    global_group, *windowed = json.loads(out.read_text())["results"]["minivllm"]["kv_cache_groups"]
    assert global_group["sliding_window"] is None and len(windowed) == 2
    for group in windowed:
        assert group["sliding_window"] == WINDOW
        assert group["peak_blocks"] <= 4 * (-(-(WINDOW - 1 + 32) // BS) + 1)
        assert group["peak_blocks"] < global_group["peak_blocks"]


@pytest.mark.parametrize(
    ("family", "layers"),
    [
        ("gemma2", ["sliding_attention", "full_attention"] * 2),  # groups (1, 3), (0, 2)
        # 6 windowed : 2 global -> groups of 2: (3, 7), then (0, 4), (1, 5), (2, 6)
        ("gemma3", (["sliding_attention"] * 3 + ["full_attention"]) * 2),
    ],
)
def test_groups_of_several_layers_share_the_cache_slot_by_slot(
    tmp_path: Path, family: str, layers: list[str]
) -> None:
    """Layer i writes and reads slot j, its place in its group, through its group's tables:
    with two layers a group, every slot of a block belongs to another layer, and a layer that
    read another's slot or table would change the tokens."""
    hf, path = save_gemma(tmp_path, family, layer_types=layers, num_hidden_layers=len(layers))
    prompts, max_tokens, expected = engine_prompts(hf)
    with checked_llm(
        model=str(path), skip_tokenizer_init=True, block_size=BS, num_gpu_blocks_override=36,
        max_model_len=56, max_num_batched_tokens=16, max_num_seqs=6,
    ) as llm:  # fmt: skip
        engine = llm.llm_engine
        runner = engine.runner
        assert isinstance(runner, HybridModelRunner) and runner.kv_cache.shape[0] == 2
        groups = [g.layer_ids for g in engine.kv_cache_manager.kv_cache_groups]  # type: ignore[attr-defined]
        assert groups[0] == tuple(i for i, k in enumerate(layers) if k == "full_attention")
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        assert engine.scheduler.num_preemptions > 0

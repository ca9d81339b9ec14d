"""Two pipeline stages of every family in the model registry give one process's greedy tokens,
and transformers' (paper §4.6; the issue's done-when for pipeline parallelism).

Each family's whole module tree is built, and `keep_stage` (minivllm/model/pipeline.py) puts a
`PPMissingLayer` where the other stage holds the part, so each family meets the split in its own
way: Qwen2's tied LM head lives on the last stage, which has no embedding, so the table is loaded
into the LM head there; Phi-3's fused checkpoint tensors and Mixtral's per-expert tensors are
dropped for the layers of the other stage (`stage_target`), Qwen3-MoE's experts sit on the stage
of their layer; Gemma 2 and 3 scale the embedding on stage 0 only, add each layer's residual
inside the layer (one tensor travels between stages, not two) and keep their windowed and global
layers in KV cache groups across the stages (each stage fills a group's slots with its own
layers: global; window | window); Gemma 3's q/k norms go with their layer, and both its RoPE
tables (local and global bases) are on every stage. The tiny families have 2 layers (1 + 1), the
Gemmas 3 (2 + 1).

Every family runs two prompts, Gemma 2 six through a KV pool small enough to preempt, with
chunked prefill and shared prefixes (SMALL_ENGINE of tests/model/test_model_families.py); the
single-process engine runs them in this process, the two stages run over gloo, spawned by the
engine, and both must give transformers' tokens; each stage must hold exactly its parts (asked of
every rank). The
Llama family's stages (with tensor parallelism, uneven partitions, batches in flight and failures)
are tests/distributed/test_pipeline_parallel.py's; the bundled SmolLM2 over two torchrun nodes is
tests/distributed/test_multinode.py's. A pooling model (BERT's encoder, a cross-encoder, a
classifier made of a causal LM) is not split: it is refused by name before any process starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM
from minivllm.distributed.pipeline import stage_sizes
from tests.distributed.test_tensor_parallel import tp_llm
from tests.model.test_model_families import (
    SMALL_ENGINE,
    greedy,
    prompts_and_oracle,
    save_family,
    small_engine_workload,
)
from tests.model.test_model_gemma import save_gemma
from tests.utils.pooling_utils import save_tiny_bert
from tests.utils.tp_utils import live_descendants, no_leftover_processes, stage_parts

pytestmark = pytest.mark.timeout(600)  # a hang guard for a broken send; no timing

# One family per model class of the registry that generates (Mistral is Llama's class: see
# test_pipeline_parallel.py), each with two prompts; Gemma 2, whose KV cache groups meet the
# stages, with SMALL_ENGINE's workload, which preempts, chunks and hits the prefix cache (the
# Llama tests hold every stage layout to that too). The Gemmas' three groups need a larger pool.
FAMILIES = ["qwen2-tied", "qwen3-hd32", "phi3", "mixtral", "qwen3-moe", "gemma2", "gemma3"]
GEMMA_ENGINE = SMALL_ENGINE | dict(num_gpu_blocks_override=40, max_model_len=52)


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield from no_leftover_processes()


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stages_give_one_process_s_and_transformers_greedy_tokens(
    tmp_path: Path, family: str
) -> None:
    if family.startswith("gemma"):
        hf, path = save_gemma(tmp_path, family)
        engine: dict[str, Any] = dict(GEMMA_ENGINE)
    else:
        hf, path = save_family(tmp_path, family)
        engine = dict(max_model_len=64)
    if family == "gemma2":
        prompts, max_tokens, expected = small_engine_workload(hf)
    else:
        prompts, max_tokens, expected = prompts_and_oracle(hf, count=2)
    engine |= dict(skip_tokenizer_init=True, cpu_kv_cache_space=0.01)
    with tp_llm(path, 1, **engine) as one:
        single = greedy(one, prompts, max_tokens)
    with tp_llm(path, 1, pipeline_parallel_size=2, **engine) as llm:
        parts = llm.llm_engine.executor.collective_rpc(stage_parts)
        got = greedy(llm, prompts, max_tokens)
        stats = llm.get_stats()
    n = hf.config.num_hidden_layers
    first = stage_sizes(n, 2)[0]
    assert parts == [
        dict(layers=list(range(first)), embed=True, norm=False, lm_head=False),
        dict(layers=list(range(first, n)), embed=False, norm=True, lm_head=True),
    ]
    assert single == expected
    assert got == expected
    if family == "gemma2":
        assert stats.num_preemptions > 0 and stats.num_prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("num_labels", [None, 1], ids=["bert-embedding", "bert-cross-encoder"])
def test_a_pooling_model_over_two_stages_is_refused_by_name_before_any_process(
    tmp_path: Path, num_labels: int | None
) -> None:
    path = save_tiny_bert(tmp_path, num_labels=num_labels)
    before = set(live_descendants())
    with pytest.raises(ValueError, match="runner='pooling' is not supported with pipeline_paral"):
        LLM(str(path), pipeline_parallel_size=2)
    assert set(live_descendants()) == before  # no worker was started

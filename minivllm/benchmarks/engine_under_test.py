"""What the `minivllm bench` commands share besides the workload (workload.py), the report
(report.py) and the machine's limits (machine.py): the engine under test and a loop that drives it
step by step, the model's cost in FLOPs and bytes, each tensor-parallel rank's share.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm.benchmarks.workload import BenchRequest, fixed_params, random_requests
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.beam_search import BeamSearchParams
from minivllm.llm import LLM
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.weights import weight_bytes
from minivllm.sampling_params import SamplingParams
from minivllm.worker.worker_proc import RankReport, rank_report

GPU_EPILOG = """\
On a GPU (TinyLlama, bfloat16, Triton attention):
  minivllm bench {name} --model TinyLlama/TinyLlama-1.1B-Chat-v1.0 --dtype bfloat16 \\
      --device cuda --attention-backend triton{extra}
"""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What every offline bench takes besides the engine's flags (EngineArgs.add_cli_args)."""
    g = parser.add_argument_group("run")
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for every system (unset: torch's); 1 is far faster on a "
        "CPU that other jobs share, where threads wait on each other at every op",
    )
    g.add_argument("--json", type=Path, default=None, help="also write the results to this file")


def build_llm(args: argparse.Namespace, **overrides: Any) -> LLM:
    """The engine under test, from the engine's flags; `overrides` are a run's own settings."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), **overrides)
    return LLM(**dataclasses.asdict(engine_args))


def workload_for(llm: LLM, args: argparse.Namespace) -> list[BenchRequest]:
    """The random dataset of `--num-prompts`, `--input-len`, `--output-len` and `--seed`, its token
    ids drawn clear of the engine's tokenizer's special tokens."""
    tok = llm.get_tokenizer()
    return random_requests(
        args.num_prompts,
        args.input_len,
        args.output_len,
        llm.llm_engine.vocab_size,
        args.seed,
        getattr(tok, "all_special_ids", ()),
    )


def warm_up(llm: LLM) -> None:
    """One tiny untimed run: first-call allocations and kernel selection stay out of the timings."""
    vocab = llm.llm_engine.vocab_size
    prompts = [{"prompt_token_ids": [(7 * i + 1) % vocab for i in range(n)]} for n in (5, 37)]
    llm.generate(prompts, fixed_params(4), use_tqdm=False)


def prompts_of(requests: Sequence[BenchRequest]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": r.prompt_token_ids} for r in requests]


def drive_engine(
    llm: LLM,
    requests: Sequence[BenchRequest],
    params: Sequence[SamplingParams | BeamSearchParams],
    before_step: Callable[[], object] | None = None,
    after_step: Callable[[], object] | None = None,
    desc: str = "steps",
) -> int:
    """Run the requests through `llm.llm_engine` one `step()` at a time (what `LLM.generate` does),
    calling the hooks around each step so that a benchmark can read the scheduler and the block
    manager between steps. Returns the number of output tokens."""
    from tqdm.auto import tqdm

    engine = llm.llm_engine
    base = f"bench-{time.monotonic_ns()}-"
    for i, (r, p) in enumerate(zip(requests, params)):
        engine.add_request(base + str(i), {"prompt_token_ids": r.prompt_token_ids}, p)
    generated = 0
    with tqdm(total=len(requests), desc=desc, unit="req") as bar:
        while engine.has_unfinished_requests():
            if before_step is not None:
                before_step()
            outputs = engine.step()
            if after_step is not None:
                after_step()
            for out in outputs:
                if out.finished:
                    bar.update(1)
                    generated += sum(len(o.token_ids) for o in out.outputs)
    return generated


# ---------------------------------------------------------------------------------- the model's cost
@dataclass
class ModelCost:
    """Parameter counts that turn tokens into FLOPs (2 FLOPs per parameter per token) and bytes."""

    body_params: int  # every matmul weight a token passes through, LM head and embedding excluded
    lm_head_params: int  # vocab * hidden: only rows that are sampled pay for it
    weight_bytes: int  # all weights, read once per decode step (tied embedding counted once)
    kv_bytes_per_token: int  # K and V of all layers

    @classmethod
    def of(cls, llm: LLM) -> ModelCost:
        """The whole model's counts, whatever share of it this process holds: they are taken from
        the model built on the `meta` device (no memory), at tensor_parallel_size 1."""
        engine = llm.llm_engine
        cfg = engine.model.config
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, engine.runner.backend)
        total = sum(p.numel() for p in model.parameters())  # shared (tied) tensors count once
        embed = model.model.embed_tokens.weight.numel()
        lm_head = model.lm_head.weight.numel()
        body = total - embed - (0 if cfg.tie_word_embeddings else lm_head)
        elem = torch.empty((), dtype=engine.dtype).element_size()
        kv_elem = torch.empty((), dtype=engine.kv_cache_dtype).element_size()  # kv_cache_dtype
        kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_elem
        stored = total * elem  # a GGUF model's blocks: the bytes it holds (one device only)
        if engine.config.resolved.quantization == "gguf":
            stored = weight_bytes(engine.model)
        return cls(body, lm_head, stored, kv)

    def useful_flops(self, requests: Sequence[BenchRequest], n: int = 1) -> float:
        """The least work any engine must do: every prompt token and every output token but the
        last goes through the body once; the LM head runs once per sampled token."""
        body_tokens = sum(len(r.prompt_token_ids) + n * (r.output_len - 1) for r in requests)
        head_rows = sum(n * r.output_len for r in requests)
        return 2.0 * (self.body_params * body_tokens + self.lm_head_params * head_rows)


# ---------------------------------------------------------------------------------- the ranks
def rank_reports(llm: LLM) -> list[RankReport]:
    """Each rank's weights, KV cache and bytes communicated so far (one row at N = 1)."""
    return llm.llm_engine.executor.collective_rpc(rank_report)


def tensor_parallel_rows(
    before: Sequence[RankReport],
    after: Sequence[RankReport],
    requests: Sequence[BenchRequest],
) -> list[dict[str, Any]]:
    """Per rank: memory held, and payload bytes put into collectives between `before` and `after`
    per token of useful work (every prompt token and every output token but the last passes the
    model once; recomputation after preemption is paid on top) and per sampled token."""
    body_tokens = sum(len(r.prompt_token_ids) + r.output_len - 1 for r in requests)
    sampled = sum(r.output_len for r in requests)
    return [
        {
            "rank": a.rank,
            "weight_bytes": a.weight_bytes,
            "kv_cache_bytes": a.kv_cache_bytes,
            "kv_blocks": a.num_kv_blocks,
            "heads": a.num_heads,
            "kv_heads": a.num_kv_heads,
            "all_reduce_bytes_per_token": (a.all_reduce_bytes - b.all_reduce_bytes) / body_tokens,
            "gather_bytes_per_sampled_token": (a.gather_bytes - b.gather_bytes) / sampled,
        }
        for b, a in zip(before, after)
    ]

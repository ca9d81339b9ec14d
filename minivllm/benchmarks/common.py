"""What the `minivllm bench` commands share: the workload, the engine under test, the peers'
model, the machine's limits (matmul FLOP/s, copy bandwidth), timing, tables and JSON.

The workload is vLLM's `random` dataset (vllm/benchmarks/datasets.py, `RandomDataset`): prompts of
random token ids with lengths drawn uniformly from a range, each run to exactly its drawn output
length (`ignore_eos=True`), so that every system computes the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm.beam_search import BeamSearchParams
from minivllm.distributed.worker import RankReport, rank_report
from minivllm.engine_args import EngineArgs
from minivllm.entrypoints.cli import HelpFormatter
from minivllm.llm import LLM
from minivllm.model.llama import LlamaForCausalLM
from minivllm.sampling_params import SamplingParams

GPU_EPILOG = """\
On a GPU (TinyLlama, bfloat16, Triton attention):
  minivllm bench {name} --model TinyLlama/TinyLlama-1.1B-Chat-v1.0 --dtype bfloat16 \\
      --device cuda --attention-backend triton{extra}
"""


# ---------------------------------------------------------------------------------- the workload
@dataclass
class BenchRequest:
    prompt_token_ids: list[int]  # (input_len,)
    output_len: int  # exact number of tokens to generate (EOS is ignored)


def length_range(text: str) -> tuple[int, int]:
    """argparse type: "128" (fixed) or "16-256" / "16:256" (uniform, inclusive)."""
    parts = text.replace(":", "-").split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(
            f"expected N or MIN-MAX with 1 <= MIN <= MAX, got {text!r}"
        )
    return lo, hi


def random_requests(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int,
    special_ids: Sequence[int] = (),
) -> list[BenchRequest]:
    """vLLM's random dataset: uniform lengths, uniform token ids (special tokens left out, so that
    no prompt carries a stray BOS/EOS)."""
    rng = random.Random(seed)
    special = set(special_ids)
    pool = [t for t in range(vocab_size) if t not in special]
    return [
        BenchRequest(
            [rng.choice(pool) for _ in range(rng.randint(*input_len))], rng.randint(*output_len)
        )
        for _ in range(num_prompts)
    ]


def fixed_params(output_len: int, **kwargs: Any) -> SamplingParams:
    """Exactly `output_len` tokens, greedy unless told otherwise."""
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=output_len, ignore_eos=True, **kwargs)


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


def add_workload_arguments(
    parser: argparse.ArgumentParser, num_prompts: int, input_len: str, output_len: str
) -> None:
    g = parser.add_argument_group(
        "workload (vLLM's random dataset)", "drawn with the engine's --seed"
    )
    g.add_argument("--num-prompts", type=int, default=num_prompts, help="requests in the workload")
    g.add_argument(
        "--input-len",
        type=length_range,
        default=input_len,  # argparse passes a string default through `type`
        help="prompt tokens: N, or MIN-MAX drawn uniformly",
    )
    g.add_argument(
        "--output-len",
        type=length_range,
        default=output_len,
        help="output tokens, each request run to exactly its own: N, or MIN-MAX",
    )


def build_llm(args: argparse.Namespace, **overrides: Any) -> LLM:
    """The engine under test, from the engine's flags; `overrides` are a run's own settings."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), **overrides)
    return LLM(**dataclasses.asdict(engine_args))


def workload_for(llm: LLM, args: argparse.Namespace) -> list[BenchRequest]:
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
        kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem
        return cls(body, lm_head, total * elem, kv)

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


# ---------------------------------------------------------------------------------- machine limits
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(
    dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 5
) -> float:
    """Dense FLOP/s of the machine for `dtype`: the best of several large square matmuls."""
    if device.type == "cuda":
        size = max(size, 8192)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up
    best = float("inf")
    inner = 3
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b)
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / inner)
    return 2.0 * size**3 / best


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes/s a device-to-device copy moves (read + write), the best of several."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * nbytes / best


# ---------------------------------------------------------------------------------- peers' model
def load_hf_model(name: str | None, dtype: torch.dtype, device: torch.device) -> Any:
    """transformers' own model from the same folder minivllm loads (GGUF: its converted copy)."""
    from transformers import AutoModelForCausalLM

    from minivllm.model.loader import resolve_model

    path = resolve_model(name).path
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


# ---------------------------------------------------------------------------------- timing, output
@contextmanager
def timed(device: torch.device, into: dict[str, float], key: str = "seconds") -> Iterator[None]:
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    into[key] = time.perf_counter() - start


def machine_load() -> str:
    """The 1-minute load average and core count: timings on a shared machine need it beside them."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return f"{os.cpu_count()} cores"
    return f"load {load:.2f} on {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(
        h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))
    )
    print(line)
    print("-" * len(line))
    for row in cells:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
        )


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"results written to {path}")


def set_epilog(parser: argparse.ArgumentParser, epilog: str) -> None:
    """Show the GPU invocation under --help, whoever built the parser (the CLI or `-m`)."""
    parser.epilog = epilog
    parser.formatter_class = HelpFormatter


def run_main(
    add_arguments: Callable[[argparse.ArgumentParser], None],
    main: Callable[[argparse.Namespace], int],
    doc: str | None,
) -> int:
    """`python -m minivllm.benchmarks.<name>`: the same arguments the CLI wires in."""
    parser = argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_arguments(parser)
    return main(parser.parse_args())

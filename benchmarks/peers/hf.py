"""The peers of `minivllm bench throughput`: transformers' static batching and its own continuous
batching, each run on the bench's workload in a process of its own (see isolated.py).

  hf-static   `generate` on fixed batches with left padding: a batch decodes until its longest
              request is done (the paper's HF baseline); only each request's own tokens count
  hf-cb       transformers' continuous batching with its paged cache (its manager API), each
              request with its own `max_new_tokens`
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from minivllm.benchmarks.isolated import current_rss_bytes, peak_rss_bytes
from minivllm.benchmarks.machine import timed
from minivllm.benchmarks.workload import BenchRequest


def load_hf_model(name: str | None, dtype: torch.dtype, device: torch.device) -> Any:
    """transformers' own model from the same folder minivllm loads (GGUF: its converted copy)."""
    from transformers import AutoModelForCausalLM

    from minivllm.model.loader import resolve_model

    path = resolve_model(name).path
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


def peer_process(
    args: argparse.Namespace,
    requests: Sequence[BenchRequest],
    peer: str,
    batch_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """One peer's row, in a fresh process: load transformers' model, warm up, run, peak RSS."""
    if args.threads:
        torch.set_num_threads(args.threads)
    start_rss = current_rss_bytes()
    model = load_hf_model(args.model, dtype, device)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = model.config.eos_token_id if model.config.eos_token_id is not None else 0
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    warm_up_hf(model, pad_id)
    if peer == "hf-static":
        row = run_hf_static(model, requests, batch_size, pad_id)
    else:
        row = run_hf_cb(model, requests, args.max_num_batched_tokens, pad_id)
    return {**row, "peak_rss_bytes": peak_rss_bytes(), "start_rss_bytes": start_rss}


def run_hf_static(
    model: Any, requests: Sequence[BenchRequest], batch_size: int, pad_id: int
) -> dict[str, Any]:
    """Fixed batches in arrival order, left-padded; each batch generates its longest output."""
    device = model.device
    useful = 0
    generated = 0
    t: dict[str, float] = {}
    bar = tqdm(total=len(requests), desc=f"hf-static (batch {batch_size})", unit="req")
    with timed(device, t), torch.no_grad():
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = [[pad_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
            mask = [
                [0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                for r in batch
            ]
            longest = max(r.output_len for r in batch)
            out = model.generate(
                torch.tensor(ids, device=device),
                attention_mask=torch.tensor(mask, device=device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
            generated += (out.shape[1] - width) * len(batch)
            useful += sum(r.output_len for r in batch)
            bar.update(len(batch))
    bar.close()
    return {
        "system": f"hf-static (batch {batch_size})",
        "seconds": t["seconds"],
        "output_tokens": useful,
        "output_tokens_per_s": useful / t["seconds"],
        "generated_tokens_incl_padding": generated,
    }


def run_hf_cb(
    model: Any, requests: Sequence[BenchRequest], max_batch_tokens: int, pad_id: int
) -> dict[str, Any]:
    """transformers' continuous batching manager, one `add_request` per request with its own
    `max_new_tokens`; `eos_token_id=-1` turns EOS off (the peers' `ignore_eos`)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256  # transformers' default page size
    longest = max(r.output_len for r in requests)
    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=longest, eos_token_id=-1, pad_token_id=pad_id
    )
    # Sized to hold the whole workload at once: on CPU the manager would otherwise size its cache
    # from the machine's free RAM.
    num_blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page) for r in requests)
    cb_config = ContinuousBatchingConfig(
        num_blocks=num_blocks + len(requests), max_batch_tokens=max_batch_tokens
    )
    results: dict[str, Any] = {}
    t: dict[str, float] = {}
    bar = tqdm(total=len(requests), desc="hf-cb", unit="req")
    with (
        model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, warmup=False
        ) as manager,
        timed(model.device, t),
    ):
        for i, r in enumerate(requests):
            manager.add_request(
                r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len, eos_token_id=-1
            )
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped early")
                continue
            if result.is_finished():
                results[result.request_id] = result
                bar.update(1)
    bar.close()
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return {
        "system": "hf-cb",
        "seconds": t["seconds"],
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / t["seconds"],
    }


def warm_up_hf(model: Any, pad_id: int) -> None:
    with torch.no_grad():
        model.generate(
            torch.tensor([[1, 2, 3, 4]], device=model.device),
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=pad_id,
        )

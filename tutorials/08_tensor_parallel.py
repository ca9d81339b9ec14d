"""08 · Tensor parallelism: one model split over two ranks, the same tokens out.

A model too big for one device is split Megatron-style (the PagedAttention paper, §4.6): each of N
ranks holds 1/N of every layer — its share of the query heads, the KV heads they read, half of the
MLP's width, a slice of the vocabulary — and, with it, only its own KV heads in every block of the
KV cache. The ranks meet in an all-reduce after the attention's output projection and after the
MLP's down projection (two per layer), once in the embedding, and in a gather of the logits to
rank 0. The scheduler does not move: rank 0 schedules, sends each step's plain `SchedulerOutput`
to the other ranks, and samples.

The script runs one tiny random Llama (4 query heads, 2 KV heads) at tensor_parallel_size 1 and 2
on this CPU (gloo), asks each rank what it holds and what it has sent (`collective_rpc`), and
compares the tokens.

Run: python tutorials/08_tensor_parallel.py
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams
from minivllm.distributed.worker import rank_report
from minivllm.model.loader import resolve_model

LAYERS, HIDDEN, VOCAB = 4, 128, 49152


def tiny_llama(folder: Path) -> Path:
    """A random 4-layer Llama with SmolLM2's tokenizer (its weights drawn wide, so its next-token
    choices are clear-cut, like a trained model's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model(None).path / name, folder)
    return folder


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_llama(Path(tmp)))
        prompts = [
            {"prompt_token_ids": [100 + 7 * i + j for j in range(20 + 5 * i)]} for i in range(4)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        # Every prompt token and every output token but the last passes through the model once.
        tokens_computed = sum(len(p["prompt_token_ids"]) + 24 - 1 for p in prompts)
        outputs = {}
        for size in (1, 2):
            llm = LLM(
                model, tensor_parallel_size=size, num_gpu_blocks_override=64, max_model_len=512
            )
            out = llm.generate(prompts, params, use_tqdm=False)
            outputs[size] = [list(o.outputs[0].token_ids) for o in out]
            print(f"tensor_parallel_size {size}:")
            for r in llm.llm_engine.executor.collective_rpc(rank_report):
                print(
                    f"  rank {r.rank}: weights {r.weight_bytes / 2**20:.2f} MiB, "
                    f"KV cache {r.kv_cache_bytes / 2**20:.2f} MiB ({r.num_kv_blocks} blocks, "
                    f"{r.num_heads} query heads, {r.num_kv_heads} KV head(s)), "
                    f"all-reduce {r.all_reduce_bytes / tokens_computed:,.0f} B per token, "
                    f"gather {r.gather_bytes / (4 * 24):,.0f} B per sampled token"
                )
            llm.shutdown()  # stops the worker process (deleting the LLM or exiting would too)

    per_token = (2 * LAYERS + 1) * HIDDEN * 4
    print(
        f"an all-reduce of each token's hidden state, (2 x {LAYERS} layers + 1) x {HIDDEN} x 4 B = "
        f"{per_token:,} B per token; a ring all-reduce sends 2(N-1)/N of it from each rank"
    )
    print(f"first output at both sizes: {outputs[1][0][:8]} ... / {outputs[2][0][:8]} ...")
    same = outputs[1] == outputs[2]
    print(f"outputs equal at tensor_parallel_size 1 and 2: {same}")
    print(
        "LESSON: two ranks each held half of every layer and half of each KV block (one of the two "
        "KV heads), exchanged only each token's hidden state twice per layer plus their slice of "
        f"the logits, and produced the same tokens as one device: {same}."
    )


if __name__ == "__main__":  # the workers are spawned processes that re-import this file
    main()

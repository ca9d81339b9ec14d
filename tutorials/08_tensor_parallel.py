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
compares the tokens. It ends with a picture of who holds what at two ranks: the slices of the
weights (rows of the column-parallel layers, columns of the row-parallel ones) and of one KV block.

Run: python tutorials/08_tensor_parallel.py [OUT_DIR]   (writes OUT_DIR/08_shards.png)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams
from minivllm.model.resolver import resolve_model
from minivllm.worker.worker_proc import rank_report

LAYERS, HIDDEN, VOCAB = 4, 128, 49152
HEADS, KV_HEADS, INTERMEDIATE, BLOCK_SIZE = 4, 2, 256, 16
OUT = (Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "out").resolve()


def tiny_llama(folder: Path) -> Path:
    """A random 4-layer Llama with SmolLM2's tokenizer (its weights drawn wide, so its next-token
    choices are clear-cut, like a trained model's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
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
        outputs, reports = {}, []
        for size in (1, 2):
            llm = LLM(
                model,
                tensor_parallel_size=size,
                block_size=BLOCK_SIZE,
                num_gpu_blocks_override=64,
                max_model_len=512,
            )
            out = llm.generate(prompts, params, use_tqdm=False)
            outputs[size] = [list(o.outputs[0].token_ids) for o in out]
            print(f"tensor_parallel_size {size}:")
            reports = llm.llm_engine.executor.collective_rpc(rank_report)  # the last: 2 ranks
            for r in reports:
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
    picture = draw_shards(reports, OUT / "08_shards.png")
    print(f"picture: {picture}")
    print(
        "LESSON: two ranks each held half of every layer and half of each KV block (one of the two "
        "KV heads), exchanged only each token's hidden state twice per layer plus their slice of "
        f"the logits, and produced the same tokens as one device: {same}."
    )
    print(
        "TRY THIS: set KV_HEADS = 1 (one KV head for all four query heads). Predict before you "
        "run: each rank still holds half of the query heads, but both keep a copy of the one KV "
        "head, so each rank's KV cache is the whole cache, not half of it."
    )


def draw_shards(reports: list, path: Path) -> Path:
    """Which rank holds which slice, drawn from the ranks' own reports: a column-parallel weight
    (q_proj: rows are query heads), a row-parallel one (o_proj: columns are query heads) and one
    KV block (its slots x KV heads x head_dim)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    head_dim = HIDDEN // HEADS
    colour = {r.rank: plt.get_cmap("tab10")(r.rank) for r in reports}
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.6))
    panels = [
        ("q_proj (column-parallel)\nrows: query heads", "in: hidden", "out: heads x head_dim"),
        ("o_proj (row-parallel)\ncolumns: query heads", "in: heads x head_dim", "out: hidden"),
        (f"one KV block: {BLOCK_SIZE} slots\ncolumns: KV heads", "KV head x head_dim", "slot"),
    ]
    for ax, (title, xlabel, ylabel) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    for r in reports:
        first_head = r.rank * r.num_heads  # rank r holds query heads [first, first + num_heads)
        # KV heads [first_kv, first_kv + num_kv_heads); fewer KV heads than ranks: replicated,
        # and the ranks' colours overlap in the block.
        first_kv = r.rank * KV_HEADS // len(reports)
        rows = (first_head * head_dim, r.num_heads * head_dim)
        axes[0].add_patch(Rectangle((0, rows[0]), HIDDEN, rows[1], color=colour[r.rank]))
        axes[1].add_patch(Rectangle((rows[0], 0), rows[1], HIDDEN, color=colour[r.rank]))
        kv = (first_kv * head_dim, r.num_kv_heads * head_dim)
        axes[2].add_patch(Rectangle((kv[0], 0), kv[1], BLOCK_SIZE, color=colour[r.rank], alpha=0.7))
        for h in range(r.num_heads):
            axes[0].text(HIDDEN / 2, (first_head + h + 0.5) * head_dim, f"head {first_head + h}",
                         ha="center", va="center", fontsize=8)  # fmt: skip
            axes[1].text((first_head + h + 0.5) * head_dim, HIDDEN / 2, f"head {first_head + h}",
                         ha="center", va="center", fontsize=8, rotation=90)  # fmt: skip
        for h in range(r.num_kv_heads):
            axes[2].text((first_kv + h + 0.5) * head_dim, BLOCK_SIZE / 2,
                         f"K and V of\nKV head {first_kv + h}", ha="center", va="center",
                         fontsize=8)  # fmt: skip
    axes[0].set_xlim(0, HIDDEN)
    axes[0].set_ylim(HEADS * head_dim, 0)
    axes[1].set_xlim(0, HEADS * head_dim)
    axes[1].set_ylim(HIDDEN, 0)
    axes[2].set_xlim(0, KV_HEADS * head_dim)
    axes[2].set_ylim(BLOCK_SIZE, 0)
    ranks = [Patch(color=colour[r.rank], label=f"rank {r.rank}") for r in reports]
    fig.legend(handles=ranks, loc="lower center", ncol=len(ranks), fontsize=9)
    fig.suptitle("tensor_parallel_size 2: who holds which slice", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":  # the workers are spawned processes that re-import this file
    main()

"""16 · Pipeline stages: a model cut in two, on two processes, the same tokens out.

Tensor parallelism (tutorial 08) splits every layer; pipeline parallelism (GPipe; vLLM's
`--pipeline-parallel-size`) splits the stack. Stage 0 holds the embedding and the first decoder
layers, the last stage the last layers, the final norm and the LM head. In a step, stage 0 runs
its layers over the step's T tokens and sends each token's hidden state, and Llama's residual
stream beside it, to stage 1, which runs the rest and sends the logits back to the driver (stage
0's process), which samples. The scheduler does not know there are stages: the block tables it
makes name the same blocks on every stage, and each stage keeps in them the K and V of its own
layers only.

The script runs a tiny random Llama of 5 layers with pipeline_parallel_size 1 and 2 on this CPU
(the engine spawns stage 1, gloo carries the sends), asks each stage which layers it holds and
what its KV cache costs (`collective_rpc`), records what stage 0 sends in each step, and compares
the tokens.

Run: python tutorials/16_pipeline_stages.py [OUT_DIR]   (writes OUT_DIR/16_pipeline_stages.png)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from minivllm import LLM, SamplingParams
from minivllm.distributed.pipeline import IntermediateTensors
from minivllm.model.pipeline import is_missing
from minivllm.worker.model_runner import ModelRunner

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 5, 64, 4, 2, 256
BLOCK_SIZE, NUM_BLOCKS = 16, 32
OUT = (Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "out").resolve()


def tiny_llama(folder: Path) -> Path:
    """A random 5-layer Llama, saved as `save_pretrained` saves one: a config.json and its named
    tensors (no tokenizer: the prompts are token ids). The weights are drawn wide (std 0.2), so
    that its greedy choices are clear-cut, like a trained model's."""
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB,
        hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
        tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    head_dim = HIDDEN // HEADS
    q, kv, mlp = HEADS * head_dim, KV_HEADS * head_dim, 2 * HIDDEN  # output widths
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}  # fmt: skip
    for i in range(LAYERS):
        shapes |= {
            f"model.layers.{i}.{name}.weight": shape
            for name, shape in [
                ("input_layernorm", (HIDDEN,)), ("self_attn.q_proj", (q, HIDDEN)),
                ("self_attn.k_proj", (kv, HIDDEN)), ("self_attn.v_proj", (kv, HIDDEN)),
                ("self_attn.o_proj", (HIDDEN, q)), ("post_attention_layernorm", (HIDDEN,)),
                ("mlp.gate_proj", (mlp, HIDDEN)), ("mlp.up_proj", (mlp, HIDDEN)),
                ("mlp.down_proj", (HIDDEN, mlp)),
            ]
        }  # fmt: skip
    torch.manual_seed(0)
    weights = {
        name: torch.ones(shape) if len(shape) == 1 else 0.2 * torch.randn(shape)  # norms: 1
        for name, shape in shapes.items()
    }
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@dataclass
class StageReport:
    """One stage's share of the model and of the KV cache, as its own process sees it."""

    stage: int  # pp rank: 0 .. pipeline_parallel_size - 1
    pid: int  # the process it runs in
    layers: tuple[int, int]  # [start, end) of the decoder layers it runs
    parts: list[str]  # the parts besides decoder layers that exist on it (not PPMissingLayer)
    # [its layers, 2 (K, V), blocks, block_size, KV heads, head_dim]
    kv_cache_shape: tuple[int, ...]
    kv_bytes_per_block: int  # one block of the KV cache, over all of its layers
    sent_bytes: int  # hidden states and residuals it has sent to the next stage


def stage_report(runner: ModelRunner) -> StageReport:
    """A `collective_rpc` function: it runs on every rank, in the rank's own process (the spawned
    stage re-imports this file to find it), and its result comes back to the driver."""
    body = runner.model.model
    parts = {"embed_tokens": body.embed_tokens, "norm": body.norm, "lm_head": runner.model.lm_head}
    cache = runner.kv_cache
    return StageReport(
        stage=runner.pp.rank,
        pid=os.getpid(),
        layers=(body.start_layer, body.end_layer),
        parts=[name for name, module in parts.items() if not is_missing(module)],
        kv_cache_shape=tuple(cache.shape),
        kv_bytes_per_block=cache[:, :, 0].numel() * cache.element_size(),
        sent_bytes=runner.pp.sent_bytes,
    )


def record_sends(llm: LLM, sends: list) -> None:
    """Record what stage 0 (the driver's own runner) hands on in each step: the shapes and dtype
    of the `IntermediateTensors` it passes to its pipeline group's `send`."""
    pp = llm.llm_engine.runner.pp
    send = pp.send

    def recording(t: IntermediateTensors) -> None:
        assert t.residual is not None  # Llama keeps its residual stream apart: it travels too
        sends.append((tuple(t.hidden.shape), tuple(t.residual.shape), t.hidden.dtype))
        send(t)

    pp.send = recording  # type: ignore[method-assign]


def main() -> None:
    prompts = [{"prompt_token_ids": [3 + 11 * i + j for j in range(12 + 4 * i)]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = dict(skip_tokenizer_init=True, block_size=BLOCK_SIZE,
                  num_gpu_blocks_override=NUM_BLOCKS, max_model_len=128)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_llama(Path(tmp)))
        tokens, reports, sends = {}, {}, []
        for size in (1, 2):
            llm = LLM(model, pipeline_parallel_size=size, **engine)
            if size == 2:
                record_sends(llm, sends)
            out = llm.generate(prompts, params, use_tqdm=False)
            tokens[size] = [list(o.outputs[0].token_ids) for o in out]
            reports[size] = llm.llm_engine.executor.collective_rpc(stage_report)
            llm.shutdown()  # stops the spawned stage (deleting the LLM or exiting would too)

    (one,) = reports[1]
    print(f"pipeline_parallel_size 1: one process ({one.pid}) holds layers {one.layers[0]}.."
          f"{one.layers[1] - 1}, {', '.join(one.parts)}; KV cache {list(one.kv_cache_shape)}, "
          f"{one.kv_bytes_per_block:,} B per block")  # fmt: skip
    print("pipeline_parallel_size 2:")
    for r in reports[2]:
        print(f"  stage {r.stage} (pid {r.pid}): layers {r.layers[0]}..{r.layers[1] - 1}, "
              f"{', '.join(r.parts) or 'no other part'}; KV cache {list(r.kv_cache_shape)}, "
              f"{r.kv_bytes_per_block:,} B per block")  # fmt: skip
    stages = reports[2]
    per_block = sum(r.kv_bytes_per_block for r in stages)
    print(f"bytes per block over the stages: {per_block:,} (one process: "
          f"{one.kv_bytes_per_block:,}): each stage keeps its own layers' K and V only")  # fmt: skip

    print("what stage 0 sends to stage 1, step by step:")
    per_token = 2 * HIDDEN * 4  # hidden + residual, float32
    for step, (hidden, residual, dtype) in enumerate(sends, start=1):
        kind = "prompts" if step == 1 else "decode"
        print(f"  step {step} ({kind}): hidden {list(hidden)} + residual {list(residual)} "
              f"{str(dtype).removeprefix('torch.')} = {hidden[0] * per_token:,} B")  # fmt: skip
        if step == 2 and len(sends) > 3:
            print(f"  ... {len(sends) - 2} more decode steps like it")
            break
    tokens_sent = sum(hidden[0] for hidden, _, _ in sends)
    print(f"stage 0 sent {stages[0].sent_bytes:,} B in all = {tokens_sent} tokens x "
          f"2 x {HIDDEN} x 4 B ({per_token:,} B per token); stage 1 sent "
          f"{stages[1].sent_bytes:,} B to a next stage (its logits go to the driver)")  # fmt: skip
    assert stages[0].sent_bytes == tokens_sent * per_token

    print(f"first output, one process / two stages: {tokens[1][0]} / {tokens[2][0]}")
    same = tokens[1] == tokens[2]
    print(f"greedy outputs equal with 1 and 2 stages: {same}")
    picture = draw_stages(one, stages, sends[0][0], OUT / "16_pipeline_stages.png")
    print(f"picture: {picture}")
    print(
        f"LESSON: two processes each held their stage's layers ({stages[0].layers[1]} + "
        f"{LAYERS - stages[1].layers[0]} of {LAYERS}) and only those layers' share of every KV "
        f"block; between them travelled one hidden state and one residual per token of the step "
        f"({per_token:,} B), and the tokens were one process's: {same}."
    )
    print(
        "TRY THIS: run it with VLLM_PP_LAYER_PARTITION=1,4 in the environment. Predict before you "
        "run: which layers does each stage hold, what does a KV block cost on each, and does "
        "anything that travels between the stages change?"
    )
    assert same


def draw_stages(one: StageReport, stages: list[StageReport], hidden: tuple, path: Path) -> Path:
    """Left: the model's parts, coloured by the stage that holds them, and what crosses the cut.
    Right: one KV block's bytes, split by layer, on one process and on each stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    colour = {r.stage: plt.get_cmap("tab10")(r.stage) for r in stages}
    fig, (stack, blocks) = plt.subplots(1, 2, figsize=(10, 4.2), width_ratios=(1, 1.3))
    parts = ["embed_tokens", *(f"layer {i}" for i in range(LAYERS)), "norm", "lm_head"]
    for y, part in enumerate(parts):
        i = int(part.split()[1]) if part.startswith("layer") else None
        (owner,) = [r for r in stages if (part in r.parts if i is None else
                                          r.layers[0] <= i < r.layers[1])]  # fmt: skip
        stack.add_patch(Rectangle((0, y + 0.1), 1, 0.8, color=colour[owner.stage]))
        stack.text(0.5, y + 0.5, part, ha="center", va="center", fontsize=9)
    cut = stages[0].layers[1] + 1  # below the first layer of stage 1
    stack.plot([0, 1.1], [cut, cut], color="black", linestyle="--")
    stack.text(1.15, cut, f"step 1 sends\nhidden {list(hidden)}\n+ residual {list(hidden)}",
               fontsize=8, va="center")  # fmt: skip
    stack.set_xlim(0, 1.9)
    stack.set_ylim(len(parts), 0)
    stack.axis("off")
    stack.set_title("who holds which part", fontsize=10)

    per_layer = one.kv_bytes_per_block // LAYERS
    bars = [("one process", one.layers, None), *((f"stage {r.stage}", r.layers, r) for r in stages)]
    for x, (_, (start, end), r) in enumerate(bars):
        for layer in range(start, end):
            blocks.bar(x, per_layer, bottom=(layer - start) * per_layer, width=0.6,
                       color="0.7" if r is None else colour[r.stage], edgecolor="white")  # fmt: skip
            blocks.text(x, (layer - start + 0.5) * per_layer, f"layer {layer}", ha="center",
                        va="center", fontsize=8)  # fmt: skip
    blocks.set_xticks(range(len(bars)), [name for name, _, _ in bars])
    blocks.set_ylabel("bytes in one KV block (K and V)")
    blocks.set_title(f"one KV block: {BLOCK_SIZE} slots x {KV_HEADS} KV heads", fontsize=10)
    holders = [Patch(color=colour[r.stage], label=f"stage {r.stage}") for r in stages]
    fig.legend(handles=holders, loc="lower center", ncol=len(holders), fontsize=9)
    fig.suptitle("pipeline_parallel_size 2: the stack cut in two, and the KV cache with it")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":  # stage 1 is a spawned process that re-imports this file
    main()

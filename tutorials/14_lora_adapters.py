"""14 · LoRA adapters: many fine-tunes of one model in one batch, through a few slots.

A LoRA adapter changes each linear `y = x Wᵀ` into `y = x Wᵀ + scale · (x Aᵀ) Bᵀ` with thin A
[r, in] and B [out, r]. The base weights never change, so one engine serves many adapters at once
(Punica, S-LoRA, vLLM's `vllm/lora/`): each adapted linear holds `max_loras` adapters' A and B
stacked by *slot*, every row of the batch carries its request's slot (as it carries a block
table), and one shrink and one expand add every row's delta. The scheduler admits a request only
when its adapter has a slot; a new adapter takes a free slot, or the least recently used one.

We build a tiny random Llama and three random rank-8 adapters, "sql", "chat" and "poem", then:
1. run a batch of sql, chat and base-model requests with max_loras=1 and with max_loras=2, and
   watch (in the step trace and the LoRA manager) the slots fill and the LRU evict;
2. ask one prompt under each adapter: each answer is the base model with that adapter's
   B·A merged into its weights (checked with transformers), and no two are alike.

Run: python tutorials/14_lora_adapters.py [OUT_DIR]   (writes OUT_DIR/14_lora_slots.png)
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from minivllm import LLM, SamplingParams
from minivllm.benchmarks.lora_workload import write_random_adapter
from minivllm.lora.request import LoRARequest

plt.switch_backend("Agg")  # write files, never open a window
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "out"
OUT.mkdir(parents=True, exist_ok=True)
warnings.simplefilter("ignore")  # transformers' notices
hf_logging.disable_progress_bar()

# --- 1. A tiny base model and three adapters of it ------------------------------------------------
folder = Path(tempfile.mkdtemp())
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
hf_base = LlamaForCausalLM(config).float().eval()
hf_base.save_pretrained(folder / "base")
ENGINE = dict(skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=32)


def lora_llm(max_loras: int) -> LLM:
    return LLM(str(folder / "base"), enable_lora=True, max_loras=max_loras, max_lora_rank=8,
               **ENGINE)  # fmt: skip


llm = lora_llm(max_loras=1)
targets = llm.llm_engine.runner.lora_manager.targets  # module name -> (in, out)
print(f"adaptable linears: {len(targets)} (q, k, v, o, gate, up, down of 2 layers)")
adapters = {
    name: LoRARequest(name, i + 1, str(write_random_adapter(
        targets, 8, folder / name, seed=i, lora_alpha=64)))  # scale 64 / 8: a visible change
    for i, name in enumerate(["sql", "chat", "poem"])
}  # fmt: skip

# --- 2. One batch, one slot against two -----------------------------------------------------------
prompts = [[5 + i, 17, 42, 8 + i, 99, 3] for i in range(4)]
batch = [adapters["sql"], adapters["chat"], adapters["sql"], None]
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
timelines: dict[int, list[dict[str, str]]] = {}
for max_loras in (1, 2):
    if max_loras == 2:
        llm = lora_llm(max_loras=2)
    with llm.trace() as trace:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                     lora_request=batch)  # fmt: skip
    steps = trace.to_dict()["steps"]
    timelines[max_loras] = [step["lora_slots"] for step in steps]
    print(f"\nmax_loras={max_loras}: {len(steps)} steps")
    for step in steps:
        rows = ", ".join(f"{r['lora_name'] or 'base'}@{r['lora_slot']}" for r in step["scheduled"])
        print(f"  step {step['step']}: rows (adapter@slot) {rows}; slots {step['lora_slots']}")

# The LRU: with both slots full, "poem" takes the slot of the adapter used least recently.
manager = llm.llm_engine.runner.lora_manager
slot_names = {v.lora_int_id: k for k, v in adapters.items()}
before = {slot_names[i]: s for i, s in manager.slots.items()}  # least recently used first
llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False,
             lora_request=adapters["sql"])  # fmt: skip
touched = {slot_names[i]: s for i, s in manager.slots.items()}
llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False,
             lora_request=adapters["poem"])  # fmt: skip
after = {slot_names[i]: s for i, s in manager.slots.items()}
evicted = (set(touched) - set(after)).pop()
print(f"\nslots, least recently used first: {before}; after a sql request: {touched}")
print(f"a poem request: {after}: {evicted} was evicted from slot {touched[evicted]}")

# --- 3. One prompt, each adapter's answer ---------------------------------------------------------
prompt = prompts[0]
names = [None, "sql", "chat", "poem"]
outs = llm.generate([{"prompt_token_ids": prompt}] * 4, SamplingParams(temperature=0, max_tokens=8,
                    ignore_eos=True), use_tqdm=False,
                    lora_request=[adapters[n] if n else None for n in names])  # fmt: skip
answers = {n or "base": list(o.outputs[0].token_ids) for n, o in zip(names, outs)}


def merged_answer(name: str | None) -> list[int]:
    """transformers' greedy answer with the adapter's scale · B·A added to each weight."""
    model = copy.deepcopy(hf_base)
    if name is not None:
        cfg = json.loads((folder / name / "adapter_config.json").read_text())
        weights = load_file(folder / name / "adapter_model.safetensors")
        with torch.no_grad():
            for key, a in weights.items():
                if ".lora_A." in key:
                    module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                    b = weights[key.replace("lora_A", "lora_B")]
                    delta = cfg["lora_alpha"] / cfg["r"] * b @ a  # [out, in]
                    model.get_submodule(module).weight += delta
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    return ids[0, len(prompt) :].tolist()


print(f"\nthe prompt {prompt}, greedy, in one batch:")
for n in names:
    same = answers[n or "base"] == merged_answer(n)
    print(f"  {n or 'base':5s} -> {answers[n or 'base']}  (= transformers with it merged: {same})")
    assert same
assert len({tuple(a) for a in answers.values()}) == 4  # each adapter answers its own way

# --- 4. The picture: which adapter held each slot, step by step ----------------------------------
colours = {"sql": "tab:blue", "chat": "tab:orange", "poem": "tab:green"}
fig, axes = plt.subplots(1, 2, figsize=(9, 2.6), sharey=True)
for ax, (max_loras, timeline) in zip(axes, timelines.items()):
    for step, slots in enumerate(timeline, start=1):
        for slot, name in slots.items():
            ax.barh(int(slot), 1, left=step - 0.5, color=colours[name], edgecolor="white")
            ax.text(step, int(slot), name, ha="center", va="center", fontsize=8, color="white")
    ax.set_title(f"max_loras={max_loras}: {len(timeline)} steps")
    ax.set_xlabel("engine step")
    ax.set_xticks(range(1, len(timeline) + 1))
axes[0].set_yticks([0, 1], ["slot 0", "slot 1"])
fig.suptitle("The adapter in each device slot after every step (same batch)")
fig.tight_layout()
fig.savefig(OUT / "14_lora_slots.png", dpi=100)
print(f"picture: {OUT / '14_lora_slots.png'}")
print(
    "LESSON: an adapter is a per-row attribute of the batch, like a block table: rows of "
    "different adapters share one step through their slots; with fewer slots than adapters "
    "a request waits for a slot, and a new adapter evicts the least recently used one."
)
print(
    "TRY THIS: with max_loras=1, put chat first in the batch (chat, sql, sql, None). Predict "
    "first: which adapter holds slot 0 in step 1, and how many steps does the batch take?"
)

"""09 · Watch the scheduler: a run traced step by step, with preemption and copy-on-write.

Tutorials 02-04 showed the pieces one at a time. Here one small run on the bundled SmolLM2-135M
makes all of them happen, and `llm.trace()` records every engine step (minivllm/trace/): the
batch the scheduler chose, every block table, the reference count of every block, and the events.

The pool is deliberately tiny (20 blocks of 8 tokens) so that four requests cannot all fit:

- two prompts start with the same system prompt, and the second finds the first one's full
  blocks in the prefix cache (reference counts 2). A block is named in the cache when it is
  allocated, so the hit could happen in the same step; here the story prompt between them fills
  the first step's token budget, and the second is admitted a step later;
- one request asks for n = 2 samples: they share the prompt's blocks, and the first write into
  the shared, partly filled last block copies it (copy-on-write, paper §4.4);
- when a running sequence needs a block and none is free, the newest one is preempted: its blocks
  are freed, and it *resumes* later, recomputing what the prefix cache no longer holds (paper
  §4.5). The samples of the n = 2 request are preempted one at a time, as vLLM v1 does; the paper
  preempts all sequences of a request together (its "sequence group", §4.5).

The prompts are raw text, not chat messages, and `ignore_eos` keeps every sample going for its
whole `max_tokens`: SmolLM2-Instruct ends the would-be user turn (its end-of-turn token is the
EOS, ignored, and special tokens are left out of the text), then opens an assistant turn itself.
That is why two of the outputs start with `assistant\n`.

The script prints the run step by step, writes the trace and its page (OUT_DIR/09_trace/index.html:
open it in a browser, drag the slider or use the arrow keys), and draws the whole run as one
picture (OUT_DIR/09_block_map.png).

Run: python tutorials/09_watch_the_scheduler.py [OUT_DIR [NUM_BLOCKS]]   (~10-30 s on a CPU)
"""

from __future__ import annotations

import sys
from pathlib import Path

from minivllm import LLM, SamplingParams
from minivllm.trace.plot import plot_block_map

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "out"
NUM_BLOCKS = int(sys.argv[2]) if len(sys.argv) > 2 else 20  # the whole KV cache, 8 tokens a block

llm = LLM(
    block_size=8,
    num_gpu_blocks_override=NUM_BLOCKS,
    max_num_seqs=4,
    max_num_batched_tokens=64,  # the token budget of one step
    max_model_len=128,  # prompt + output, at most: the pool must hold one whole request
)
SYSTEM = "You are a patient teacher. You explain how computers manage memory, in one sentence."
prompts = [
    f"{SYSTEM} What is a page?",
    "Once upon a time, in a small town by the sea, there lived an old sailor who kept a notebook "
    "of every storm he had ever seen. One winter evening, a child knocked on his door and asked",
    f"{SYSTEM} What is a page table?",
    "The three primary colours are",
]
short = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
two_samples = SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=24, ignore_eos=True)

with llm.trace() as trace:
    outputs = llm.generate(prompts, [short, long, short, two_samples], use_tqdm=False)

# --- 1. The run, step by step: the batch, and what happened to the blocks -----------------------
steps = trace.steps
sequences = trace.to_dict()["sequences"]


def name(seq_id: int) -> str:
    info = sequences[str(seq_id)]
    return f"seq {seq_id} (request {info['request_id']})"


print(f"{len(steps)} steps on {NUM_BLOCKS} blocks of 8 tokens; budget 64 tokens per step")
print("batch [seq:tokens computed this step]; blocks held after the step (finished ones freed)")
quiet: list[int] = []  # steps skipped since the last line printed
for i, step in enumerate(steps):
    batch = ", ".join(f"{s['seq_id']}:{s['num_new_tokens']}" for s in step["scheduled"])
    events = []
    for hit in step["cache_hits"]:
        events.append(f"cache hit: {name(hit['seq_id'])} reuses blocks {hit['blocks']}")
    events += [f"PREEMPTED {name(s)}" for s in step["preempted"]]
    events += [f"forked {name(s)}: shares its parent's blocks" for s in step["forked"]]
    events += [f"copy-on-write: block {src} -> block {dst}" for src, dst in step["copies"]]
    events += [f"finished {name(s)}" for s in step["finished"]]
    same = i > 0 and [s["seq_id"] for s in steps[i - 1]["scheduled"]] == [
        s["seq_id"] for s in step["scheduled"]
    ]
    if same and not events and all(s["num_new_tokens"] == 1 for s in step["scheduled"]):
        quiet.append(step["step"])
        continue
    if quiet:
        print(f"  ... steps {quiet[0]}-{quiet[-1]}: the same sequences decode, one token each")
        quiet = []
    used = NUM_BLOCKS - step["num_free_blocks"]
    print(f"step {step['step']:2d}: batch [{batch}]  blocks held {used:2d}/{NUM_BLOCKS}", end="")
    print(("  <- " + "; ".join(events)) if events else "")

# --- 2. Three moments to look at in the page ----------------------------------------------------
hit_step = next(s for s in steps if s["cache_hits"])
shared = sorted(int(b) for b, n in hit_step["ref_counts"].items() if n > 1)
print(f"step {hit_step['step']}: blocks {shared} are held twice (reference count 2): one copy of")
print("  the shared system prompt's KV serves both requests")

preempt_step = next((s for s in steps if s["preempted"]), None)
victim = preempt_step["preempted"][0] if preempt_step else None
if preempt_step is None:
    print("no preemption: every running sequence found a free block at every step")
else:
    back = next(
        s
        for s in steps[preempt_step["step"] :]
        if any(h["seq_id"] == victim for h in s["cache_hits"])
    )
    tokens_back = next(h for h in back["cache_hits"] if h["seq_id"] == victim)
    print(
        f"step {preempt_step['step']}: no free block for the older sequences, so the newest, "
        f"{name(victim)}, was preempted;\n  at step {back['step']} it resumed and took "
        f"{tokens_back['num_cached_tokens']} of its tokens from the prefix cache instead of "
        "recomputing them"
    )

# The n = 2 request: two samples need two of the max_num_seqs=4 rows, and three sequences run
# from step 2. Admission is first come, first served, and a preempted sequence waits at the
# front of the queue: nothing is admitted past it, so the request waits for a sequence to finish.
first_step = {}  # request id -> the step its first token was computed
for step in steps:
    for item in step["scheduled"]:
        first_step.setdefault(sequences[str(item["seq_id"])]["request_id"], step["step"])
n2 = outputs[3].request_id
print(
    f"request {n2} (n = 2) arrived with the others but was first scheduled at step "
    f"{first_step[n2]}: its two samples need 2 of the 4 rows (max_num_seqs) and 3 were taken; "
    "once a preempted sequence waited ahead of it, it waited for that one too"
)

copy_step = next(s for s in steps if s["copies"])
src, dst = copy_step["copies"][0]
print(
    f"step {copy_step['step']}: the two samples of request 3 shared block {src}, partly filled; "
    f"the first to write got a copy, block {dst}"
)
for out in outputs:
    for sample in out.outputs:
        print(f"  request {out.request_id} #{sample.index}: {sample.text.strip()[:50]!r}")

# --- 3. The page, and the whole run in one picture ----------------------------------------------
page = trace.save(OUT / "09_trace")
print(f"page: {page}  (open it, then press the arrow keys; add #step={copy_step['step']} to the")
print("  address to open at the copy-on-write)")
figure = plot_block_map(trace.to_dict(), OUT / "09_block_map.png")
print(f"figure: {figure}")

assert shared and src != dst
num_preempted = sum(len(s["preempted"]) for s in steps)
preempted = (
    f"preempted {num_preempted} times when the pool ran out" if victim else "preempted nobody"
)
print(
    f"LESSON: in {len(steps)} steps the scheduler shared a cached prefix, {preempted}, and "
    "copied one block on write for n = 2: the block manager did it all with block tables and "
    "reference counts."
)
print(
    "TRY THIS: give the pool 48 blocks instead of 20: `python tutorials/09_watch_the_scheduler.py "
    "OUT_DIR 48`. Predict before you run: no PREEMPTED line, the same cache hit and copy-on-write, "
    "and the same number of steps (the decodes set the pace, not the pool)."
)

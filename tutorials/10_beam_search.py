"""10 · Beam search as copy-on-write.

Beam search keeps the `beam_width` most likely continuations of a prompt. Every step each beam
proposes its best next tokens and only the best `beam_width` extensions survive, so most beams
descend from the same few parents and share almost all of their history. The PagedAttention paper
(§4.4) makes that sharing free:

- a surviving extension FORKS its parent: a new block table pointing at the parent's blocks,
  whose reference counts go up;
- a parent nobody extends is PRUNED: its blocks are freed (a shared one just loses a reference);
- a beam about to write into a shared, half-full last block gets a private COPY of that one block.

This script runs one beam search on the bundled model one engine step at a time, prints the block
map of the live beams as it changes, and counts the blocks held against what separate copies
would take. The picture it draws is blocks in use over the run, with and without sharing.

Run: python tutorials/10_beam_search.py [OUT_DIR]
Try this: change WIDTH from 4 to 8. Predict first: does the saving grow or shrink, and why?
"""

from __future__ import annotations

import sys
from pathlib import Path

from minivllm import LLM, BeamSearchParams

OUT = (Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "out").resolve()
OUT.mkdir(parents=True, exist_ok=True)
WIDTH, MAX_TOKENS = 4, 24

# Prefix caching off: only the sharing between the beams is counted.
llm = LLM(max_model_len=512, num_gpu_blocks_override=64, enable_prefix_caching=False)
engine = llm.llm_engine
bm = engine.kv_cache_manager
copies: list[tuple[int, int]] = []
copy_blocks = engine.runner.copy_blocks
engine.runner.copy_blocks = lambda c: (copies.extend(c), copy_blocks(c))[1]  # count the copies


def block_map() -> str:
    """Each live beam's block table; a block shared with another beam is shown as `id*refs`."""
    rows = []
    for seq in engine.scheduler.running:
        table = bm.get_block_table(seq.seq_id)
        cells = [
            f"{b}*{bm.block_pool.blocks[b].ref_cnt}"
            if bm.block_pool.blocks[b].ref_cnt > 1
            else f"{b}"
            for b in table
        ]
        rows.append(f"    beam {seq.seq_id:>2}: [{' '.join(cells)}]")
    return "\n".join(rows)


prompt = "The three most important ideas in operating systems are"
engine.add_request("beams", prompt, BeamSearchParams(WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True))
held, separate = [], []
result = None
step = 0
dipped = False
while engine.has_unfinished_requests():
    outputs = engine.step()
    step += 1
    held.append(bm.num_blocks - bm.num_free_blocks)
    separate.append(bm.num_blocks_without_sharing())
    # The first step after step 1 at which the beams hold one block between them (a "dip").
    dip = step > 1 and held[-1] == 1 and 1 not in held[1:-1]
    if step in (1, 2, 12, MAX_TOKENS - 1) or dip:
        print(f"step {step}: {held[-1]} blocks held, {separate[-1]} if every beam had its own copy")
        print(block_map() or "    (search over: every block freed)")
    if dip:
        dipped = True
        print(
            f"    a dip to one block: all {WIDTH} survivors of step {step} extend the same parent "
            "beam.\n    The other parents were pruned and their blocks freed; the survivors are "
            "forks of\n    that one parent, and its history still fits in one block, so they all "
            "point at it."
        )
    result = next((o for o in outputs if o.finished), result)

assert result is not None
if not dipped:  # whether all survivors ever share one parent so early depends on the logits
    fewest = min(held[1:])
    print(
        f"no dip to one block in this run: the fewest blocks the beams held after step 1 were "
        f"{fewest}, at step {held.index(fewest, 1) + 1}\n    (their histories had split into "
        "different parents before they left the first block)"
    )
print(f"\nthe {WIDTH} beams, best first (score = mean log-probability per token):")
n_prompt = len(result.prompt_token_ids)
for c in result.outputs:
    score = c.cumulative_logprob / (n_prompt + len(c.token_ids))
    print(f"  {score:7.3f}  {c.text.strip()!r}")
saving = 1 - sum(held) / sum(separate)
print(f"copy-on-write copies: {len(copies)} blocks, over {step} steps")
print(f"blocks held on average: {sum(held) / step:.1f}, without sharing {sum(separate) / step:.1f}")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(6.4, 3.2))
ax.plot(range(1, step + 1), separate, label="every beam its own copy", color="tab:red")
ax.plot(range(1, step + 1), held, label="shared blocks (PagedAttention)", color="tab:blue")
ax.fill_between(range(1, step + 1), held, separate, color="tab:blue", alpha=0.15)
ax.set_xlabel("engine step")
ax.set_ylabel("KV blocks in use")
ax.set_title(f"Beam search, width {WIDTH}: {saving:.0%} of the KV memory saved")
ax.legend()
fig.tight_layout()
fig.savefig(OUT / "10_beam_blocks.png", dpi=100)
print(f"picture: {OUT / '10_beam_blocks.png'}")

assert saving > 0 and copies and llm.get_stats().num_free_kv_blocks == bm.num_blocks
print(
    f"LESSON: beams share their history's blocks: {saving:.0%} of the KV memory saved over the "
    f"run, at the cost of {len(copies)} one-block copies; a pruned beam frees only what no "
    "other beam still points at."
)
print(
    f"TRY THIS: change WIDTH from {WIDTH} to 8. Predict before you run: does the saving grow or "
    "shrink? (The beams still share one prompt and most of their history, while separate copies "
    "grow with the width.)"
)

"""11 · Structured outputs: a grammar masks the logits, row by row.

A model asked for JSON usually gives something *like* JSON: a code fence, a remark, a missing
brace. A grammar engine makes it exact. Each JSON schema (or regex, or grammar) is compiled once
into a machine that knows, at every point of the output, which of the vocabulary's tokens may come
next; the sampler sets every other token's logit to -inf before it samples. The model still picks
the token — among the ones the grammar allows.

This script asks the bundled model for a city as JSON twice: free, and under a JSON schema. For
the constrained run it steps the engine by hand and, before each step, counts how many of the
vocabulary's tokens the mask allows. Inside a string almost anything goes; between fields only a
few tokens (a comma, a quote, a brace) survive; at the end only EOS.

Run: python tutorials/11_structured_outputs.py [OUT_DIR]
Try this: add "maxLength": 12 to "name". Predict first: how does the allowed count change inside
the name's string once it reaches 12 characters?
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.sample.logits_processors import bitmask_to_bool

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "tutorials/out")
OUT.mkdir(parents=True, exist_ok=True)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer", "minimum": 0},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population", "capital"],
}
llm = LLM(max_model_len=512, num_gpu_blocks_override=64)
engine = llm.llm_engine
tokenizer = llm.get_tokenizer()
prompt = tokenizer.apply_chat_template(
    [{"role": "user", "content": "Describe the city of Lyon as a JSON object."}],
    tokenize=False,
    add_generation_prompt=True,
)

free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)
print(f"free:        {free[0].outputs[0].text!r}")

# The same prompt under the schema, one engine step at a time.
params = SamplingParams(
    temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA)
)
request = engine.add_request("json", prompt, params)
seq = request.seqs[0]
vocab = engine.vocab_size
allowed: list[int] = []
while engine.has_unfinished_requests():
    grammar = seq.grammar
    assert grammar is not None
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)  # 1 bit per token
    grammar.fill_bitmask(bitmask, 0)  # what the matcher allows after the output so far
    allowed.append(int(bitmask_to_bool(bitmask, vocab).sum()))
    engine.step()
    if len(allowed) <= 8:
        token = tokenizer.decode(seq.output_token_ids[-1:])
        print(f"  step {len(allowed)}: {allowed[-1]:>6} of {vocab} tokens allowed -> {token!r}")
text = seq.detokenizer.output_text if seq.detokenizer is not None else ""
print(f"constrained: {text!r}")
city = json.loads(text)
assert set(SCHEMA["required"]) <= set(city)
manager = engine.structured_output_manager
print(
    f"compiled once in {manager.compile_times_s[0] * 1e3:.1f} ms; mask sizes: "
    f"min {min(allowed)}, median {sorted(allowed)[len(allowed) // 2]}, max {max(allowed)}"
)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(6.4, 3.2))
ax.step(range(1, len(allowed) + 1), allowed, where="mid", color="tab:blue", label="allowed")
ax.axhline(vocab, color="tab:red", linestyle="--", label=f"whole vocabulary ({vocab})")
ax.set_yscale("log")
ax.set_xlabel("output token")
ax.set_ylabel("tokens the mask allows")
ax.set_title("A JSON schema as a token mask, step by step")
ax.legend(loc="lower left")
fig.tight_layout()
fig.savefig(OUT / "11_mask_sizes.png", dpi=100)
print(f"picture: {OUT / '11_mask_sizes.png'}")
print(
    "LESSON: a grammar is a per-row mask over the vocabulary: wide inside free text, a handful "
    "of tokens at the structure's joints, only EOS at its end; the output parses every time."
)
print(
    'TRY THIS: add "maxLength": 12 to the schema\'s name. Predict first: how many tokens does '
    "the mask allow once the name has 12 characters?"
)

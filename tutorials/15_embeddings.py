"""15 · Embeddings: the engine with decoding taken away.

An embedding model reads a text once and returns one vector. In minivllm that is a pooling
request (minivllm/pooling/): it is scheduled like any prompt, its prefill runs, and instead of a
sampler the pooler turns the prompt's hidden states into one vector (here the mean, as
sentence-transformers' all-MiniLM does); the request then finishes and its KV blocks go back.
A BERT encoder attends in both directions, so each prompt runs whole in one step.

We build a tiny random BERT on the fly (transformers' `BertConfig` + `save_pretrained`, a
WordPiece vocabulary written here, sentence-transformers' mean pooling), embed a few sentences,
check them against sentence-transformers' own `encode`, and rank them against a query by cosine.
The weights are random, so the ranking knows words, not meanings: a document that repeats the
query's words scores highest.

Run: python tutorials/15_embeddings.py [OUT_DIR]   (writes OUT_DIR/15_ranking.png)
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from minivllm import LLM

plt.switch_backend("Agg")  # write files, never open a window
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "out"
warnings.simplefilter("ignore")  # transformers' and sentence-transformers' notices

QUERY = "where do cats sleep"
DOCS = [
    "cats sleep on the warm mat",
    "the capital of france is paris",
    "dogs sleep where cats sleep",
    "a train leaves the station at noon",
    "where do cats sleep",
]

# --- 1. A tiny BERT, saved as sentence-transformers saves all-MiniLM ------------------------------
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.models import Pooling, Transformer  # noqa: E402
from transformers import BertConfig, BertModel, BertTokenizer  # noqa: E402

folder = Path(tempfile.mkdtemp()) / "tiny-minilm"
words = sorted({w for text in [QUERY, *DOCS] for w in text.split()})
letters = "abcdefghijklmnopqrstuvwxyz"
vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters)]
vocab += [w for w in words if w not in vocab]
torch.manual_seed(0)
config = BertConfig(
    vocab_size=len(vocab),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
)
BertModel(config).save_pretrained(folder / "bert")
(folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder / "bert")
bert = Transformer(str(folder / "bert"))
st = SentenceTransformer(modules=[bert, Pooling(64, pooling_mode="mean")], device="cpu")
st.save(str(folder / "st"))
print(f"a BERT of {sum(p.numel() for p in st.parameters()):,} parameters, mean pooling")

# --- 2. Embed: one prefill per text, then the pooler ----------------------------------------------
# dtype "auto" would be float16 for a pooling model, as in vLLM (a float32 checkpoint is downcast to
# float16, whose 10-bit mantissa keeps embeddings close); float32 here, to compare with
# sentence-transformers' float32 vectors digit for digit.
llm = LLM(str(folder / "st"), dtype="float32")
pooler = llm.llm_engine.pooler
sched = llm.llm_engine.config.scheduler
print(
    f"pooler: {pooler.pooling_type} pooling, causal={pooler.causal}; chunked prefill "
    f"{'on' if sched.enable_chunked_prefill else 'off'} (an encoder's prompt runs whole)"
)
outputs = llm.embed([QUERY, *DOCS], use_tqdm=False)
ours = torch.tensor([o.outputs.embedding for o in outputs])  # [1 + docs, 64]
ref = st.encode([QUERY, *DOCS], convert_to_tensor=True).float()
agree = torch.nn.functional.cosine_similarity(ours, ref).min().item()
print(f"{len(outputs)} embeddings of {ours.shape[1]} numbers; agreement with sentence-transformers: "
      f"cosine >= {agree:.6f}")  # fmt: skip
stats = llm.get_stats()
print(f"KV blocks: {stats.num_kv_blocks} (encoder-only attention reads and writes no cache)")
assert agree >= 0.99999

# --- 3. Rank the documents against the query ------------------------------------------------------
scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
ranking = sorted(range(len(DOCS)), key=lambda i: -scores[i])
print(f"query: {QUERY!r}")
for place, i in enumerate(ranking, 1):
    print(f"  {place}. {scores[i]:.3f}  {DOCS[i]!r}")
assert DOCS[ranking[0]] == QUERY  # the same words, the same vector: cosine 1

# --- 4. The picture: the documents by cosine to the query -------------------------------------------
OUT.mkdir(parents=True, exist_ok=True)
fig, ax = plt.subplots(figsize=(7, 2.8))
ax.barh([DOCS[i] for i in reversed(ranking)], [scores[i] for i in reversed(ranking)])
ax.set_xlabel(f"cosine similarity to {QUERY!r}")
ax.set_title("a random tiny BERT ranks by shared words", fontsize=10)
fig.tight_layout()
fig.savefig(OUT / "15_ranking.png", dpi=100)
print(f"figure: {OUT / '15_ranking.png'}")

print(
    f"LESSON: an embedding is one prefill and a pooler, no decode step; the engine's vectors "
    f"equal sentence-transformers' (cosine >= {agree:.5f}); ranking is a cosine per document, "
    f"and a document that repeats the query scores {scores[ranking[0]]:.3f}."
)
print(
    "TRY THIS: add the document 'cats sleep' to DOCS. Predict before you run: it ranks near the "
    "top, above the documents that share no word with the query."
)

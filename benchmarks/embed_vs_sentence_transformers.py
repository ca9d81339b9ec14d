"""`LLM.embed` against sentence-transformers' `encode` on one embedding model (issue 48).

A pooling request is a prefill with no decode (minivllm/pooling/). sentence-transformers pads each
batch of 32 sentences to its longest (after sorting them by length) and runs transformers' BERT on
the padded rectangle; minivllm packs the batch's tokens back to back under one token budget, so it
computes no padding, and attends within each sentence with encoder-only attention (no KV cache,
`AttentionBackend.attend_encoder`).

The model has all-MiniLM-L6-v2's shape (a 6-layer BERT, hidden 384, 12 heads, FFN 1536, mean
pooling, normalized) with random weights and a small WordPiece vocabulary (speed does not depend on
the weights or on the vocabulary's size). The sentences are 256 random word sequences of 16-128
tokens each. Each engine runs in a process of its own with the same threads; the two alternate for
`--rounds` rounds (each the fastest of `--repeats` timed passes after a warm-up pass), and the
medians and their ratio are printed with the CPU model and the load.

Each `--pairs` entry is `minivllm_dtype:sentence_transformers_dtype`. By default: each engine's
default against the other's (`auto:float32`: minivllm's `dtype="auto"`, which for a pooling model is
vLLM's float16, against sentence-transformers' float32), then the same dtype on both sides, which
measures the engines (float32, bfloat16, float16). Every pair also prints how close the two
engines' embeddings are (cosine, the minimum over the sentences), which is what a narrower dtype
costs where they differ, and a table of every pair closes the run. A ratio between different
dtypes is labelled a dtype mismatch: it measures the dtypes as much as the engines.

    python -m benchmarks.embed_vs_sentence_transformers --rounds 3 --threads 1
    python -m benchmarks.embed_vs_sentence_transformers --pairs bfloat16:bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
CACHE = Path.home() / ".cache" / "minivllm-bench" / "minilm-l6-random"
# all-MiniLM-L6-v2's BertConfig
MINILM_SHAPE: dict[str, Any] = {
    "hidden_size": 384,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "max_position_embeddings": 512,
}


def build_model(out: Path) -> Path:
    """The random MiniLM-shaped sentence-transformers folder (built once, then reused)."""
    if (out / "modules.json").exists():
        return out
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    from tests.utils.pooling_utils import BERT_VOCAB, save_st_model

    base = out.parent / (out.name + "-base")
    base.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(BERT_VOCAB), initializer_range=0.05, **MINILM_SHAPE)
    BertModel(config).save_pretrained(base)
    (base / "vocab.txt").write_text("\n".join(BERT_VOCAB) + "\n")
    BertTokenizer(str(base / "vocab.txt"), do_lower_case=True).save_pretrained(base)
    return save_st_model(out, base, "mean", normalize=True)


def make_sentences(model: Path, count: int, seed: int) -> list[str]:
    """`count` sentences of 16-128 tokens (with [CLS] and [SEP]), lengths uniform at random."""
    from transformers import AutoTokenizer

    from tests.utils.pooling_utils import BERT_VOCAB

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    words = [w for w in BERT_VOCAB[5:] if w.isalpha() and not w.startswith("#")]
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        target = rng.randint(16, 128)
        text = ""
        while True:
            longer = (text + " " + rng.choice(words)).strip()
            if len(tokenizer(longer)["input_ids"]) > target:
                break
            text = longer
        sentences.append(text)
    return sentences


def run_one(
    engine: str,
    model: Path,
    sentences: list[str],
    threads: int,
    dtype: str,
    repeats: int = 1,
    save: Path | None = None,
) -> dict[str, Any]:
    """Embed `sentences` once to warm up, then `repeats` times timed; the fastest pass's seconds
    (on a busy machine the fastest pass is the one least disturbed by other jobs), and the dtype
    the engine ran. The embeddings go to `save` (float32 [N, H]) if given."""
    import torch

    torch.set_num_threads(threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if engine == "sentence-transformers":
            from sentence_transformers import SentenceTransformer

            torch_dtype = getattr(torch, dtype)
            st = SentenceTransformer(
                str(model), device="cpu", model_kwargs={"torch_dtype": torch_dtype}
            )
            ran = str(next(st.parameters()).dtype).removeprefix("torch.")

            def embed() -> torch.Tensor:  # [N, H]
                return st.encode(sentences, batch_size=32, convert_to_tensor=True).float()

        else:
            from minivllm import LLM

            llm = LLM(str(model), cpu_kv_cache_space=1, dtype=dtype)
            ran = str(llm.llm_engine.config.resolved.dtype).removeprefix("torch.")

            def embed() -> torch.Tensor:  # [N, H]
                outputs = llm.embed(sentences, use_tqdm=False)
                return torch.tensor([o.outputs.embedding for o in outputs])

    embed()
    passes = []
    for _ in range(repeats):
        start = time.perf_counter()
        vectors = embed()
        passes.append(time.perf_counter() - start)
        assert len(vectors) == len(sentences)
    if save is not None:
        torch.save(vectors, save)
    return {"seconds": min(passes), "dtype": ran}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-sentences", type=int, default=256)
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed passes per round; the fastest counts"
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        help="both engines' dtype: the same as --pairs DTYPE:DTYPE",
    )
    parser.add_argument(
        "--pairs",
        default="auto:float32,float32:float32,bfloat16:bfloat16,float16:float16",
        help="comma-separated minivllm_dtype:sentence_transformers_dtype pairs (the default: "
        "each engine's default, then each dtype on both sides)",
    )
    parser.add_argument(
        "--one", choices=["minivllm", "sentence-transformers"], help=argparse.SUPPRESS
    )
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dtype is not None and not args.one:
        args.pairs = f"{args.dtype}:{args.dtype}"
    pairs = [tuple(pair.split(":")) for pair in args.pairs.split(",")]
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in ("auto", *DTYPES) or pair[1] not in DTYPES:
            parser.error(f"--pairs: each must be minivllm_dtype:st_dtype from {DTYPES}, got {pair}")

    model = build_model(CACHE)
    sentences_file = CACHE.parent / f"minilm-sentences-{args.num_sentences}.json"
    if not sentences_file.exists():
        sentences_file.write_text(json.dumps(make_sentences(model, args.num_sentences, seed=0)))
    sentences = json.loads(sentences_file.read_text())

    if args.one:  # the child process: one engine, one timed pass, JSON on stdout
        result = run_one(
            args.one, model, sentences, args.threads, args.dtype, args.repeats, args.save
        )
        print(json.dumps(result))
        return

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokens = sum(len(tokenizer(s)["input_ids"]) for s in sentences)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load before: {os.getloadavg()[:3]}")
    print(
        f"{len(sentences)} sentences, {tokens} tokens; {args.threads} threads; {args.rounds} rounds "
        f"of {args.repeats} timed passes (the fastest counts)"
    )
    summary = [compare_pair(pair, args, sentences, tokens) for pair in pairs]
    print(f"load after: {os.getloadavg()[:3]}")
    print(
        "\n| minivllm | sentence-transformers | minivllm ÷ sentence-transformers | cosine (min) |"
    )
    print("|---|---|---|---|")
    for line in summary:
        print(line)


def compare_pair(
    pair: tuple[str, ...], args: argparse.Namespace, sentences: list[str], tokens: int
) -> str:
    """One dtype pair: the engines alternated for `args.rounds` rounds, then the medians, the
    throughput ratio and the embeddings' closeness; returns the pair's row of the summary."""
    import tempfile

    import torch
    import torch.nn.functional as F

    dtypes = dict(zip(["minivllm", "sentence-transformers"], pair))
    seconds: dict[str, list[float]] = {"minivllm": [], "sentence-transformers": []}
    ran: dict[str, str] = {}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        saved = {engine: Path(tmp) / f"{i}.pt" for i, engine in enumerate(seconds)}
        for round_ in range(args.rounds):
            for engine in seconds:
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.embed_vs_sentence_transformers", "--one", engine,
                     "--threads", str(args.threads), "--num-sentences", str(args.num_sentences),
                     "--dtype", dtypes[engine], "--repeats", str(args.repeats),
                     "--save", str(saved[engine])],
                    check=True, capture_output=True, text=True, env=env,
                )  # fmt: skip
                result = json.loads(out.stdout.strip().splitlines()[-1])
                took, ran[engine] = result["seconds"], result["dtype"]
                seconds[engine].append(took)
                print(
                    f"round {round_ + 1} {engine:>22} ({ran[engine]}): {took:.2f} s "
                    f"({len(sentences) / took:.1f} sentences/s)"
                )
        cosine = F.cosine_similarity(*(torch.load(saved[e]) for e in seconds)).min().item()
    medians = {engine: statistics.median(values) for engine, values in seconds.items()}
    ratio = medians["sentence-transformers"] / medians["minivllm"]
    for engine, median in medians.items():
        print(
            f"{engine:>22} ({ran[engine]}): median {median:.2f} s, "
            f"{len(sentences) / median:.1f} sentences/s, {tokens / median:.0f} tokens/s"
        )
    mismatch = "" if ran["minivllm"] == ran["sentence-transformers"] else ", a dtype mismatch"
    print(
        f"minivllm {pair[0]} ({ran['minivllm']}) / sentence-transformers {pair[1]}: "
        f"throughput {ratio:.2f}x{mismatch}; embeddings' cosine, min over sentences: {cosine:.7f}"
    )
    mine, theirs = (f"{ran[e]} {medians[e]:.2f} s" for e in seconds)
    label = "auto: " if pair[0] == "auto" else ""
    return f"| {label}{mine} | {theirs} | **{ratio:.2f}x**{mismatch} | {cosine:.7f} |"


if __name__ == "__main__":
    main()

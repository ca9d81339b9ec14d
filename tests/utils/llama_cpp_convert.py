"""A tiny transformers checkpoint as llama.cpp's convert_hf_to_gguf.py would write it, for tests.

The GGUF tests hold minivllm's reader to transformers: a random tiny model is saved with
`save_pretrained`, its safetensors file (what llama.cpp's converter reads) is written here as a
GGUF file under llama.cpp's conventions, and the file must give transformers' tokens. What the
converter does, restated from its behaviour (not its code):

- names: llama.cpp's (`blk.N.attn_q.weight`, `output_norm.weight`, ...); Gemma's four norms a layer
  are `attn_norm`, `post_attention_norm`, `ffn_norm` (the MLP's pre-norm) and `post_ffw_norm`;
  a MoE router is `ffn_gate_inp`;
- its llama converter (Llama, Mixtral) permutes the rows of q and k so that RoPE rotates
  interleaved pairs; its Gemma converters add 1 to every norm weight (Gemma's norm multiplies by
  1 + w); a MoE layer's experts are stacked per weight, [E, rows, columns] (`ffn_gate_exps`),
  or in older Mixtral files written one tensor per expert (`blk.N.ffn_gate.E.weight`);
- metadata under the architecture's prefix; these files carry no tokenizer, so `{arch}.vocab_size`
  says the vocabulary's size;
- Llama 3.1's `llama3` RoPE scaling is written as no metadata but a tensor, `rope_freqs.weight`:
  one divisor per rotated pair (1 for short wavelengths, the factor for long ones, a smooth blend
  in between), which llama.cpp divides its frequencies by.

A tensor of two or more dimensions may be stored quantized (`qtype_of(gguf_name)`):
gguf.quants.quantize writes Q4_0 ... Q8_0 from the weight; a K-quant is random blocks of the
right shape (gguf_utils.random_blocks), which do not approximate the weight.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from einops import rearrange
from safetensors.torch import load_file

from tests.utils.gguf_utils import QUANTIZABLE, quantized, scaled, write_gguf

# HuggingFace's per-layer module names -> llama.cpp's
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # phi3: q, k and v in one tensor
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate and up in one tensor
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # Qwen3-MoE's router
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's
}
GEMMA_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# An expert's weight in Mixtral's and Qwen3-MoE's checkpoints -> its part in llama.cpp's name.
EXPERT_PARTS = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)
GEMMA = ("gemma2", "gemma3")


def gguf_name(name: str, arch: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.{i}.{module}.{weight|bias}
    module, _, kind = rest.rpartition(".")
    names = GEMMA_LAYER_NAMES if arch in GEMMA else LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{kind}"


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order: within each head, row j of the first half goes to 2j and row j
    of the second half to 2j + 1."""
    return rearrange(w, "(heads pair half) ... -> (heads half pair) ...", heads=n_heads, pair=2)


def metadata(c: Any, arch: str) -> dict[str, object]:
    """The keys llama.cpp's converter writes for `arch`, from a transformers config `c`."""
    rope = dict(c.rope_parameters or {})
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (written as the base)
    fields: dict[str, object] = {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": getattr(c, "head_dim", None)
        or c.hidden_size // c.num_attention_heads,
        "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        "vocab_size": c.vocab_size,
    }
    if arch != "gemma2":  # llama.cpp's Gemma 2 converter writes no base: 10,000 is its default
        fields["rope.freq_base"] = float(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") == "linear":
        fields["rope.scaling.type"] = "linear"
        fields["rope.scaling.factor"] = float(rope["factor"])
    if arch == "llama" and getattr(c, "num_local_experts", None):  # Mixtral
        fields["expert_count"] = c.num_local_experts
        fields["expert_used_count"] = c.num_experts_per_tok
    if arch == "qwen3moe":
        fields["expert_count"] = c.num_experts
        fields["expert_used_count"] = c.num_experts_per_tok
        fields["expert_feed_forward_length"] = c.moe_intermediate_size
    if arch in GEMMA:
        fields["attention.sliding_window"] = c.sliding_window
        if c.final_logit_softcapping:
            fields["final_logit_softcapping"] = float(c.final_logit_softcapping)
    if arch == "gemma2":
        fields["attn_logit_softcapping"] = float(c.attn_logit_softcapping)
    return {f"{arch}.{key}": value for key, value in fields.items()}


def convert(
    config: Any,
    folder: Path,
    path: Path,
    arch: str,
    qtype_of: Callable[[str], int] | None = None,
    per_expert: bool = False,
    fields: dict[str, object] | None = None,
) -> Path:
    """Write the checkpoint in `folder` (transformers config `config`) as a GGUF file of llama.cpp
    architecture `arch` at `path`; `qtype_of` gives each tensor's GGML type (F32: 0), and
    `fields` the metadata where it is not the converter's (`metadata`)."""
    state = load_file(str(folder / "model.safetensors"))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    weights: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer, part) -> by expert
    for name, w in state.items():
        w = w.float()
        match = _EXPERT.match(name)
        if match:
            layer, e, part = match.groups()
            experts.setdefault((layer, EXPERT_PARTS[part]), {})[int(e)] = w
            continue
        if arch in GEMMA and name.endswith("norm.weight"):
            w = w + 1
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = permute(w, config.num_attention_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            w = permute(w, config.num_key_value_heads)
        weights[gguf_name(name, arch)] = w
    for (layer, part), by_expert in experts.items():
        if per_expert:
            for e, w in by_expert.items():
                weights[f"blk.{layer}.ffn_{part}.{e}.weight"] = w
        else:
            stack = torch.stack([by_expert[e] for e in sorted(by_expert)])  # [E, rows, columns]
            weights[f"blk.{layer}.ffn_{part}_exps.weight"] = stack
    rope = dict(config.rope_parameters or {})
    if arch == "llama" and rope.get("rope_type") == "llama3":
        weights["rope_freqs.weight"] = llama3_divisors(config, rope)
    tensors = {name: encode(name, w, qtype_of) for name, w in weights.items()}
    return write_gguf(
        path, metadata(config, arch) if fields is None else fields, tensors, arch=arch
    )


def llama3_divisors(config: Any, rope: dict[str, Any]) -> torch.Tensor:  # float32 [head_dim // 2]
    """llama3 scaling as the divisor of each RoPE frequency (what rope_freqs holds)."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = float(rope.get("rope_theta", 10000.0))
    factor, low, high = (float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old_len = float(rope["original_max_position_embeddings"])
    divisors = []
    for freq in 1.0 / base ** (torch.arange(0, dim, 2).double() / dim):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old_len / high:
            divisors.append(1.0)
        elif wavelen > old_len / low:
            divisors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors, dtype=torch.float32)


def encode(
    name: str, w: torch.Tensor, qtype_of: Callable[[str], int] | None
) -> tuple[np.ndarray, int]:
    """The tensor as the file stores it: float32, float16, or the blocks of its type (row by
    row)."""
    qtype = qtype_of(name) if qtype_of is not None and w.dim() >= 2 else 0
    array = w.numpy().astype(np.float32)
    if qtype in (0, 1):  # F32, F16
        return array.astype(np.float16 if qtype else np.float32), qtype
    rows = array.reshape(-1, array.shape[-1])  # quantization runs along rows only
    blocks = quantized(qtype, rows, seed=zlib.crc32(name.encode()))
    if qtype not in QUANTIZABLE:  # random K-quant blocks, scaled to the weight's size
        blocks = scaled(blocks, qtype, float(rows.std()))
    return blocks.reshape(*array.shape[:-1], -1), qtype


def use_own_cache(tmp_path: Path, monkeypatch: Any) -> None:
    """Converted GGUF folders go to the test's own cache (MINIVLLM_CACHE), after the CPU kernels
    are loaded from the machine's: in a fresh cache they would be compiled again (a minute)."""
    from minivllm.cpu.build import CpuKernelUnavailable, load_cpu_kernels

    with contextlib.suppress(CpuKernelUnavailable):  # the engine then runs its reference
        load_cpu_kernels()
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))


def qtypes_by_layer(table: dict[str, tuple[int, ...]]) -> Callable[[str], int]:
    """A `qtype_of` for `convert`: a tensor's type by its llama.cpp kind ("attn_q",
    "ffn_up_exps", "token_embd"), layer i taking entry i of the kind's tuple (cycling); an older
    file's per-expert tensor takes its stack's; a kind the table does not name stays F32."""

    def qtype_of(name: str) -> int:
        parts = name.split(".")  # blk.{i}.{kind}[.{expert}].weight, or {kind}.weight
        if parts[0] != "blk":
            return table.get(parts[0], (0,))[0]
        choices = table.get(parts[2] + ("_exps" if len(parts) == 5 else ""), (0,))
        return choices[int(parts[1]) % len(choices)]

    return qtype_of


def convert_lora(
    config: Any,
    adapter: Path,
    path: Path,
    arch: str,
    alpha: float | None = None,
    extra_fields: dict[str, object] | None = None,
) -> Path:
    """Write the PEFT adapter folder `adapter` (of a base with transformers config `config`) as
    llama.cpp's convert_lora_to_gguf.py does: `general.type = "adapter"`, `adapter.type =
    "lora"`, `adapter.lora.alpha`; each pair under its base tensor's name plus `.lora_a` [r, in]
    and `.lora_b` [out, r]; the base converter's q/k permutation applied to B's rows (it permutes
    the product B·A, whose rows are B's). `alpha` overrides the folder's lora_alpha;
    `extra_fields` are added to the metadata."""
    import json

    lora_config = json.loads((adapter / "adapter_config.json").read_text())
    state = load_file(str(adapter / "adapter_model.safetensors"))
    tensors: dict[str, tuple[np.ndarray, int]] = {}
    for key, w in state.items():  # base_model.model.{module}.lora_A.weight
        module, part = key.removeprefix("base_model.model.").rsplit(".", 2)[:2]
        w = w.float()
        if part == "lora_B" and arch == "llama" and module.endswith(("q_proj", "k_proj")):
            heads = "num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"
            w = permute(w, getattr(config, heads))
        suffix = {"lora_A": ".lora_a", "lora_B": ".lora_b"}[part]
        tensors[gguf_name(f"{module}.weight", arch) + suffix] = (w.numpy(), 0)
    fields: dict[str, object] = {
        "general.type": "adapter",
        "adapter.type": "lora",
        "adapter.lora.alpha": float(lora_config["lora_alpha"] if alpha is None else alpha),
        **(extra_fields or {}),
    }
    return write_gguf(path, fields, tensors, arch=arch)

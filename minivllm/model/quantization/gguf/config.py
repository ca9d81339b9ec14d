"""llama.cpp's GGUF metadata as the HuggingFace `config.json` it stands for.

A GGUF file describes its model in key/value metadata, each key prefixed with the file's
architecture (`general.architecture`): "gemma2.attention.sliding_window". `hf_config` writes those
keys in HuggingFace's spelling, so that one reader (the registry's `config_from_hf_dict`) types
every checkpoint, whatever file it came from, and the converted folder's config.json is that dict.

What the metadata leaves unsaid is what llama.cpp's loader hard-codes (src/llama-model.cpp, and
each architecture's graph), and minivllm assumes the same:

- **llama with experts is Mixtral**: `llama.expert_count` / `expert_used_count`; the router's
  top-k weights are renormalised (llama.cpp's `build_moe_ffn(..., norm_w=true)`).
- **qwen3moe** renormalises too, whatever `norm_topk_prob` the HuggingFace model had; its experts
  are `expert_feed_forward_length` wide (else `feed_forward_length / expert_used_count`). A layer
  without a router tensor (`blk.N.ffn_gate_inp`) is a dense MLP (Qwen3-MoE's `mlp_only_layers`).
- **gemma2 / gemma3**: the layers alternate windowed and global in a fixed pattern (every 2nd
  layer global for gemma2, every 6th for gemma3); the windowed layers of gemma3 rotate with
  base 10,000 and no scaling; gemma2's caps default to 50 (scores) and 30 (logits) and its window
  to 4,096; gemma3 has no score cap. `query_pre_attn_scalar` is not in the file: llama.cpp takes
  the head size, except for the 27B models (46 layers of gemma2, 62 of gemma3), whose scalar is
  hidden / heads (gemma_pytorch's configs, which llama.cpp cites).

GGUF does not record tied embeddings either: they are tied when the file has no `output.weight`.

**Embedding files** (llama.cpp's `--embedding` models):

- **bert** is transformers' `BertModel` (minivllm/model/models/bert.py): LayerNorm epsilon
  `attention.layer_norm_epsilon`, `tokenizer.ggml.token_type_count` token types, absolute
  positions; `attention.causal` is false (a causal file is refused). Its GELU is the exact one
  that transformers' BERT runs (llama.cpp's graph runs ggml's tanh approximation of it).
- **`{arch}.pooling_type`** (llama.cpp's `enum llama_pooling_type`) is what llama.cpp's converter
  read from sentence-transformers' Pooling module (`_try_set_pooling_type`), and
  `sentence_transformers_files` writes it back as those module files, so that the converted
  folder pools as the folder it came from did (minivllm/pooling/config.py reads them). The file
  does not say whether a Normalize module followed: embeddings are normalized, vLLM's default
  for `embed` (and llama.cpp's server's). Types 0 (none: a vector per token) and 4 (rank: a
  reranker's logits) are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from minivllm.model.config import UnsupportedModelError

# llama.cpp's `general.architecture` -> the HuggingFace architecture the registry knows it by
# (llama with experts is Mixtral: `hf_config` decides).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "bert": "BertModel",
}
# The architecture's `model_type` in transformers (AutoConfig reads it from config.json).
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "BertModel": "bert",
}
# llama.cpp's `enum llama_pooling_type` (`{arch}.pooling_type`) -> the `pooling_mode` of
# sentence-transformers' Pooling module; and the types no pooler here runs.
GGUF_POOLING_TYPES = {1: "mean", 2: "cls", 3: "lasttoken"}
_UNSUPPORTED_POOLING_TYPES = {0: "none", 4: "rank"}
# gemma2 / gemma3: every n-th layer is global (llama.cpp's `set_swa_pattern`), and the layer
# count of the 27B model, the one whose query_pre_attn_scalar is hidden / heads.
_GEMMA = {"gemma2": {"pattern": 2, "layers_27b": 46}, "gemma3": {"pattern": 6, "layers_27b": 62}}


def hf_config(
    fields: dict[str, Any], tensor_names: Collection[str], n_vocab: int = 0
) -> dict[str, Any]:
    """The config.json of the model a GGUF file holds, from its metadata (`fields`, vocabulary
    arrays left out) and the names of its tensors. `n_vocab` is the vocabulary's size where the
    file has no `{arch}.vocab_size` (older converters wrote none): llama.cpp then counts the
    tokenizer's tokens (`tokenizer.ggml.tokens`), which `gguf.gguf_hf_config` does."""
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; minivllm runs "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}")
        return default if value is None else value

    pooling_mode(fields)  # a pooling type no pooler here runs is refused before anything else

    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    scaling: dict[str, Any] | None = None
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
    eos = fields.get("tokenizer.ggml.eos_token_id")
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(get("vocab_size") or n_vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0)),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        # Qwen3's and Gemma's head_dim is not hidden / heads; llama.cpp writes it as the key length.
        "head_dim": int(
            get("attention.key_length") or get("rope.dimension_count") or hidden // heads
        ),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": scaling,
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "sliding_window": get("attention.sliding_window"),  # Phi-3's; refused where it is short
        "hidden_act": "silu",
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }
    if arch == "llama" and get("expert_count"):
        cfg.update(_mixtral(get))
    elif arch == "qwen3moe":
        cfg.update(_qwen3_moe(get, tensor_names, cfg))
    elif arch in _GEMMA:
        cfg.update(_gemma(arch, get, cfg))
    elif arch == "bert":
        cfg.update(_bert(get, fields))
    cfg["model_type"] = _MODEL_TYPES[cfg["architectures"][0]]
    return cfg


def _mixtral(get: Callable[..., Any]) -> dict[str, Any]:
    """llama.cpp's `llama` architecture with experts: `feed_forward_length` is each expert's."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
    }


def _qwen3_moe(
    get: Callable[..., Any], tensor_names: Collection[str], cfg: dict[str, Any]
) -> dict[str, Any]:
    used = int(get("expert_used_count"))
    width = get("expert_feed_forward_length") or cfg["intermediate_size"] // used
    dense = [
        layer
        for layer in range(cfg["num_hidden_layers"])
        if f"blk.{layer}.ffn_gate_inp.weight" not in tensor_names
    ]
    return {
        "num_experts": int(get("expert_count")),
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(width),
        # A dense layer's MLP width; a file of sparse layers only may not say it.
        "intermediate_size": cfg["intermediate_size"] or int(width),
        "norm_topk_prob": True,  # llama.cpp's qwen3moe graph always renormalises
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _gemma(arch: str, get: Callable[..., Any], cfg: dict[str, Any]) -> dict[str, Any]:
    layers, pattern = cfg["num_hidden_layers"], _GEMMA[arch]["pattern"]
    big = layers == _GEMMA[arch]["layers_27b"]
    window = get("attention.sliding_window", 4096 if arch == "gemma2" else None)
    if window is None:
        raise UnsupportedModelError(f"a {arch} GGUF file without attention.sliding_window")
    gemma2 = arch == "gemma2"
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"]
        if big
        else cfg["head_dim"],
        "attn_logit_softcapping": float(get("attn_logit_softcapping", 50.0)) if gemma2 else None,
        "final_logit_softcapping": get("final_logit_softcapping", 30.0 if gemma2 else None),
        "sliding_window": int(window),
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "rope_local_base_freq": None if gemma2 else 10000.0,
    }


def _bert(get: Callable[..., Any], fields: dict[str, Any]) -> dict[str, Any]:
    if get("attention.causal", False):
        raise UnsupportedModelError(
            "a bert GGUF file with attention.causal = true is not supported (BERT attends both "
            "ways)"
        )
    return {
        "hidden_act": "gelu",
        "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-12)),
        "type_vocab_size": int(fields.get("tokenizer.ggml.token_type_count") or 2),
        "position_embedding_type": "absolute",
        "tie_word_embeddings": False,
    }


def pooling_mode(fields: dict[str, Any]) -> str | None:
    """sentence-transformers' pooling mode for the file's `{arch}.pooling_type`; None where it
    has none. A type no pooler here runs is refused by name, with the allowed values."""
    arch = fields.get("general.architecture")
    value = fields.get(f"{arch}.pooling_type")
    if value is None:
        return None
    if int(value) not in GGUF_POOLING_TYPES:
        name = _UNSUPPORTED_POOLING_TYPES.get(int(value), "unknown")
        allowed = ", ".join(f"{k} ({v})" for k, v in GGUF_POOLING_TYPES.items())
        raise UnsupportedModelError(
            f"{arch}.pooling_type = {value} ({name}) is not supported; minivllm pools with "
            f"pooling_type {allowed}"
        )
    return GGUF_POOLING_TYPES[int(value)]


def sentence_transformers_files(fields: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """The sentence-transformers module files (relative path -> JSON) that stand for the file's
    `pooling_type`: Transformer, Pooling and Normalize; none for a file without one."""
    mode = pooling_mode(fields)
    if mode is None:
        return {}
    kinds = ("Transformer", "Pooling", "Normalize")
    paths = ("", "1_Pooling", "2_Normalize")
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(zip(kinds, paths))
    ]
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode": mode}
    return {"modules.json": modules, "1_Pooling/config.json": pooling}

"""Llama-like decoders as a typed config, read from a HuggingFace `config.json` or GGUF metadata.

Everything the model code needs and nothing else (the other families differ from Llama by a few
switches: `qkv_bias`, `qk_norm`, `sliding_window`). It reads HuggingFace's JSON, both transformers
4's `rope_theta`/`rope_scaling` and transformers 5's `rope_parameters`; a GGUF file's metadata is
first written as the config.json it stands for (minivllm/model/quantization/gguf/config.py), so the model never sees where
its weights came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# What an architecture's config.json leaves unsaid, its modelling code hard-coding it. (Which
# architectures run, and by which class, is the model registry's: registry.py.)
ARCHITECTURE_FACTS: dict[str, dict[str, Any]] = {
    "Qwen2ForCausalLM": {"qkv_bias": True},  # q/k/v carry a bias, o does not
    "Qwen3ForCausalLM": {"qk_norm": True},  # each head's q and k are RMS-normalised before RoPE
    "Qwen2Model": {"qkv_bias": True},  # the bare decoders (pooling models): the same facts
    "Qwen3Model": {"qk_norm": True},
    "Qwen2ForSequenceClassification": {"qkv_bias": True},  # a causal LM read as a classifier
    "Qwen3ForSequenceClassification": {"qk_norm": True},
}
# A bare decoder's checkpoint (`Qwen3Model`) has no LM head: it is tied to the embedding, so that
# the model's shapes stay a causal LM's at no cost (the pooling runner never computes logits).
BARE_DECODERS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this code cannot run exactly."""


@dataclass
class LlamaConfig:
    """Shapes and constants of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int  # d_model
    intermediate_size: int  # SwiGLU inner width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads: grouped-query attention; 1: multi-query
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or {"rope_type": "linear", "factor": ...}, {"rope_type": "llama3", "factor": ...,
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} or a GGUF file's
    # rope_freqs divisors, {"rope_type": "freq_factors", "freq_factors": [...]}.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # a bias on q, k, v and o (Llama's flag; Qwen3's)
    qkv_bias: bool = False  # a bias on q, k and v only (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's q and k, before RoPE (Qwen3)
    mlp_bias: bool = False
    sliding_window: int | None = None  # attend to the last W tokens only (Mistral); None: all
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)  # a model may stop on several tokens
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_attention_heads < 1 or self.num_key_value_heads < 1:
            raise ValueError("num_attention_heads and num_key_value_heads must be at least 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Read a HuggingFace `config.json` (transformers 4 or 5 spelling)."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)"
            )
        rope = dict(cfg.get("rope_parameters") or {})  # transformers 5 keeps theta and scaling here
        partial = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
        if float(partial) != 1.0:  # Phi-3's option (and others'): RoPE on part of each head
            raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported")
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope or None
        if scaling is not None:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False))
            or arch in BARE_DECODERS,
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=_sliding_window(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            architecture=arch,
            **ARCHITECTURE_FACTS.get(arch, {}),
        )


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window of a config that uses one (Qwen2/3 write one that is off: `use_sliding_window`)."""
    kinds = cfg.get("layer_types") or ["sliding_attention"]
    if cfg.get("use_sliding_window") is False or "sliding_attention" not in kinds:
        return None
    if "full_attention" in kinds:  # Qwen2's max_window_layers: the first layers attend fully
        raise UnsupportedModelError("mixed sliding and full attention layers: unsupported")
    return None if cfg.get("sliding_window") is None else int(cfg["sliding_window"])

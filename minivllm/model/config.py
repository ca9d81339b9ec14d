"""The Llama architecture as a typed config, read from a HuggingFace `config.json` or GGUF metadata.

Everything the model code needs and nothing else. Two readers feed it — HuggingFace's JSON (both
the `rope_theta`/`rope_scaling` spelling of transformers 4 and the `rope_parameters` spelling of
transformers 5) and llama.cpp's GGUF key/value metadata — so the model itself never sees where its
weights came from. (GGUF's reader is `config_from_gguf_fields` in gguf.py, loaded with GGUF files.)

Tier: leaves. It imports no other tier of the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Architectures whose math this code reproduces exactly. Mistral is Llama's math when it has no
# sliding window, so it is accepted on that condition only.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    # None, or {"rope_type": "linear", "factor": ...} or {"rope_type": "llama3", "factor": ...,
    # "low_freq_factor": ..., "high_freq_factor": ..., "original_max_position_embeddings": ...}.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
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

    def to_hf_dict(self) -> dict[str, Any]:
        """The config in HuggingFace's `config.json` spelling (what `from_hf_dict` reads back)."""
        return {
            "architectures": [self.architecture],
            "model_type": "mistral" if self.architecture == "MistralForCausalLM" else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0]
            if len(self.eos_token_ids) == 1
            else self.eos_token_ids,
        }

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Read a HuggingFace `config.json` (transformers 4 or 5 spelling)."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; minivllm runs {SUPPORTED_ARCHITECTURES}"
            )
        if arch == "MistralForCausalLM" and cfg.get("sliding_window") is not None:
            raise UnsupportedModelError(
                "MistralForCausalLM with a sliding window is not supported (set sliding_window to null "
                "only if the model was trained without it)"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)"
            )
        rope = dict(cfg.get("rope_parameters") or {})  # transformers 5 keeps theta and scaling here
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            architecture=arch,
        )

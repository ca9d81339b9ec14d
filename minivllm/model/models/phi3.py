"""Phi-3 (Microsoft): Llama's math, with q/k/v and gate/up stored fused in the checkpoint.

transformers' `modeling_phi3.py` computes what Llama does (RMSNorm, RoPE attention, SwiGLU MLP
with the gate first in the fused output), but its weights are `self_attn.qkv_proj` ([q + 2 kv,
hidden]) and `mlp.gate_up_proj` ([2 I, hidden]) rather than Llama's separate projections. minivllm
fuses them the same way, so the one difference is in loading: `packed_checkpoint` tells the
weight loader (weights.py) to cut each fused tensor into its parts and hand each to the fused
layer's loader, which, under tensor parallelism, keeps only this rank's heads of each part
(vLLM's `packed_modules_mapping`).

Phi-3's long-context variants scale RoPE with `longrope` (two per-frequency factor lists);
that is refused by name when the config is read (config.py's supported rope types), as is a
`partial_rotary_factor` other than 1. Phi-3-mini's config sets `sliding_window` (2047); the
loader refuses such a window shorter than max_model_len until sliding-window attention lands.
"""

from __future__ import annotations

from typing import ClassVar

from minivllm.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: Llama's decoder, loaded from fused `qkv_proj` and `gate_up_proj` tensors."""

    packed_checkpoint: ClassVar[bool] = True

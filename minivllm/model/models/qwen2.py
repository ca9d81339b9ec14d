"""Qwen2 and Qwen2.5 (Alibaba): Llama's decoder with a bias on the q, k and v projections.

Against Llama (llama.py), transformers' `modeling_qwen2.py` differs in one line of the attention:
`q_proj`, `k_proj` and `v_proj` are built with `bias=True`, `o_proj` without. There is no config
flag for it, so the config reader supplies one (`qkv_bias`, `ARCHITECTURE_FACTS` in config.py),
and Llama's fused projection takes it: one bias of q + 2 kv rows, split by heads like the weight
under tensor parallelism (`QKVParallelLinear`). The small Qwen2.5 models (0.5B-3B) tie their
embeddings, which Llama's code already does. Qwen2's optional sliding window
(`use_sliding_window`) is off in every released checkpoint; one that turns it on is refused by
the loader.

So the math is Llama's, and this class exists as vLLM's `qwen2.py` does: the registry's target
for `Qwen2ForCausalLM`, and the place a Qwen2 difference would go. Walked end to end in the docs'
"Adding a model" page (docs/concepts/adding-a-model.md).
"""

from __future__ import annotations

from minivllm.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: `LlamaForCausalLM` built from a config with `qkv_bias=True`."""

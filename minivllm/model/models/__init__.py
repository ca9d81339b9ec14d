"""One file a model family, each the math of its decoder over the shared layers (vLLM's
`vllm/model_executor/models/`).

`llama.py` is the base: the others differ from it by a module or two and subclass or compose it
(Qwen2's q/k/v bias, Qwen3's q/k norms, Phi-3's fused checkpoint tensors, Mixtral's and Qwen3-MoE's
experts, Gemma 2/3's sandwich norms, soft caps and windows). `adapters.py` reads a causal LM as a
classifier through some of its LM head's rows (vLLM's `as_seq_cls_model`: Qwen3-Reranker).
`registry.py` maps a checkpoint's `architectures` to the class that runs it.
"""

"""LoRA adapters, many in one batch (vLLM's `vllm/lora/`; Punica and S-LoRA's batching).

A request may run under an adapter (`LoRARequest`); requests of different adapters, and of the
base model, share one step. An adapter is a per-row attribute of the batch, like the block table:
each adapted linear holds the A/B of `max_loras` resident adapters stacked by slot, and one shrink
and one expand over the whole batch add each row's delta.

- `request.py`     `LoRARequest(lora_name, lora_int_id, lora_path)`
- `errors.py`      the typed errors of a bad adapter, each naming what is wrong
- `peft_loader.py` a PEFT folder (adapter_config.json + adapter_model.safetensors), checked
- `gguf_loader.py` a llama.cpp GGUF adapter file (convert_lora_to_gguf.py's), on a GGUF base
- `punica.py`      shrink / expand in plain PyTorch: the specification
- `triton_punica.py` the same two ops as Triton kernels (the triton backend's)
- `punica_selector.py` which implementation a backend runs (the cpu backend's: minivllm/cpu/)
- `layers.py`      the wrappers that give a linear (and the slices of a fused one) its delta, each
                   holding its rank's shard of A/B under tensor parallelism, as vLLM's do
- `manager.py`     device slots and the host-memory LRU: add, activate, evict

The scheduler admits a request only when its adapter can get a slot, and the prefix cache keys a
block by its adapter too (minivllm/core/); the model runner maps each row to its slot before the
forward (minivllm/worker/model_runner.py).
"""

"""The attention backends, each an implementation of minivllm/attention/abstract.py.

- `reference.py`  gather each request's K/V through its block table, then scaled-dot-product
                  attention: the specification every other backend is held to
- `cpu.py`        the CPU default: every row through the compiled paged kernels (minivllm/cpu/)
- `triton.py`     the CUDA default: fused Triton kernels for the cache write, prefill and decode,
                  with `triton_plan.py` (the per-step work list), `triton_kernels.py` and
                  `triton_decode_kernels.py` (the kernels), `triton_encoder_kernels.py`
                  (encoder-only attention: variable-length, bidirectional, no cache)

Backends are plug-ins: the platform names them (minivllm/platforms/) and the selector
(minivllm/attention/selector.py) imports the one a step needs by that name.
"""

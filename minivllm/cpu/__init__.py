"""The CPU plug-in: the compiled kernels (`csrc/`), their build per instruction-set level, their ops.

vLLM keeps its kernels in a top-level `csrc/` beside the Python package and compiles them when the
package is built. Here the C++ sources are in `csrc/` and are compiled on first use (`build.py`,
one build per instruction-set level: `isa.py`), together with the Python wrappers of the ops
(`ops.py`), the custom ops' CPU forwards (`op_forwards.py`) and the fused MoE op's (`moe.py`). The
CPU platform (minivllm/platforms/cpu.py) names these modules, which are imported by those names at
first use. What uses the kernels sits above: the CPU attention backend
(minivllm/attention/backends/cpu.py) and the decode loop (minivllm/worker/cpu_decode_loop.py).

What lives here, and the test that holds each source to its plain-PyTorch reference:

| source | ops | test |
|---|---|---|
| `cpu_attention.cpp` | `paged_decode`, `reshape_and_cache` | tests/cpu/test_kernels_cpu_attention.py |
| `cpu_attention_avx512.cpp` | the float32 AVX-512 loops of `paged_decode` | tests/cpu/test_kernels_cpu_attention_avx512.py |
| `cpu_attention_avx2.cpp` | the same loops for AVX2 (`paged_decode_loops` says which run) | tests/cpu/test_kernels_cpu_attention_avx512.py |
| `cpu_layernorm.cpp` | `rms_norm`, `fused_add_rms_norm` | tests/cpu/test_kernels_cpu_layernorm.py |
| `cpu_activation_rope.cpp` | `silu_and_mul`, `rotary_embedding` | tests/cpu/test_kernels_cpu_activation_rope.py |
| `cpu_skinny_gemm.cpp` | `skinny_gemm` | tests/cpu/test_kernels_cpu_skinny_gemm.py |
| `cpu_gguf_gemm.cpp` | `gguf_linear`, `gguf_dequantize` | tests/cpu/test_kernels_cpu_gguf.py |
| `cpu_lora_punica.cpp` | `lora_shrink`, `lora_expand` (Punica's batched LoRA ops, run by minivllm/lora/ on the `cpu` backend) | tests/cpu/test_kernels_cpu_lora_punica.py |
| `cpu_decode_layers.cpp` | `decode_layers` (wrapped by minivllm/worker/cpu_decode_loop.py, which declares what it covers) | tests/worker/test_kernels_cpu_decode_loop.py, tests/worker/test_decode_loop_coverage.py |

`build.py` compiles them into one library (tests/cpu/test_kernels_cpu_build.py). The model's own
files import nothing from here.
"""

"""All of minivllm's compiled code, in one place: the C++ sources, their build and their Python ops.

vLLM keeps its kernels in a top-level `csrc/` beside the Python package and compiles them when the
package is built. Here they are compiled on first use (`cpu_build.py`), so they must ship inside
the package; `kernels` says what the folder holds to a reader of Python imports
(`from minivllm.cpu import ops as cpu_ops`), where `csrc` would only say "C++ sources".

What lives here, and the test that holds each source to its plain-PyTorch reference:

| source | ops | test |
|---|---|---|
| `cpu_attention.cpp` | `paged_decode`, `reshape_and_cache` | tests/test_kernels_cpu_attention.py |
| `cpu_attention_avx512.cpp` | the float32 AVX-512 loops of `paged_decode` | tests/test_kernels_cpu_attention_avx512.py |
| `cpu_layernorm.cpp` | `rms_norm`, `fused_add_rms_norm` | tests/test_kernels_cpu_layernorm.py |
| `cpu_activation_rope.cpp` | `silu_and_mul`, `rotary_embedding` | tests/test_kernels_cpu_activation_rope.py |
| `cpu_skinny_gemm.cpp` | `skinny_gemm` | tests/test_kernels_cpu_skinny_gemm.py |
| `cpu_decode_layers.cpp` | `decode_layers` (wrapped by `cpu_decode_layers.py`) | tests/test_kernels_cpu_decode_loop.py |

`cpu_build.py` compiles them into one library (tests/test_kernels_cpu_build.py), `cpu_ops.py`
wraps each op in a Python function. Who calls them: the CPU attention backend
(minivllm/cpu/attention.py), the CPU platform's custom-op forwards
(minivllm/cpu/op_forwards.py), and the model runner's decode replay
(`cpu_decode_layers.py`). The model's own files import nothing from here.
"""

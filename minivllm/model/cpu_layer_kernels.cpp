// Fused per-token layer ops for CPUs: RMSNorm (alone and with its residual add), SiLU-and-mul,
// and rotary embedding, each one pass over its rows.
//
// Between a decoder layer's matmuls, plain PyTorch runs each formula as a chain of elementwise
// ops, and every link reads and writes the whole activation: RMSNorm alone is float(), pow, mean,
// add, rsqrt, mul, to() and mul, plus the residual add before it; RoPE is two muls, a neg, a cat
// and an add. On SmolLM2 with 32 requests that chain is ~16% of an engine step, spent moving bytes,
// not computing. Each op here reads its inputs once and writes its outputs once, keeping a row in
// registers and L1 between the formula's steps (measured on 2 cores at 32 and 300 tokens: 3-15x
// faster than the plain forms; SiLU-and-mul, bound by its exp, 1.5-2x). vLLM's CPU backend does
// the same (csrc/cpu/layernorm.cpp, activation.cpp, pos_encoding.cpp); the ops keep vLLM's names,
// and the norms and SiLU-and-mul its arguments too. rotary_embedding differs: it takes queries
// and keys as one tensor (they sit side by side in the qkv output) and minivllm's cos/sin table.
//
// The specification of each op is its plain-PyTorch form (RMSNorm and the MLP in
// minivllm/model/llama.py, RotaryEmbedding in minivllm/model/rope.py), and
// tests/test_cpu_layer_kernels.py holds them equal. Every dtype computes in float32 and rounds
// once per output, except where the specification itself rounds (RMSNorm casts back to the input
// dtype before the weight, as transformers does, so bfloat16 rounds at the same place).
//
// Rows run in parallel on PyTorch's intra-op pool (at::parallel_for), in tasks of at least ATen's
// own grain, so a decode step's handful of rows stays on the calling thread: waking the pool costs
// more than they do. Inner loops are plain, unit-stride and free of aliasing (__restrict__ helper
// arguments), which is what lets -O3 -ffast-math with the host's SIMD flags vectorize them, sums
// included (fast-math lets the compiler split one sum into several partial ones; this is also why
// results differ from PyTorch's in the last bits). Built into the same library as the attention
// kernel by minivllm/attention/cpu_build.py, whose cpu_kernels.cpp owns the namespace
// (TORCH_LIBRARY); this file adds to it (TORCH_LIBRARY_FRAGMENT).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// Rows per parallel task: at least ATen's grain for its own elementwise ops (32K elements,
// at::internal::GRAIN_SIZE in TensorIterator.h, a header too heavy to include for one number).
constexpr int64_t kGrainElems = 32768;

inline int64_t rows_per_task(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems));
}

void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
}

void check_same_dtype(const at::Tensor& t, const at::Tensor& input, const char* op,
                      const char* name) {
  TORCH_CHECK(t.scalar_type() == input.scalar_type(), op, ": ", name,
              " must have the input's dtype ", input.scalar_type(), ", got ", t.scalar_type());
}

// ------------------------------------------------------------------------------------ RMSNorm
template <typename scalar_t>
inline float sum_of_squares(const scalar_t* __restrict__ x, int64_t n) {  // x: [n]
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = float(x[i]);
    sum += v * v;
  }
  return sum;
}

// 1 / sqrt(mean(x^2) + eps), from a row's sum of squares.
inline float inverse_rms(float sum_sq, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_sq / float(n) + eps);
}

// out = weight * dtype(x * inv_rms): the cast back to scalar_t comes before the weight, as in
// transformers' LlamaRMSNorm (a no-op for float32).
template <typename scalar_t>
inline void normalize_row(scalar_t* __restrict__ out,       // [n]
                          const scalar_t* __restrict__ x,   // [n]
                          const scalar_t* __restrict__ w,   // [n]
                          float inv_rms, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = scalar_t(float(scalar_t(float(x[i]) * inv_rms)) * float(w[i]));
}

template <typename scalar_t>
void rms_norm_kernel(scalar_t* __restrict__ out,           // [T, hidden] contiguous
                     const scalar_t* __restrict__ input,   // [T, hidden], rows input_stride apart
                     const scalar_t* __restrict__ weight,  // [hidden]
                     int64_t num_tokens, int64_t hidden, int64_t input_stride, float eps) {
  at::parallel_for(0, num_tokens, rows_per_task(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* x = input + t * input_stride;
      const float inv_rms = inverse_rms(sum_of_squares(x, hidden), hidden, eps);
      normalize_row(out + t * hidden, x, weight, inv_rms, hidden);
    }
  });
}

// out = input * rsqrt(mean(input^2, -1) + epsilon) * weight, row by row.
void rms_norm(const at::Tensor& out,     // [T, hidden] contiguous
              const at::Tensor& input,   // [T, hidden], last dim contiguous, any row stride
              const at::Tensor& weight,  // [hidden]
              double epsilon) {
  const char* op = "rms_norm";
  check_cpu(input, op, "input");
  check_cpu(out, op, "out");
  check_cpu(weight, op, "weight");
  TORCH_CHECK(input.dim() == 2, op, ": input must be 2-D [T, hidden], got ", input.dim(), "-D");
  const int64_t num_tokens = input.size(0), hidden = input.size(1);
  TORCH_CHECK(hidden <= 1 || input.stride(1) == 1, op,
              ": input's last dim must be contiguous (stride 1), got stride ", input.stride(1));
  TORCH_CHECK(out.sizes() == input.sizes() && out.is_contiguous(), op,
              ": out must be a contiguous tensor of the input's shape ", input.sizes(), ", got ",
              out.sizes(), out.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(), op,
              ": weight must be a contiguous [hidden] = [", hidden, "] tensor, got ",
              weight.sizes());
  check_same_dtype(out, input, op, "out");
  check_same_dtype(weight, input, op, "weight");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, input.scalar_type(), "rms_norm", [&] {
        rms_norm_kernel<scalar_t>(out.data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                                  weight.const_data_ptr<scalar_t>(), num_tokens, hidden,
                                  input.stride(0), static_cast<float>(epsilon));
      });
}

// r += x, rounded to scalar_t as the decoder layer's `hidden + attn` is.
template <typename scalar_t>
inline void add_row(scalar_t* __restrict__ r, const scalar_t* __restrict__ x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) r[i] = scalar_t(float(x[i]) + float(r[i]));  // r, x: [n]
}

template <typename scalar_t>
void fused_add_rms_norm_kernel(scalar_t* __restrict__ input,     // [T, hidden] in: x, out: normed
                               scalar_t* __restrict__ residual,  // [T, hidden] in: r, out: x + r
                               const scalar_t* __restrict__ weight,  // [hidden]
                               int64_t num_tokens, int64_t hidden, float eps) {
  at::parallel_for(0, num_tokens, rows_per_task(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* x = input + t * hidden;
      scalar_t* r = residual + t * hidden;
      // Three loops over the row, but one pass over memory: the row (a few KiB) is still in L1
      // for the second and third. Separate loops vectorize where one fused loop did not (storing
      // the rounded sum and squaring it in one statement defeats GCC for bfloat16).
      add_row(r, x, hidden);
      normalize_row(x, r, weight, inverse_rms(sum_of_squares(r, hidden), hidden, eps), hidden);
    }
  });
}

// residual = input + residual; input = rms_norm(residual) * weight; both in place. This is the
// decoder layer's `hidden + attn` followed by the next norm, in one pass.
void fused_add_rms_norm(const at::Tensor& input,     // [T, hidden] contiguous
                        const at::Tensor& residual,  // [T, hidden] contiguous
                        const at::Tensor& weight,    // [hidden]
                        double epsilon) {
  const char* op = "fused_add_rms_norm";
  check_cpu(input, op, "input");
  check_cpu(residual, op, "residual");
  check_cpu(weight, op, "weight");
  TORCH_CHECK(input.dim() == 2 && input.is_contiguous(), op,
              ": input must be a contiguous 2-D [T, hidden] tensor, got ", input.sizes(),
              input.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.is_contiguous(), op,
              ": residual must be a contiguous tensor of the input's shape ", input.sizes(),
              ", got ", residual.sizes(), residual.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(input.numel() == 0 || input.data_ptr() != residual.data_ptr(), op,
              ": input and residual must be different tensors");
  const int64_t num_tokens = input.size(0), hidden = input.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(), op,
              ": weight must be a contiguous [hidden] = [", hidden, "] tensor, got ",
              weight.sizes());
  check_same_dtype(residual, input, op, "residual");
  check_same_dtype(weight, input, op, "weight");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, input.scalar_type(), "fused_add_rms_norm", [&] {
        fused_add_rms_norm_kernel<scalar_t>(
            input.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
            weight.const_data_ptr<scalar_t>(), num_tokens, hidden, static_cast<float>(epsilon));
      });
}

// ------------------------------------------------------------------------------- SiLU and mul
// silu(g) = g / (1 + exp(-g)). Under fast-math a vectorized division is a reciprocal estimate
// refined by one Newton step, which turns 1 / inf into NaN: exp(-g) is capped at exp(80) (its
// reciprocal still a normal float), so for g < -80 silu is ~1e-35 * g instead of -0. The exp
// vectorizes as glibc's vector expf (libmvec), which fast-math allows.
template <typename scalar_t>
inline void silu_and_mul_row(scalar_t* __restrict__ out,         // [d]
                             const scalar_t* __restrict__ gate,  // [d]
                             const scalar_t* __restrict__ up,    // [d]
                             int64_t d) {
  for (int64_t i = 0; i < d; ++i) {
    const float g = float(gate[i]);
    out[i] = scalar_t(g / (1.f + std::exp(std::min(-g, 80.f))) * float(up[i]));
  }
}

template <typename scalar_t>
void silu_and_mul_kernel(scalar_t* __restrict__ out,          // [T, d] contiguous
                         const scalar_t* __restrict__ input,  // [T, 2 * d], rows input_stride apart
                         int64_t num_tokens, int64_t d, int64_t input_stride) {
  at::parallel_for(0, num_tokens, rows_per_task(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* gate = input + t * input_stride;  // [d], then up: [d]
      silu_and_mul_row(out + t * d, gate, gate + d, d);
    }
  });
}

// out = silu(input[:, :d]) * input[:, d:]: the SwiGLU MLP's activation, gate then up halves.
void silu_and_mul(const at::Tensor& out,    // [T, d] contiguous
                  const at::Tensor& input)  // [T, 2 * d], last dim contiguous, any row stride
{
  const char* op = "silu_and_mul";
  check_cpu(input, op, "input");
  check_cpu(out, op, "out");
  TORCH_CHECK(input.dim() == 2, op, ": input must be 2-D [T, 2 * d], got ", input.dim(), "-D");
  TORCH_CHECK(input.size(1) % 2 == 0, op,
              ": input's last dim must be even (gate and up halves), got ", input.size(1));
  TORCH_CHECK(input.size(1) <= 1 || input.stride(1) == 1, op,
              ": input's last dim must be contiguous (stride 1), got stride ", input.stride(1));
  const int64_t num_tokens = input.size(0), d = input.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == num_tokens && out.size(1) == d &&
                  out.is_contiguous(),
              op, ": out must be a contiguous [T, d] = [", num_tokens, ", ", d, "] tensor, got ",
              out.sizes());
  check_same_dtype(out, input, op, "out");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, input.scalar_type(), "silu_and_mul", [&] {
        silu_and_mul_kernel<scalar_t>(out.data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                                      num_tokens, d, input.stride(0));
      });
}

// --------------------------------------------------------------------------- rotary embedding
// NeoX-style RoPE of one head in place: the pairs are (x[i], x[i + half]). `lo` and `hi` are the
// head's two halves, which never overlap, so the loop may be vectorized without a runtime check.
template <typename scalar_t>
inline void rotate_head(scalar_t* __restrict__ lo,        // [half] x[:half]
                        scalar_t* __restrict__ hi,        // [half] x[half:]
                        const float* __restrict__ cos,    // [2 * half]
                        const float* __restrict__ sin,    // [2 * half]
                        int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = float(lo[i]), x2 = float(hi[i]);
    lo[i] = scalar_t(x1 * cos[i] - x2 * sin[i]);
    hi[i] = scalar_t(x2 * cos[i + half] + x1 * sin[i + half]);
  }
}

template <typename scalar_t>
void rotary_embedding_kernel(const int64_t* __restrict__ positions,  // [T]
                             scalar_t* __restrict__ x,  // [T, heads, head_dim], rows x_stride apart
                             const float* __restrict__ cos_sin,  // [2, max_positions, head_dim]
                             int64_t num_tokens, int64_t heads, int64_t head_dim,
                             int64_t x_stride, int64_t max_positions) {
  const int64_t half = head_dim / 2;
  const float* sin_table = cos_sin + max_positions * head_dim;  // cos_sin[1]
  at::parallel_for(0, num_tokens, rows_per_task(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      // Every head of a token turns by the same angles: one cos/sin row, read once per token.
      const float* cos = cos_sin + positions[t] * head_dim;  // [head_dim]
      const float* sin = sin_table + positions[t] * head_dim;  // [head_dim]
      scalar_t* row = x + t * x_stride;  // [heads, head_dim]
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* head = row + h * head_dim;
        rotate_head(head, head + half, cos, sin, half);
      }
    }
  });
}

// x = x * cos + rotate_half(x) * sin at each token's position, in place; rotate_half(x) is
// cat(-x[..., half:], x[..., :half]). x may be the query-and-key part of the fused qkv output, a
// view whose rows are longer than heads * head_dim: the row stride is passed, not required.
void rotary_embedding(const at::Tensor& positions,  // int64 [T]
                      const at::Tensor& x,          // [T, heads, head_dim]
                      const at::Tensor& cos_sin) {  // float32 [2, max_positions, head_dim]
  const char* op = "rotary_embedding";
  check_cpu(positions, op, "positions");
  check_cpu(x, op, "x");
  check_cpu(cos_sin, op, "cos_sin");
  TORCH_CHECK(x.dim() == 3, op, ": x must be 3-D [T, heads, head_dim], got ", x.dim(), "-D");
  const int64_t num_tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(head_dim % 2 == 0, op, ": head_dim must be even, got ", head_dim);
  TORCH_CHECK(head_dim <= 1 || x.stride(2) == 1, op,
              ": x's last dim must be contiguous (stride 1), got stride ", x.stride(2));
  TORCH_CHECK(heads <= 1 || x.stride(1) == head_dim, op,
              ": x's heads must be adjacent (stride(1) == head_dim = ", head_dim, "), got ",
              x.stride(1));
  // Overlapping rows would be rotated twice (e.g. an expanded tensor).
  TORCH_CHECK(num_tokens <= 1 || x.stride(0) >= heads * head_dim, op,
              ": x's rows must not overlap (stride(0) >= heads * head_dim = ", heads * head_dim,
              "), got ", x.stride(0));
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == num_tokens &&
                  positions.scalar_type() == at::kLong,
              op, ": positions must be int64 [T] = [", num_tokens, "], got ",
              positions.scalar_type(), " ", positions.sizes());
  TORCH_CHECK(cos_sin.dim() == 3 && cos_sin.size(0) == 2 && cos_sin.size(2) == head_dim &&
                  cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(),
              op, ": cos_sin must be a contiguous float32 [2, max_positions, head_dim = ", head_dim,
              "] tensor, got ", cos_sin.scalar_type(), " ", cos_sin.sizes());
  const int64_t max_positions = cos_sin.size(1);
  const auto pos = positions.contiguous();
  const int64_t* p = pos.const_data_ptr<int64_t>();
  // A position outside the table would read past it: refuse before touching x, so a bad call
  // leaves x as it was (a loop over T integers, negligible beside the rotation).
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < max_positions, op, ": positions must be in [0, ",
                max_positions, "), got ", p[t], " at index ", t);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding", [&] {
        rotary_embedding_kernel<scalar_t>(p, x.data_ptr<scalar_t>(),
                                          cos_sin.const_data_ptr<float>(), num_tokens, heads,
                                          head_dim, x.stride(0), max_positions);
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()", &rms_norm);
  m.def(
      "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) "
      "-> ()",
      &fused_add_rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()", &silu_and_mul);
  m.def("rotary_embedding(Tensor positions, Tensor(a!) x, Tensor cos_sin) -> ()",
        &rotary_embedding);
}

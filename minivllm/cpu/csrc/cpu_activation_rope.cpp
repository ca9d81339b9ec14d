// Fused per-token layer ops for CPUs: SiLU-and-mul and rotary embedding here, RMSNorm (alone and
// with its residual add) in cpu_layernorm.cpp; each one pass over its tensor.
//
// Between a decoder layer's matmuls, plain PyTorch runs each formula as a chain of elementwise ops,
// and every link reads and writes the whole activation: RMSNorm alone is float(), pow, mean, add,
// rsqrt, mul, to() and mul, plus the residual add before it; RoPE is two muls, a neg, a cat and an
// add. That chain's time goes to moving bytes, not computing. Each op here reads its inputs once
// and writes its outputs once, keeping a row in registers and L1 between the formula's steps
// (SiLU-and-mul gains least: its exp, not its bytes, bounds it; the Performance page,
// docs/performance.md, has the measurements). vLLM's CPU backend does the same
// (csrc/cpu/layernorm.cpp, activation.cpp, pos_encoding.cpp); the ops keep vLLM's names, and the
// norms and SiLU-and-mul its arguments too. rotary_embedding differs: it takes queries and keys as
// one tensor (they sit side by side in the qkv output) and minivllm's cos/sin table.
//
// Two layouts. On a CPU the model's linears compute x·Wᵀ as (W·xᵀ)ᵀ, which MKL runs faster at
// decode row counts (minivllm/model/layers/linear.py), so every linear returns a transposed
// view: logically [T, N], physically a contiguous [N, T] ("feature-major", strides (1, T)). The
// ops take that layout as it is and keep it (the next linear reads it at the same speed), since
// transposing the qkv, gate_up and down outputs to rows first cost more than the fusion saved.
// They also take token-major rows (stride(1) == 1), as vLLM's do; a single token is both.
// `python benchmarks/cpu_layer_layouts.py` times each op on the layout as it is against
// `.contiguous()` and the token-major op.
//
// The specification of each op is its plain-PyTorch form (RMSNorm and the MLP in
// minivllm/model/models/llama.py, RotaryEmbedding in minivllm/model/layers/rotary_embedding.py), and
// tests/cpu/test_kernels_cpu_layernorm.py holds them equal in both layouts. Every dtype computes in
// float32 and rounds once per output, except where the specification itself rounds (RMSNorm
// casts back to the input dtype before the weight, as transformers does).
//
// Work runs in parallel on PyTorch's intra-op pool (at::parallel_for), in tasks of at least ATen's
// own grain, so a decode step's handful of rows stays on the calling thread: waking the pool costs
// more than they do. Inner loops are plain, unit-stride and free of aliasing (__restrict__ helper
// arguments), which is what lets -O3 -ffast-math with the host's SIMD flags vectorize them, sums
// included (fast-math lets the compiler split one sum into several partial ones; this is also why
// results differ from PyTorch's in the last bits). Built into the same library as the attention
// kernel by minivllm/cpu/build.py, whose cpu_attention.cpp owns the namespace
// (TORCH_LIBRARY); this file and cpu_layernorm.cpp add to it (TORCH_LIBRARY_FRAGMENT).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

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

// ------------------------------------------------------------------------------- SiLU and mul
// silu(g) = g / (1 + exp(-g)). Under fast-math a vectorized division is a reciprocal estimate
// refined by one Newton step, which turns 1 / inf into NaN: exp(-g) is capped at exp(80) (its
// reciprocal still a normal float), so for g < -80 silu is ~1e-35 * g instead of -0. The exp
// vectorizes as glibc's vector expf (libmvec), which fast-math allows.
template <typename scalar_t>
inline void silu_and_mul_run(scalar_t* __restrict__ out,         // [n]
                             const scalar_t* __restrict__ gate,  // [n]
                             const scalar_t* __restrict__ up,    // [n]
                             int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
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
      silu_and_mul_run(out + t * d, gate, gate + d, d);
    }
  });
}

// Feature-major, the input's gate half is its first d * T elements and the up half the next
// d * T, and the output's d * T elements line up with both: one elementwise loop.
template <typename scalar_t>
void silu_and_mul_feature_major_kernel(scalar_t* __restrict__ out,  // [d, T] contiguous
                                       const scalar_t* __restrict__ input,  // [2 * d, T] contiguous
                                       int64_t num_tokens, int64_t d) {
  const int64_t n = d * num_tokens;
  const scalar_t* gate = input;    // [d, T]
  const scalar_t* up = input + n;  // [d, T]
  // Half the grain in outputs: the same 32K input elements per task as the token-major path.
  at::parallel_for(0, n, kGrainElems / 2, [&](int64_t begin, int64_t end) {
    silu_and_mul_run(out + begin, gate + begin, up + begin, end - begin);
  });
}

// out = silu(input[:, :d]) * input[:, d:]: the SwiGLU MLP's activation, gate then up halves.
// input is token-major (any row stride) or feature-major; out has input's layout.
void silu_and_mul(const at::Tensor& out,    // [T, d]
                  const at::Tensor& input)  // [T, 2 * d]
{
  const char* op = "silu_and_mul";
  check_cpu(input, op, "input");
  check_cpu(out, op, "out");
  TORCH_CHECK(input.dim() == 2, op, ": input must be 2-D [T, 2 * d], got ", input.dim(), "-D");
  TORCH_CHECK(input.size(1) % 2 == 0, op,
              ": input's last dim must be even (gate and up halves), got ", input.size(1));
  const int64_t num_tokens = input.size(0), d = input.size(1) / 2;
  const bool token_major = input.size(1) <= 1 || input.stride(1) == 1;
  TORCH_CHECK(token_major || input.t().is_contiguous(), op,
              ": input must be token-major (stride(1) == 1) or feature-major (input.t() "
              "contiguous, strides (1, T) = (1, ", num_tokens, ")), got strides ",
              input.strides());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == num_tokens && out.size(1) == d &&
                  (token_major ? out.is_contiguous() : out.t().is_contiguous()),
              op, ": out must be a [T, d] = [", num_tokens, ", ", d, "] tensor in the input's ",
              token_major ? "token-major layout (contiguous)" : "feature-major layout (out.t() "
              "contiguous)", ", got ", out.sizes(), " with strides ", out.strides());
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), op, ": out must have the input's dtype ",
              input.scalar_type(), ", got ", out.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, input.scalar_type(), "silu_and_mul", [&] {
        if (token_major)
          silu_and_mul_kernel<scalar_t>(out.data_ptr<scalar_t>(),
                                        input.const_data_ptr<scalar_t>(), num_tokens, d,
                                        input.stride(0));
        else
          silu_and_mul_feature_major_kernel<scalar_t>(
              out.data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(), num_tokens, d);
      });
}

// --------------------------------------------------------------------------- rotary embedding
// NeoX-style RoPE in place: the pairs are (x[i], x[i + half]), turned by the angles at i and at
// i + half. For a token-major head, lo and hi are the head's two halves and the angles one table
// row; feature-major, they are one pair (i, i + half) across n tokens and the angles each token's.
// lo and hi never overlap, so the loop vectorizes without a runtime check.
template <typename scalar_t>
inline void rotate(scalar_t* __restrict__ lo,         // [n]
                   scalar_t* __restrict__ hi,         // [n]
                   const float* __restrict__ cos_lo,  // [n]
                   const float* __restrict__ sin_lo,  // [n]
                   const float* __restrict__ cos_hi,  // [n]
                   const float* __restrict__ sin_hi,  // [n]
                   int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x1 = float(lo[i]), x2 = float(hi[i]);
    lo[i] = scalar_t(x1 * cos_lo[i] - x2 * sin_lo[i]);
    hi[i] = scalar_t(x2 * cos_hi[i] + x1 * sin_hi[i]);
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
      const float* cos = cos_sin + positions[t] * head_dim;    // [head_dim]
      const float* sin = sin_table + positions[t] * head_dim;  // [head_dim]
      scalar_t* row = x + t * x_stride;  // [heads, head_dim]
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* head = row + h * head_dim;  // [head_dim]
        rotate(head, head + half, cos, sin, cos + half, sin + half, half);
      }
    }
  });
}

// Tokens per tile of the feature-major path: the tile's angles (cos and sin, [head_dim, 32]
// each, 16 KiB at head_dim 64) stay in L1 while every head of those tokens turns by them. 32
// rather than 64: more tiles share out evenly between the threads (float32 gains; bfloat16 is
// about even).
constexpr int64_t kRopeTileTokens = 32;

template <typename scalar_t>
void rotary_embedding_feature_major_kernel(
    const int64_t* __restrict__ positions,  // [T]
    scalar_t* __restrict__ x,               // [heads, head_dim, T] contiguous: the view's storage
    const float* __restrict__ cos_sin,      // [2, max_positions, head_dim]
    int64_t num_tokens, int64_t heads, int64_t head_dim, int64_t max_positions) {
  const int64_t half = head_dim / 2;
  const float* sin_table = cos_sin + max_positions * head_dim;  // cos_sin[1]
  const int64_t num_tiles = (num_tokens + kRopeTileTokens - 1) / kRopeTileTokens;
  const int64_t grain = std::max<int64_t>(1, rows_per_task(heads * head_dim) / kRopeTileTokens);
  at::parallel_for(0, num_tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> cos(head_dim * kRopeTileTokens);  // [head_dim, n] the tile's angles, laid
    std::vector<float> sin(head_dim * kRopeTileTokens);  // out like x: tokens innermost
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t t0 = tile * kRopeTileTokens, n = std::min(kRopeTileTokens, num_tokens - t0);
      // Each token's table row, gathered once and transposed: then every head reads pair i's
      // angles as one contiguous run, like its values.
      for (int64_t j = 0; j < n; ++j) {
        const float* c = cos_sin + positions[t0 + j] * head_dim;    // [head_dim]
        const float* s = sin_table + positions[t0 + j] * head_dim;  // [head_dim]
        for (int64_t i = 0; i < head_dim; ++i) {
          cos[i * n + j] = c[i];
          sin[i * n + j] = s[i];
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* head = x + h * head_dim * num_tokens + t0;  // [head_dim, n], rows T apart
        for (int64_t i = 0; i < half; ++i)
          rotate(head + i * num_tokens, head + (i + half) * num_tokens, &cos[i * n], &sin[i * n],
                 &cos[(i + half) * n], &sin[(i + half) * n], n);
      }
    }
  });
}

// x = x * cos + rotate_half(x) * sin at each token's position, in place; rotate_half(x) is
// cat(-x[..., half:], x[..., :half]). x is the query-and-key part of the fused qkv output, as a
// view: of a token-major qkv, rows longer than heads * head_dim (the row stride is passed); of a
// feature-major qkv, strides (1, head_dim * T, T), i.e. x.permute(1, 2, 0) contiguous.
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
  // Token-major rows must not overlap, or one would turn twice (e.g. an expanded tensor).
  const bool token_major = (head_dim <= 1 || x.stride(2) == 1) &&
                           (heads <= 1 || x.stride(1) == head_dim) &&
                           (num_tokens <= 1 || x.stride(0) >= heads * head_dim);
  TORCH_CHECK(token_major || x.permute({1, 2, 0}).is_contiguous(), op,
              ": x must be token-major (strides (>= heads * head_dim, head_dim, 1) = (>= ",
              heads * head_dim, ", ", head_dim, ", 1)) or feature-major (strides (1, head_dim * "
              "T, T) = (1, ", head_dim * num_tokens, ", ", num_tokens, ")), got strides ",
              x.strides());
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
        const float* table = cos_sin.const_data_ptr<float>();
        if (token_major)
          rotary_embedding_kernel<scalar_t>(p, x.data_ptr<scalar_t>(), table, num_tokens, heads,
                                            head_dim, x.stride(0), max_positions);
        else
          rotary_embedding_feature_major_kernel<scalar_t>(
              p, x.data_ptr<scalar_t>(), table, num_tokens, heads, head_dim, max_positions);
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()", &silu_and_mul);
  m.def("rotary_embedding(Tensor positions, Tensor(a!) x, Tensor cos_sin) -> ()",
        &rotary_embedding);
}

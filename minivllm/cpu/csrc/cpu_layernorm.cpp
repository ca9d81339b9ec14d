// Fused RMSNorm for CPUs, alone and with the residual add before it, each one pass over its rows.
//
// The two norms of minivllm/cpu/csrc/cpu_activation_rope.cpp's family of fused layer ops (that file's
// header says why they exist, how they are built and how they are tested, and why an op takes two
// layouts); here only what is particular to the norms. Plain PyTorch runs RMSNorm as float(), pow,
// mean, add, rsqrt, mul, to() and mul, plus the residual add before it, each a pass over the
// activation; these read each input once and write each output once. vLLM's CPU backend does the
// same (csrc/cpu/layernorm.cpp), with these names and arguments. The specification is RMSNorm in
// minivllm/model/models/llama.py: float32 arithmetic, cast back to the input dtype before the weight, as
// transformers does.
//
// Layouts. fused_add_rms_norm's `input` is a sublayer's output, and on a CPU the model's linears
// return feature-major views ([T, hidden] whose storage is a contiguous [hidden, T]; see
// cpu_activation_rope.cpp): it is normalized where it lies, in whichever of the two layouts it has,
// because copying it to rows first (aten's transpose) cost more than the fusion saved. The
// residual stream stays token-major ([T, hidden] contiguous) through the layers. A feature-major
// input is turned into rows a tile of tokens at a time, in a buffer that never leaves L1, and the
// row code runs on it: the arithmetic, and so the result, is the token-major path's bit for bit.
// (Walking the tile feature by feature instead, with the residual strided, kept the data in cache
// too but left the bfloat16 rounding scalar, and ran slower.)

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

// Tokens per tile of the feature-major path: the tile's input, turned into rows (36 KiB in
// float32 at hidden 576, 18 KiB in bfloat16), stays in L1 while the row code runs on it.
constexpr int64_t kTileTokens = 16;

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

// ------------------------------------------------------------------------------ one row
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

// weight * dtype(x * inv_rms): the cast back to scalar_t comes before the weight, as in
// transformers' LlamaRMSNorm (a no-op for float32).
template <typename scalar_t>
inline scalar_t normalize(float x, float inv_rms, float w) {
  return scalar_t(float(scalar_t(x * inv_rms)) * w);
}

template <typename scalar_t>
inline void normalize_row(scalar_t* __restrict__ out,       // [n]
                          const scalar_t* __restrict__ x,   // [n]
                          const scalar_t* __restrict__ w,   // [n]
                          float inv_rms, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = normalize<scalar_t>(float(x[i]), inv_rms, float(w[i]));
}

// r += x, rounded to scalar_t as the decoder layer's `hidden + attn` is.
template <typename scalar_t>
inline void add_row(scalar_t* __restrict__ r, const scalar_t* __restrict__ x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) r[i] = scalar_t(float(x[i]) + float(r[i]));  // r, x: [n]
}

// ------------------------------------------------------------------------------------ RMSNorm
template <typename scalar_t>
void rms_norm_kernel(scalar_t* __restrict__ out,           // [T, hidden] contiguous
                     const scalar_t* __restrict__ input,   // [T, hidden], rows input_stride apart
                     const scalar_t* __restrict__ weight,  // [hidden]
                     int64_t num_tokens, int64_t hidden, int64_t input_stride, float eps) {
  at::parallel_for(0, num_tokens, rows_per_task(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* x = input + t * input_stride;  // [hidden]
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

// ------------------------------------------------------------- residual add + RMSNorm, by rows
template <typename scalar_t>
void fused_add_rms_norm_kernel(scalar_t* __restrict__ input,     // [T, hidden] in: x, out: normed
                               scalar_t* __restrict__ residual,  // [T, hidden] in: r, out: x + r
                               const scalar_t* __restrict__ weight,  // [hidden]
                               int64_t num_tokens, int64_t hidden, float eps) {
  at::parallel_for(0, num_tokens, rows_per_task(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* x = input + t * hidden;     // [hidden]
      scalar_t* r = residual + t * hidden;  // [hidden]
      // Three loops over the row, but one pass over memory: the row (a few KiB) is still in L1
      // for the second and third. Separate loops vectorize where one fused loop did not (storing
      // the rounded sum and squaring it in one statement defeats GCC for bfloat16).
      add_row(r, x, hidden);
      normalize_row(x, r, weight, inverse_rms(sum_of_squares(r, hidden), hidden, eps), hidden);
    }
  });
}

// ----------------------------------------------------- residual add + RMSNorm, feature-major
// dst[j * hidden + h] = src[h * src_stride + j]: n tokens' features from feature-major storage
// into token-major rows. Plain moves, no arithmetic: the formula runs on the rows, unchanged.
template <typename scalar_t>
inline void gather_rows(scalar_t* __restrict__ dst,        // [n, hidden]
                        const scalar_t* __restrict__ src,  // [hidden, n], rows src_stride apart
                        int64_t n, int64_t hidden, int64_t src_stride) {
  for (int64_t h = 0; h < hidden; ++h)
    for (int64_t j = 0; j < n; ++j) dst[j * hidden + h] = src[h * src_stride + j];
}

// The inverse: dst[h * dst_stride + j] = src[j * hidden + h].
template <typename scalar_t>
inline void scatter_rows(scalar_t* __restrict__ dst,        // [hidden, n], rows dst_stride apart
                         const scalar_t* __restrict__ src,  // [n, hidden]
                         int64_t n, int64_t hidden, int64_t dst_stride) {
  for (int64_t h = 0; h < hidden; ++h)
    for (int64_t j = 0; j < n; ++j) dst[h * dst_stride + j] = src[j * hidden + h];
}

template <typename scalar_t>
void fused_add_rms_norm_feature_major_kernel(
    scalar_t* __restrict__ input,     // [hidden, T] contiguous: the [T, hidden] view's storage
    scalar_t* __restrict__ residual,  // [T, hidden] contiguous
    const scalar_t* __restrict__ weight,  // [hidden]
    int64_t num_tokens, int64_t hidden, float eps) {
  const int64_t num_tiles = (num_tokens + kTileTokens - 1) / kTileTokens;
  const int64_t grain = std::max<int64_t>(1, rows_per_task(hidden) / kTileTokens);
  at::parallel_for(0, num_tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> rows(kTileTokens * hidden);  // [n, hidden] the tile's input, by rows
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t t0 = tile * kTileTokens, n = std::min(kTileTokens, num_tokens - t0);
      scalar_t* x = input + t0;  // [hidden, n], features num_tokens apart
      // The tile's input, turned into rows in an L1-sized buffer: then the token-major row code
      // (vectorized, the same arithmetic) runs on it, and the result is turned back.
      gather_rows(rows.data(), x, n, hidden, num_tokens);
      for (int64_t j = 0; j < n; ++j) {
        scalar_t* xr = rows.data() + j * hidden;         // [hidden]
        scalar_t* r = residual + (t0 + j) * hidden;      // [hidden]
        add_row(r, xr, hidden);
        normalize_row(xr, r, weight, inverse_rms(sum_of_squares(r, hidden), hidden, eps), hidden);
      }
      scatter_rows(x, rows.data(), n, hidden, num_tokens);
    }
  });
}

// residual = input + residual; input = rms_norm(residual) * weight; both in place. This is the
// decoder layer's `hidden + attn` followed by the next norm, in one pass. `input` keeps its
// layout: token-major (contiguous) or feature-major (input.t() contiguous).
void fused_add_rms_norm(const at::Tensor& input,     // [T, hidden] token- or feature-major
                        const at::Tensor& residual,  // [T, hidden] contiguous
                        const at::Tensor& weight,    // [hidden]
                        double epsilon) {
  const char* op = "fused_add_rms_norm";
  check_cpu(input, op, "input");
  check_cpu(residual, op, "residual");
  check_cpu(weight, op, "weight");
  TORCH_CHECK(input.dim() == 2, op, ": input must be 2-D [T, hidden], got ", input.dim(), "-D");
  const int64_t num_tokens = input.size(0), hidden = input.size(1);
  const bool token_major = input.is_contiguous();
  const bool feature_major = input.t().is_contiguous();
  TORCH_CHECK(token_major || feature_major, op,
              ": input must be contiguous (token-major) or the transpose of a contiguous tensor "
              "(feature-major: strides (1, T) = (1, ", num_tokens, ")), got strides ",
              input.strides());
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.is_contiguous(), op,
              ": residual must be a contiguous tensor of the input's shape ", input.sizes(),
              ", got ", residual.sizes(), residual.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(input.numel() == 0 || input.data_ptr() != residual.data_ptr(), op,
              ": input and residual must be different tensors");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(), op,
              ": weight must be a contiguous [hidden] = [", hidden, "] tensor, got ",
              weight.sizes());
  check_same_dtype(residual, input, op, "residual");
  check_same_dtype(weight, input, op, "weight");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, input.scalar_type(), "fused_add_rms_norm", [&] {
        // One token, or one feature, is both layouts: the row kernel takes it.
        auto* kernel = token_major ? fused_add_rms_norm_kernel<scalar_t>
                                   : fused_add_rms_norm_feature_major_kernel<scalar_t>;
        kernel(input.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
               weight.const_data_ptr<scalar_t>(), num_tokens, hidden,
               static_cast<float>(epsilon));
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()", &rms_norm);
  m.def(
      "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) "
      "-> ()",
      &fused_add_rms_norm);
}

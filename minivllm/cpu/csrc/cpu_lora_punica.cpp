// Punica's two batched LoRA ops for CPUs: shrink and expand, every row with its own adapter.
//
// Punica (Chen et al., 2023) serves many adapters in one batch: each token row t carries a slot
// s = token_slots[t] into the stacked A and B of the resident adapters, and one call runs the
// whole batch, whatever mix of adapters it holds (vLLM's vllm/lora/ops/triton_ops/lora_shrink_op.py
// and lora_expand_op.py; on CPUs vLLM runs its torch_ops.py). The specification is
// minivllm/lora/punica.py:
//
//     shrink  y[t, :]                        = x[t] · A[s]ᵀ                  (0 where s == -1)
//     expand  out[t, offset : offset + N]   += (y[t] · B[s]ᵀ) · scale[s]     (untouched if s == -1)
//
//     x       [T, K]        token rows, unit stride along K
//     lora_a  [L, R, K]     contiguous; slot s's A, rows past its rank zero
//     y       [T, R]        contiguous
//     lora_b  [L, N, R]     contiguous; slot s's B (one slice of a packed q|k|v or gate|up)
//     scales  [L]           lora_alpha / r
//     out     [T, >= offset + N], any strides: a CPU linear's output may be feature-major
//
// The reference groups rows by slot and runs one GEMM per adapter; here every output element is
// one dot product read straight from its row's slot, which is the per-row definition itself and
// needs no grouping: LoRA's matrices are thin (R is 8-64), so a dot over K (shrink) or over R
// (expand) is the whole work of an element, and the compiler vectorizes that loop at each
// instruction-set level the library is built for (minivllm/cpu/isa.py), summing in float32.
// Work is split over PyTorch's threads by (row, output column) pairs, so a single decode row still
// spreads over the threads; the regions touch raw pointers only.
//
// bfloat16 and float16 are read and summed in float32, and rounded where the reference rounds:
// y once; the expand's product, then its scaling, then the sum with `out`. float32 rounds nowhere
// extra, so it differs from the reference only in summation order.
// tests/cpu/test_kernels_cpu_lora_punica.py holds both ops to punica.py.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

// Multiply-adds per parallel task: at least ATen's grain for its elementwise ops (32K).
constexpr int64_t kGrainMacs = 32768;

inline int64_t grain_for(int64_t macs_per_item) {
  return std::max<int64_t>(1, kGrainMacs / std::max<int64_t>(1, macs_per_item));
}

template <typename scalar_t>
inline float dot(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return sum;
}

template <typename scalar_t>
void shrink_rows(scalar_t* __restrict__ y, const scalar_t* __restrict__ x, int64_t ldx,
                 const scalar_t* __restrict__ a, const int64_t* __restrict__ slots, int64_t T,
                 int64_t R, int64_t K) {
  at::parallel_for(0, T * R, grain_for(K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / R, r = i % R, s = slots[t];
      y[i] = s < 0 ? scalar_t(0.f)
                   : static_cast<scalar_t>(dot(x + t * ldx, a + (s * R + r) * K, K));
    }
  });
}

template <typename scalar_t>
void expand_rows(scalar_t* __restrict__ out, int64_t ldo_t, int64_t ldo_n,
                 const scalar_t* __restrict__ y, const scalar_t* __restrict__ b,
                 const scalar_t* __restrict__ scales, const int64_t* __restrict__ slots,
                 int64_t T, int64_t N, int64_t R) {
  at::parallel_for(0, T * N, grain_for(R), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / N, n = i % N, s = slots[t];
      if (s < 0) continue;
      // The reference's three roundings: F.linear's output, `* scales[s]`, then `+=`.
      const scalar_t product = static_cast<scalar_t>(dot(y + t * R, b + (s * N + n) * R, R));
      const scalar_t delta = static_cast<scalar_t>(static_cast<float>(product) *
                                                   static_cast<float>(scales[s]));
      scalar_t& o = out[t * ldo_t + n * ldo_n];
      o = static_cast<scalar_t>(static_cast<float>(o) + static_cast<float>(delta));
    }
  });
}

void check_slots(const at::Tensor& slots, int64_t T, int64_t L, const char* op) {
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.size(0) == T && slots.is_contiguous(),
              op, ": token_slots must be a contiguous int64 CPU tensor [", T, "]");
  // A pass over T integers (an ATen min/max would cost more, at every slice of every layer).
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s[t] >= -1 && s[t] < L, op, ": token_slots must be in [-1, ", L, "), got ", s[t],
                " at row ", t);
}

void check_float(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " must be ",
              like.scalar_type(), ", got ", t.scalar_type());
}

// y = x · A[slot]ᵀ per row (zero where the slot is -1). y [T, R] contiguous, written whole.
void lora_shrink(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                 const at::Tensor& token_slots) {
  const char* op = "minivllm_cpu::lora_shrink";
  check_float(x, y, op, "x");
  check_float(lora_a, y, op, "lora_a");
  TORCH_CHECK(x.dim() == 2 && lora_a.dim() == 3 && y.dim() == 2, op,
              ": x [T, K], lora_a [L, R, K] and y [T, R] expected");
  const int64_t T = x.size(0), K = x.size(1), L = lora_a.size(0), R = lora_a.size(1);
  TORCH_CHECK(lora_a.size(2) == K && lora_a.is_contiguous(), op,
              ": lora_a must be a contiguous [L, R, ", K, "]");
  TORCH_CHECK(y.size(0) == T && y.size(1) == R && y.is_contiguous(), op,
              ": y must be a contiguous [", T, ", ", R, "]");
  TORCH_CHECK(x.stride(1) == 1 || K == 1, op, ": x must have unit stride along K");
  check_slots(token_slots, T, L, op);
  if (T == 0 || R == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_shrink", [&] {
    shrink_rows<scalar_t>(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.stride(0),
                          lora_a.data_ptr<scalar_t>(), token_slots.data_ptr<int64_t>(), T, R, K);
  });
}

// out[:, offset : offset + N] += (y · B[slot]ᵀ) · scales[slot] per row; rows of slot -1 untouched.
void lora_expand(at::Tensor& out, const at::Tensor& y, const at::Tensor& lora_b,
                 const at::Tensor& token_slots, const at::Tensor& scales, int64_t offset) {
  const char* op = "minivllm_cpu::lora_expand";
  check_float(y, out, op, "y");
  check_float(lora_b, out, op, "lora_b");
  check_float(scales, out, op, "scales");
  TORCH_CHECK(out.dim() == 2 && y.dim() == 2 && lora_b.dim() == 3, op,
              ": out [T, width], y [T, R] and lora_b [L, N, R] expected");
  const int64_t T = y.size(0), R = y.size(1), L = lora_b.size(0), N = lora_b.size(1);
  TORCH_CHECK(lora_b.size(2) == R && lora_b.is_contiguous(), op,
              ": lora_b must be a contiguous [L, N, ", R, "]");
  TORCH_CHECK(y.is_contiguous(), op, ": y must be contiguous");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == L && scales.is_contiguous(), op,
              ": scales must be a contiguous [", L, "]");
  TORCH_CHECK(out.size(0) == T && offset >= 0 && offset + N <= out.size(1), op, ": out [", T,
              ", >= ", offset + N, "] expected for offset ", offset, " and N ", N, ", got [",
              out.size(0), ", ", out.size(1), "]");
  check_slots(token_slots, T, L, op);
  if (T == 0 || N == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "lora_expand", [&] {
    expand_rows<scalar_t>(out.data_ptr<scalar_t>() + offset * out.stride(1), out.stride(0),
                          out.stride(1), y.data_ptr<scalar_t>(), lora_b.data_ptr<scalar_t>(),
                          scales.data_ptr<scalar_t>(), token_slots.data_ptr<int64_t>(), T, N, R);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("lora_shrink(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor token_slots) -> ()",
        &lora_shrink);
  m.def(
      "lora_expand(Tensor(a!) out, Tensor y, Tensor lora_b, Tensor token_slots, Tensor scales, "
      "int offset) -> ()",
      &lora_expand);
}

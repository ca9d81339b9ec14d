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
// spreads over the threads; the regions touch raw pointers only. `add_lora_linear` (vLLM's name)
// runs both ops for every slice of one linear, the C++ decode loop's call: one region of shrinks,
// one of expands, the same elements as the two ops slice by slice.
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
#include <vector>

namespace {

// Multiply-adds per parallel task. A decode row's delta is small (a q|k|v shrink is 48 dots of
// 576), and a parallel region costs about a microsecond, which a task of this many float32
// multiply-adds (32 KB of A or B streamed) outweighs: a single row's delta spreads over the
// threads instead of running on one while the others wait for the next base linear.
constexpr int64_t kGrainMacs = 8192;

inline int64_t grain_for(int64_t macs_per_item) {
  return std::max<int64_t>(1, kGrainMacs / std::max<int64_t>(1, macs_per_item));
}

// The per-row work every op below runs, each compiled once per dtype (never inlined or cloned
// into its callers, where -ffast-math could sum a dot in another order): an element is the same
// float32 sum whichever op, thread split or batch computed it, so the fused `add_lora_linear`
// equals a shrink and an expand per slice bit for bit, and a row's delta is batch-invariant.
#if defined(__clang__)
#define MINIVLLM_ONE_COPY __attribute__((noinline))
#else
#define MINIVLLM_ONE_COPY __attribute__((noinline, noclone))
#endif

template <typename scalar_t>
inline float dot(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return sum;
}

// y[r] = x · a[r] for r in [r0, r1); x [K], a [R, K] one slot's A, y [R] one row's.
template <typename scalar_t>
MINIVLLM_ONE_COPY void shrink_row(scalar_t* __restrict__ y, const scalar_t* __restrict__ x,
                                  const scalar_t* __restrict__ a, int64_t r0, int64_t r1,
                                  int64_t K) {
  for (int64_t r = r0; r < r1; ++r) y[r] = static_cast<scalar_t>(dot(x, a + r * K, K));
}

// out[n · ldo] += (y · b[n]) · scale for n in [n0, n1); y [R], b [N, R] one slot's B.
template <typename scalar_t>
MINIVLLM_ONE_COPY void expand_row(scalar_t* __restrict__ out, int64_t ldo,
                                  const scalar_t* __restrict__ y, const scalar_t* __restrict__ b,
                                  scalar_t scale, int64_t n0, int64_t n1, int64_t R) {
  for (int64_t n = n0; n < n1; ++n) {
    // The reference's three roundings: F.linear's output, `* scales[s]`, then `+=`.
    const scalar_t product = static_cast<scalar_t>(dot(y, b + n * R, R));
    const scalar_t delta =
        static_cast<scalar_t>(static_cast<float>(product) * static_cast<float>(scale));
    scalar_t& o = out[n * ldo];
    o = static_cast<scalar_t>(static_cast<float>(o) + static_cast<float>(delta));
  }
}

// Runs f(t, c0, c1) over the pieces of [begin, end) in a [rows, width] index space, one piece
// per row it crosses: a task's items are split into runs of one row without a division per item.
template <typename F>
inline void for_row_pieces(int64_t begin, int64_t end, int64_t width, const F& f) {
  int64_t t = begin / width, c = begin % width;
  while (begin < end) {
    const int64_t stop = std::min(width, c + (end - begin));
    f(t, c, stop);
    begin += stop - c;
    ++t;
    c = 0;
  }
}

// One linear's slices, as the kernels read them: slice i's A [L, R, K] and B [L, N_i, R] and
// where its N_i columns start in the output (side by side, from 0, or at one offset).
template <typename scalar_t>
struct Slices {
  std::vector<const scalar_t*> a, b;
  std::vector<int64_t> offset;  // size + 1: slice i's columns are [offset[i], offset[i + 1])
};

// y [T, S·R] (each row's slices' y side by side) = x Aᵢ[slot]ᵀ; zero where the slot is -1.
template <typename scalar_t>
void shrink_rows(scalar_t* __restrict__ y, const scalar_t* __restrict__ x, int64_t ldx,
                 const Slices<scalar_t>& sl, const int64_t* __restrict__ slots, int64_t T,
                 int64_t R, int64_t K) {
  const int64_t width = int64_t(sl.a.size()) * R;
  at::parallel_for(0, T * width, grain_for(K), [&](int64_t begin, int64_t end) {
    for_row_pieces(begin, end, width, [&](int64_t t, int64_t c0, int64_t c1) {
      const int64_t s = slots[t];
      scalar_t* yt = y + t * width;
      if (s < 0) {
        std::fill(yt + c0, yt + c1, scalar_t(0.f));
        return;
      }
      for (int64_t i = c0 / R; i * R < c1; ++i) {  // the slices this piece crosses
        const int64_t r0 = std::max(c0, i * R) - i * R, r1 = std::min(c1, (i + 1) * R) - i * R;
        shrink_row(yt + i * R, x + t * ldx, sl.a[i] + s * R * K, r0, r1, K);
      }
    });
  });
}

// out[t, slice i's columns] += (y[t, i] · Bᵢ[slot]ᵀ) · scales[slot]; rows of slot -1 untouched.
template <typename scalar_t>
void expand_rows(scalar_t* __restrict__ out, int64_t ldo_t, int64_t ldo_n,
                 const scalar_t* __restrict__ y, const Slices<scalar_t>& sl,
                 const scalar_t* __restrict__ scales, const int64_t* __restrict__ slots,
                 int64_t T, int64_t R) {
  const int64_t num = int64_t(sl.b.size()), width = sl.offset[num];
  at::parallel_for(0, T * width, grain_for(R), [&](int64_t begin, int64_t end) {
    for_row_pieces(begin, end, width, [&](int64_t t, int64_t c0, int64_t c1) {
      const int64_t s = slots[t];
      if (s < 0) return;
      for (int64_t i = 0; i < num; ++i) {
        const int64_t lo = sl.offset[i], hi = sl.offset[i + 1], n = hi - lo;
        if (hi <= c0 || lo >= c1) continue;
        expand_row(out + t * ldo_t + lo * ldo_n, ldo_n, y + (t * num + i) * R,
                   sl.b[i] + s * n * R, scales[s], std::max(c0, lo) - lo, std::min(c1, hi) - lo,
                   R);
      }
    });
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

void check_x(const at::Tensor& x, const at::Tensor& like, const char* op) {
  check_float(x, like, op, "x");
  TORCH_CHECK(x.dim() == 2, op, ": x [T, K] expected");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) == 1, op, ": x must have unit stride along K");
}

// lora_a [L, R, K], contiguous, of out's dtype; returns L.
int64_t check_a(const at::Tensor& a, const at::Tensor& like, int64_t R, int64_t K, const char* op) {
  check_float(a, like, op, "lora_a");
  TORCH_CHECK(a.dim() == 3 && a.size(1) == R && a.size(2) == K && a.is_contiguous(), op,
              ": lora_a must be a contiguous [L, ", R, ", ", K, "]");
  return a.size(0);
}

// lora_b [L, N, R], contiguous, of out's dtype; returns N.
int64_t check_b(const at::Tensor& b, const at::Tensor& like, int64_t L, int64_t R,
                const char* op) {
  check_float(b, like, op, "lora_b");
  TORCH_CHECK(b.dim() == 3 && b.size(0) == L && b.size(2) == R && b.is_contiguous(), op,
              ": lora_b must be a contiguous [", L, ", N, ", R, "]");
  return b.size(1);
}

void check_scales(const at::Tensor& scales, const at::Tensor& like, int64_t L, const char* op) {
  check_float(scales, like, op, "scales");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == L && scales.is_contiguous(), op,
              ": scales must be a contiguous [", L, "]");
}

void check_out(const at::Tensor& out, int64_t T, int64_t width, int64_t offset, const char* op) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && offset >= 0 && offset + width <= out.size(1),
              op, ": out [", T, ", >= ", offset + width, "] expected for offset ", offset,
              " and N ", width, ", got ", out.sizes());
}

// y = x · A[slot]ᵀ per row (zero where the slot is -1). y [T, R] contiguous, written whole.
void lora_shrink(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                 const at::Tensor& token_slots) {
  const char* op = "minivllm_cpu::lora_shrink";
  check_x(x, y, op);
  TORCH_CHECK(lora_a.dim() == 3 && y.dim() == 2, op,
              ": x [T, K], lora_a [L, R, K] and y [T, R] expected");
  const int64_t T = x.size(0), K = x.size(1), R = lora_a.size(1);
  const int64_t L = check_a(lora_a, y, R, K, op);
  TORCH_CHECK(y.size(0) == T && y.size(1) == R && y.is_contiguous(), op,
              ": y must be a contiguous [", T, ", ", R, "]");
  check_slots(token_slots, T, L, op);
  if (T == 0 || R == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_shrink", [&] {
    const Slices<scalar_t> sl{{lora_a.data_ptr<scalar_t>()}, {}, {0, R}};
    shrink_rows<scalar_t>(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.stride(0), sl,
                          token_slots.data_ptr<int64_t>(), T, R, K);
  });
}

// out[:, offset : offset + N] += (y · B[slot]ᵀ) · scales[slot] per row; rows of slot -1 untouched.
void lora_expand(at::Tensor& out, const at::Tensor& y, const at::Tensor& lora_b,
                 const at::Tensor& token_slots, const at::Tensor& scales, int64_t offset) {
  const char* op = "minivllm_cpu::lora_expand";
  check_float(y, out, op, "y");
  TORCH_CHECK(out.dim() == 2 && y.dim() == 2 && lora_b.dim() == 3, op,
              ": out [T, width], y [T, R] and lora_b [L, N, R] expected");
  const int64_t T = y.size(0), R = y.size(1), L = lora_b.size(0);
  const int64_t N = check_b(lora_b, out, L, R, op);
  TORCH_CHECK(y.is_contiguous(), op, ": y must be contiguous");
  check_scales(scales, out, L, op);
  check_out(out, T, N, offset, op);
  check_slots(token_slots, T, L, op);
  if (T == 0 || N == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "lora_expand", [&] {
    const Slices<scalar_t> sl{{}, {lora_b.data_ptr<scalar_t>()}, {0, N}};
    expand_rows<scalar_t>(out.data_ptr<scalar_t>() + offset * out.stride(1), out.stride(0),
                          out.stride(1), y.data_ptr<scalar_t>(), sl, scales.data_ptr<scalar_t>(),
                          token_slots.data_ptr<int64_t>(), T, R);
  });
}

constexpr int64_t kStackY = 4096;  // add_lora_linear's y on the stack up to this many elements

// vLLM's `add_lora_linear` (vllm/lora/punica_wrapper/punica_base.py): one linear's whole delta,
// every slice's shrink in one parallel region, then every slice's expand in one more, the slices'
// outputs side by side from column 0 of `out`. What the C++ decode loop runs per linear: the
// same elements as `lora_shrink` + `lora_expand` per slice, in 2 regions instead of 2 per slice.
void add_lora_linear(at::Tensor& out, const at::Tensor& x, at::TensorList lora_a,
                     at::TensorList lora_b, const at::Tensor& token_slots,
                     const at::Tensor& scales) {
  const char* op = "minivllm_cpu::add_lora_linear";
  check_x(x, out, op);
  TORCH_CHECK(!lora_a.empty() && lora_a.size() == lora_b.size() && lora_a[0].dim() == 3, op,
              ": one lora_a [L, R, K] and one lora_b [L, N, R] per slice expected, got ",
              lora_a.size(), " and ", lora_b.size());
  const int64_t T = x.size(0), K = x.size(1), R = lora_a[0].size(1);
  const int64_t L = lora_a[0].size(0), S = int64_t(lora_a.size());
  std::vector<int64_t> offset(1, 0);
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(check_a(lora_a[i], out, R, K, op) == L, op, ": every lora_a must have ", L,
                " slots");
    offset.push_back(offset.back() + check_b(lora_b[i], out, L, R, op));
  }
  check_scales(scales, out, L, op);
  check_out(out, T, offset.back(), 0, op);
  check_slots(token_slots, T, L, op);
  if (T == 0 || R == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "add_lora_linear",
                                  [&] {
    Slices<scalar_t> sl{{}, {}, offset};
    for (int64_t i = 0; i < S; ++i) {
      sl.a.push_back(lora_a[i].data_ptr<scalar_t>());
      sl.b.push_back(lora_b[i].data_ptr<scalar_t>());
    }
    // y [T, S·R]: on the stack for a decode step's few rows (no allocation per linear).
    scalar_t on_stack[kStackY];
    std::vector<scalar_t> on_heap(T * S * R > kStackY ? T * S * R : 0);
    scalar_t* y = on_heap.empty() ? on_stack : on_heap.data();
    const int64_t* slots = token_slots.data_ptr<int64_t>();
    shrink_rows<scalar_t>(y, x.data_ptr<scalar_t>(), x.stride(0), sl, slots, T, R, K);
    expand_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), out.stride(1), y, sl,
                          scales.data_ptr<scalar_t>(), slots, T, R);
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
  m.def(
      "add_lora_linear(Tensor(a!) out, Tensor x, Tensor[] lora_a, Tensor[] lora_b, "
      "Tensor token_slots, Tensor scales) -> ()",
      &add_lora_linear);
}

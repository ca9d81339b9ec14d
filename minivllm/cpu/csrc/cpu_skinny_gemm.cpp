// A skinny float32 GEMM for CPUs: out[T, N] = x[T, K] · weight[N, K]ᵀ for the few rows of decode.
//
// At decode, a linear multiplies a handful of token rows (T = the running requests, 1-64) by a
// weight far larger than the caches: SmolLM2's 30 layers hold 425 MB of float32 weights, read
// once per step. MKL's sgemm copies ("packs") its operands into blocked buffers on every call,
// which costs little for square matrices but, from T = 2 (at T = 1 MKL switches to its
// matrix-vector routine), makes the step take far longer than reading the weights once.
// This kernel packs nothing: it streams the weight as stored, a few rows at a time, and multiplies
// each block of rows by every token while the block sits in L1. Its lead over MKL shrinks as T
// grows and MKL's packing pays off, so the model calls this kernel at T <= 64 only
// (`SKINNY_GEMM_MAX_ROWS`; python benchmarks/skinny_gemm.py measures both).
// ROCm's vLLM has kernels of the same kind for the same reason ("skinny GEMMs", wvSplitK).
//
// The register tile: 4 weight rows x 6 tokens, 24 running sums of 16 lanes each, along K. For
// every 16 columns of K the tile loads 4 weight vectors and 6 token vectors and does 24 FMAs; at
// the end each sum is folded across its lanes. The next tiles' weight rows are prefetched while
// the first token tile of a block runs, so that the stream from memory overlaps the arithmetic.
// Each output is one sum over K in a fixed order, so results are deterministic; they differ from
// MKL's in the last bits (a different summation order), as any two BLAS libraries' do.
//
// The output is token-major rows. The model's other CPU ops take either layout (see
// cpu_activation_rope.cpp), and the next linear reads rows as they are. Work is split over
// PyTorch's intra-op threads by blocks of weight rows (at::parallel_for). The AVX-512 path is
// compiled where PyTorch detected AVX-512 (minivllm/cpu/build.py); elsewhere the op
// calls at::mm, and minivllm/cpu/ops.py keeps MKL's path there (`skinny_gemm_fast`).
// tests/cpu/test_kernels_cpu_skinny_gemm.py holds it equal to torch.mm.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kRows = 4;    // weight rows per register tile
constexpr int kTokens = 6;  // token rows per register tile: 4 x 6 sums + 4 + 1 vectors < 32
constexpr int kPrefetchTiles = 2;  // how many weight-row tiles ahead the stream is prefetched

// Columns [k, k + 16) of the tile's sums; the mask loads the columns past K as zeros.
template <int R, int TB>
inline void step(const float* __restrict__ w, int64_t ldw, const float* __restrict__ x,
                 int64_t ldx, int64_t k, __mmask16 m, bool prefetch, __m512 (&acc)[R][TB]) {
  __m512 wv[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) wv[i] = _mm512_maskz_loadu_ps(m, w + i * ldw + k);
  // Into L2: into L1 it would push out the token rows the tile rereads. Near the weight's end the
  // address may lie past it; a prefetch never faults, it is only a hint.
  if (prefetch) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchTiles * R + i) * ldw + k),
                   _MM_HINT_T1);
  }
#pragma GCC unroll 8
  for (int j = 0; j < TB; ++j) {
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + j * ldx + k);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
  }
}

// out[j, i] = dot(w[i, :], x[j, :]) for i < R, j < TB. Strides in elements.
template <int R, int TB>
inline void tile(const float* __restrict__ w, int64_t ldw, const float* __restrict__ x,
                 int64_t ldx, float* __restrict__ out, int64_t ldo, int64_t K, bool prefetch) {
  __m512 acc[R][TB];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < TB; ++j) acc[i][j] = _mm512_setzero_ps();
  // Whole vectors of K first, then (when K is not a multiple of 16) one masked step: a mask in
  // the main loop would cost every step of it.
  const int64_t k_full = K & ~int64_t(15);
  for (int64_t k = 0; k < k_full; k += 16) step<R, TB>(w, ldw, x, ldx, k, __mmask16(0xFFFF), prefetch, acc);
  if (k_full < K) step<R, TB>(w, ldw, x, ldx, k_full, __mmask16((1u << (K - k_full)) - 1), prefetch, acc);
#pragma GCC unroll 8
  for (int j = 0; j < TB; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) out[j * ldo + i] = _mm512_reduce_add_ps(acc[i][j]);
}

// The last tile of a block has fewer than kTokens tokens: one instantiation per count.
template <int R>
inline void token_tail(const float* w, int64_t ldw, const float* x, int64_t ldx, float* out,
                       int64_t ldo, int64_t K, int64_t tokens, bool prefetch) {
  switch (tokens) {
    case 1: tile<R, 1>(w, ldw, x, ldx, out, ldo, K, prefetch); break;
    case 2: tile<R, 2>(w, ldw, x, ldx, out, ldo, K, prefetch); break;
    case 3: tile<R, 3>(w, ldw, x, ldx, out, ldo, K, prefetch); break;
    case 4: tile<R, 4>(w, ldw, x, ldx, out, ldo, K, prefetch); break;
    case 5: tile<R, 5>(w, ldw, x, ldx, out, ldo, K, prefetch); break;
    default: break;
  }
}

// Weight rows [0, R) against every token. The block's rows stay in L1 across the token tiles; the
// first tile prefetches the stream ahead.
template <int R>
void row_block(const float* w, int64_t ldw, const float* x, int64_t ldx, float* out, int64_t ldo,
               int64_t K, int64_t T) {
  int64_t t = 0;
  for (; t + kTokens <= T; t += kTokens)
    tile<R, kTokens>(w, ldw, x + t * ldx, ldx, out + t * ldo, ldo, K, t == 0);
  if (t < T) token_tail<R>(w, ldw, x + t * ldx, ldx, out + t * ldo, ldo, K, T - t, t == 0);
}

void skinny_gemm_avx512(const float* w, const float* x, int64_t ldx, float* out, int64_t ldo,
                        int64_t N, int64_t K, int64_t T) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRows, rows = std::min<int64_t>(kRows, N - n0);
      if (rows == kRows) {
        row_block<kRows>(w + n0 * K, K, x, ldx, out + n0, ldo, K, T);
      } else {  // N not a multiple of kRows: the last rows one at a time
        for (int64_t n = n0; n < N; ++n) row_block<1>(w + n * K, K, x, ldx, out + n, ldo, K, T);
      }
    }
  });
}
#endif  // __AVX512F__

bool skinny_gemm_fast() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

void skinny_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  const char* op = "minivllm_cpu::skinny_gemm";
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu(), op,
              ": out, x and weight must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              op, ": out, x and weight must be float32, got ", out.scalar_type(), ", ",
              x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, op,
              ": x [T, K], weight [N, K] and out [T, N] must be 2-D");
  const int64_t T = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, op, ": weight must be [N, ", K, "] for x [", T, ", ", K,
              "], got [", weight.size(0), ", ", weight.size(1), "]");
  TORCH_CHECK(out.size(0) == T && out.size(1) == N, op, ": out must be [", T, ", ", N, "], got [",
              out.size(0), ", ", out.size(1), "]");
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous");
  // A dimension of size 1 may have any stride (PyTorch calls such a tensor contiguous).
  TORCH_CHECK((x.stride(1) == 1 || K == 1) && (out.stride(1) == 1 || N == 1), op,
              ": x and out must be token-major (unit stride along their last dimension)");
  if (T == 0 || N == 0) return;
#if defined(__AVX512F__)
  skinny_gemm_avx512(weight.data_ptr<float>(), x.data_ptr<float>(), x.stride(0),
                     out.data_ptr<float>(), out.stride(0), N, K, T);
#else
  out.copy_(at::mm(x, weight.t()));
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("skinny_gemm(Tensor(a!) out, Tensor x, Tensor weight) -> ()", &skinny_gemm);
  m.def("skinny_gemm_fast() -> bool", &skinny_gemm_fast);
}

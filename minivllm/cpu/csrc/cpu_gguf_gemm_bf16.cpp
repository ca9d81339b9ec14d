// Linear layers on GGUF's quantized blocks with bf16 dot products (AVX512-BF16):
// out[M, N] = bf16(x[M, K]) · bf16(dequant(qweight[N, row_bytes]))ᵀ, sums in float32.
//
// cpu_gguf_gemm.cpp's float32 path unpacks 16 weights into a float vector and FMAs it into each
// token: 16 products per instruction. Past a few token rows (a batch's decode step) that FMA
// count, not the weight bytes, is the cost. `vdpbf16ps` multiplies 32 bf16 pairs per instruction
// into 16 float32 sums, so the same tiles here unpack 32 weights (two float vectors), round them to
// one bf16 vector, and take one instruction per token where the float32 path takes two. The
// activations are rounded to bf16 once per call, as llama.cpp rounds them to 8-bit blocks (its
// `vec_dot_type`) for its integer dots. This is what a quantized model loses for it:
//   |out - x · Wᵀ| <= (2^-8 + K · 2^-24) · (|x| · |W|ᵀ)   (each factor off by at most 2^-9)
// held by tests/cpu/test_kernels_cpu_gguf.py. The float32 path stays for CPUs without AVX512-BF16.
//
// Batch-invariance. Each output is the same chain of `vdpbf16ps` over K in order, whatever M is
// and whichever path (on the fly or chunked) ran it: a request's logits do not depend on what else
// is in the batch, so greedy output with speculative decoding or chunked prefill equals greedy
// output without it. The chunked path computes that chain with float32 FMAs (`split_tile`: the
// same bits, faster on this project's CPU), and both paths fold their lanes as
// `_mm512_reduce_add_ps` does (`store_sums`).
//
// The functions that use AVX512-BF16 carry its `target` attribute, and the op refuses to run where
// the CPU lacks it (`gguf_has_bf16_dot`), so the library still loads on any AVX-512 CPU.

#include "cpu_gguf_blocks.h"
#include "cpu_gguf_sum16.h"

#include <vector>

namespace {

#if defined(__AVX512F__)
#define BF16_TARGET __attribute__((target("avx512bf16")))

bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

constexpr int kGroup = 4;      // weight rows per work item
constexpr int kMaxTokens = 8;  // tokens per register tile

// Bf16 rows (the long rows' chunked scratch) as a block type of their own, for the same tiles.
struct BF16Rows {
  static constexpr int kBlock = 32, kBytes = 64;
};

// Weights [32 i, 32 i + 32) of block b as one bf16 vector, in order (round to nearest even).
template <class Q>
BF16_TARGET inline __m512bh pair(const uint8_t* b, int i) {
  return _mm512_cvtne2ps_pbh(Q::weights(b, 2 * i + 1), Q::weights(b, 2 * i));
}

template <>
BF16_TARGET inline __m512bh pair<BF16Rows>(const uint8_t* b, int) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(b));
}

// x's rows as bf16 in tiles of up to kMaxTokens tokens, each tile [K / 32][TB][32] (as
// cpu_gguf_gemm.cpp's pack_tokens, 32 columns a step).
BF16_TARGET void pack_tokens(const float* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xp) {
  for (int64_t t0 = 0; t0 < M; t0 += kMaxTokens) {
    const int64_t tb = std::min<int64_t>(kMaxTokens, M - t0);
    uint16_t* dst = xp + t0 * K;
    for (int64_t c = 0; c < K / 32; ++c)
      for (int64_t t = 0; t < tb; ++t) {
        const float* src = x + (t0 + t) * ldx + c * 32;
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        _mm512_storeu_si512(dst + (c * tb + t) * 32, reinterpret_cast<__m512i>(v));
      }
  }
}

// out[t, r] = dot(w row r, x row t) for r < rows (<= R), t < TB: cpu_gguf_gemm.cpp's tile, 32
// weights a step. Rows past `rows` repeat the last one; their sums are dropped.
template <class Q, int R, int TB>
BF16_TARGET void tile(const uint8_t* w, int64_t row_bytes, int64_t rows, const uint16_t* xp,
                      float* out, int64_t ldo, int64_t blocks) {
  constexpr int P = Q::kBlock / 32;  // bf16 vectors per block
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(r, rows - 1) * row_bytes;
  __m512 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  constexpr int64_t step = R * Q::kBytes;  // prefetched as cpu_gguf_gemm.cpp's tile does
  const char* ahead = reinterpret_cast<const char*>(w) + 8192;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* xb = xp + b * (P * TB * 32);
#pragma GCC unroll 16
    for (int64_t j = 0; j < (step + 63) / 64; ++j) _mm_prefetch(ahead + b * step + 64 * j, _MM_HINT_T0);
#pragma GCC unroll 8
    for (int i = 0; i < P; ++i) {
      __m512bh wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) wv[r] = pair<Q>(wr[r] + b * Q::kBytes, i);
#pragma GCC unroll 8
      for (int t = 0; t < TB; ++t) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + (i * TB + t) * 32));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
      }
    }
  }
  store_sums<R, TB>(acc, rows, out, ldo);
}

// A group's rows against TB tokens: 4 rows per tile up to 4 tokens, 2 rows up to 8.
template <class Q, int TB>
BF16_TARGET void group_tile(const uint8_t* w, int64_t row_bytes, int64_t rows, const uint16_t* xp,
                            float* out, int64_t ldo, int64_t blocks) {
  constexpr int R = TB <= 4 ? 4 : 2;
  for (int64_t r0 = 0; r0 < rows; r0 += R)
    tile<Q, R, TB>(w + r0 * row_bytes, row_bytes, std::min<int64_t>(R, rows - r0), xp, out + r0,
                   ldo, blocks);
}

// ---- The chunked path's tile: vdpbf16ps's sums by float32 FMAs, the same bits.
// On this project's CPU a loop of independent `vdpbf16ps` retires about one every 2 cycles and
// one of 512-bit FMAs about 2 a cycle (docs/performance.md): 32 pairs a token cost 2 cycles one
// way and 1 the other. Intel specifies the instruction as two float32 additions of exact products
// per lane, the odd element's first, with denormals read and written as zero, so fma(w_odd,
// x_odd, acc) then fma(w_even, x_even, acc) under FTZ and DAZ give the same bits
// (tests/cpu/test_kernels_cpu_gguf.py holds a row's bits alone and in chunked batches). So past the on-the-fly bound the weights are unpacked once to bf16 and
// widened to float32 split by parity ([even 16][odd 16] for each 32, bf16's bits in float32's top
// half: exact), the tokens too, and the tiles run FMAs: the same sums, in the same order.
constexpr int kSplitTokens = 4;  // tokens per FMA tile

// A bf16 pair vector (32 elements) as its even and odd elements in float32, stored [even][odd].
inline void store_split(float* dst, __m512i pair_bits) {
  _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(pair_bits, 16)));
  _mm512_storeu_ps(dst + 16, _mm512_castsi512_ps(
                                 _mm512_and_si512(pair_bits, _mm512_set1_epi32(int(0xFFFF0000)))));
}

// x's rows rounded to bf16 and split, in tiles of up to kSplitTokens tokens: [K / 32][TB][32].
BF16_TARGET void pack_tokens_split(const float* x, int64_t ldx, int64_t M, int64_t K, float* xs) {
  for (int64_t t0 = 0; t0 < M; t0 += kSplitTokens) {
    const int64_t tb = std::min<int64_t>(kSplitTokens, M - t0);
    float* dst = xs + t0 * K;
    for (int64_t c = 0; c < K / 32; ++c)
      for (int64_t t = 0; t < tb; ++t) {
        const float* src = x + (t0 + t) * ldx + c * 32;
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        store_split(dst + (c * tb + t) * 32, reinterpret_cast<__m512i>(v));
      }
  }
}

// Rows of `blocks` blocks each, rounded to bf16 and split (row stride K floats).
template <class Q>
BF16_TARGET void dequantize_rows_split(const uint8_t* w, int64_t rows, int64_t blocks, float* y) {
  const int64_t K = blocks * Q::kBlock;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = w + (n * blocks + b) * Q::kBytes;
#pragma GCC unroll 8
      for (int i = 0; i < Q::kBlock / 32; ++i)
        store_split(y + n * K + b * Q::kBlock + 32 * i, reinterpret_cast<__m512i>(pair<Q>(blk, i)));
    }
}

// out[t, r] = dot(w row r, x row t) for r < rows (<= R), t < TB, on split rows and tokens: per
// lane the chain of `tile`'s vdpbf16ps, as FMAs (odd, then even), then the same reduction.
template <int R, int TB>
void split_tile(const float* w, int64_t K, int64_t rows, const float* xs, float* out,
                int64_t ldo) {
  const float* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(r, rows - 1) * K;
  __m512 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // FTZ and DAZ for the FMAs, as vdpbf16ps; not for the reduction
  for (int64_t s = 0; s < K / 32; ++s) {
    __m512 we[R], wo[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      we[r] = _mm512_loadu_ps(wr[r] + 32 * s);
      wo[r] = _mm512_loadu_ps(wr[r] + 32 * s + 16);
    }
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) {
      const float* xt = xs + (s * TB + t) * 32;
      const __m512 xe = _mm512_loadu_ps(xt), xo = _mm512_loadu_ps(xt + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r][t] = _mm512_fmadd_ps(wo[r], xo, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(we[r], xe, acc[r][t]);
      }
    }
  }
  _mm_setcsr(csr);
  store_sums<R, TB>(acc, rows, out, ldo);
}

// out[t, n] for n < rows, t < M on split rows: kSplitRows rows at a time (in L1 while every
// token tile passes over them; the tokens stream from L2), token tiles innermost.
constexpr int kSplitRows = 4;
void split_rows_by_tokens(const float* w, int64_t K, int64_t rows, const float* xs, int64_t M,
                          float* out, int64_t ldo) {
  constexpr int R = kSplitRows;
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const float* wr = w + r0 * K;
    const int64_t n = std::min<int64_t>(R, rows - r0);
    for (int64_t t0 = 0; t0 < M; t0 += kSplitTokens) {
      const float* xt = xs + t0 * K;
      float* ot = out + t0 * ldo + r0;
      switch (std::min<int64_t>(kSplitTokens, M - t0)) {
        case 1: split_tile<R, 1>(wr, K, n, xt, ot, ldo); break;
        case 2: split_tile<R, 2>(wr, K, n, xt, ot, ldo); break;
        case 3: split_tile<R, 3>(wr, K, n, xt, ot, ldo); break;
        default: split_tile<R, 4>(wr, K, n, xt, ot, ldo); break;
      }
    }
  }
}

// out[t, n] = dot(w row n, x row t) for n < rows, t < M; token tiles innermost.
template <class Q>
BF16_TARGET void rows_by_tokens(const uint8_t* w, int64_t row_bytes, int64_t rows,
                                const uint16_t* xp, int64_t M, int64_t K, float* out, int64_t ldo) {
  const int64_t blocks = K / Q::kBlock;
  for (int64_t g = 0; g < rows; g += kGroup) {
    const uint8_t* wg = w + g * row_bytes;
    const int64_t n = std::min<int64_t>(kGroup, rows - g);
    for (int64_t t0 = 0; t0 < M; t0 += kMaxTokens) {
      const uint16_t* xt = xp + t0 * K;
      float* ot = out + t0 * ldo + g;
      switch (std::min<int64_t>(kMaxTokens, M - t0)) {
        case 1: group_tile<Q, 1>(wg, row_bytes, n, xt, ot, ldo, blocks); break;
        case 2: group_tile<Q, 2>(wg, row_bytes, n, xt, ot, ldo, blocks); break;
        case 3: group_tile<Q, 3>(wg, row_bytes, n, xt, ot, ldo, blocks); break;
        case 4: group_tile<Q, 4>(wg, row_bytes, n, xt, ot, ldo, blocks); break;
        case 5: group_tile<Q, 5>(wg, row_bytes, n, xt, ot, ldo, blocks); break;
        case 6: group_tile<Q, 6>(wg, row_bytes, n, xt, ot, ldo, blocks); break;
        case 7: group_tile<Q, 7>(wg, row_bytes, n, xt, ot, ldo, blocks); break;
        default: group_tile<Q, 8>(wg, row_bytes, n, xt, ot, ldo, blocks); break;
      }
    }
  }
}

// Rows of `blocks` blocks each into bf16 (row stride K elements).
template <class Q>
BF16_TARGET void dequantize_rows_bf16(const uint8_t* w, int64_t rows, int64_t blocks, uint16_t* y) {
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = w + (n * blocks + b) * Q::kBytes;
#pragma GCC unroll 8
      for (int i = 0; i < Q::kBlock / 32; ++i)
        _mm512_storeu_si512(y + (n * blocks + b) * Q::kBlock + 32 * i,
                            reinterpret_cast<__m512i>(pair<Q>(blk, i)));
    }
}

// Whether M token rows are unpacked on the fly. A tile of 8 tokens unpacks its weights again, and
// with a dot twice as cheap that unpacking is soon the larger part: past these bounds each thread
// rounds a chunk of rows to bf16 once, split into a float32 scratch in L2 (`dequantize_rows_split`),
// and runs the FMA tiles over it (measured at SmolLM2's shapes; K-quants unpack more slowly, so
// they stop sooner).
template <class Q>
bool on_the_fly(int64_t M, int64_t K) {
  return M <= (Q::kBlock == 256 ? 16 : 24) && M * K * int64_t(sizeof(uint16_t)) <= (1 << 20);
}
constexpr int64_t kScratchBytes = 256 * 1024;
constexpr int64_t kTokensPerPass = 64;
// Rows up to this long take the FMA tiles; longer ones keep vdpbf16ps on a bf16 scratch: 4 split
// rows and 4 split tokens of SmolLM2's down projection (K = 1,536) are 48 KB, more than L1 holds
// beside the rest, and there the FMA tiles measured slower (docs/performance.md). Same bits.
constexpr int64_t kSplitMaxK = 1024;

template <class Q>
void linear_on_the_fly(float* out, const uint16_t* xp, const uint8_t* w, int64_t M, int64_t N,
                       int64_t K) {
  const int64_t row_bytes = K / Q::kBlock * Q::kBytes;
  at::parallel_for(0, (N + kGroup - 1) / kGroup, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kGroup, n1 = std::min(N, end * kGroup);
    rows_by_tokens<Q>(w + n0 * row_bytes, row_bytes, n1 - n0, xp, M, K, out + n0, N);
  });
}

template <class Q>
void linear_chunked_bf16(float* out, const uint16_t* xp, const uint8_t* w, int64_t M, int64_t N,
                         int64_t K) {
  const int64_t row_bytes = K / Q::kBlock * Q::kBytes;
  const int64_t threads = at::get_num_threads();  // chunks as linear_chunked's, bf16 rows
  const int64_t target = std::clamp<int64_t>(kScratchBytes / (2 * K), 16, 256);
  const int64_t chunks = threads * ((N + threads * target - 1) / (threads * target));
  const int64_t rows_per = std::max<int64_t>(1, (N + chunks - 1) / chunks);
  at::parallel_for(0, (N + rows_per - 1) / rows_per, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> scratch(rows_per * K);  // [rows_per, K] bf16
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n0 = c * rows_per, rows = std::min(rows_per, N - n0);
      dequantize_rows_bf16<Q>(w + n0 * row_bytes, rows, K / Q::kBlock, scratch.data());
      for (int64_t t0 = 0; t0 < M; t0 += kTokensPerPass)
        rows_by_tokens<BF16Rows>(reinterpret_cast<const uint8_t*>(scratch.data()), 2 * K, rows,
                                 xp + t0 * K, std::min(kTokensPerPass, M - t0), K,
                                 out + t0 * N + n0, N);
    }
  });
}

template <class Q>
void linear_chunked(float* out, const float* xs, const uint8_t* w, int64_t M, int64_t N,
                    int64_t K) {
  const int64_t row_bytes = K / Q::kBlock * Q::kBytes;
  // Chunks of rows, their count a multiple of the thread count so that the threads split evenly.
  const int64_t threads = at::get_num_threads();
  const int64_t target = std::clamp<int64_t>(kScratchBytes / (4 * K), 16, 256);
  const int64_t chunks = threads * ((N + threads * target - 1) / (threads * target));
  const int64_t rows_per = std::max<int64_t>(1, (N + chunks - 1) / chunks);
  at::parallel_for(0, (N + rows_per - 1) / rows_per, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(rows_per * K);  // [rows_per, K] bf16 values, split
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n0 = c * rows_per, rows = std::min(rows_per, N - n0);
      dequantize_rows_split<Q>(w + n0 * row_bytes, rows, K / Q::kBlock, scratch.data());
      for (int64_t t0 = 0; t0 < M; t0 += kTokensPerPass)
        split_rows_by_tokens(scratch.data(), K, rows, xs + t0 * K,
                             std::min(kTokensPerPass, M - t0), out + t0 * N + n0, N);
    }
  });
}
#endif  // __AVX512F__

bool gguf_has_bf16_dot() {
#if defined(__AVX512F__)
  return cpu_has_bf16_dot();
#else
  return false;
#endif
}

void gguf_linear_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                      int64_t qtype) {
  const char* op = "minivllm_cpu::gguf_linear_bf16";
  TORCH_CHECK(gguf_has_bf16_dot(), op, ": this CPU (or this build) has no AVX512-BF16; use gguf_linear");
#if defined(__AVX512F__)
  with_type(qtype, op, [&](auto q) {
    using Q = decltype(q);
    const LinearShape shape = check_linear<Q>(out, x, qweight, op);
    const int64_t M = shape.M, N = shape.N, K = shape.K;
    if (M == 0 || N == 0) return;
    if (on_the_fly<Q>(M, K) || K > kSplitMaxK) {
      std::vector<uint16_t> packed(M * K);  // x as bf16 token tiles (pack_tokens)
      pack_tokens(x.data_ptr<float>(), x.stride(0), M, K, packed.data());
      (on_the_fly<Q>(M, K) ? linear_on_the_fly<Q> : linear_chunked_bf16<Q>)(
          out.data_ptr<float>(), packed.data(), qweight.data_ptr<uint8_t>(), M, N, K);
    } else {
      std::vector<float> split(M * K);  // x as bf16 values, split (pack_tokens_split)
      pack_tokens_split(x.data_ptr<float>(), x.stride(0), M, K, split.data());
      linear_chunked<Q>(out.data_ptr<float>(), split.data(), qweight.data_ptr<uint8_t>(), M, N,
                        K);
    }
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("gguf_linear_bf16(Tensor(a!) out, Tensor x, Tensor qweight, int qtype) -> ()",
        &gguf_linear_bf16);
  m.def("gguf_has_bf16_dot() -> bool", &gguf_has_bf16_dot);
}

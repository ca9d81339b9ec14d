// gguf_linear on AVX2 CPUs (x86-64-v3: AVX2, FMA, F16C, no AVX-512) with 8-bit integer dots, as
// ggml's CPU backend does (llama.cpp ggml-cpu, arch/x86/quants.c: ggml_vec_dot_q4_1_q8_1,
// ggml_vec_dot_q4_K_q8_K, ggml_vec_dot_q6_K_q8_K and their siblings).
//
// Why integers. AVX2 has no bf16 dot and 8 float lanes: a float32 FMA does 8 products. The weights'
// quants are small integers already, so x is rounded once per call to 8-bit blocks and the block
// products are `_mm256_maddubs_epi16` (u8 x s8, 32 products into 16 int16 pair sums) then
// `_mm256_madd_epi16` (pairs into 8 int32, optionally times a sub-block scale): 32 products per
// instruction pair, and the float scales are applied once per block, not once per weight. Nothing
// is dequantized to float32. The price is x's rounding, bounded and tested:
//   |out - x · Wᵀ| <= Σ_blocks Σ_k |w_k| · (max|x_block| / 127) / 2   (plus float32 rounding)
//
// x's blocks (`quantize_tokens`), as ggml's Q8_1 / Q8_K (symmetric, one float scale, no zero point):
//   32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)   per 32:  dx = max|x| / 127, xq = rint(x / dx),
//                                                              sx = dx · Σ xq   (for the offsets)
//   K-quants (Q4_K, Q5_K, Q6_K)                       per 256: dx, xq[256], bsums[16] = Σ of each 16
// rint rounds half to even; xq = rint(x · (127 / max|x|)) exactly as written, so that the tests'
// numpy reference of this scheme rounds every element the same way.
//
// The weights. Each thread unpacks a group of weight rows once into a per-thread buffer
// (std::vectors): every quant as one byte in x's order, and the block's scales beside it. Then
// register tiles of R rows x T tokens run over the buffer, so that a 32-byte load of weights serves
// T tokens and a load of x serves R rows; token panels keep the x rows that the tiles reread in L2.
// The int8 buffer is a quarter of the float32 scratch that dequantize-then-multiply would write.
// At decode's few token rows (kInRegisterTokens) the K-quants skip the buffer: writing and
// rereading it costs more than the packed weight's own bytes, so each super-block is unpacked in
// registers and dotted at once (tileK_in_registers, cpu_gguf_kquant_avx2.h), with the same int32
// lanes and float steps as the buffered tile: a row's output does not depend on the batch size.
//
// Threads split the weight rows (at::parallel_for); inside the parallel regions only raw pointers
// and std::vector are touched: ATen ops there would run without the caller's InferenceMode.
// AVX2 builds run it as gguf_linear. AVX-512 builds compile it too, for gguf_linear_int8 on CPUs
// with AVX512-VNNI (cpu_gguf_gemm.cpp checks the CPU): there everything from the kernel header on
// carries the avx512vnni target (`#pragma GCC target`), and each 32-byte dot is one VNNI
// instruction (`dot4`: vpdpbusd; `dot32`: maddubs then vpdpwssd) that gives the int32 lanes of
// AVX2's maddubs/madd pair, exactly: maddubs's int16 pair sums cannot saturate for these quants,
// so the outputs equal the AVX2 build's for the same x and weights. The K-quants' in-register
// tiles dot two 32-byte chunks an instruction there (512 bits, `dot512`) and hold all 8 decode
// tokens at once (32 registers), but fold each super-block's lanes back to AVX2's 8 before the
// float steps, which stay 256 bits wide: the same outputs. Q8_0 on VNNI has a kernel of its own
// (`linearQ8_0`: its bytes dotted where they lie, at every M), whose float steps are its own, so
// its outputs differ from the AVX2 build's within the bound below (and are batch-invariant).
// tests/cpu/test_kernels_cpu_gguf.py holds this to a numpy model of the same integer scheme and
// to the float product within the bound above.

#include "cpu_gguf_blocks.h"

#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#if defined(__AVX512F__)
#define MINIVLLM_INT8_VNNI 1
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#endif
#include "cpu_gguf_kquant_avx2.h"
#include "cpu_gguf_xq_avx2.h"

namespace minivllm_gguf_avx2 {
namespace {

// ------------------------------------------------------------------- unpacking weight blocks
// The nibbles of 16 bytes as 32 bytes: the low nibbles (weights 0..15), then the high (16..31).
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo4 = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), lo4), _mm_and_si128(v, lo4));
}
// Bit j of the 32-bit qh as 0x10 in byte j: a 5-bit quant's top bit.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  // byte j <- byte j / 8 of qh; keep bit j % 8; compare: 0xFF where set
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(qh)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// 32-weight types: block b of a row becomes q[32] (one byte per weight, in order) and two floats,
// w_k = A · q_k + B; so Σ_k w_k · dx · xq_k = A · dx · (q · xq) + B · sx. Q8_0's q is signed
// (kSigned), the others' are 0..31.
struct Q4_0x { using Q = Q4_0; static constexpr bool kSigned = false, kOffset = true;
  static void unpack(const uint8_t* b, uint8_t* q, float& A, float& B) {  // | d | qs[16] |
    store32(q, nibbles32(b + 2));
    A = half(b), B = -8.0f * A;
  }
};
struct Q4_1x { using Q = Q4_1; static constexpr bool kSigned = false, kOffset = true;
  static void unpack(const uint8_t* b, uint8_t* q, float& A, float& B) {  // | d | m | qs[16] |
    store32(q, nibbles32(b + 4));
    A = half(b), B = half(b + 2);
  }
};
struct Q5_0x { using Q = Q5_0; static constexpr bool kSigned = false, kOffset = true;
  static void unpack(const uint8_t* b, uint8_t* q, float& A, float& B) {  // | d | qh | qs[16] |
    store32(q, _mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2)));
    A = half(b), B = -16.0f * A;
  }
};
struct Q5_1x { using Q = Q5_1; static constexpr bool kSigned = false, kOffset = true;
  static void unpack(const uint8_t* b, uint8_t* q, float& A, float& B) {  // | d | m | qh | qs[16] |
    store32(q, _mm256_or_si256(nibbles32(b + 8), fifth_bits(b + 4)));
    A = half(b), B = half(b + 2);
  }
};
struct Q8_0x { using Q = Q8_0; static constexpr bool kSigned = true, kOffset = false;
  static void unpack(const uint8_t* b, uint8_t* q, float& A, float& B) {  // | d | int8 qs[32] |
    std::memcpy(q, b + 2, 32);
    A = half(b), B = 0.0f;
  }
};

// The K-quants' unpacking (to a buffer, or in registers) is in cpu_gguf_kquant_avx2.h.

// ------------------------------------------------------------------------------ the tiles
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// A group of unpacked rows, 32-weight types: q [rows][padded64(K)] bytes (zeros past K), A in
// block pairs [rows][padded64(K) / 64][8] (pair_lanes) and B [rows][padded8(K / 32)] (zeros past
// the last block).
struct Rows32 { const uint8_t* q; const float* A; const float* B; };

// out[t · ldo + r] = Σ_b A_rb · dx_tb · (q_rb · xq_tb) + Σ_b B_rb · sx_tb, for r < rows (<= R),
// t < T. Rows past `rows` repeat the last; their sums are dropped.
// Two blocks a step: each block's dot is maddubs then madd (8 int32 sums); one hadd packs both
// blocks' sums into one vector (pair_lanes' order), so that one conversion and one FMA with the
// pair's scales serve 64 products. The offsets go into the same float lanes, 8 blocks an FMA, and
// the tile ends with one horizontal sum per output.
template <class X, int R, int T>
void tile32(Rows32 w, int64_t rows, const Tokens& x, int64_t t0, float* out, int64_t ldo) {
  const int64_t ldq = x.ldq, pairs = ldq / 64, nbp = padded8(x.blocks);
  int64_t row[R];
  for (int r = 0; r < R; ++r) row[r] = std::min<int64_t>(r, rows - 1);
  const int8_t* xq = x.xq.data() + t0 * ldq;
  const float* dx = x.dx.data() + t0 * pairs * 8;
  const float* sx = x.sx.data() + t0 * nbp;
  // q · x over 32 bytes: |q| · (x with q's sign) for Q8_0, whose q is signed (maddubs' unsigned
  // side must not be), so every pair sum stays within int16.
  auto dot = [&](__m256i q, const int8_t* xp) {
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
    if (X::kSigned) xv = _mm256_sign_epi8(xv, q), q = _mm256_sign_epi8(q, q);
    return dot4(q, xv);
  };
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* qr = w.q + row[r] * ldq + 64 * j;
      const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr));
      const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + 32));
      const __m256 A = _mm256_loadu_ps(w.A + (row[r] * pairs + j) * 8);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const int8_t* xt = xq + t * ldq + 64 * j;
        const __m256i sums = _mm256_hadd_epi32(dot(q0, xt), dot(q1, xt + 32));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                    _mm256_mul_ps(A, _mm256_loadu_ps(dx + (t * pairs + j) * 8)), acc[r][t]);
      }
    }
  }
  if (X::kOffset)  // Σ B · sx, 8 blocks an FMA
    for (int64_t b = 0; b < nbp; b += 8)
      for (int r = 0; r < R; ++r) {
        const __m256 Bv = _mm256_loadu_ps(w.B + row[r] * nbp + b);
        for (int t = 0; t < T; ++t)
          acc[r][t] = _mm256_fmadd_ps(Bv, _mm256_loadu_ps(sx + t * nbp + b), acc[r][t]);
      }
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < T; ++t) out[t * ldo + r] = hsum(acc[r][t]);
}

// A group of unpacked rows, K-quants: q [rows][K] bytes, sc [rows][K / 256][8][16],
// mn [rows][K / 256][16], d and dmin [rows][K / 256].
struct RowsK { const uint8_t* q; const int16_t* sc; const int16_t* mn; const float* d; const float* dmin; };

template <class X, int R, int T>
void tileK(RowsK w, int64_t rows, const Tokens& x, int64_t t0, float* out, int64_t ldo) {
  const int64_t K = x.K, ns = x.blocks;
  int64_t row[R];
  for (int r = 0; r < R; ++r) row[r] = std::min<int64_t>(r, rows - 1);
  const int8_t* xq = x.xq.data() + t0 * K;
  const float* dx = x.dx.data() + t0 * ns;
  const int16_t* bsums = x.bsums.data() + t0 * ns * 16;
  __m256 acc[R];  // token t in lane t
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t rs = row[r] * ns + s;
      const uint8_t* q = w.q + row[r] * K + 256 * s;
      const int16_t* sc = w.sc + rs * 128;
      __m256i sumi[T];
      for (int t = 0; t < T; ++t) sumi[t] = _mm256_setzero_si256();
#pragma GCC unroll 2  // a full unroll lets GCC hoist all 32 dots, and spill them
      for (int c = 0; c < 8; ++c) {
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
        const __m256i scv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16 * c));
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) {
          sumi[t] = dot32(sumi[t], qv, xq + t * K + 256 * s + 32 * c, scv);
        }
      }
      const KScales k{load32(w.mn + rs * 16), w.d[rs], w.dmin[rs]};
      acc[r] = accumulate<X, T>(acc[r], sumi, k, bsums + s * 16, ns * 16, dx + s, ns);
    }
  }
  for (int r = 0; r < rows; ++r) {
    alignas(32) float o[8];
    _mm256_store_ps(o, acc[r]);
    for (int t = 0; t < T; ++t) out[t * ldo + r] = o[t];
  }
}

// Software prefetch of the weight stream, kPrefetchAhead bytes ahead of p and as many bytes as
// one block: called once a block, it asks for every line before the tile reads it. Without it one
// core's reads of the rows' single stream stall on memory at decode's few tokens (measured, with
// the distances tried, on docs/performance.md).
constexpr int64_t kPrefetchAhead = 2048;
template <int kBytes>
inline void prefetch_ahead(const uint8_t* p) {
  const char* a = reinterpret_cast<const char*>(p) + kPrefetchAhead;
#pragma GCC unroll 4
  for (int j = 0; j < (kBytes + 63) / 64; ++j) _mm_prefetch(a + 64 * j, _MM_HINT_T0);
}

// The same outputs as tileK, for rows [0, rows) of packed blocks w (row stride row_bytes) and
// tokens [t0, t0 + T), with every super-block unpacked in registers (X::dot) and dotted into the
// T tokens at once: no buffer is written or reread. Each row's weight bytes are read once, in
// order, so that a thread's rows are one stream that the hardware prefetcher follows.
template <class X, int T>
void tileK_in_registers(const uint8_t* w, int64_t row_bytes, int64_t rows, const Tokens& x,
                        int64_t t0, float* out, int64_t ldo) {
  const int64_t K = x.K, ns = x.blocks;
  const int8_t* xq = x.xq.data() + t0 * K;
  const float* dx = x.dx.data() + t0 * ns;
  const int16_t* bsums = x.bsums.data() + t0 * ns * 16;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    __m256 acc = _mm256_setzero_ps();  // token t in lane t
    for (int64_t s = 0; s < ns; ++s) {
      prefetch_ahead<X::Q::kBytes>(wr + s * X::Q::kBytes);
      __m256i sumi[T];
      for (int t = 0; t < T; ++t) sumi[t] = _mm256_setzero_si256();
#if defined(MINIVLLM_INT8_VNNI)
      const KScales k = X::template dot512<T>(wr + s * X::Q::kBytes, xq + 256 * s, K, sumi);
#else
      const KScales k = X::template dot<T>(wr + s * X::Q::kBytes, xq + 256 * s, K, sumi);
#endif
      acc = accumulate<X, T>(acc, sumi, k, bsums + s * 16, ns * 16, dx + s, ns);
    }
    alignas(32) float o[8];
    _mm256_store_ps(o, acc);
    for (int t = 0; t < T; ++t) out[t * ldo + r] = o[t];
  }
}

// ------------------------------------------------------------------------------ the linear
constexpr int kTokens = 4;                   // tokens per register tile
constexpr int64_t kPanelBytes = 64 * 1024;   // x rows (int8) that the tiles reread: kept in L2
constexpr int64_t kGroupBytes = 128 * 1024;  // a thread's unpacked rows (1 to 2.2 bytes a weight)
// K-quants at up to kInRegisterTokens token rows skip the buffer (tileK_in_registers): unpacking
// again for every kTokens tokens costs less than writing and rereading the unpacked rows. Work
// items of kInRegisterRows rows, whose packed bytes stay in L2 while each token tile rereads them.
constexpr int64_t kInRegisterTokens = 8, kInRegisterRows = 16;
// Tokens per in-register tile: AVX-512's 32 vector registers hold all 8 tokens' sums, so that
// each super-block is unpacked once a step; AVX2's 16 hold 4.
#if defined(MINIVLLM_INT8_VNNI)
constexpr int kInRegisterTile = 8;
#else
constexpr int kInRegisterTile = 4;
#endif

// Rows per work item: a buffer of about kGroupBytes, a multiple of 4, in a number of items that
// splits evenly over the threads.
int64_t group_rows(int64_t N, int64_t K, int64_t bytes_per_weight) {
  const int64_t threads = at::get_num_threads();
  const int64_t target = std::clamp<int64_t>(kGroupBytes / (bytes_per_weight * K), 4, 256);
  const int64_t groups = threads * ((N + threads * target - 1) / (threads * target));
  return (std::max<int64_t>(1, (N + groups - 1) / groups) + 3) / 4 * 4;
}

// The tiles over one group of unpacked rows: token panels of x that stay in L2; in a panel, each
// R rows (their buffer in L1) against every tile of kTokens tokens. `tile(r0, rows, t0, T)` runs
// the register tile of rows [r0, r0 + rows) and tokens [t0, t0 + T).
template <int R, class Tile>
void over_group(int64_t rows, int64_t M, int64_t K, Tile&& tile) {
  const int64_t panel = std::max<int64_t>(kTokens, kPanelBytes / K / kTokens * kTokens);
  for (int64_t p0 = 0; p0 < M; p0 += panel) {
    const int64_t p1 = std::min(M, p0 + panel);
    for (int64_t r0 = 0; r0 < rows; r0 += R)
      for (int64_t t0 = p0; t0 < p1; t0 += kTokens) {
        const int64_t n = std::min<int64_t>(R, rows - r0);
        switch (std::min<int64_t>(kTokens, p1 - t0)) {
          case 1: tile(std::integral_constant<int, 1>{}, r0, n, t0); break;
          case 2: tile(std::integral_constant<int, 2>{}, r0, n, t0); break;
          case 3: tile(std::integral_constant<int, 3>{}, r0, n, t0); break;
          default: tile(std::integral_constant<int, 4>{}, r0, n, t0); break;
        }
      }
  }
}

// Rows per register tile: one token (decode): 4 rows share each load of x. More tokens: `many`
// rows x 4 tokens, 2 for the 32-weight types (8 float sums); 1 for the K-quants, which also keep
// 4 int32 sums of a super-block live, and whose x loads are memory operands of their dots.
template <class F>
void with_rows(int64_t M, int many, F&& f) {
  if (M == 1) f(std::integral_constant<int, 4>{});
  else if (many == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

template <class X>
void linear32(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N,
              int64_t K) {
  using Q = typename X::Q;
  const Tokens tok = quantize_tokens(x, ldx, M, K, 32);
  const int64_t nb = K / 32, nbp = padded8(nb), ldq = padded64(K), row_bytes = nb * Q::kBytes;
  const int64_t G = group_rows(N, K, 2);
  with_rows(M, 2, [&](auto r_) {
    constexpr int R = decltype(r_)::value;
    at::parallel_for(0, (N + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> q(G * ldq, 0);  // [G][padded64(K)] this thread's rows, a byte a weight
      std::vector<float> A(G * ldq / 8, 0.0f);  // [G][padded64(K) / 64][8]   (pair_lanes)
      std::vector<float> B(G * nbp, 0.0f);  // [G][padded8(K / 32)]
      for (int64_t g = begin; g < end; ++g) {
        const int64_t n0 = g * G, rows = std::min(G, N - n0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t b = 0; b < nb; ++b) {
            float a;
            X::unpack(w + (n0 + r) * row_bytes + b * Q::kBytes, q.data() + r * ldq + 32 * b, a,
                      B[r * nbp + b]);
            pair_lanes(A.data() + r * ldq / 8, b, a);
          }
        over_group<R>(rows, M, K, [&](auto t_, int64_t r0, int64_t n, int64_t t0) {
          const Rows32 rw{q.data() + r0 * ldq, A.data() + r0 * ldq / 8, B.data() + r0 * nbp};
          tile32<X, R, decltype(t_)::value>(rw, n, tok, t0, out + t0 * N + n0 + r0, N);
        });
      }
    });
  });
}

template <class X>
void linearK(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N,
             int64_t K) {
  using Q = typename X::Q;
  const Tokens tok = quantize_tokens(x, ldx, M, K, 256);
  const int64_t ns = K / 256, row_bytes = ns * Q::kBytes, G = group_rows(N, K, 3);
  if (M <= kInRegisterTokens) {  // each kInRegisterRows rows against every tile of kTokens tokens
    at::parallel_for(0, (N + kInRegisterRows - 1) / kInRegisterRows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n0 = begin * kInRegisterRows; n0 < std::min(N, end * kInRegisterRows); n0 += kInRegisterRows) {
        const int64_t rows = std::min(kInRegisterRows, N - n0);
        for (int64_t t0 = 0; t0 < M; t0 += kInRegisterTile) {
          const uint8_t* wg = w + n0 * row_bytes;
          float* o = out + t0 * N + n0;
          switch (std::min<int64_t>(kInRegisterTile, M - t0)) {
            case 1: tileK_in_registers<X, 1>(wg, row_bytes, rows, tok, t0, o, N); break;
            case 2: tileK_in_registers<X, 2>(wg, row_bytes, rows, tok, t0, o, N); break;
            case 3: tileK_in_registers<X, 3>(wg, row_bytes, rows, tok, t0, o, N); break;
#if defined(MINIVLLM_INT8_VNNI)
            case 4: tileK_in_registers<X, 4>(wg, row_bytes, rows, tok, t0, o, N); break;
            case 5: tileK_in_registers<X, 5>(wg, row_bytes, rows, tok, t0, o, N); break;
            case 6: tileK_in_registers<X, 6>(wg, row_bytes, rows, tok, t0, o, N); break;
            case 7: tileK_in_registers<X, 7>(wg, row_bytes, rows, tok, t0, o, N); break;
            default: tileK_in_registers<X, 8>(wg, row_bytes, rows, tok, t0, o, N); break;
#else
            default: tileK_in_registers<X, 4>(wg, row_bytes, rows, tok, t0, o, N); break;
#endif
          }
        }
      }
    });
    return;
  }
  with_rows(M, 1, [&](auto r_) {
    constexpr int R = decltype(r_)::value;
    at::parallel_for(0, (N + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> q(G * K);             // [G][K]
      std::vector<int16_t> sc(G * ns * 128);     // [G][K / 256][8][16]
      std::vector<int16_t> mn(G * ns * 16);      // [G][K / 256][16]
      std::vector<float> d(G * ns), dmin(G * ns);  // [G][K / 256]
      for (int64_t g = begin; g < end; ++g) {
        const int64_t n0 = g * G, rows = std::min(G, N - n0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t s = 0; s < ns; ++s) {
            const int64_t rs = r * ns + s;
            X::unpack(w + (n0 + r) * row_bytes + s * Q::kBytes,
                      KBlock{q.data() + r * K + 256 * s, sc.data() + rs * 128, mn.data() + rs * 16,
                             d.data() + rs, dmin.data() + rs});
          }
        over_group<R>(rows, M, K, [&](auto t_, int64_t r0, int64_t n, int64_t t0) {
          const int64_t o = r0 * ns;
          const RowsK rw{q.data() + r0 * K, sc.data() + o * 128, mn.data() + o * 16, d.data() + o,
                         dmin.data() + o};
          tileK<X, R, decltype(t_)::value>(rw, n, tok, t0, out + t0 * N + n0 + r0, N);
        });
      }
    });
  });
}

#if defined(MINIVLLM_INT8_VNNI)
// ------------------------------------------------------------------ Q8_0 on AVX512-VNNI
// Q8_0's quants are bytes already: there is nothing to unpack, only the block's fp16 scale. So
// here, at every token count, each block pair is dotted where it lies (no buffer), 64 products a
// `vpdpbusd` per token, and its two scales applied to the pair's int32 lanes in one FMA:
//   Σ_k w_k · dx · xq_k = Σ_blocks (d · dx) · (q · xq)
// vpdpbusd multiplies unsigned by signed bytes, and both Q8_0's q and x's xq are signed; so x
// goes in as xq + 128 (`xu`, unsigned) and each lane starts from -128 · Σ q over its 4 weights
// (`dot4` of 0x80 bytes with q, once a row for all tokens): xu · q - 128 · Σ q = xq · q exactly.
// The float steps are this kernel's own, the same at every M (batch-invariant), not tile32's:
// a block's 8 int32 lanes times its d · dx into 8 float lanes, one horizontal sum at the end.
struct TokensQ8 {
  int64_t pairs;
  std::vector<uint8_t> xu;  // [M][pairs][64] xq + 128; 128 (xq = 0) past the last block
  std::vector<float> dx;    // [M][pairs][16] each block's dx in its 8 lanes; 0 past the last block
};

TokensQ8 quantize_tokens_q8(const float* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t nb = K / 32, pairs = (nb + 1) / 2;
  TokensQ8 t{pairs, std::vector<uint8_t>(M * pairs * 64, 0x80), std::vector<float>(M * pairs * 16, 0.0f)};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        int8_t q[32];
        const float d = quantize_block(x + m * ldx + b * 32, 32, q);
        uint8_t* u = t.xu.data() + m * pairs * 64 + b * 32;
        for (int k = 0; k < 32; ++k) u[k] = uint8_t(q[k] ^ 0x80);
        float* dl = t.dx.data() + m * pairs * 16 + b * 8;
        for (int k = 0; k < 8; ++k) dl[k] = d;
      }
  });
  return t;
}

// out[t · ldo + r] for rows r < rows of w (Q8_0 blocks, row stride row_bytes), tokens t < T of x.
template <int T>
void tileQ8_0(const uint8_t* w, int64_t row_bytes, int64_t rows, const TokensQ8& x, int64_t t0,
              int64_t nb, float* out, int64_t ldo) {
  const int64_t pairs = x.pairs;
  const uint8_t* xu = x.xu.data() + t0 * pairs * 64;
  const float* dx = x.dx.data() + t0 * pairs * 16;
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t* b0 = wr + 2 * p * Q8_0::kBytes;
      prefetch_ahead<2 * Q8_0::kBytes>(b0);
      const bool two = 2 * p + 1 < nb;
      // the pair's quants, block 2p in the low half, 2p + 1 (or zeros) in the high
      const __m256i q1 = two ? load32(b0 + Q8_0::kBytes + 2) : _mm256_setzero_si256();
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(load32(b0 + 2)), q1, 1);
      const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(),
                                             _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, q));
      const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(half(b0))),
                                          _mm256_set1_ps(two ? half(b0 + Q8_0::kBytes) : 0.0f), 1);
      for (int t = 0; t < T; ++t) {
        const __m512i sums = _mm512_dpbusd_epi32(start, load64(xu + (t * pairs + p) * 64), q);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums),
                                 _mm512_mul_ps(d, _mm512_loadu_ps(dx + (t * pairs + p) * 16)), acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(acc[t]);
  }
}

void linearQ8_0(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N,
                int64_t K) {
  const TokensQ8 tok = quantize_tokens_q8(x, ldx, M, K);
  const int64_t nb = K / 32, row_bytes = nb * Q8_0::kBytes;
  // Work items of kInRegisterRows rows, whose bytes stay in L1 while every 8-token tile rereads them.
  at::parallel_for(0, (N + kInRegisterRows - 1) / kInRegisterRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin * kInRegisterRows; n0 < std::min(N, end * kInRegisterRows); n0 += kInRegisterRows) {
      const int64_t rows = std::min(kInRegisterRows, N - n0);
      for (int64_t t0 = 0; t0 < M; t0 += 8) {
        const uint8_t* wg = w + n0 * row_bytes;
        float* o = out + t0 * N + n0;
        switch (std::min<int64_t>(8, M - t0)) {
          case 1: tileQ8_0<1>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 2: tileQ8_0<2>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 3: tileQ8_0<3>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 4: tileQ8_0<4>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 5: tileQ8_0<5>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 6: tileQ8_0<6>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 7: tileQ8_0<7>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          default: tileQ8_0<8>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
        }
      }
    }
  });
}
#endif  // MINIVLLM_INT8_VNNI

}  // namespace

// out[M, N] (contiguous) = x[M, K] (row stride ldx) · Wᵀ for GGUF blocks w [N, row_bytes] of a
// type that cpu_gguf_gemm.cpp's gguf_linear has checked (its GGML number, shapes and M, N > 0).
void gguf_linear_int8(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M,
                      int64_t N, int64_t K, int64_t qtype) {
  switch (qtype) {
    case Q4_0::kType: return linear32<Q4_0x>(out, x, ldx, w, M, N, K);
    case Q4_1::kType: return linear32<Q4_1x>(out, x, ldx, w, M, N, K);
    case Q5_0::kType: return linear32<Q5_0x>(out, x, ldx, w, M, N, K);
    case Q5_1::kType: return linear32<Q5_1x>(out, x, ldx, w, M, N, K);
#if defined(MINIVLLM_INT8_VNNI)
    case Q8_0::kType: return linearQ8_0(out, x, ldx, w, M, N, K);
#else
    case Q8_0::kType: return linear32<Q8_0x>(out, x, ldx, w, M, N, K);
#endif
    case Q4_K::kType: return linearK<Q4_Kx>(out, x, ldx, w, M, N, K);
    case Q5_K::kType: return linearK<Q5_Kx>(out, x, ldx, w, M, N, K);
    case Q6_K::kType: return linearK<Q6_Kx>(out, x, ldx, w, M, N, K);
    default: TORCH_CHECK(false, "gguf_linear_int8: GGML type ", qtype, " is not supported");
  }
}

}  // namespace minivllm_gguf_avx2
#if defined(__AVX512F__)
#pragma GCC pop_options
#endif
#endif  // __AVX2__

// The unsigned 32-weight types' (Q4_0, Q4_1, Q5_0, Q5_1) many-token tile on AVX2, in the layout of
// the K-quants' `tile_octet` (cpu_gguf_krows_avx2.h): 8 weight rows interleaved, one row a lane,
// so that a block's integer sum needs no horizontal reduction (the layout of ggml's repacked
// q4_0_8x8 GEMM, ggml-cpu repack.cpp, at AVX2's 8 lanes).
//
// Why. The row-major tile32 (cpu_gguf_block32_avx2.h) dots one row's block pair against a token's
// (two maddubs, an hadd of their int16 sums, one madd), then gathers each group of 8 blocks' lanes
// into block totals with two hadds and two permutes per row and token: shuffles on one port. Here
// a 32-byte vector holds 4 consecutive weights of each of 8 rows, and x's 4 bytes are broadcast:
//   P = maddubs(w, broadcast(xq[4g .. 4g + 3]))   lane pair of row r: its 4 products, 2 a pair
// The P of several groups add in int16 (kSumGroups32: as many as cannot overflow, |xq| <= 127:
// quants <= 15 give 2 · 15 · 127 a lane a group, 8 groups 30480; quants <= 31 allow 4), then one
// `madd` by ones gives each lane one row's block total S_b = Σ q · xq. On VNNI each group is one
// vpdpbusd into the int32 lanes instead. Integers: exact in any order, so S_b equals tile32's,
// tile32_in_registers', and the AMX tile's.
//
// The float steps are block_step's, vectorised over the 8 rows: per token, block b into partial
// b mod 8, p = fma(S_b, A_b · dx_b, p); p = fma(B_b, sx_b, p), then the same partials_tree per
// output. The partials are independent sums, so the tile runs partial by partial (blocks l, l + 8,
// l + 16, ... in order) and keeps only the current partial of each token in a register. The blocks
// past the last (tile32's zero padding) are skipped: their steps add fma(0, 0, p) = p exactly.
// So every output is bit for bit the same as on the other tiles, in any batch.
//
// The buffer, per 8 rows ("octet") and block, kOctetBytes32 bytes:
//   q  [8 groups][8 rows][4]   the quants, group g = weights 4g .. 4g + 3
//   A, B [8 rows] float        the scales (w = A · q + B)
// Included by cpu_gguf_gemm_avx2.cpp only (after cpu_gguf_krows_avx2.h and
// cpu_gguf_block32_avx2.h), and like it compiled for AVX2 and AVX-512 builds.

#pragma once

#include "cpu_gguf_blocks.h"

#if defined(__AVX2__)
#include <immintrin.h>

namespace minivllm_gguf_avx2 {
namespace {

constexpr int64_t kOctetBytes32 = 256 + 64;
// Groups of 4 weights whose int16 products add before the madd to int32 (see above).
template <class X>
constexpr int kSumGroups32 = std::is_same_v<typename X::Q, Q4_0> || std::is_same_v<typename X::Q, Q4_1> ? 8 : 4;

// Rows [0, rows) (rows <= 8; missing rows repeat the last, their outputs never stored) of packed
// blocks w (row stride row_bytes), all nb blocks, into dst (nb · kOctetBytes32).
template <class X>
void pack_octet32(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t nb, uint8_t* dst) {
  using Q = typename X::Q;
  alignas(32) uint8_t q[kOctet][32];
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = dst + b * kOctetBytes32;
    float* A = reinterpret_cast<float*>(o + 256);
    for (int r = 0; r < kOctet; ++r) unpack<X>(w + std::min<int64_t>(r, rows - 1) * row_bytes + b * Q::kBytes, q[r], A[r], A[8 + r]);
    for (int g = 0; g < 8; ++g)
      for (int r = 0; r < kOctet; ++r) std::memcpy(o + 32 * g + 4 * r, q[r] + 4 * g, 4);
  }
}

// One block's totals S_b for T tokens (a row a lane) of octet block o and x bytes xb (token t at
// xb + t · ldq).
template <class X, int T>
inline void octet_block_sums(const uint8_t* o, const int8_t* xb, int64_t ldq, __m256i (&S)[T]) {
#if defined(MINIVLLM_INT8_VNNI)
  for (int t = 0; t < T; ++t) S[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int g = 0; g < 8; ++g) {
    const __m256i wv = load32(o + 32 * g);
    for (int t = 0; t < T; ++t) S[t] = _mm256_dpbusd_epi32(S[t], wv, broadcast4(xb + t * ldq + 4 * g));
  }
#else
  constexpr int kG = kSumGroups32<X>;
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 2
  for (int j = 0; j < 8 / kG; ++j) {
    __m256i P[T];
#pragma GCC unroll 8
    for (int i = 0; i < kG; ++i) {
      const int g = j * kG + i;
      const __m256i wv = load32(o + 32 * g);
      for (int t = 0; t < T; ++t) {
        const __m256i p = _mm256_maddubs_epi16(wv, broadcast4(xb + t * ldq + 4 * g));
        P[t] = i == 0 ? p : kept(_mm256_add_epi16(P[t], p));
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m256i s = _mm256_madd_epi16(P[t], ones);
      S[t] = j == 0 ? s : _mm256_add_epi32(S[t], s);
    }
  }
#endif
}

// Outputs out[t · ldo + r] (r < rows, t < T) of one packed octet pk (nb blocks) and tokens
// [t0, t0 + T) of x.
template <class X, int T>
void tile_octet32(const uint8_t* pk, int64_t nb, int64_t rows, const Tokens& x, int64_t t0, float* out,
                  int64_t ldo) {
  const int64_t ldq = x.ldq, nbp = padded8(x.blocks);
  const int8_t* xq = x.xq.data() + t0 * ldq;
  const float* dx = x.dx.data() + t0 * nbp;
  const float* sx = x.sx.data() + t0 * nbp;
  __m256 part[T][8];  // [token][partial] a row a lane
#pragma GCC unroll 1
  for (int l = 0; l < 8; ++l) {
    __m256 p[T];
    for (int t = 0; t < T; ++t) p[t] = _mm256_setzero_ps();
#pragma GCC unroll 1
    for (int64_t b = l; b < nb; b += 8) {
      const uint8_t* o = pk + b * kOctetBytes32;
      __m256i S[T];
      octet_block_sums<X, T>(o, xq + 32 * b, ldq, S);
      const __m256 A = _mm256_loadu_ps(reinterpret_cast<const float*>(o + 256));
      const __m256 B = _mm256_loadu_ps(reinterpret_cast<const float*>(o + 288));
      for (int t = 0; t < T; ++t)
        p[t] = block_step<X>(p[t], S[t], A, _mm256_set1_ps(dx[t * nbp + b]), B, _mm256_set1_ps(sx[t * nbp + b]));
    }
    for (int t = 0; t < T; ++t) part[t][l] = p[t];
  }
  store_octet<T>(part, rows, out, ldo);
}

}  // namespace
}  // namespace minivllm_gguf_avx2
#endif  // __AVX2__

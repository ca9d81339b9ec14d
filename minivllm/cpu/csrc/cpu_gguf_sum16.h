// Sums of a register tile's float32 lanes, one output each, with `_mm512_reduce_add_ps`'s bits.
//
// A GGUF tile (cpu_gguf_gemm_bf16.cpp) keeps one 16-lane vector of partial sums per weight row and
// token; each output is the sum of its vector's lanes. GCC's `_mm512_reduce_add_ps` takes 7
// instructions per vector; `fold16` sums 16 vectors in 45, with the same pairs, so outputs keep
// their bits whichever way a tile stores them (batch-invariance needs that: the 1-token and the
// many-token tiles must agree). Included by cpu_gguf_gemm_bf16.cpp, in the avx512 build only.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace {

#if defined(__AVX512F__)
// The lanes of 16 vectors summed at once, each sum the same bits as `_mm512_reduce_add_ps`'s:
// that one adds lane i to lane i + 8, then i + 4, then i + 2, then lanes 0 and 1 (GCC's
// avx512fintrin.h). Here each of the four rounds takes those same pairs for two vectors with two
// shuffles and one add, so 16 sums cost 45 instructions instead of 16 reductions of 7 and the
// tile's outputs keep their bits. Float addition is commutative, so the shuffles' operand order
// does not matter; its grouping does, and it is the reduction's. Lane 4 L + m of the result is
// the sum of a[4 m + L].
inline __m512 fold16(const __m512* a) {
  __m512 b[8];  // b[j]: lane i + a[2j]'s i + 8 for i < 8, then the same for a[2j + 1]
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
  __m512 c[4];  // c[i]: 128-bit lane L the four partials (then + 4) of a[4 i + L]
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  __m512 d[2];  // d[k]: 128-bit lane L the two partials (then + 2) of a[8 k + L], a[8 k + 4 + L]
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    const __m512d lo = _mm512_castps_pd(c[2 * k]), hi = _mm512_castps_pd(c[2 * k + 1]);
    d[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

// out[t, r] = the sum of acc[r][t]'s lanes for r < rows, t < TB (`_mm512_reduce_add_ps`'s bits).
template <int R, int TB>
inline void store_sums(const __m512 (&acc)[R][TB], int64_t rows, float* out, int64_t ldo) {
  if constexpr (R * TB == 16) {  // the 8-token and 4-token tiles: 16 sums in one fold
    alignas(64) float sums[16];  // lane 4 L + m holds the sum of acc's i = 4 m + L (r * TB + t)
    _mm512_store_ps(sums, fold16(&acc[0][0]));
    for (int r = 0; r < rows; ++r)
      for (int t = 0; t < TB; ++t) {
        const int i = r * TB + t;
        out[t * ldo + r] = sums[4 * (i % 4) + i / 4];
      }
  } else {
    for (int r = 0; r < rows; ++r)
      for (int t = 0; t < TB; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
}

#endif  // __AVX512F__

}  // namespace

// x rounded to 8-bit blocks, as ggml's Q8_1 / Q8_K: the activations' side of the integer dots of
// cpu_gguf_gemm_avx2.cpp (AVX2 and AVX512-VNNI) and cpu_gguf_amx.cpp (AMX). Both include this
// header, so a token row is rounded the same way whichever kernel multiplies it: the first step of
// their outputs being equal bit for bit.
// Like cpu_gguf_kquant_avx2.h, it is compiled in each including file with that file's target.

#pragma once

#include "cpu_gguf_blocks.h"

#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>

namespace minivllm_gguf_avx2 {
namespace {

// ------------------------------------------------------------------------- x as 8-bit blocks
// One block of n (32 or 256) floats: xq = rint(x · id), id = 127 / max|x| (0 for an all-zero
// block); returns the scale dx = max|x| / 127. The divisions are intrinsics so that -ffast-math
// cannot turn them into reciprocal products (which round differently from the reference).
inline float quantize_block(const float* x, int n, int8_t* xq) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float mx = _mm_cvtss_f32(m);
  const float d = _mm_cvtss_f32(_mm_div_ss(m, _mm_set_ss(127.0f)));
  const float id = mx != 0.0f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(127.0f), m)) : 0.0f;
  const __m256 vid = _mm256_set1_ps(id);
  for (int i = 0; i < n; i += 32) {  // 4 x 8 int32 -> 32 int8, in order
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), vid));
    // packs interleave 128-bit lanes: (0 1 | 2 3) -> bytes 0,2,1,3 ... ; permute puts them back
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i), ordered);
  }
  return d;
}

// Blocks rounded up to a multiple of 8: the offsets' per-block floats (B, sx) are padded with zeros
// to whole vectors of 8 blocks, which the tiles multiply with one FMA each.
inline int64_t padded8(int64_t blocks) { return (blocks + 7) / 8 * 8; }

// The 32-weight tiles dot two blocks a step (`pair_dot`): K padded to a multiple of 64 with zero
// quants.
inline int64_t padded64(int64_t K) { return (K + 63) / 64 * 64; }

// x[M, K] (row stride ldx) as blocks of kBlock: xq [M][ldq] and
// - kBlock 32: ldq = padded64(K) (zero quants past K), dx [M][padded8(K / 32)] and sx (dx · Σ xq)
//   alike, zeros past the last block;
// - kBlock 256: ldq = K, dx [M][K / 256] and bsums [M][K / 256][16] (Σ xq of each 16).
struct Tokens {
  int64_t K, ldq, blocks;
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
  std::vector<int16_t> bsums;
};

Tokens quantize_tokens(const float* x, int64_t ldx, int64_t M, int64_t K, int block) {
  const int64_t ldq = block == 32 ? padded64(K) : K, nbp = padded8(K / block);
  Tokens t{K, ldq, K / block, std::vector<int8_t>(M * ldq, 0), {}, {}, {}};
  if (block == 32) t.dx.assign(M * nbp, 0.0f), t.sx.assign(M * nbp, 0.0f);
  else t.dx.resize(M * t.blocks), t.bsums.resize(M * t.blocks * 16);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < t.blocks; ++b) {
        int8_t* q = t.xq.data() + m * ldq + b * block;
        const float d = quantize_block(x + m * ldx + b * block, block, q);
        if (block == 32) {
          t.dx[m * nbp + b] = d;
          int s = 0;
          for (int k = 0; k < 32; ++k) s += q[k];
          t.sx[m * nbp + b] = d * float(s);
        } else {
          t.dx[m * t.blocks + b] = d;
          for (int j = 0; j < 16; ++j) {
            int s = 0;
            for (int k = 0; k < 16; ++k) s += q[16 * j + k];
            t.bsums[(m * t.blocks + b) * 16 + j] = int16_t(s);
          }
        }
      }
  });
  return t;
}

}  // namespace
}  // namespace minivllm_gguf_avx2
#endif  // __AVX2__

// The few helpers that every AVX2 tile of cpu_gguf_gemm_avx2.cpp shares: the horizontal sum and
// the weight stream's prefetch (x's 8-bit blocks, which the AMX kernel shares too, are in
// cpu_gguf_xq_avx2.h). Included by cpu_gguf_gemm_avx2.cpp only (after cpu_gguf_xq_avx2.h), and
// like it compiled for AVX2 and AVX-512 builds.

#pragma once

#include "cpu_gguf_blocks.h"

#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>

namespace minivllm_gguf_avx2 {
namespace {

// ------------------------------------------------------------------- shared by the tiles
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
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

}  // namespace
}  // namespace minivllm_gguf_avx2
#endif  // __AVX2__

// The float32 inner loops of the CPU paged decode kernel (cpu_attention.cpp), written for AVX2 and
// FMA: one request's scores q · k over its cached tokens, and its score-weighted sum of values.
//
// The AVX2 twin of cpu_attention_avx512.cpp, for the CPUs that have AVX2 and FMA but no AVX-512
// (AMD before Zen 4, most Intel client parts). The ideas are that file's; what changes is the
// vector (8 float32 lanes, not 16) and the register file (16 vectors, not 32):
//
// - Scores. One query head meets 8 tokens of a block at once: 8 running dot products, then one
//   transpose-and-add tree (`fold8`) leaves the 8 scores in one vector, stored with one
//   instruction, instead of a horizontal sum per token and head.
// - Values. A head's output stays in registers while the tokens of a block are added into it.
//   16 registers hold 64 floats of sums with room for the weights, so a head of 128 is done as
//   two halves of 64, each walking the block's rows while they are in L1; a head of 32 keeps two
//   sums per vector (even and odd tokens) so that 8 chains of FMAs are in flight, as 64 has.
//
// Both walk the block table as cpu_attention.cpp's `for_each_cached_token` does and prefetch the
// next block while this one is computed; the scores pass also starts the values pass's stream of
// V blocks into L2 before it ends (`kValueLead`, half the AVX-512 file's). Results differ from
// the portable loops' only in the order of the float32 sums;
// tests/cpu/test_kernels_cpu_attention_avx512.py holds both to the reference backend at each
// instruction-set level.
//
// A bfloat16 cache (kv_cache_dtype="bfloat16" under float32 weights) is read as 16-bit patterns
// and widened on load: zero-extend 8 of them to 32 bits, shift left by 16 (`load8`), exact.
//
// Compiled with code only in the avx2 build of minivllm/cpu/isa.py (AVX2 and FMA, no AVX-512):
// the avx512 build runs cpu_attention_avx512.cpp instead, and elsewhere `decode_avx2_applies` is
// false and cpu_attention.cpp keeps its portable loops, as it does for float32 queries over a
// float16 cache, for bfloat16 or float16 queries, and for head sizes other than 32, 64 and 128.

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define MINIVLLM_ATTENTION_AVX2 1
#define MINIVLLM_DECODE_LANES 8  // floats a vector (cpu_attention_entry.h)
#include <immintrin.h>

#include "cpu_attention_prefetch.h"
#endif

namespace minivllm_cpu_avx2 {

#if defined(MINIVLLM_ATTENTION_AVX2)
namespace {

constexpr int kTokens = 8;  // tokens per register tile: one vector of scores

// 8 cached values as float32: a float32 cache's as they are, a bfloat16 cache's (their 16-bit
// patterns) zero-extended to 32 bits and shifted into float32's top half, which is exact.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Each lane of the result is the sum of the 8 lanes of one input: lane t = Σ a[t]. A transpose
// and add in three rounds, halving the number of vectors each round: 21 instructions for 8 sums.
inline __m256 fold8(const __m256 (&a)[kTokens]) {
  __m256 b[4];  // b[i], per 128-bit lane: partial sums of tokens 2i and 2i+1, interleaved
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m256 c[2];  // c[i], per 128-bit lane: partial sums of tokens 4i .. 4i+3, in order
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    const __m256d lo = _mm256_castps_pd(b[2 * i]), hi = _mm256_castps_pd(b[2 * i + 1]);
    c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(lo, hi)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(lo, hi)));
  }
  // Add the two 128-bit lanes of each c[i]: tokens 0..3 from c[0], 4..7 from c[1].
  return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20),
                       _mm256_permute2f128_ps(c[0], c[1], 0x31));
}

using minivllm_cpu_decode::BlockPrefetcher;
using minivllm_cpu_decode::value_lead_blocks;
// The V stream's lead into L2 (cpu_attention_prefetch.h `value_lead_blocks`).
constexpr int64_t kValueLead = 128 << 10;  // an AVX2 client part's L2 may be 256 KB

// Scores of one query head (C vectors, at q) against n <= 8 consecutive rows of a block. A whole
// tile runs over the head's vectors outside and the tokens inside, so that one vector of the
// query and the 8 sums are all it keeps in registers; a block's last, shorter tile reads only
// its n rows (the ones after may be another block's memory, or none).
template <int C, typename T>
inline __m256 scores8(const float* q, const T* k, int64_t row_elems, int64_t n) {
  __m256 acc[kTokens];  // [8 tokens] running dot products, 8 lanes each
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
  if (n == kTokens) {
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t)
        acc[t] = _mm256_fmadd_ps(qc, load8(k + t * row_elems + 8 * c), acc[t]);
    }
  } else {  // t known at compile time, so that acc stays in registers
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) {
      if (t < n) {
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c)
          acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), load8(k + t * row_elems + 8 * c),
                                   acc[t]);
      }
    }
  }
  return fold8(acc);
}

template <int C, typename T>
void scores_kernel(const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                   int64_t seq_len, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                   float* scores) {
  constexpr int64_t hd = 8 * C;
  const int64_t group = num_heads / num_kv_heads, row_elems = num_kv_heads * hd;
  const int64_t block_elems = block_size * row_elems;
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  const int64_t lead = value_lead_blocks<kValueLead>(num_blocks, block_elems * int64_t(sizeof(T)));
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < num_blocks; ++j) {
    const T* block = k_cache + int64_t(table[j]) * block_elems;  // [block_size, kv, hd]
    const int64_t t0 = j * block_size, n_block = std::min(block_size, seq_len - t0);
    BlockPrefetcher<false> prefetch;
    prefetch.start(j + 1 < num_blocks ? k_cache + int64_t(table[j + 1]) * block_elems : nullptr,
                   block_elems, num_heads * ((n_block + kTokens - 1) / kTokens));
    // V block jv: the first blocks of V while the last blocks of K are scored.
    const int64_t jv = j - (num_blocks - lead);
    BlockPrefetcher<true> prefetch_v;
    prefetch_v.start(jv >= 0 ? v_cache + int64_t(table[jv]) * block_elems : nullptr, block_elems,
                     num_heads * ((n_block + kTokens - 1) / kTokens));
    for (int64_t r = 0; r < n_block; r += kTokens) {
      const int64_t n = std::min<int64_t>(kTokens, n_block - r);
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lanes);  // lanes < n
      for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
        const T* k = block + r * row_elems + kv * hd;  // token r's K row of this KV head
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          prefetch.pass();
          prefetch_v.pass();
          const __m256 s = scores8<C>(q + h * hd, k, row_elems, n);
          float* dst = scores + h * seq_len + t0 + r;
          // A masked store is slow on some AVX2 CPUs (AMD's): only a short tile takes it.
          if (n == kTokens) _mm256_storeu_ps(dst, s);
          else _mm256_maskstore_ps(dst, mask, s);
        }
      }
    }
  }
}

// acc[0 : 8 * W] += Σ_t p[t] · v_t[0 : 8 * W] over a block's n rows (v: row 0, rows row_elems
// apart), with the W vectors of sums in registers. Fewer than 8 vectors keep one sum per
// vector for even tokens and one for odd, so that 8 independent chains of FMAs are in flight:
// one chain would wait on each FMA's latency.
template <int W, typename T>
inline void add_rows(const float* p, const T* v, int64_t row_elems, int64_t n, float* acc) {
  constexpr int kChains = W >= 8 ? 1 : 8 / W;
  __m256 sum[kChains][W];
#pragma GCC unroll 8
  for (int c = 0; c < W; ++c) {
    sum[0][c] = _mm256_loadu_ps(acc + 8 * c);
#pragma GCC unroll 8
    for (int s = 1; s < kChains; ++s) sum[s][c] = _mm256_setzero_ps();
  }
  int64_t t = 0;
  for (; t + kChains <= n; t += kChains) {
#pragma GCC unroll 8
    for (int s = 0; s < kChains; ++s) {
      const __m256 ps = _mm256_broadcast_ss(p + t + s);
#pragma GCC unroll 8
      for (int c = 0; c < W; ++c)
        sum[s][c] = _mm256_fmadd_ps(ps, load8(v + (t + s) * row_elems + 8 * c), sum[s][c]);
    }
  }
  for (; t < n; ++t) {
    const __m256 ps = _mm256_broadcast_ss(p + t);
#pragma GCC unroll 8
    for (int c = 0; c < W; ++c)
      sum[0][c] = _mm256_fmadd_ps(ps, load8(v + t * row_elems + 8 * c), sum[0][c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < W; ++c) {
#pragma GCC unroll 8
    for (int s = 1; s < kChains; ++s) sum[0][c] = _mm256_add_ps(sum[0][c], sum[s][c]);
    _mm256_storeu_ps(acc + 8 * c, sum[0][c]);
  }
}

template <int C, typename T>
void values_kernel(const float* p, const T* v_cache, const int32_t* table, int64_t seq_len,
                   int64_t block_size, int64_t num_heads, int64_t num_kv_heads, float* acc) {
  constexpr int64_t hd = 8 * C;
  constexpr int W = C < 8 ? C : 8;  // vectors of the head summed per walk of the block's rows
  const int64_t group = num_heads / num_kv_heads, row_elems = num_kv_heads * hd;
  const int64_t block_elems = block_size * row_elems;
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  const int64_t lead = value_lead_blocks<kValueLead>(num_blocks, block_elems * int64_t(sizeof(T)));
  for (int64_t j = 0; j < num_blocks; ++j) {
    const T* block = v_cache + int64_t(table[j]) * block_elems;  // [block_size, kv, hd]
    const int64_t t0 = j * block_size, n_block = std::min(block_size, seq_len - t0);
    BlockPrefetcher<false> prefetch;
    prefetch.start(j + 1 < num_blocks ? v_cache + int64_t(table[j + 1]) * block_elems : nullptr,
                   block_elems, num_heads);
    BlockPrefetcher<true> prefetch_lead;  // the V stream, `lead` blocks ahead, into L2
    prefetch_lead.start(j + lead < num_blocks ? v_cache + int64_t(table[j + lead]) * block_elems
                                              : nullptr,
                        block_elems, num_heads);
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      const T* v = block + kv * hd;  // row 0 of this KV head
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        prefetch.pass();
        prefetch_lead.pass();
        for (int64_t d = 0; d < hd; d += 8 * W)  // a head of 128: two halves
          add_rows<W>(p + h * seq_len + t0, v + d, row_elems, n_block, acc + h * hd + d);
      }
    }
  }
}

}  // namespace
#endif  // MINIVLLM_ATTENTION_AVX2

bool decode_avx2_applies(int64_t head_dim) {
#if defined(MINIVLLM_ATTENTION_AVX2)
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

#include "cpu_attention_entry.h"  // decode_scores, decode_values

}  // namespace minivllm_cpu_avx2

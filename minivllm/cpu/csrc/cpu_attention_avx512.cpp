// The float32 inner loops of the CPU paged decode kernel (cpu_attention.cpp), written for AVX-512:
// one request's scores q · k over its cached tokens, and its score-weighted sum of values.
//
// Decode attention should cost what reading its K and V costs: every step reads each running
// request's whole context once per layer. The compiler-vectorized loops of cpu_attention.cpp did
// not get there (benchmarks/cpu_decode.py measures both against a copy of memory). Two things
// held them back, both about the shape of the work rather than the memory:
//
// - Scores. A token's score is a 64-long dot product: four vector FMAs, then a fold of the
//   vector's 16 lanes into one number, which takes as many instructions again and is paid for
//   every token and head. Here one query head meets 16 tokens of a block at once: 16 running
//   vectors, then one transpose-and-add tree (45 instructions) folds all 16 together and leaves
//   the 16 scores in one vector, stored with one instruction.
// - Values. Each head's output (64 floats) was loaded and stored again for every token. Here it
//   stays in registers while the 16 tokens of a block are added into it.
//
// Both walk the block table as cpu_attention.cpp's `for_each_cached_token` does, and prefetch the
// next block while this one is computed (blocks are scattered, so the hardware prefetcher cannot
// guess where the next one starts); the scores pass also starts the values pass's stream of V
// blocks into L2 before it ends (`kValueLead`). Results differ from the portable loops' only in
// the order of the float32 sums; tests/cpu/test_kernels_cpu_attention.py holds both to the
// reference backend.
//
// The loops also read a bfloat16 cache (kv_cache_dtype="bfloat16" under float32 weights): half the
// bytes per token. bfloat16 is float32's top 16 bits, so widening 16 of them is one zero-extend to
// 32 bits and one shift left by 16 (`load16`); the arithmetic is the float32 loops' own.
//
// Compiled with code only in the avx512 build of minivllm/cpu/isa.py (the avx512 and avx512_bf16
// levels); the avx2 build runs cpu_attention_avx2.cpp, the same loops for 8-lane vectors.
// Elsewhere `decode_avx512_applies` is false and cpu_attention.cpp keeps its portable loops, as it
// does for float32 queries over a float16 cache, for bfloat16 or float16 queries, and for head
// sizes other than 32, 64 and 128.

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#define MINIVLLM_DECODE_LANES 16  // floats a vector (cpu_attention_entry.h)
#include <immintrin.h>

#include "cpu_attention_prefetch.h"
#endif

namespace minivllm_cpu_avx512 {

#if defined(__AVX512F__)
namespace {

constexpr int kTokens = 16;  // tokens per register tile: one vector of scores

// 16 cached values as float32: a float32 cache's as they are, a bfloat16 cache's (their 16-bit
// patterns) zero-extended to 32 bits and shifted into float32's top half, which is exact.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Each lane of the result is the sum of the 16 lanes of one input: lane t = Σ a[t]. A transpose
// and add in four rounds, halving the number of vectors each round: 45 instructions for 16 sums.
inline __m512 fold16(const __m512 (&a)[kTokens]) {
  __m512 b[8];  // b[i], per 128-bit lane: partial sums of tokens 2i and 2i+1, interleaved
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 c[4];  // c[i], per 128-bit lane: partial sums of tokens 4i .. 4i+3, in order
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_castps_pd(b[2 * i]), hi = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // Now add the four 128-bit lanes of each c[i] together, leaving c[i]'s tokens in lane i.
  auto pairs = [](__m512 x, __m512 y) {  // [x0+x1, x2+x3, y0+y1, y2+y3] in 128-bit lanes
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return pairs(pairs(c[0], c[1]), pairs(c[2], c[3]));
}

using minivllm_cpu_decode::BlockPrefetcher;
using minivllm_cpu_decode::value_lead_blocks;
// The V stream's lead into L2 (cpu_attention_prefetch.h `value_lead_blocks`).
constexpr int64_t kValueLead = 256 << 10;

// Scores of one query head (C vectors) against n <= 16 consecutive rows of a block.
template <int C, typename T>
inline __m512 scores16(const __m512 (&q)[C], const T* k, int64_t row_elems, int64_t n) {
  __m512 acc[kTokens];  // [16 tokens] running dot products, 16 lanes each
#pragma GCC unroll 16
  for (int t = 0; t < kTokens; ++t) {
    acc[t] = _mm512_setzero_ps();
    if (t < n) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[t] = _mm512_fmadd_ps(q[c], load16(k + t * row_elems + 16 * c), acc[t]);
    }
  }
  return fold16(acc);
}

template <int C, typename T>
void scores_kernel(const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                   int64_t seq_len, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                   float* scores) {
  constexpr int64_t hd = 16 * C;
  const int64_t group = num_heads / num_kv_heads, row_elems = num_kv_heads * hd;
  const int64_t block_elems = block_size * row_elems;
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  const int64_t lead = value_lead_blocks<kValueLead>(num_blocks, block_elems * int64_t(sizeof(T)));
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
      const __mmask16 mask = __mmask16((1u << n) - 1);
      for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
        const T* k = block + r * row_elems + kv * hd;  // token r's K row of this KV head
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          __m512 qh[C];
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) qh[c] = _mm512_loadu_ps(q + h * hd + 16 * c);
          prefetch.pass();
          prefetch_v.pass();
          _mm512_mask_storeu_ps(scores + h * seq_len + t0 + r, mask,
                                scores16<C>(qh, k, row_elems, n));
        }
      }
    }
  }
}

template <int C, typename T>
void values_kernel(const float* p, const T* v_cache, const int32_t* table, int64_t seq_len,
                   int64_t block_size, int64_t num_heads, int64_t num_kv_heads, float* acc) {
  constexpr int64_t hd = 16 * C;
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
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        const float* ph = p + h * seq_len + t0;  // this block's weights for head h
        // Two sums per vector, even and odd tokens: one chain of dependent FMAs would wait on
        // each FMA's latency; eight independent chains keep both FMA units busy.
        __m512 even[C], odd[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          even[c] = _mm512_loadu_ps(acc + h * hd + 16 * c);
          odd[c] = _mm512_setzero_ps();
        }
        const T* v = block + kv * hd;  // row 0 of this KV head
        prefetch.pass();
        prefetch_lead.pass();
        int64_t t = 0;
        for (; t + 2 <= n_block; t += 2) {
          const __m512 p0 = _mm512_set1_ps(ph[t]), p1 = _mm512_set1_ps(ph[t + 1]);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) {
            even[c] = _mm512_fmadd_ps(p0, load16(v + t * row_elems + 16 * c), even[c]);
            odd[c] = _mm512_fmadd_ps(p1, load16(v + (t + 1) * row_elems + 16 * c), odd[c]);
          }
        }
        if (t < n_block) {
          const __m512 p0 = _mm512_set1_ps(ph[t]);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c)
            even[c] = _mm512_fmadd_ps(p0, load16(v + t * row_elems + 16 * c), even[c]);
        }
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
          _mm512_storeu_ps(acc + h * hd + 16 * c, _mm512_add_ps(even[c], odd[c]));
      }
    }
  }
}

}  // namespace
#endif  // __AVX512F__

bool decode_avx512_applies(int64_t head_dim) {
#if defined(__AVX512F__)
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

#include "cpu_attention_entry.h"  // decode_scores, decode_values

}  // namespace minivllm_cpu_avx512

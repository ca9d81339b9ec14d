// The K-quants (Q4_K, Q5_K, Q6_K) on AVX2's 8-bit integer dots: each super-block unpacked two
// ways, for cpu_gguf_gemm_avx2.cpp's two tiles.
//
// - `unpack`: into a buffer (a byte a weight, the scales as _mm256_madd_epi16 wants them), which
//   the many-token tiles reread for every token. Unpacking once pays when many tokens share it.
// - `dot`: in registers, dotted at once into a few tokens' 8-bit x and never stored. At decode's
//   few rows the buffer's write and reread cost more than the weight's own bytes from memory, so
//   here the unpacking is interleaved with the dots, as llama.cpp's ggml_vec_dot_q4_K_q8_K and
//   ggml_vec_dot_q6_K_q8_K do it (ggml-cpu, arch/x86/quants.c).
//
// Both give the same int32 lanes: lane i of a 32-weight chunk's `madd(maddubs(q, xq), scale)` is
// the sum of weights 4i..4i+3's products, whichever way q was made, and integer sums are exact in
// any order. Both tiles then end each super-block with the same float operations on the lanes'
// whole-super-block totals (cpu_gguf_kfloat_avx2.h's `KSums`), so a token's output is bit for bit
// the same whichever tile ran it: batch-invariant.
//
// Per super-block of 256 weights, with xq x's 8-bit quants, dx its scale and bsums[16] the sums of
// each 16 of xq (cpu_gguf_gemm_avx2.cpp's `quantize_tokens`):
//   Σ_k w_k · dx · xq_k = dx · (d · Σ_c madd(q_c · xq_c, sc_c) - dmin · Σ_j mn_j · bsums_j)
// with q the unsigned quants in weight order, sc_c the 16 int16 scales of chunk c's products, and
// mn_j the coefficient of the j-th 16-sum (a sub-block's min, or Q6_K's 32 · scale).
// Included by cpu_gguf_gemm_avx2.cpp only, and like it compiled for AVX2 and AVX-512 builds (the
// latter with AVX512-VNNI's dots, MINIVLLM_INT8_VNNI).

#pragma once

#include "cpu_gguf_blocks.h"
#include "cpu_gguf_kfloat_avx2.h"

#if defined(__AVX2__)
#include <immintrin.h>

namespace minivllm_gguf_avx2 {
namespace {

// An fp16 scale by F16C's conversion (cpu_gguf_blocks.h's `fp16` is the portable bit-twiddling).
inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}
inline void store32(uint8_t* dst, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v); }
// A shuffle control that copies 16-bit element e of each 128-bit half into all 8 of its lanes.
inline __m256i pick16(int e) { return _mm256_set1_epi16(short(((2 * e + 1) << 8) | (2 * e))); }
inline __m256i pick16(int e_low, int e_high) {  // element e_low in the low half, e_high in the high
  return _mm256_setr_m128i(_mm_set1_epi16(short(((2 * e_low + 1) << 8) | (2 * e_low))),
                           _mm_set1_epi16(short(((2 * e_high + 1) << 8) | (2 * e_high))));
}

// sumi += madd(maddubs(q, x), sc): 32 products of unsigned q and signed x, weighted pairwise by
// the int16 scales sc into 8 int32 lanes. q <= 63 and |x| <= 127 keep every pair within int16.
inline __m256i dot32(__m256i sumi, __m256i q, const int8_t* x, __m256i sc) {
#if defined(MINIVLLM_INT8_VNNI)
  return _mm256_dpwssd_epi32(sumi, _mm256_maddubs_epi16(q, load32(x)), sc);
#else
  return _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q, load32(x)), sc));
#endif
}
// 8 int32 lanes, each the sum of 4 adjacent products of unsigned q and signed x (lane i: bytes
// 4i..4i+3). Without VNNI, maddubs's int16 pair sums cannot saturate for the callers' ranges.
inline __m256i dot4(__m256i q, __m256i x) {
#if defined(MINIVLLM_INT8_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

#if defined(MINIVLLM_INT8_VNNI)
// The same dots 512 bits wide, two 32-byte chunks an instruction (`dot64`). Chunk pairs put one
// chunk in each 256-bit half, so `fold`, the halves' int32 lanes added, gives the lanes that the
// two chunks' 256-bit dots sum to: integers, exact in any order, so the float steps after them
// (`KSums`) see AVX2's lanes.
inline __m512i load64(const void* p) { return _mm512_loadu_si512(p); }
// Both 256-bit halves the 32 bytes at p: one broadcast load, which each half then unpacks its way.
inline __m512i twice32(const void* p) { return _mm512_broadcast_i64x4(load32(p)); }
constexpr __mmask32 kHigh16 = 0xFFFF0000;  // the 16-bit elements of the high 256-bit half
inline __m512i dot64(__m512i sumi, __m512i q, const int8_t* x, __m512i sc) {
  return _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q, load64(x)), sc);
}
inline __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
// pick16 for 512 bits: element e_low of each 128-bit lane in the low 256-bit half, e_high in the high.
inline __m512i pick16x2(int e_low, int e_high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(pick16(e_low)), pick16(e_high), 1);
}
#endif

// Where `unpack` writes a super-block: q[256] (bytes 0..63, in weight order), sc[8][16] int16
// (chunk c's scales), mn[16], d and dmin.
struct KBlock {
  uint8_t* q;
  int16_t* sc;
  int16_t* mn;
  float* d;
  float* dmin;
};
inline void broadcast16(int16_t* dst, int lo, int hi) {  // lanes 0..7 lo, 8..15 hi
  for (int i = 0; i < 8; ++i) dst[i] = int16_t(lo), dst[8 + i] = int16_t(hi);
}

// The in-register scales of Q4_K and Q5_K: 8 int16 scales in each 128-bit half (sub-block s's
// broadcast by pick16(s)), and each min twice, once per 16-sum of its sub-block.
inline KScales k_scales(const uint8_t* b, __m256i& sc16) {
  uint64_t sc, m;
  k_scales_mins8(b + 4, sc, m);
  const __m128i sc8 = _mm_cvtsi64_si128(int64_t(sc)), mn8 = _mm_cvtsi64_si128(int64_t(m));
  sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc8));
  return {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8)), half(b), half(b + 2)};
}
inline void k_scales_to(const uint8_t* b, KBlock o) {  // the same, as `unpack` stores them
  for (int s = 0; s < 8; ++s) {
    int sc, m;
    k_scale_min(b + 4, s, sc, m);
    broadcast16(o.sc + 16 * s, sc, sc);
    o.mn[2 * s] = o.mn[2 * s + 1] = int16_t(m);
  }
  *o.d = half(b), *o.dmin = half(b + 2);
}

// Q4_K: | fp16 d | fp16 dmin | scales[12] | qs[128] |
//   32-byte chunk c = qs[32c, 32c + 32): its low nibbles are sub-block 2c (weights 64c + l), its
//   high nibbles sub-block 2c + 1 (weights 64c + 32 + l); w = (d · sc_s) · q - dmin · m_s
struct Q4_Kx {
  using Q = Q4_K;
  static constexpr bool kFoldMins = false;
  static constexpr int kSumGroups = 8;  // q <= 15: 8 pair sums of 2 · 15 · 127 fit int16
  static void unpack(const uint8_t* b, KBlock o) {
    const __m256i lo4 = _mm256_set1_epi8(0xF);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(b + 16 + 32 * c);
      store32(o.q + 64 * c, _mm256_and_si256(v, lo4));
      store32(o.q + 64 * c + 32, _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4));
    }
    k_scales_to(b, o);
  }
  // sumi[t] += the super-block's scaled chunk dots with token t's xq (x + t · ldx, 256 bytes).
  template <int T>
  static KScales dot(const uint8_t* b, const int8_t* x, int64_t ldx, __m256i (&sumi)[T]) {
    const __m256i lo4 = _mm256_set1_epi8(0xF);
    __m256i sc16;
    const KScales k = k_scales(b, sc16);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(b + 16 + 32 * c);
      const __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
      const __m256i sc_lo = _mm256_shuffle_epi8(sc16, pick16(2 * c));
      const __m256i sc_hi = _mm256_shuffle_epi8(sc16, pick16(2 * c + 1));
      for (int t = 0; t < T; ++t) {
        sumi[t] = dot32(sumi[t], lo, x + t * ldx + 64 * c, sc_lo);
        sumi[t] = dot32(sumi[t], hi, x + t * ldx + 64 * c + 32, sc_hi);
      }
    }
    return k;
  }
#if defined(MINIVLLM_INT8_VNNI)
  // `dot` in 512 bits: chunk c's low nibbles (sub-block 2c) in the low half, its high nibbles
  // (2c + 1) in the high half, whose x bytes [64c, 64c + 64) are then one contiguous load.
  template <int T>
  static KScales dot512(const uint8_t* b, const int8_t* x, int64_t ldx, __m256i (&sumi)[T]) {
    const __m512i lo4 = _mm512_set1_epi8(0xF);
    __m256i sc16;
    const KScales k = k_scales(b, sc16);
    const __m512i sc = _mm512_broadcast_i64x4(sc16);
    __m512i acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i v = twice32(b + 16 + 32 * c);
      const __m512i q = _mm512_and_si512(_mm512_mask_srli_epi16(v, kHigh16, v, 4), lo4);
      const __m512i s = _mm512_shuffle_epi8(sc, pick16x2(2 * c, 2 * c + 1));
      for (int t = 0; t < T; ++t) acc[t] = dot64(acc[t], q, x + t * ldx + 64 * c, s);
    }
    for (int t = 0; t < T; ++t) sumi[t] = _mm256_add_epi32(sumi[t], fold(acc[t]));
    return k;
  }
#endif
};

// Q5_K: | fp16 d | fp16 dmin | scales[12] | qh[32] | qs[128] |
//   as Q4_K, and bit s of qh[l] is the 5th bit (16) of weight l of sub-block s
struct Q5_Kx {
  using Q = Q5_K;
  static constexpr bool kFoldMins = false;
  static constexpr int kSumGroups = 4;  // q <= 31: 4 pair sums of 2 · 31 · 127 fit int16
  static void unpack(const uint8_t* b, KBlock o) {
    const __m256i lo4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const __m256i qh = load32(b + 16);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(b + 48 + 32 * c);
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * c + h;
        const __m256i nib = h ? _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4) : _mm256_and_si256(v, lo4);
        const __m256i top = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), one);
        store32(o.q + 32 * s, _mm256_or_si256(nib, _mm256_slli_epi16(top, 4)));
      }
    }
    k_scales_to(b, o);
  }
  // Bit s of each byte of qh moved to bit 4: a 16-bit shift moves no other byte's bit there.
  static __m256i fifth(__m256i qh, int s) {
    const __m256i v = s < 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
  }
  template <int T>
  static KScales dot(const uint8_t* b, const int8_t* x, int64_t ldx, __m256i (&sumi)[T]) {
    const __m256i lo4 = _mm256_set1_epi8(0xF), qh = load32(b + 16);
    __m256i sc16;
    const KScales k = k_scales(b, sc16);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(b + 48 + 32 * c);
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, lo4), fifth(qh, 2 * c));
      const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4), fifth(qh, 2 * c + 1));
      const __m256i sc_lo = _mm256_shuffle_epi8(sc16, pick16(2 * c));
      const __m256i sc_hi = _mm256_shuffle_epi8(sc16, pick16(2 * c + 1));
      for (int t = 0; t < T; ++t) {
        sumi[t] = dot32(sumi[t], lo, x + t * ldx + 64 * c, sc_lo);
        sumi[t] = dot32(sumi[t], hi, x + t * ldx + 64 * c + 32, sc_hi);
      }
    }
    return k;
  }
#if defined(MINIVLLM_INT8_VNNI)
  // As Q4_K's: sub-block 2c in the low half, 2c + 1 in the high. The high half's qh shifted right
  // by one once (`qh1`) puts both halves' 5th bits at bit 2c, which one shift then moves to bit 4.
  template <int T>
  static KScales dot512(const uint8_t* b, const int8_t* x, int64_t ldx, __m256i (&sumi)[T]) {
    const __m512i lo4 = _mm512_set1_epi8(0xF), bit4 = _mm512_set1_epi8(0x10);
    const __m512i qh = twice32(b + 16), qh1 = _mm512_mask_srli_epi16(qh, kHigh16, qh, 1);
    __m256i sc16;
    const KScales k = k_scales(b, sc16);
    const __m512i sc = _mm512_broadcast_i64x4(sc16);
    __m512i acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i v = twice32(b + 48 + 32 * c);
      const __m512i top = c < 2 ? _mm512_slli_epi16(qh1, 4 - 2 * c) : _mm512_srli_epi16(qh1, 2 * c - 4);
      const __m512i q = _mm512_or_si512(_mm512_and_si512(_mm512_mask_srli_epi16(v, kHigh16, v, 4), lo4),
                                        _mm512_and_si512(top, bit4));
      const __m512i s = _mm512_shuffle_epi8(sc, pick16x2(2 * c, 2 * c + 1));
      for (int t = 0; t < T; ++t) acc[t] = dot64(acc[t], q, x + t * ldx + 64 * c, s);
    }
    for (int t = 0; t < T; ++t) sumi[t] = _mm256_add_epi32(sumi[t], fold(acc[t]));
    return k;
  }
#endif
};

// Q6_K: | ql[128] | qh[64] | int8 scales[16] | fp16 d |
//   chunk c = 4H + t (weights 128 H + 32 t + l, l < 32) has its low 4 bits in
//   ql[64 H + 32 (t % 2) + l] (the low nibble for t < 2, the high for t >= 2) and its top 2 in
//   bits 2t, 2t + 1 of qh[32 H + l]; w = (d · sc_j) · (q - 32) with j = k / 16, so the chunk's
//   first 16 products take scale 2c, the next 16 scale 2c + 1; mn_j = 32 · sc_j and dmin = d.
struct Q6_Kx {
  using Q = Q6_K;
  static constexpr bool kFoldMins = true;  // mn_j = 32 · sc_j and dmin = d: S - M in integers
  static constexpr int kSumGroups = 2;  // q <= 63: 2 pair sums of 2 · 63 · 127 fit int16
  static void unpack(const uint8_t* b, KBlock o) {
    const __m256i lo4 = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
    for (int H = 0; H < 2; ++H) {
      const __m256i hbits = load32(b + 128 + 32 * H);
      for (int t = 0; t < 4; ++t) {
        const __m256i l = load32(b + 64 * H + 32 * (t % 2));
        const __m256i nib = t < 2 ? _mm256_and_si256(l, lo4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), lo4);
        const __m256i top = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * t)), three);
        store32(o.q + 128 * H + 32 * t, _mm256_or_si256(nib, _mm256_slli_epi16(top, 4)));
      }
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int c = 0; c < 8; ++c) broadcast16(o.sc + 16 * c, sc[2 * c], sc[2 * c + 1]);
    for (int j = 0; j < 16; ++j) o.mn[j] = int16_t(32 * sc[j]);
    *o.d = *o.dmin = half(b + 208);
  }
  template <int T>
  static KScales dot(const uint8_t* b, const int8_t* x, int64_t ldx, __m256i (&sumi)[T]) {
    const __m256i lo4 = _mm256_set1_epi8(0xF), top2 = _mm256_set1_epi8(0x30);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    // scales 0..7 (half H = 0) and 8..15 (H = 1), each in both 128-bit halves
    const __m256i sc_half[2] = {_mm256_permute4x64_epi64(sc16, 0x44), _mm256_permute4x64_epi64(sc16, 0xEE)};
    const float d = half(b + 208);
#pragma GCC unroll 2
    for (int H = 0; H < 2; ++H) {
      const __m256i l0 = load32(b + 64 * H), l1 = load32(b + 64 * H + 32), hb = load32(b + 128 + 32 * H);
      // chunk t's quants: its nibbles, and bits 2t, 2t + 1 of hb moved to bits 4, 5
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, lo4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top2)),
          _mm256_or_si256(_mm256_and_si256(l1, lo4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4), _mm256_and_si256(hb, top2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4),
                          _mm256_and_si256(_mm256_srli_epi16(hb, 2), top2))};
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m256i sc = _mm256_shuffle_epi8(sc_half[H], pick16(2 * t, 2 * t + 1));
        for (int i = 0; i < T; ++i) sumi[i] = dot32(sumi[i], q[t], x + i * ldx + 128 * H + 32 * t, sc);
      }
    }
    return {_mm256_slli_epi16(sc16, 5), d, d};
  }
#if defined(MINIVLLM_INT8_VNNI)
  // `dot` in 512 bits: chunks 4H + 0, 1 in one vector (ql[64 H, 64 H + 64) as it lies, so x's
  // bytes [128 H, 128 H + 64) are one load) and chunks 4H + 2, 3 in another; each 128-bit lane
  // takes one scale, 8H + 4p + lane (vpermw).
  template <int T>
  static KScales dot512(const uint8_t* b, const int8_t* x, int64_t ldx, __m256i (&sumi)[T]) {
    const __m512i lo4 = _mm512_set1_epi8(0xF), top2 = _mm512_set1_epi8(0x30);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    const __m512i sc = _mm512_castsi256_si512(sc16);
    const float d = half(b + 208);
    __m512i acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int H = 0; H < 2; ++H) {
      const __m512i l = load64(b + 64 * H), hb = twice32(b + 128 + 32 * H);
      // chunk 4H + 0 takes bits 0, 1 of hb (shift 4), chunk 4H + 1 bits 2, 3 (shift 2); then
      // chunk 4H + 2 bits 4, 5 (as they are), 4H + 3 bits 6, 7 (shift -2)
      const __m512i h01 = _mm512_mask_slli_epi16(_mm512_slli_epi16(hb, 2), ~kHigh16, hb, 4);
      const __m512i h23 = _mm512_mask_srli_epi16(hb, kHigh16, hb, 2);
      const __m512i q01 = _mm512_or_si512(_mm512_and_si512(l, lo4), _mm512_and_si512(h01, top2));
      const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), lo4),
                                          _mm512_and_si512(h23, top2));
      const __m512i s01 = _mm512_permutexvar_epi16(scale_lanes(8 * H), sc);
      const __m512i s23 = _mm512_permutexvar_epi16(scale_lanes(8 * H + 4), sc);
      for (int t = 0; t < T; ++t) {
        acc[t] = dot64(acc[t], q01, x + t * ldx + 128 * H, s01);
        acc[t] = dot64(acc[t], q23, x + t * ldx + 128 * H + 64, s23);
      }
    }
    for (int t = 0; t < T; ++t) sumi[t] = _mm256_add_epi32(sumi[t], fold(acc[t]));
    return {_mm256_slli_epi16(sc16, 5), d, d};
  }
  // vpermw's indices: 16-bit element j0 + lane in every element of 128-bit lane `lane`.
  static __m512i scale_lanes(int j0) {
    return _mm512_setr_epi64(0x0001000100010001LL * j0, 0x0001000100010001LL * j0,
                             0x0001000100010001LL * (j0 + 1), 0x0001000100010001LL * (j0 + 1),
                             0x0001000100010001LL * (j0 + 2), 0x0001000100010001LL * (j0 + 2),
                             0x0001000100010001LL * (j0 + 3), 0x0001000100010001LL * (j0 + 3));
  }
#endif
};

}  // namespace
}  // namespace minivllm_gguf_avx2
#endif  // __AVX2__

// GGUF's block formats for the CPU kernels: each type's layout, its portable dequantization
// and its AVX-512 unpacking of 16 weights at a time (llama.cpp's ggml-quants.c, in C++ structs).
// Included by cpu_gguf_gemm.cpp only; a header so that the GEMM file holds the tiles and the ops.
//
// Exactness. Every product in a dequantization is exact in float32: an fp16 scale has an 11-bit
// significand, a K-quant's sub-scale 6 or 7 bits and a quant at most 8, and a product of a- and
// b-bit significands needs at most a + b <= 24 bits. The one rounding is the add of the offset
// (Q4_1, Q5_1, Q4_K, Q5_K), so an FMA, a mul then an add, and -ffast-math's reassociation of the
// products all give gguf.quants.dequantize's float32 bit for bit; gguf_dequantize is tested so.

#pragma once


#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float fp16(const uint8_t* p) {  // GGUF's scales: little-endian IEEE half, unaligned
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// A K-quant's j-th (of 8) 6-bit scale and min, packed in 12 bytes (llama.cpp's
// get_scale_min_k4): j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 in the nibbles of byte
// j + 4 with their top 2 bits in the spare top bits of bytes j - 4 and j.
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// All eight of k_scale_min's 6-bit scales (sc) and mins (m), one a byte, sub-block s in byte s,
// four at a time on 32-bit words: scales[12] = | a: sc0..3 (+ top bits of sc4..7) | b: m0..3
// (+ top bits of m4..7) | c: low nibbles sc4..7, high nibbles m4..7 |.
inline void k_scales_mins8(const uint8_t* s, uint64_t& sc, uint64_t& m) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4), std::memcpy(&b, s + 4, 4), std::memcpy(&c, s + 8, 4);
  const uint32_t sc_hi = (c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030);
  const uint32_t m_hi = ((c >> 4) & 0x0F0F0F0F) | ((b >> 2) & 0x30303030);
  sc = uint64_t(a & 0x3F3F3F3F) | (uint64_t(sc_hi) << 32);
  m = uint64_t(b & 0x3F3F3F3F) | (uint64_t(m_hi) << 32);
}

#if defined(__AVX512F__)
// 16 bytes as 16 int32 lanes.
inline __m512i bytes16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// The low (high = false) or high nibbles of 16 bytes, as 16 int32 lanes.
inline __m512i nibbles16(const uint8_t* p, bool high) {
  const __m512i v = bytes16(p);
  return high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(0xF));
}
// Adds 16 to the lanes whose bit is set in `fifth`: a 5-bit quant's top bit, from its bitmap.
inline __m512i add16(__m512i v, __mmask16 fifth) {
  return _mm512_mask_add_epi32(v, fifth, v, _mm512_set1_epi32(16));
}
inline __m512 to_float(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline uint16_t load_u16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}
// An fp16 scale in all 16 lanes: broadcast, then convert, which is fewer instructions than
// converting the scalar and broadcasting the float.
inline __m512 fp16x16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(short(bits)));
}
// Two adjacent fp16 scales (Q4_1's d and m) converted together: lanes alternate d, m.
inline void fp16x16_pair(const uint8_t* p, __m512& d, __m512& m) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m512 both = _mm512_cvtph_ps(_mm256_set1_epi32(int(bits)));
  d = _mm512_moveldup_ps(both), m = _mm512_movehdup_ps(both);
}
inline __m512 times(__m512i q, __m512 scale) { return _mm512_mul_ps(to_float(q), scale); }
inline __m512 times(__m512i q, float scale) { return times(q, _mm512_set1_ps(scale)); }
inline __m512 times_plus(__m512i q, __m512 scale, __m512 offset) {  // scale * q + offset
  return _mm512_fmadd_ps(to_float(q), scale, offset);
}
// Lane `lane` of v in all 16 lanes.
inline __m512 lane(__m512 v, int lane) { return _mm512_permutexvar_ps(_mm512_set1_epi32(lane), v); }
// A Q4_K or Q5_K block's per-sub-block factors, all eight at once: lane s holds d · sc_s and lane
// 8 + s holds -(dmin · m_s), the same float products k_scale_min's scalars give. The kernels
// call `weights` for every 16 weights of a block; this vector depends on the block only, so the
// compiler computes it once per block (the loop over a block is unrolled) and each sub-block takes
// its two factors by one lane broadcast each.
inline __m512 k_factors(const uint8_t* b) {
  uint64_t sc, m;
  k_scales_mins8(b + 4, sc, m);
  const __m512 q = to_float(_mm512_cvtepu8_epi32(_mm_set_epi64x(int64_t(m), int64_t(sc))));
  return _mm512_mul_ps(q, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(_cvtsh_ss(load_u16(b))),
                                               _mm512_set1_ps(-_cvtsh_ss(load_u16(b + 2)))));
}
#endif

// ------------------------------------------------------------------------------ block formats
// Each type: its GGML number, weights per block, bytes per block; `dequantize` writes a block's
// floats (portable: the formula of gguf.quants, loop by loop); `weights(b, i)` returns weights
// [16 i, 16 i + 16) of the block as one vector. The kernels call it with i a constant of an
// unrolled loop, so the scales that vectors share are read and converted once.

// Q4_0: 32 weights in 18 bytes   | fp16 d | qs[16] |
//   weight j < 16 is the low nibble of qs[j], weight j + 16 its high nibble; w = d * (q - 8)
struct Q4_0 {
  static constexpr int kType = 2, kBlock = 32, kBytes = 18;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = fp16(b);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float((b[2 + j] & 0xF) - 8);
      y[j + 16] = d * float((b[2 + j] >> 4) - 8);
    }
  }
#if defined(__AVX512F__)
  static __m512 weights(const uint8_t* b, int i) {
    return times(_mm512_sub_epi32(nibbles16(b + 2, i), _mm512_set1_epi32(8)), fp16x16(b));
  }
#endif
};

// Q4_1: 32 weights in 20 bytes   | fp16 d | fp16 m | qs[16] |
//   nibbles as Q4_0; w = d * q + m (m: the block's minimum)
struct Q4_1 {
  static constexpr int kType = 3, kBlock = 32, kBytes = 20;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = fp16(b), m = fp16(b + 2);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float(b[4 + j] & 0xF) + m;
      y[j + 16] = d * float(b[4 + j] >> 4) + m;
    }
  }
#if defined(__AVX512F__)
  static __m512 weights(const uint8_t* b, int i) {
    __m512 d, m;
    fp16x16_pair(b, d, m);
    return times_plus(nibbles16(b + 4, i), d, m);
  }
#endif
};

// Q5_0: 32 weights in 22 bytes   | fp16 d | qh (uint32) | qs[16] |
//   nibbles as Q4_0, and bit j of qh is weight j's 5th bit; w = d * (q - 16)
struct Q5_0 {
  static constexpr int kType = 6, kBlock = 32, kBytes = 22;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = fp16(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[6 + j] & 0xF) | (((qh >> j) & 1) << 4);
      const int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      y[j] = d * float(lo - 16);
      y[j + 16] = d * float(hi - 16);
    }
  }
#if defined(__AVX512F__)
  static __m512 weights(const uint8_t* b, int i) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m512i q = add16(nibbles16(b + 6, i), __mmask16(qh >> (16 * i)));
    return times(_mm512_sub_epi32(q, _mm512_set1_epi32(16)), fp16x16(b));
  }
#endif
};

// Q5_1: 32 weights in 24 bytes   | fp16 d | fp16 m | qh (uint32) | qs[16] |
//   quants as Q5_0; w = d * q + m
struct Q5_1 {
  static constexpr int kType = 7, kBlock = 32, kBytes = 24;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = fp16(b), m = fp16(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[8 + j] & 0xF) | (((qh >> j) & 1) << 4);
      const int hi = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      y[j] = d * float(lo) + m;
      y[j + 16] = d * float(hi) + m;
    }
  }
#if defined(__AVX512F__)
  static __m512 weights(const uint8_t* b, int i) {
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    __m512 d, m;
    fp16x16_pair(b, d, m);
    return times_plus(add16(nibbles16(b + 8, i), __mmask16(qh >> (16 * i))), d, m);
  }
#endif
};

// Q8_0: 32 weights in 34 bytes   | fp16 d | int8 qs[32] |
//   w = d * q
struct Q8_0 {
  static constexpr int kType = 8, kBlock = 32, kBytes = 34;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = fp16(b);
    for (int j = 0; j < 32; ++j) y[j] = d * float(int8_t(b[2 + j]));
  }
#if defined(__AVX512F__)
  static __m512 weights(const uint8_t* b, int i) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * i));
    return times(_mm512_cvtepi8_epi32(q), fp16x16(b));
  }
#endif
};

// Q4_K: 256 weights in 144 bytes   | fp16 d | fp16 dmin | scales[12] | qs[128] |
//   8 sub-blocks of 32, each with a 6-bit scale sc and min m (k_scale_min). Sub-blocks 2c and
//   2c + 1 share qs[32c, 32c + 32): 2c the low nibbles, 2c + 1 the high ones.
//   w = (d * sc) * q - (dmin * m)
struct Q4_K {
  static constexpr int kType = 12, kBlock = 256, kBytes = 144;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = fp16(b), dmin = fp16(b + 2);
    for (int s = 0; s < 8; ++s) {
      int sc, m;
      k_scale_min(b + 4, s, sc, m);
      const float dl = d * float(sc), ml = dmin * float(m);
      const uint8_t* q = b + 16 + 32 * (s / 2);
      const int shift = 4 * (s % 2);
      for (int l = 0; l < 32; ++l) y[32 * s + l] = dl * float((q[l] >> shift) & 0xF) - ml;
    }
  }
#if defined(__AVX512F__)
  static __m512 weights(const uint8_t* b, int i) {  // sub-block s = i / 2, its lanes 16 (i % 2) on
    const int s = i / 2;
    const __m512 f = k_factors(b);
    const __m512i q = nibbles16(b + 16 + 32 * (s / 2) + 16 * (i % 2), s % 2);
    return times_plus(q, lane(f, s), lane(f, 8 + s));
  }
#endif
};

// Q5_K: 256 weights in 176 bytes   | fp16 d | fp16 dmin | scales[12] | qh[32] | qs[128] |
//   as Q4_K, and bit s of qh[l] is the 5th bit of weight l of sub-block s.
//   w = (d * sc) * q - (dmin * m)
struct Q5_K {
  static constexpr int kType = 13, kBlock = 256, kBytes = 176;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = fp16(b), dmin = fp16(b + 2);
    const uint8_t* qh = b + 16;
    for (int s = 0; s < 8; ++s) {
      int sc, m;
      k_scale_min(b + 4, s, sc, m);
      const float dl = d * float(sc), ml = dmin * float(m);
      const uint8_t* q = b + 48 + 32 * (s / 2);
      const int shift = 4 * (s % 2);
      for (int l = 0; l < 32; ++l) {
        const int v = ((q[l] >> shift) & 0xF) | (((qh[l] >> s) & 1) << 4);
        y[32 * s + l] = dl * float(v) - ml;
      }
    }
  }
#if defined(__AVX512F__)
  static __m512 weights(const uint8_t* b, int i) {
    const int s = i / 2, h = i % 2;
    const __m512 f = k_factors(b);
    // The lanes whose qh byte has bit s set: one byte test gives all 16 5th bits.
    const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + 16 * h));
    const __mmask16 fifth = _mm_test_epi8_mask(qh, _mm_set1_epi8(char(1 << s)));
    const __m512i q = add16(nibbles16(b + 48 + 32 * (s / 2) + 16 * h, s % 2), fifth);
    return times_plus(q, lane(f, s), lane(f, 8 + s));
  }
#endif
};

// Q6_K: 256 weights in 210 bytes   | ql[128] | qh[64] | int8 scales[16] | fp16 d |
//   two halves of 128; in half H, for t < 4 and l < 32, weight 128 H + 32 t + l has
//   its low 4 bits in ql[64 H + 32 (t % 2) + l] (the low nibble for t < 2, the high for t >= 2)
//   and its top 2 bits in bits 2t, 2t + 1 of qh[32 H + l].
//   Weight k's scale is scales[k / 16]; w = (d * scale) * (q - 32)
struct Q6_K {
  static constexpr int kType = 14, kBlock = 256, kBytes = 210;
  static void dequantize(const uint8_t* b, float* y) {
    const float d = fp16(b + 208);
    for (int k = 0; k < 256; ++k) {
      const int H = k / 128, t = (k % 128) / 32, l = k % 32;
      const int lo = (b[64 * H + 32 * (t % 2) + l] >> (4 * (t / 2))) & 0xF;
      const int hi = (b[128 + 32 * H + l] >> (2 * t)) & 3;
      y[k] = (d * float(int8_t(b[192 + k / 16]))) * float((lo | (hi << 4)) - 32);
    }
  }
#if defined(__AVX512F__)
  static __m512 weights(const uint8_t* b, int i) {  // weights 16 i = 128 H + 32 t + 16 h on
    const int H = i / 8, t = (i % 8) / 2, h = i % 2;
    const __m512i lo = nibbles16(b + 64 * H + 32 * (t % 2) + 16 * h, t >= 2);
    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(bytes16(b + 128 + 32 * H + 16 * h), 2 * t),
                                         _mm512_set1_epi32(3));
    const __m512i q = _mm512_or_si512(lo, _mm512_slli_epi32(top, 4));
    // all 16 factors d · scale_j at once, computed once per block as Q4_K's k_factors
    const __m512 f = _mm512_mul_ps(to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))),
                                   _mm512_set1_ps(_cvtsh_ss(load_u16(b + 208))));
    return times(_mm512_sub_epi32(q, _mm512_set1_epi32(32)), lane(f, i));
  }
#endif
};

// Calls f(Type{}) for the GGML type number; refuses the others by number.
template <class F>
void with_type(int64_t qtype, const char* op, F&& f) {
  switch (qtype) {
    case Q4_0::kType: return f(Q4_0{});
    case Q4_1::kType: return f(Q4_1{});
    case Q5_0::kType: return f(Q5_0{});
    case Q5_1::kType: return f(Q5_1{});
    case Q8_0::kType: return f(Q8_0{});
    case Q4_K::kType: return f(Q4_K{});
    case Q5_K::kType: return f(Q5_K{});
    case Q6_K::kType: return f(Q6_K{});
    default:
      TORCH_CHECK(false, op, ": GGML type ", qtype, " is not supported (supported: 2 Q4_0, ",
                  "3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K)");
  }
}

// ------------------------------------------------------------------------ dequantizing rows
// rows weight rows of `blocks` blocks each into y (row stride ldy floats).
template <class Q>
void dequantize_rows(const uint8_t* w, int64_t rows, int64_t blocks, float* y, int64_t ldy) {
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = w + (n * blocks + b) * Q::kBytes;
      float* out = y + n * ldy + b * Q::kBlock;
#if defined(__AVX512F__)
#pragma GCC unroll 16
      for (int i = 0; i < Q::kBlock / 16; ++i) _mm512_storeu_ps(out + 16 * i, Q::weights(blk, i));
#else
      Q::dequantize(blk, out);
#endif
    }
}

// ------------------------------------------------------------------------ the ops' checks
int64_t check_weight(const at::Tensor& qweight, int64_t K, const char* op, int64_t block,
                     int64_t bytes) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kByte &&
                  qweight.dim() == 2 && qweight.is_contiguous(),
              op, ": qweight must be a contiguous CPU uint8 tensor [N, row_bytes]");
  TORCH_CHECK(K % block == 0, op, ": K (", K, ") must be a multiple of the type's block of ",
              block, " weights");
  TORCH_CHECK(qweight.size(1) == K / block * bytes, op, ": qweight rows must be ",
              K / block * bytes, " bytes for K = ", K, ", got ", qweight.size(1));
  return qweight.size(0);
}

// A 2-D CPU float32 tensor, contiguous, or with rows_strided any row stride (token rows of a
// wider tensor).
void check_float(const at::Tensor& t, const char* what, const char* op, bool rows_strided = false) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2, op, ": ",
              what, " must be a 2-D CPU float32 tensor");
  TORCH_CHECK(rows_strided ? t.stride(1) == 1 && (t.size(0) <= 1 || t.stride(0) >= t.size(1))
                           : t.is_contiguous(),
              op, ": ", what, rows_strided ? " must have unit stride along K" : " must be contiguous");
}

// A GGUF linear's arguments, checked as every linear op checks them: x [M, K] (token rows of any
// stride), out [M, N] contiguous, qweight N rows of K / Q::kBlock blocks of type Q.
struct LinearShape { int64_t M, N, K; };
template <class Q>
LinearShape check_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                         const char* op) {
  check_float(x, "x [M, K]", op, /*rows_strided=*/true);
  check_float(out, "out [M, N]", op);
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t N = check_weight(qweight, K, op, Q::kBlock, Q::kBytes);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, op, ": out must be [", M, ", ", N,
              "], got [", out.size(0), ", ", out.size(1), "]");
  return {M, N, K};
}


}  // namespace

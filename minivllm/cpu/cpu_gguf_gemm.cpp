// Linear layers on GGUF's quantized blocks: out[M, N] = x[M, K] · dequant(qweight[N, row_bytes])ᵀ.
//
// A GGUF weight row is a run of blocks, each a few scales and a few bits per weight (llama.cpp's
// ggml-quants.c). Dequantizing the whole weight to float32 first would read the blocks, write 4
// bytes per weight and read them back; at decode's few rows that traffic is the whole cost. So,
// as llama.cpp's `ggml_vec_dot_*` do, each block is unpacked in registers where it is used and
// multiplied into every token row at once: the weight's bytes stream from memory once per call,
// 4-7x fewer than its float32 form.
//
// Two paths, chosen by the number of token rows M (`on_the_fly`):
// - few rows (decode, small batches): a register tile of R weight rows x TB tokens, R * TB sums of
//   16 lanes. Each 16 weights are unpacked into one float vector (`weights`) and FMA'd into every
//   token of the tile; a row group is unpacked once per 8 tokens. The weight stream is prefetched
//   in software, which the R interleaved row streams need to run at memory speed.
// - many rows (prefill): unpacking once per 8 tokens would dominate, so each thread dequantizes a
//   chunk of rows into a float32 scratch that fits in L2 and runs the same tiles over it (the
//   float32 rows as a block type of their own, `F32`). On this project's AMD CPU that tile kernel
//   ran about twice as fast as at::mm (MKL) on the same chunk, so at::mm is only the fallback's.
//
// No int8 path. llama.cpp's CPU dots quantize x to int8 blocks and multiply with integer dot
// products (AVX512-VNNI: 64 products per instruction). With 32-weight blocks each block's int32
// sums still need, per token, a conversion and a scale FMA, so 64 weights cost about as many
// instructions as the float32 path's four 16-lane FMAs, and x would lose precision for it. At
// decode's single row the float32 path already streams the weights at close to memory speed.
//
// Exactness. Every product in a dequantization is exact in float32: an fp16 scale has an 11-bit
// significand, a K-quant's sub-scale 6 or 7 bits and a quant at most 8, and a product of a- and
// b-bit significands needs at most a + b <= 24 bits. The one rounding is the add of the offset
// (Q4_1, Q5_1, Q4_K, Q5_K), so an FMA, a mul then an add, and -ffast-math's reassociation of the
// products all give gguf.quants.dequantize's float32 bit for bit; gguf_dequantize is tested so.
//
// The AVX-512 path is compiled where PyTorch detected AVX-512 (minivllm/cpu/build.py); elsewhere
// both ops use the portable per-block loops (`dequantize`), and gguf_linear at::mm on chunks of
// dequantized rows for every M.
// tests/test_kernels_cpu_gguf.py holds both ops to gguf's numpy dequantization.

#include <ATen/ATen.h>
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
inline __m512 times_plus(__m512i q, float scale, float offset) {
  return times_plus(q, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
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
    int sc, m;
    k_scale_min(b + 4, s, sc, m);
    const __m512i q = nibbles16(b + 16 + 32 * (s / 2) + 16 * (i % 2), s % 2);
    return times_plus(q, fp16(b) * float(sc), -(fp16(b + 2) * float(m)));
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
    int sc, m;
    k_scale_min(b + 4, s, sc, m);
    // The lanes whose qh byte has bit s set: one byte test gives all 16 5th bits.
    const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + 16 * h));
    const __mmask16 fifth = _mm_test_epi8_mask(qh, _mm_set1_epi8(char(1 << s)));
    const __m512i q = add16(nibbles16(b + 48 + 32 * (s / 2) + 16 * h, s % 2), fifth);
    return times_plus(q, fp16(b) * float(sc), -(fp16(b + 2) * float(m)));
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
    return times(_mm512_sub_epi32(q, _mm512_set1_epi32(32)), fp16(b + 208) * float(int8_t(b[192 + i])));
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

// --------------------------------------------------------------- decode: unpack on the fly
#if defined(__AVX512F__)
constexpr int kGroup = 4;       // weight rows per work item: the largest register tile's R
constexpr int kMaxTokens = 8;   // tokens per register tile; more rows go in several tiles
// Whether M token rows of K are unpacked on the fly. Each tile of 8 tokens unpacks the weights
// again, and every row group rereads all M packed tokens; past these bounds, unpacking once into
// a float32 chunk and multiplying that is faster (measured at SmolLM2's shapes, one core):
// K-quants' unpacking (sub-block scales, more bits to gather) costs more per weight, so it stops
// paying sooner, and tokens past about an L2 (1 MiB) are reread from further away.
template <class Q>
bool on_the_fly(int64_t M, int64_t K) {
  return M <= (Q::kBlock == 256 ? 64 : 256) && M * K * int64_t(sizeof(float)) <= (1 << 20);
}
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead the weight stream is prefetched (measured)

// x's rows in tiles of up to kMaxTokens tokens, each tile [K / 16][TB][16]: a register tile then
// finds every token's next 16 columns at fixed offsets from one pointer, instead of keeping one
// address register per token (which spilled at 8 tokens).
void pack_tokens(const float* x, int64_t ldx, int64_t M, int64_t K, float* xp) {
  for (int64_t t0 = 0; t0 < M; t0 += kMaxTokens) {
    const int64_t tb = std::min<int64_t>(kMaxTokens, M - t0);
    float* dst = xp + t0 * K;
    for (int64_t c = 0; c < K / 16; ++c)
      for (int64_t t = 0; t < tb; ++t)
        std::memcpy(dst + (c * tb + t) * 16, x + (t0 + t) * ldx + c * 16, 16 * sizeof(float));
  }
}

// out[t, r] = dot(w row r, x row t) for r < rows (<= R), t < TB; xp is the tile's packed tokens.
// Each vector of R rows' weights is unpacked once and multiplied into all TB tokens, and each
// token vector loaded once for all R rows. Rows past `rows` repeat the last one, so that the
// tile stays one instantiation; their sums are dropped.
template <class Q, int R, int TB>
void tile(const uint8_t* w, int64_t row_bytes, int64_t rows, const float* xp, float* out,
          int64_t ldo, int64_t blocks) {
  constexpr int V = Q::kBlock / 16;  // vectors per block
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(r, rows - 1) * row_bytes;
  __m512 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  // The tile's rows are one run of R * row_bytes bytes, and the next tiles' follow it. Each block
  // step prefetches as many bytes as it reads, kPrefetchBytes ahead in that run: R rows read at
  // once are R short streams, which the hardware's prefetcher does not follow well.
  constexpr int64_t step = R * Q::kBytes;
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = xp + b * (V * TB * 16);
    // ceil(step / 64) lines, 64 bytes apart: consecutive steps leave no line out, with no branch.
#pragma GCC unroll 16
    for (int64_t j = 0; j < (step + 63) / 64; ++j) _mm_prefetch(ahead + b * step + 64 * j, _MM_HINT_T0);
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) {
      __m512 wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) wv[r] = Q::weights(wr[r] + b * Q::kBytes, i);
#pragma GCC unroll 8
      for (int t = 0; t < TB; ++t) {
        const __m512 xv = _mm512_loadu_ps(xb + (i * TB + t) * 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < TB; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// A group's rows against TB tokens: 4 rows per tile up to 4 tokens, 2 rows up to 8 (at most 16
// sums, leaving registers for the unpacked weights and a token vector).
template <class Q, int TB>
void group_tile(const uint8_t* w, int64_t row_bytes, int64_t rows, const float* xp, float* out,
                int64_t ldo, int64_t blocks) {
  constexpr int R = TB <= 4 ? 4 : 2;
  for (int64_t r0 = 0; r0 < rows; r0 += R)
    tile<Q, R, TB>(w + r0 * row_bytes, row_bytes, std::min<int64_t>(R, rows - r0), xp,
                   out + r0, ldo, blocks);
}

// out[t, n] = dot(w row n, x row t) for n < rows, t < M (xp: pack_tokens; out: row stride ldo).
// Token tiles innermost: a group's weights stay in L1 while every tile rereads them.
template <class Q>
void rows_by_tokens(const uint8_t* w, int64_t row_bytes, int64_t rows, const float* xp,
                    int64_t M, int64_t K, float* out, int64_t ldo) {
  const int64_t blocks = K / Q::kBlock;
  for (int64_t g = 0; g < rows; g += kGroup) {
    const uint8_t* wg = w + g * row_bytes;
    const int64_t n = std::min<int64_t>(kGroup, rows - g);
    for (int64_t t0 = 0; t0 < M; t0 += kMaxTokens) {
      const float* xt = xp + t0 * K;
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

template <class Q>
void linear_on_the_fly(const uint8_t* w, const float* xp, float* out, int64_t M, int64_t N,
                       int64_t K) {
  const int64_t row_bytes = K / Q::kBlock * Q::kBytes;
  at::parallel_for(0, (N + kGroup - 1) / kGroup, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kGroup, n1 = std::min(N, end * kGroup);
    rows_by_tokens<Q>(w + n0 * row_bytes, row_bytes, n1 - n0, xp, M, K, out + n0, N);
  });
}

// Float32 rows (the chunked path's scratch) as a block type of their own, for the same tiles.
struct F32 {
  static constexpr int kBlock = 16, kBytes = 64;
  static __m512 weights(const uint8_t* b, int) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(b));
  }
};
#endif  // __AVX512F__

// ------------------------------------------------------------- many rows: dequant in chunks
constexpr int64_t kScratchBytes = 256 * 1024;  // a chunk of float32 rows, well inside L2
constexpr int64_t kTokensPerPass = 64;  // token rows multiplied per pass over a chunk

// Chunks of rows, their count a multiple of the thread count so that the threads split evenly.
int64_t chunk_rows(int64_t N, int64_t K) {
  const int64_t threads = at::get_num_threads();
  const int64_t target = std::clamp<int64_t>(kScratchBytes / (4 * K), 16, 256);
  const int64_t chunks = threads * ((N + threads * target - 1) / (threads * target));
  return std::max<int64_t>(1, (N + chunks - 1) / chunks);
}

// xp: the packed tokens (AVX-512 only, else unused).
template <class Q>
void linear_by_chunks(const at::Tensor& out, const at::Tensor& x, const float* xp,
                      const uint8_t* w, int64_t N, int64_t K) {
  const int64_t M = x.size(0), blocks = K / Q::kBlock, rows_per = chunk_rows(N, K);
  const int64_t chunks = (N + rows_per - 1) / rows_per;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    at::Tensor scratch = at::empty({rows_per, K}, x.options());  // [rows_per, K] float32
    float* y = scratch.data_ptr<float>();
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n0 = c * rows_per, rows = std::min(rows_per, N - n0);
      dequantize_rows<Q>(w + n0 * blocks * Q::kBytes, rows, blocks, y, K);
#if defined(__AVX512F__)
      // Passes of kTokensPerPass tokens, so that their packed rows and the chunk share L2.
      for (int64_t t0 = 0; t0 < M; t0 += kTokensPerPass)
        rows_by_tokens<F32>(reinterpret_cast<const uint8_t*>(y), 4 * K, rows, xp + t0 * K,
                            std::min(kTokensPerPass, M - t0), K, out.data_ptr<float>() + t0 * N + n0, N);
#else
      // Inside a parallel region MKL runs on this thread; out's columns [n0, n0 + rows) are a
      // strided view, which MKL writes in place (its ldc).
      at::Tensor dst = out.narrow(1, n0, rows);
      at::mm_out(dst, x, scratch.narrow(0, 0, rows).t());
#endif
    }
  });
}

// ---------------------------------------------------------------------------------- the ops
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

void gguf_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                 int64_t qtype) {
  const char* op = "minivllm_cpu::gguf_linear";
  with_type(qtype, op, [&](auto q) {
    using Q = decltype(q);
    check_float(x, "x [M, K]", op, /*rows_strided=*/true);
    check_float(out, "out [M, N]", op);
    const int64_t M = x.size(0), K = x.size(1);
    const int64_t N = check_weight(qweight, K, op, Q::kBlock, Q::kBytes);
    TORCH_CHECK(out.size(0) == M && out.size(1) == N, op, ": out must be [", M, ", ", N,
                "], got [", out.size(0), ", ", out.size(1), "]");
    if (M == 0 || N == 0) return;
    const uint8_t* w = qweight.data_ptr<uint8_t>();
#if defined(__AVX512F__)
    // The token tiles (pack_tokens); one token's tile is its row as it is.
    at::Tensor packed = M == 1 ? x : at::empty({M * K}, x.options());
    float* xp = packed.data_ptr<float>();
    if (M > 1) pack_tokens(x.data_ptr<float>(), x.stride(0), M, K, xp);
    if (on_the_fly<Q>(M, K)) return linear_on_the_fly<Q>(w, xp, out.data_ptr<float>(), M, N, K);
#else
    const float* xp = nullptr;
#endif
    linear_by_chunks<Q>(out, x, xp, w, N, K);
  });
}

void gguf_dequantize(at::Tensor& out, const at::Tensor& qweight, int64_t qtype) {
  const char* op = "minivllm_cpu::gguf_dequantize";
  with_type(qtype, op, [&](auto q) {
    using Q = decltype(q);
    check_float(out, "out [N, K]", op);
    const int64_t K = out.size(1), N = check_weight(qweight, K, op, Q::kBlock, Q::kBytes);
    TORCH_CHECK(out.size(0) == N, op, ": out must have ", N, " rows, got ", out.size(0));
    const int64_t blocks = K / Q::kBlock;
    const uint8_t* w = qweight.data_ptr<uint8_t>();
    float* y = out.data_ptr<float>();
    // An embedding lookup dequantizes a few gathered rows: at least 16 per thread.
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      dequantize_rows<Q>(w + begin * blocks * Q::kBytes, end - begin, blocks, y + begin * K, K);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("gguf_linear(Tensor(a!) out, Tensor x, Tensor qweight, int qtype) -> ()", &gguf_linear);
  m.def("gguf_dequantize(Tensor(a!) out, Tensor qweight, int qtype) -> ()", &gguf_dequantize);
}

// The 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on AVX2's 8-bit integer dots: each
// block's quants unpacked to 32 bytes in weight order, and the two register tiles that dot them.
//
// - `tile32`: over a buffer of unpacked rows (a byte a weight, the scales beside), which the
//   many-token tiles reread for every token. Unpacking once pays when many tokens share it.
//   Q8_0 only on AVX2: the unsigned types' many tokens take 8 interleaved rows, one a lane
//   (`tile_octet32`, cpu_gguf_rows32_avx2.h), with the same integers and float steps.
// - `tile32_in_registers`: each block pair unpacked in registers and dotted at once into a few
//   tokens (decode), never stored. At one token the buffer's write and reread cost more than the
//   packed weight's own bytes (0.56 to 1.06 a weight) from memory, as llama.cpp's
//   ggml_vec_dot_q4_1_q8_1 (ggml-cpu, arch/x86/quants.c) dots each block where it lies.
//
// Both sum each block's products as whole integers, then run the same float steps in the same
// order per (row, token) (`block_step`: 8 float partials, block b into partial b mod 8, then one
// fixed tree), as the K-quants do per super-block (cpu_gguf_kfloat_avx2.h). So a token's output is
// bit for bit the same whichever tile ran it, whatever the batch: batch-invariant; and an AMX tile
// product, which sums a whole block of 32 bytes into each output, gives the same integers
// (cpu_gguf_amx32.h).
// Included by cpu_gguf_gemm_avx2.cpp (after cpu_gguf_tile_avx2.h), for AVX2 and AVX-512 builds
// alike, and by cpu_gguf_amx.cpp for the unpacking and the float steps.

#pragma once

#include "cpu_gguf_blocks.h"

#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>

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

// 32-weight types: block b of a row gives 32 quants (`quants`: a byte a weight, in order) and two
// floats (`scales`), w_k = A · q_k + B; so Σ_k w_k · dx · xq_k = A · dx · (q · xq) + B · sx.
// Q8_0's q is signed (kSigned), the others' are 0..31. `unpack` stores the quants for tile32.
struct Q4_0x { using Q = Q4_0; static constexpr bool kSigned = false, kOffset = true;
  static __m256i quants(const uint8_t* b) { return nibbles32(b + 2); }  // | d | qs[16] |
  static void scales(const uint8_t* b, float& A, float& B) { A = half(b), B = -8.0f * A; }
};
struct Q4_1x { using Q = Q4_1; static constexpr bool kSigned = false, kOffset = true;
  static __m256i quants(const uint8_t* b) { return nibbles32(b + 4); }  // | d | m | qs[16] |
  static void scales(const uint8_t* b, float& A, float& B) { A = half(b), B = half(b + 2); }
};
struct Q5_0x { using Q = Q5_0; static constexpr bool kSigned = false, kOffset = true;
  static __m256i quants(const uint8_t* b) {  // | d | qh | qs[16] |
    return _mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2));
  }
  static void scales(const uint8_t* b, float& A, float& B) { A = half(b), B = -16.0f * A; }
};
struct Q5_1x { using Q = Q5_1; static constexpr bool kSigned = false, kOffset = true;
  static __m256i quants(const uint8_t* b) {  // | d | m | qh | qs[16] |
    return _mm256_or_si256(nibbles32(b + 8), fifth_bits(b + 4));
  }
  static void scales(const uint8_t* b, float& A, float& B) { A = half(b), B = half(b + 2); }
};
struct Q8_0x { using Q = Q8_0; static constexpr bool kSigned = true, kOffset = false;
  static __m256i quants(const uint8_t* b) { return load32(b + 2); }  // | d | int8 qs[32] |
  static void scales(const uint8_t* b, float& A, float& B) { A = half(b), B = 0.0f; }
};
template <class X>
void unpack(const uint8_t* b, uint8_t* q, float& A, float& B) {
  store32(q, X::quants(b));
  X::scales(b, A, B);
}

// The K-quants' unpacking (to a buffer, or in registers) is in cpu_gguf_kquant_avx2.h.

// ------------------------------------------------------------------------------ the tiles

// A group of unpacked rows, 32-weight types: q [rows][padded64(K)] bytes (zeros past K), A and B
// [rows][padded8(K / 32)] (zeros past the last block).
struct Rows32 { const uint8_t* q; const float* A; const float* B; };

// q · x over one block's 32 bytes, as 8 int32 lanes: |q| · (x with q's sign) for Q8_0, whose q
// is signed (maddubs' unsigned side must not be), so every pair sum stays within int16.
template <class X>
inline __m256i block_dot(__m256i q, const int8_t* xp) {
  __m256i xv = load32(xp);
  if (X::kSigned) xv = _mm256_sign_epi8(xv, q), q = _mm256_sign_epi8(q, q);
  return dot4(q, xv);
}

// A block pair's dots as lanes | b b b+1 b+1 | b b b+1 b+1 |, each the sum of 8 adjacent products
// (block b's weights 0..7, 8..15 in the low half, 16..23, 24..31 in the high): _mm256_hadd_epi32
// of the two blocks' dot4. Without VNNI the unsigned types add the int16 pair sums of maddubs
// first (_mm256_hadd_epi16, then one madd for both blocks): the same integers, one instruction
// fewer; they cannot wrap, |pair sum| <= 2 · 31 · 127, twice that < 2^15. Q8_0 (signed, pair sums
// up to 2 · 127²) takes the int32 way.
template <class X>
inline __m256i pair_dot(__m256i q0, const int8_t* x0, __m256i q1, const int8_t* x1) {
#if !defined(MINIVLLM_INT8_VNNI)
  if constexpr (!X::kSigned) {
    const __m256i p = _mm256_hadd_epi16(_mm256_maddubs_epi16(q0, load32(x0)), _mm256_maddubs_epi16(q1, load32(x1)));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
  }
#endif
  return _mm256_hadd_epi32(block_dot<X>(q0, x0), block_dot<X>(q1, x1));
}

// The float steps of the 32-weight types, on whole-block integer sums (every tile runs them, in
// this order, on each output: cpu_gguf_amx.cpp's AMX tiles too, 16 weight rows a vector).
// Per block b of one weight row and one token, S_b = Σ_k q_k · xq_k (an integer: exact in any
// order), and the output's partial l = b mod 8:
//   p[l] = fma(S_b, A_b · dx_b, p[l]);  p[l] = fma(B_b, sx_b, p[l])   (no second step for Q8_0)
// then the fixed tree of the 8 partials (partials_tree, cpu_gguf_kfloat_avx2.h), as the K-quants'
// super-blocks. With 8 partials, 8 blocks' lanes (4 pairs) give their 8 totals with one
// transposition (`block_totals`), one block a lane, and the float steps of 8 blocks are one
// vector operation each.
//
// Blocks 8g..8g+7's totals, block 8g + l in lane l, from hadd(pair 0, pair 1) and hadd(pair 2,
// pair 3) of the group (their lanes | b0 b1 b2 b3 | b0 b1 b2 b3 | and the same for b4..b7).
inline __m256i block_totals(__m256i h01, __m256i h23) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(h01, h23, 0x20), _mm256_permute2x128_si256(h01, h23, 0x31));
}
template <class X>
inline __m256 block_step(__m256 p, __m256i S, __m256 A, __m256 dx, __m256 B, __m256 sx) {
  p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(A, dx), p);
  if (X::kOffset) p = _mm256_fmadd_ps(B, sx, p);
  return p;
}
// The output from its 8 partials (one a lane).
inline float block_output(__m256 p) {
  alignas(32) float l[8];
  _mm256_store_ps(l, p);
  return partials_tree(l, [](float a, float b) { return a + b; });
}

// out[t · ldo + r] = Σ_b (A_rb · dx_tb · (q_rb · xq_tb) + B_rb · sx_tb), for r < rows (<= R),
// t < T, in the float steps above. Rows past `rows` repeat the last; their sums are dropped.
// A group of 8 blocks a step: for each row and token, its 4 pairs' dots (`pair_dot`), their 8
// block totals (`block_totals`), then the group's float steps, one vector each.
template <class X, int R, int T>
void tile32(Rows32 w, int64_t rows, const Tokens& x, int64_t t0, float* out, int64_t ldo) {
  const int64_t ldq = x.ldq, pairs = ldq / 64, nbp = padded8(x.blocks);
  int64_t row[R];
  for (int r = 0; r < R; ++r) row[r] = std::min<int64_t>(r, rows - 1);
  const int8_t* xq = x.xq.data() + t0 * ldq;
  const float* dx = x.dx.data() + t0 * nbp;
  const float* sx = x.sx.data() + t0 * nbp;
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < nbp / 8; ++g) {
    const int64_t np = std::min<int64_t>(4, pairs - 4 * g);  // the group's pairs (the last: 1..4)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* qr = w.q + row[r] * ldq + 256 * g;
      const __m256 A = _mm256_loadu_ps(w.A + row[r] * nbp + 8 * g);
      const __m256 B = _mm256_loadu_ps(w.B + row[r] * nbp + 8 * g);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const int8_t* xt = xq + t * ldq + 256 * g;
        __m256i v[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
          v[i] = i < np ? pair_dot<X>(load32(qr + 64 * i), xt + 64 * i, load32(qr + 64 * i + 32), xt + 64 * i + 32)
                        : _mm256_setzero_si256();
        const __m256i S = block_totals(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        acc[r][t] = block_step<X>(acc[r][t], S, A, _mm256_loadu_ps(dx + t * nbp + 8 * g), B,
                                  _mm256_loadu_ps(sx + t * nbp + 8 * g));
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < T; ++t) out[t * ldo + r] = block_output(acc[r][t]);
}

// The same outputs as tile32, for rows [0, rows) (<= R) of packed blocks w (row stride row_bytes)
// and tokens [t0, t0 + T), with each block pair unpacked in registers and dotted at once into the
// T tokens: the same int32 lanes, the group's scales gathered into A and B vectors, the same float
// steps. Row by row, each token keeps the row's group's first two pairs' lanes (hadd) while the
// last two are dotted. The rows' bytes are read once, in order; the tile's R rows are one run of R · row_bytes,
// and each row prefetches its bytes in the tiles of whole runs at least kPrefetchAhead on, so the
// later runs are asked for in full, whatever the row length (a fixed distance ahead of each row
// fell inside the tile's own rows at K = 1536, unasked beyond).
template <class X, int R, int T>
void tile32_in_registers(const uint8_t* w, int64_t row_bytes, int64_t rows, const Tokens& x,
                         int64_t t0, float* out, int64_t ldo) {
  using Q = typename X::Q;
  const int64_t ldq = x.ldq, nb = x.blocks, nbp = padded8(nb);
  const int8_t* xq = x.xq.data() + t0 * ldq;
  const float* dx = x.dx.data() + t0 * nbp;
  const float* sx = x.sx.data() + t0 * nbp;
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(r, rows - 1) * row_bytes;
  const int64_t run = R * row_bytes, ahead = (kPrefetchAhead + run - 1) / run * run;
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < nbp / 8; ++g)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {  // a row's group, then the next row's: few sums wait at once
      alignas(32) float A[8] = {}, B[8] = {};  // the group's scales, zeros past the last block
      __m256i lo[T], v0[T];  // hadd(pair 0, pair 1); the group's pair 0 or 2
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int64_t b = 8 * g + 2 * i;  // the pair's first block
        __m256i q0 = _mm256_setzero_si256(), q1 = _mm256_setzero_si256();
        if (b < nb) {  // a missing second block: zero quants and scales, as tile32's buffer pads it
          const uint8_t* p = wr[r] + b * Q::kBytes;
#pragma GCC unroll 2
          for (int l = 0; l < (2 * Q::kBytes + 63) / 64; ++l)
            _mm_prefetch(reinterpret_cast<const char*>(p + ahead) + 64 * l, _MM_HINT_T0);
          q0 = X::quants(p), X::scales(p, A[2 * i], B[2 * i]);
          if (b + 1 < nb) q1 = X::quants(p + Q::kBytes), X::scales(p + Q::kBytes, A[2 * i + 1], B[2 * i + 1]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const int8_t* xt = xq + t * ldq + 32 * b;
          const __m256i v = b < nb ? pair_dot<X>(q0, xt, q1, xt + 32) : _mm256_setzero_si256();
          if (i % 2 == 0) v0[t] = v;
          else if (i == 1) lo[t] = _mm256_hadd_epi32(v0[t], v);
          else {
            const __m256i S = block_totals(lo[t], _mm256_hadd_epi32(v0[t], v));
            acc[r][t] = block_step<X>(acc[r][t], S, _mm256_load_ps(A), _mm256_loadu_ps(dx + t * nbp + 8 * g),
                                      _mm256_load_ps(B), _mm256_loadu_ps(sx + t * nbp + 8 * g));
          }
        }
      }
    }
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < T; ++t) out[t * ldo + r] = block_output(acc[r][t]);
}

// tile32_in_registers over rows [0, rows): 4 rows a tile at one token (their loads of x shared, 4
// independent sums), 2 at two, 1 from three on (the sums of T tokens fill the registers).
template <class X, int T>
void rows32_in_registers(const uint8_t* w, int64_t row_bytes, int64_t rows, const Tokens& x,
                         int64_t t0, float* out, int64_t ldo) {
  constexpr int R = T == 1 ? 4 : T == 2 ? 2 : 1;
  for (int64_t r0 = 0; r0 < rows; r0 += R)
    tile32_in_registers<X, R, T>(w + r0 * row_bytes, row_bytes, std::min<int64_t>(R, rows - r0), x,
                                 t0, out + r0, ldo);
}

}  // namespace
}  // namespace minivllm_gguf_avx2
#endif  // __AVX2__

// Q8_0 on AVX512-VNNI (gguf_linear_int8 of AVX-512 builds): its own kernel, not AVX2's tiles.
// Included by cpu_gguf_gemm_avx2.cpp only, inside its AVX512-VNNI section.

#pragma once

#if defined(MINIVLLM_INT8_VNNI)
#include <vector>

namespace minivllm_gguf_avx2 {
namespace {

// Q8_0's quants are bytes already: there is nothing to unpack, only the block's fp16 scale. So
// here, at every token count, each block pair is dotted where it lies (no buffer), 64 products a
// `vpdpbusd` per token, and its two scales applied to the pair's int32 lanes in one FMA:
//   Σ_k w_k · dx · xq_k = Σ_blocks (d · dx) · (q · xq)
// vpdpbusd multiplies unsigned by signed bytes, and both Q8_0's q and x's xq are signed; so x
// goes in as xq + 128 (`xu`, unsigned) and each lane starts from -128 · Σ q over its 4 weights
// (`dot4` of 0x80 bytes with q, once a row for all tokens): xu · q - 128 · Σ q = xq · q exactly.
// The float steps are this kernel's own, the same at every M (batch-invariant), not tile32's:
// a block's 8 int32 lanes times its d · dx into 8 float lanes, one horizontal sum at the end.
constexpr int64_t kQ8Rows = 16;  // rows per work item

struct TokensQ8 {
  int64_t pairs;
  std::vector<uint8_t> xu;  // [M][pairs][64] xq + 128; 128 (xq = 0) past the last block
  std::vector<float> dx;    // [M][pairs][16] each block's dx in its 8 lanes; 0 past the last block
};

TokensQ8 quantize_tokens_q8(const float* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t nb = K / 32, pairs = (nb + 1) / 2;
  TokensQ8 t{pairs, std::vector<uint8_t>(M * pairs * 64, 0x80), std::vector<float>(M * pairs * 16, 0.0f)};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        int8_t q[32];
        const float d = quantize_block(x + m * ldx + b * 32, 32, q);
        uint8_t* u = t.xu.data() + m * pairs * 64 + b * 32;
        for (int k = 0; k < 32; ++k) u[k] = uint8_t(q[k] ^ 0x80);
        float* dl = t.dx.data() + m * pairs * 16 + b * 8;
        for (int k = 0; k < 8; ++k) dl[k] = d;
      }
  });
  return t;
}

// out[t · ldo + r] for rows r < rows of w (Q8_0 blocks, row stride row_bytes), tokens t < T of x.
template <int T>
void tileQ8_0(const uint8_t* w, int64_t row_bytes, int64_t rows, const TokensQ8& x, int64_t t0,
              int64_t nb, float* out, int64_t ldo) {
  const int64_t pairs = x.pairs;
  const uint8_t* xu = x.xu.data() + t0 * pairs * 64;
  const float* dx = x.dx.data() + t0 * pairs * 16;
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t* b0 = wr + 2 * p * Q8_0::kBytes;
      prefetch_ahead<2 * Q8_0::kBytes>(b0);
      const bool two = 2 * p + 1 < nb;
      // the pair's quants, block 2p in the low half, 2p + 1 (or zeros) in the high
      const __m256i q1 = two ? load32(b0 + Q8_0::kBytes + 2) : _mm256_setzero_si256();
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(load32(b0 + 2)), q1, 1);
      const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(),
                                             _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, q));
      const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(half(b0))),
                                          _mm256_set1_ps(two ? half(b0 + Q8_0::kBytes) : 0.0f), 1);
      for (int t = 0; t < T; ++t) {
        const __m512i sums = _mm512_dpbusd_epi32(start, load64(xu + (t * pairs + p) * 64), q);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums),
                                 _mm512_mul_ps(d, _mm512_loadu_ps(dx + (t * pairs + p) * 16)), acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(acc[t]);
  }
}

void linearQ8_0(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N,
                int64_t K) {
  const TokensQ8 tok = quantize_tokens_q8(x, ldx, M, K);
  const int64_t nb = K / 32, row_bytes = nb * Q8_0::kBytes;
  // Work items of kQ8Rows rows, whose bytes stay in L1 while every 8-token tile rereads them.
  at::parallel_for(0, (N + kQ8Rows - 1) / kQ8Rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin * kQ8Rows; n0 < std::min(N, end * kQ8Rows); n0 += kQ8Rows) {
      const int64_t rows = std::min(kQ8Rows, N - n0);
      for (int64_t t0 = 0; t0 < M; t0 += 8) {
        const uint8_t* wg = w + n0 * row_bytes;
        float* o = out + t0 * N + n0;
        switch (std::min<int64_t>(8, M - t0)) {
          case 1: tileQ8_0<1>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 2: tileQ8_0<2>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 3: tileQ8_0<3>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 4: tileQ8_0<4>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 5: tileQ8_0<5>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 6: tileQ8_0<6>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          case 7: tileQ8_0<7>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
          default: tileQ8_0<8>(wg, row_bytes, rows, tok, t0, nb, o, N); break;
        }
      }
    }
  });
}

}  // namespace
}  // namespace minivllm_gguf_avx2
#endif  // MINIVLLM_INT8_VNNI

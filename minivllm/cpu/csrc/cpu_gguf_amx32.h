// The 32-weight types' int8 product (Q4_0, Q4_1, Q5_0, Q5_1) for prefill-sized calls on Intel AMX
// tiles, every output bit for bit the AVX512-VNNI kernel's (cpu_gguf_block32_avx2.h), hence
// batch-invariant; the K-quants' AMX kernel (cpu_gguf_amx.cpp) is the same idea per super-block.
//
// Why it can be exact. The VNNI tiles sum each block's 32 products as one integer,
// S_b = Σ_k q_k · xq_k, before any float step, and then run per (weight row, token), block b into
// partial b mod 8 (cpu_gguf_block32_avx2.h `block_step`):
//   p = fma(S_b, A_b · dx_b, p);  p = fma(B_b, sx_b, p)
// and the 8 partials' fixed tree. An integer sum is the same in any order, so a tile product that
// multiplies 32 bytes a row, TDPBSUD of 16 tokens x 32 bytes of xq (signed) by 32 bytes of 16
// weight rows (unsigned quants 0..31), gives the S_b of 16 tokens x 16 rows at once, no zeros
// multiplied. AVX-512 then runs the same float steps in the same block order, vectorized over 16
// weight rows instead of over blocks. Q8_0 has its own VNNI kernel (cpu_gguf_q8_0_vnni.h), whose
// float steps are another's: it has no AMX tile here.
//
// Layout. Threads split the weight rows in items of a few blocks of 32 rows (two tiles of 16
// columns sharing each x tile); a thread unpacks its rows once (the VNNI kernel's `quants`, then
// one gather per 16 rows x 4 bytes) into the tiles' layout, then runs L2-sized panels of x (token
// rows past M are zeros) over them, 16 tokens a tile, two blocks of 32 weights a step.
// The work split and the masked store are the K-quants' (cpu_gguf_amx.cpp's `over_blocks` and
// `store_block`). Included by cpu_gguf_amx.cpp inside its AMX target and namespace, after them
// and cpu_gguf_block32_avx2.h.

#pragma once

// The tiles (minivllm_amx::configure_tiles with kTiles32): 0..3 int32 products [16 tokens][16
// weight rows] (blocks b, b + 1 x weight rows 0..15, 16..31), 4 and 5 16 tokens x 32 bytes of xq
// (blocks b, b + 1), 6 and 7 8 rows of 16 weight rows x 4 bytes (one block of 16 weight rows).
constexpr uint8_t kTileRows32[8] = {16, 16, 16, 16, 16, 16, 8, 8};
constexpr uint16_t kTileBytes32[8] = {64, 64, 64, 64, 32, 32, 64, 64};

// A block of kRows weight rows in the tiles' layout, nb blocks of 32 weights:
//   q [nb][2][8][16][4] bytes: the block's quants for weight rows 0..15 and 16..31, dword k / 4,
//     row, byte k % 4
//   A, B [nb][2][16] floats: w = A · q + B (zeros for rows past the matrix)
template <class X>
struct WeightBlock32 {
  std::vector<uint8_t> q;
  std::vector<float> A, B;
  explicit WeightBlock32(int64_t nb) : q(nb * 32 * kRows), A(nb * kRows), B(nb * kRows) {}

  // Rows [0, rows) of packed blocks w (row stride row_bytes); rows past them are zeros.
  void pack(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t nb) {
    using Q = typename X::Q;
    alignas(64) uint8_t qb[16][32];
    const __m512i row_at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(8));  // dwords
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t nn = 0; nn < 16; ++nn) {
          const int64_t n = 16 * h + nn, at = (b * 2 + h) * 16 + nn;
          if (n >= rows) {
            std::memset(qb[nn], 0, 32);
            A[at] = B[at] = 0.0f;
            continue;
          }
          const uint8_t* p = w + n * row_bytes + b * Q::kBytes;
          _mm256_store_si256(reinterpret_cast<__m256i*>(qb[nn]), X::quants(p));
          X::scales(p, A[at], B[at]);
        }
        for (int k4 = 0; k4 < 8; ++k4)  // bytes 4 k4 .. 4 k4 + 3 of the 16 rows
          _mm512_storeu_si512(q.data() + ((b * 2 + h) * 8 + k4) * 64,
                              _mm512_i32gather_epi32(row_at, reinterpret_cast<const int*>(&qb[0][0]) + k4, 4));
      }
  }
  const uint8_t* tile(int64_t b, int h) const { return q.data() + (b * 2 + h) * 512; }
};

// out[t · ldo + n] for tokens t < tokens (<= 16, from token row m0 of xq) and weight rows
// n < rows (<= kRows) of the packed block.
template <class X>
void block32_tile(const WeightBlock32<X>& w, int64_t rows, const Tokens& x, int64_t m0, int64_t tokens,
            float* out, int64_t ldo) {
  const int64_t ldq = x.ldq, nb = x.blocks, nbp = minivllm_gguf_avx2::padded8(nb);
  alignas(64) int32_t D[2][2][16][16];  // [block of the pair][weight rows / 16][token][weight row]
  __m512 acc[2][16][8];  // [weight rows / 16][token][partial b mod 8]
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 16; ++t)
      for (int l = 0; l < 8; ++l) acc[h][t][l] = _mm512_setzero_ps();
  const int8_t* xs = x.xq.data() + m0 * ldq;
  const float* dx = x.dx.data() + m0 * nbp;
  const float* sx = x.sx.data() + m0 * nbp;
  for (int64_t b0 = 0; b0 < nb; b0 += 2) {
    const int n = nb - b0 >= 2 ? 2 : 1;  // blocks this step
    _tile_zero(0); _tile_zero(1);
    _tile_loadd(4, xs + 32 * b0, ldq);
    _tile_loadd(6, w.tile(b0, 0), 64);
    _tile_loadd(7, w.tile(b0, 1), 64);
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    _tile_stored(0, D[0][0], 64); _tile_stored(1, D[0][1], 64);
    if (n == 2) {
      _tile_zero(2); _tile_zero(3);
      _tile_loadd(5, xs + 32 * (b0 + 1), ldq);
      _tile_loadd(6, w.tile(b0 + 1, 0), 64);
      _tile_loadd(7, w.tile(b0 + 1, 1), 64);
      _tile_dpbsud(2, 5, 6);
      _tile_dpbsud(3, 5, 7);
      _tile_stored(2, D[1][0], 64); _tile_stored(3, D[1][1], 64);
    }
    // the float steps of `block_step`, 16 weight rows a vector
    for (int i = 0; i < n; ++i) {
      const int64_t b = b0 + i;
      for (int h = 0; h < 2; ++h) {
        const __m512 A = _mm512_loadu_ps(w.A.data() + (b * 2 + h) * 16);
        const __m512 B = _mm512_loadu_ps(w.B.data() + (b * 2 + h) * 16);
        for (int t = 0; t < 16; ++t) {
          __m512& p = acc[h][t][b % 8];
          const __m512 S = _mm512_cvtepi32_ps(_mm512_load_si512(D[i][h][t]));
          p = _mm512_fmadd_ps(S, _mm512_mul_ps(A, _mm512_set1_ps(dx[t * nbp + b])), p);
          if (X::kOffset) p = _mm512_fmadd_ps(B, _mm512_set1_ps(sx[t * nbp + b]), p);
        }
      }
    }
  }
  store_block(acc, rows, tokens, out, ldo);
}

template <class X>
void linear32(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N, int64_t K) {
  using Q = typename X::Q;
  const int64_t nb = K / 32, nbp = minivllm_gguf_avx2::padded8(nb), row_bytes = nb * Q::kBytes;
  const int64_t Mp = (M + 15) / 16 * 16;
  Tokens tok = minivllm_gguf_avx2::quantize_tokens(x, ldx, M, K, 32);
  tok.xq.resize(Mp * tok.ldq, 0), tok.dx.resize(Mp * nbp, 0.0f), tok.sx.resize(Mp * nbp, 0.0f);
  over_blocks<WeightBlock32<X>>(
      out, w, M, N, tok, row_bytes, K, [] { minivllm_amx::configure_tiles(kTileRows32, kTileBytes32); },
      [&](const WeightBlock32<X>& wb, int64_t rows, int64_t m0, int64_t tokens, float* o) {
        block32_tile<X>(wb, rows, tok, m0, tokens, o, N);
      });
}

// The K-quants' (Q4_K, Q5_K, Q6_K) many-token tile on AVX2: 8 weight rows interleaved, one row a
// lane, so that a super-block's integer sums need no horizontal reduction and its products are
// summed in int16 before they are scaled (the layout of ggml's repacked q4_K_8x8 GEMM, ggml-cpu
// repack.cpp, and of this library's AMX kernel, cpu_gguf_amx.cpp, at AVX2's 8 lanes).
//
// Why. The row-major tile (one row's 32 weights against a token's 32 xq, `madd(maddubs(q, xq),
// sc)`) spends three instructions on 32 products, two of them on the two ports that multiply,
// and then sums each super-block's 8 int32 lanes per row and token with shuffles. Here a
// 32-byte vector holds 4 consecutive weights of each of 8 rows, and x's 4 bytes are broadcast:
//   P = maddubs(w, broadcast(xq[4g .. 4g + 3]))   lane pair of row r: its 4 products, 2 a pair
// Rows whose weights share one sub-scale add their P in int16 before one `madd` by the rows'
// scales (kSumGroups groups of 4 weights: as many as cannot overflow int16, |xq| <= 127), so 32
// products cost one multiply and about one add. Each lane then holds one row's super-block total,
// S = Σ sc · q · xq, and the mins' term M = Σ_j mn_j · bsums_j comes the same way (a lane a row).
// Integers: exact in any order, so S and M equal the other tiles' (and VNNI's and AMX's) totals,
// and the float steps after them (`k_step`, cpu_gguf_kfloat_avx2.h) and the 8 partials' tree are
// the same operations on each output: a token's output is bit for bit the same in any batch and
// on any of these paths.
//
// The buffer, per 8 rows ("octet") and super-block, `kOctetBytes<X>` bytes:
//   q   [64 groups][8 rows][4]              the unsigned quants, group g = weights 4g .. 4g + 3
//   sc  [64 / kSumGroups][8 rows][2] int16  each madd step's scale, twice (a lane's int16 pair)
//   mn  [8 pairs][8 rows][2] int16          mn_2p, mn_2p+1 (the coefficients of bsums 2p, 2p+1)
//   d, dmin [8 rows] float
// Included by cpu_gguf_gemm_avx2.cpp only (after cpu_gguf_kquant_avx2.h and cpu_gguf_xq_avx2.h),
// and like it compiled for AVX2 and AVX-512 builds.

#pragma once

#include "cpu_gguf_blocks.h"

#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>

namespace minivllm_gguf_avx2 {
namespace {

constexpr int kOctet = 8;  // weight rows a tile: one a lane of 8 int32
template <class X>
constexpr int64_t kOctetSteps = 64 / X::kSumGroups;  // madd steps a super-block
template <class X>
constexpr int64_t kOctetBytes = 2048 + kOctetSteps<X> * 32 + 256 + 64;

// The rows [0, rows) (rows <= 8; missing rows repeat the last, their outputs never stored) of
// packed blocks w (row stride row_bytes), all ns super-blocks, into dst (ns · kOctetBytes<X>).
// Each row's super-block goes through X::unpack (the row-major layout), then is interleaved.
template <class X>
void pack_octet(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t ns, uint8_t* dst) {
  alignas(32) uint8_t q[kOctet][256];
  alignas(32) int16_t sc[kOctet][128], mn[kOctet][16];
  float d[kOctet], dmin[kOctet];
  for (int64_t s = 0; s < ns; ++s) {
    for (int r = 0; r < kOctet; ++r) {
      const int64_t row = std::min<int64_t>(r, rows - 1);
      X::unpack(w + row * row_bytes + s * X::Q::kBytes, KBlock{q[r], sc[r], mn[r], d + r, dmin + r});
    }
    uint8_t* b = dst + s * kOctetBytes<X>;
    for (int g = 0; g < 64; ++g)
      for (int r = 0; r < kOctet; ++r) std::memcpy(b + 32 * g + 4 * r, q[r] + 4 * g, 4);
    int16_t* bsc = reinterpret_cast<int16_t*>(b + 2048);
    for (int j = 0; j < kOctetSteps<X>; ++j) {
      const int g = j * X::kSumGroups;  // the step's first group: chunk g / 8, its int32 lane g % 8
      for (int r = 0; r < kOctet; ++r) bsc[16 * j + 2 * r] = bsc[16 * j + 2 * r + 1] = sc[r][16 * (g / 8) + 2 * (g % 8)];
    }
    int16_t* bmn = bsc + 16 * kOctetSteps<X>;
    for (int p = 0; p < 8; ++p)
      for (int r = 0; r < kOctet; ++r) bmn[16 * p + 2 * r] = mn[r][2 * p], bmn[16 * p + 2 * r + 1] = mn[r][2 * p + 1];
    float* bd = reinterpret_cast<float*>(bmn + 128);
    for (int r = 0; r < kOctet; ++r) bd[r] = d[r], bd[8 + r] = dmin[r];
  }
}

inline __m256i broadcast4(const int8_t* p) {  // 4 bytes in every int32 lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256i scaled_sum(__m256i acc, __m256i p, const int16_t* sc) {  // acc + madd(p, sc)
#if defined(MINIVLLM_INT8_VNNI)
  return _mm256_dpwssd_epi32(acc, p, load32(sc));
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, load32(sc)));
#endif
}

// The end of every octet tile (tile_octet here, tile_octet32 in cpu_gguf_rows32_avx2.h): each
// token's 8 partials (a row a lane) through the fixed tree, stored to out[t · ldo + r] for the
// rows r < rows that exist.
template <int T>
inline void store_octet(const __m256 (&part)[T][8], int64_t rows, float* out, int64_t ldo) {
  for (int t = 0; t < T; ++t) {
    const __m256 o = partials_tree(part[t], [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); });
    if (rows == kOctet) {
      _mm256_storeu_ps(out + t * ldo, o);
    } else {
      alignas(32) float v[kOctet];
      _mm256_store_ps(v, o);
      for (int r = 0; r < rows; ++r) out[t * ldo + r] = v[r];
    }
  }
}

// Outputs out[t · ldo + r] (r < rows, t < T) of one packed octet pk (ns super-blocks) and tokens
// [t0, t0 + T) of x.
template <class X, int T>
void tile_octet(const uint8_t* pk, int64_t ns, int64_t rows, const Tokens& x, int64_t t0,
                float* out, int64_t ldo) {
  const int64_t K = x.K;
  const int8_t* xq = x.xq.data() + t0 * K;
  const float* dx = x.dx.data() + t0 * ns;
  const int16_t* bsums = x.bsums.data() + t0 * ns * 16;
  __m256 part[T][8];  // [token][partial] a row a lane
  for (int t = 0; t < T; ++t)
    for (int l = 0; l < 8; ++l) part[t][l] = _mm256_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* q = pk + s * kOctetBytes<X>;
    const int16_t* sc = reinterpret_cast<const int16_t*>(q + 2048);
    const int16_t* mn = sc + 16 * kOctetSteps<X>;
    const float* dd = reinterpret_cast<const float*>(mn + 128);
    const int8_t* xs = xq + 256 * s;
    __m256i S[T];
    for (int t = 0; t < T; ++t) S[t] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int j = 0; j < kOctetSteps<X>; ++j) {
      __m256i P[T];
#pragma GCC unroll 8
      for (int i = 0; i < X::kSumGroups; ++i) {
        const int g = j * X::kSumGroups + i;
        const __m256i wv = load32(q + 32 * g);
        for (int t = 0; t < T; ++t) {
          const __m256i p = _mm256_maddubs_epi16(wv, broadcast4(xs + t * K + 4 * g));
          // kept: without it GCC reassociates the unrolled adds into a tree and spills the products
          P[t] = i == 0 ? p : kept(_mm256_add_epi16(P[t], p));
        }
      }
      for (int t = 0; t < T; ++t) S[t] = scaled_sum(S[t], P[t], sc + 16 * j);
    }
    const __m256 d = _mm256_loadu_ps(dd), dmin = _mm256_loadu_ps(dd + 8);
    const int l = int(s % 8);
    for (int t = 0; t < T; ++t) {
      const int16_t* bs = bsums + t * ns * 16 + 16 * s;
      __m256i M = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) M = scaled_sum(M, broadcast4(reinterpret_cast<const int8_t*>(bs + 2 * p)), mn + 16 * p);
      part[t][l] = k_step<X>(part[t][l], S[t], M, d, dmin, _mm256_set1_ps(dx[t * ns + s]));
    }
  }
  store_octet<T>(part, rows, out, ldo);
}

}  // namespace
}  // namespace minivllm_gguf_avx2
#endif  // __AVX2__

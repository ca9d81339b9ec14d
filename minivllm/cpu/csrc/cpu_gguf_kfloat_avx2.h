// The K-quants' float steps (Q4_K, Q5_K, Q6_K on 8-bit dots): the only float arithmetic of a
// K-quant output, shared by every tile that computes one (cpu_gguf_gemm_avx2.cpp's AVX2 and
// AVX512-VNNI tiles; cpu_gguf_amx.cpp runs the same steps on AMX's sums, 16 weight rows a vector).
//
// Per super-block s of one weight row and one token, from whole integers (exact in any order):
//   S_s = Σ sc · q · xq,   M_s = Σ_j mn_j · bsums_j
// each output keeps 8 float partial sums p[0..7]; super-block s goes to partial l = s mod 8:
//   p[l] = fma(S_s, d_s · dx_s, p[l]);  p[l] = fma(-M_s, dmin_s · dx_s, p[l])
// (Q6_K, kFoldMins: dmin = d, p[l] = fma(S_s - M_s, d_s · dx_s, p[l])), and the output is one
// fixed tree of the 8: ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)).
// Every tile runs these operations on each output in this order, whichever register lane holds
// it, so a token's output is bit for bit the same at any batch size and on AVX2, VNNI or AMX.
//
// Why 8 partials and not one running sum. With one running sum a row alone (decode's one token)
// reduces each super-block's 8 int32 lanes to a total before its float step: shuffles on the port
// the unpacking uses, once a super-block. With 8 partials, 8 super-blocks' lanes wait and one
// transposition (`lane_totals<8>`) gives all 8 totals, whose float steps are then one vector
// operation; several tokens keep their totals one token a lane, one partial a vector.
// Included by cpu_gguf_kquant_avx2.h (compiled with its including file's target).

#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>

namespace minivllm_gguf_avx2 {
namespace {

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// A super-block's min coefficients (mn_j, 16 int16) and float scales.
struct KScales {
  __m256i mn;
  float d, dmin;
};

// Lane t of the result: the sum of v[t]'s 8 int32 lanes, t < T (integers: exact in any order).
// One token: its sum in lane 0; up to 4: lanes 0..3; up to 8: all.
template <int T>
inline __m256i lane_totals(const __m256i (&v)[8]) {
  if (T == 1) {
    const __m256i h = _mm256_hadd_epi32(v[0], v[0]);
    const __m128i q = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    return _mm256_castsi128_si256(_mm_hadd_epi32(q, q));
  }
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  if (T <= 4) return _mm256_castsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)));
  const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
}

// The 8 partials' fixed tree, on floats or vectors of them (an output a lane):
// ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)). Each sum passes an empty asm that the
// compiler cannot see through, so that -ffast-math cannot reassociate the tree into another
// order in one caller and not in another (measured: it did).
template <class V>
inline V kept(V v) {
  asm("" : "+v"(v));
  return v;
}
template <class V, class Add>
inline V partials_tree(const V (&p)[8], Add add) {
  const V a = kept(add(p[0], p[4])), b = kept(add(p[2], p[6]));
  const V c = kept(add(p[1], p[5])), e = kept(add(p[3], p[7]));
  return add(kept(add(a, b)), kept(add(c, e)));
}

// The float steps on 8 outputs' partials at once (one output a lane): S, M their super-block's
// integer totals, d, dmin, dx their scales.
template <class X>
inline __m256 k_step(__m256 acc, __m256i S, __m256i M, __m256 d, __m256 dmin, __m256 dx) {
  if (X::kFoldMins) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(S, M)), _mm256_mul_ps(d, dx), acc);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, dx), acc);
  return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(M), _mm256_mul_ps(dmin, dx), acc);
}

// One weight row's outputs for T <= 8 tokens, super-block by super-block (`add`), then `finish`.
// T >= 2: partial l of token t is lane t of acc[l], and each super-block's totals come from one
// transposition over the tokens. T = 1: partial l is lane l of acc[0], and 8 super-blocks' lanes
// wait in sv / mv for one transposition over the super-blocks.
template <class X, int T>
struct KSums {
  static constexpr int kVectors = T == 1 ? 1 : 8;
  __m256 acc[kVectors];
  __m256i sv[8], mv[8];     // T = 1: the waiting super-blocks' int32 lanes (S and M)
  alignas(32) float d[8], dmin[8];  // T = 1: their scales

  KSums() {
    for (int l = 0; l < kVectors; ++l) acc[l] = _mm256_setzero_ps();
  }

  // Super-block s (of ns) for tokens t < T: sumi[t] their int32 lanes, bsums and dx token t's at
  // bsums + t · bstride and dx[t · dstride] (dx points at super-block s; the super-blocks of a
  // token are adjacent, dx[-1] is super-block s - 1's).
  inline void add(int64_t s, int64_t ns, const __m256i (&sumi)[T], const KScales& k,
                  const int16_t* bsums, int64_t bstride, const float* dx, int64_t dstride) {
    const int l = int(s % 8);
    if constexpr (T == 1) {
      sv[l] = sumi[0];
      mv[l] = _mm256_madd_epi16(load32(bsums), k.mn);
      d[l] = k.d, dmin[l] = k.dmin;
      if (l == 7 || s == ns - 1) flush(l + 1, dx - l);
    } else {
      __m256i S8[8], M8[8];
      alignas(32) float dxs[8] = {};
      for (int t = 0; t < 8; ++t) {
        S8[t] = t < T ? sumi[t] : _mm256_setzero_si256();
        M8[t] = t < T ? _mm256_madd_epi16(load32(bsums + t * bstride), k.mn) : _mm256_setzero_si256();
        if (t < T) dxs[t] = dx[t * dstride];
      }
      acc[l] = step(acc[l], lane_totals<T>(S8), lane_totals<T>(M8), _mm256_set1_ps(k.d),
                    _mm256_set1_ps(k.dmin), _mm256_load_ps(dxs));
    }
  }

  // out[t · ldo] = token t's output, t < T.
  inline void finish(float* out, int64_t ldo) const {
    if constexpr (T == 1) {
      alignas(32) float p[8];
      _mm256_store_ps(p, acc[0]);
      out[0] = partials_tree(p, [](float a, float b) { return a + b; });
    } else {
      alignas(32) float o[8];
      _mm256_store_ps(o, partials_tree(acc, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); }));
      for (int t = 0; t < T; ++t) out[t * ldo] = o[t];
    }
  }

 private:
  static inline __m256 step(__m256 acc, __m256i S, __m256i M, __m256 d, __m256 dmin, __m256 dx) {
    return k_step<X>(acc, S, M, d, dmin, dx);
  }
  // T = 1: the n waiting super-blocks (lanes 0..n-1), dx their token's scales; lanes past n add
  // zero products (S = M = 0, scales 0), which leave their partials as they are.
  inline void flush(int n, const float* dx) {
    alignas(32) float dxs[8] = {};
    for (int l = 0; l < 8; ++l) {
      if (l < n) dxs[l] = dx[l];
      else sv[l] = mv[l] = _mm256_setzero_si256(), d[l] = dmin[l] = 0.0f;
    }
    acc[0] = step(acc[0], lane_totals<8>(sv), lane_totals<8>(mv), _mm256_load_ps(d),
                  _mm256_load_ps(dmin), _mm256_load_ps(dxs));
  }
};

}  // namespace
}  // namespace minivllm_gguf_avx2
#endif  // __AVX2__

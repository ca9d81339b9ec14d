// gguf_linear on AVX2 CPUs (x86-64-v3: AVX2, FMA, F16C, no AVX-512) with 8-bit integer dots, as
// ggml's CPU backend does (llama.cpp ggml-cpu, arch/x86/quants.c: ggml_vec_dot_q4_1_q8_1,
// ggml_vec_dot_q4_K_q8_K, ggml_vec_dot_q6_K_q8_K and their siblings).
//
// Why integers. AVX2 has no bf16 dot and 8 float lanes: a float32 FMA does 8 products. The weights'
// quants are small integers already, so x is rounded once per call to 8-bit blocks and the block
// products are `_mm256_maddubs_epi16` (u8 x s8, 32 products into 16 int16 pair sums) then
// `_mm256_madd_epi16` (pairs into 8 int32, optionally times a sub-block scale): 32 products per
// instruction pair, and the float scales are applied once per block, not once per weight. Nothing
// is dequantized to float32. The price is x's rounding, bounded and tested:
//   |out - x · Wᵀ| <= Σ_blocks Σ_k |w_k| · (max|x_block| / 127) / 2   (plus float32 rounding)
//
// x's blocks (`quantize_tokens`), as ggml's Q8_1 / Q8_K (symmetric, one float scale, no zero point):
//   32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)   per 32:  dx = max|x| / 127, xq = rint(x / dx),
//                                                              sx = dx · Σ xq   (for the offsets)
//   K-quants (Q4_K, Q5_K, Q6_K)                       per 256: dx, xq[256], bsums[16] = Σ of each 16
// rint rounds half to even; xq = rint(x · (127 / max|x|)) exactly as written, so that the tests'
// numpy reference of this scheme rounds every element the same way.
//
// The weights. Each thread unpacks a group of weight rows once into a per-thread buffer
// (std::vectors): every quant as one byte in x's order, and the block's scales beside it. Then
// register tiles of R rows x T tokens run over the buffer, so that a 32-byte load of weights serves
// T tokens and a load of x serves R rows; token panels keep the x rows that the tiles reread in L2.
// The int8 buffer is a quarter of the float32 scratch that dequantize-then-multiply would write.
// The K-quants' buffer interleaves 8 rows, one a lane (cpu_gguf_krows_avx2.h's `tile_octet`): x's
// 4 bytes broadcast against 4 weights of each row, products summed in int16 before their scale,
// and no horizontal sums; so does the unsigned 32-weight types' (cpu_gguf_rows32_avx2.h's
// `tile_octet32`). Q8_0 keeps the row-major buffer (`tile32`).
// At decode's few token rows (kInRegisterTokens) every type skips the buffer: writing and
// rereading it costs more than the packed weight's own bytes, so each block is unpacked in
// registers and dotted at once (tileK_in_registers here, tile32_in_registers in
// cpu_gguf_block32_avx2.h), with the same int32 lanes and float steps as the buffered tile: a
// row's output does not depend on the batch size.
// The file's parts: x's 8-bit blocks (cpu_gguf_xq_avx2.h, shared with the AMX kernel), the
// tiles' shared helpers (cpu_gguf_tile_avx2.h), the K-quants' unpacking
// (cpu_gguf_kquant_avx2.h) and many-token tile (cpu_gguf_krows_avx2.h), the 32-weight types'
// unpacking and tiles (cpu_gguf_block32_avx2.h) and many-token tile (cpu_gguf_rows32_avx2.h),
// VNNI's own Q8_0 kernel (cpu_gguf_q8_0_vnni.h);
// here the K-quants' decode tile and the linears.
//
// Threads split the weight rows (at::parallel_for); inside the parallel regions only raw pointers
// and std::vector are touched: ATen ops there would run without the caller's InferenceMode.
// AVX2 builds run it as gguf_linear. AVX-512 builds compile it too, for gguf_linear_int8 on CPUs
// with AVX512-VNNI (cpu_gguf_gemm.cpp checks the CPU): there everything from the kernel header on
// carries the avx512vnni target (`#pragma GCC target`), and each 32-byte dot is one VNNI
// instruction (`dot4`: vpdpbusd; `dot32`: maddubs then vpdpwssd) that gives the int32 lanes of
// AVX2's maddubs/madd pair, exactly: maddubs's int16 pair sums cannot saturate for these quants,
// so the outputs equal the AVX2 build's for the same x and weights. The K-quants' in-register
// tiles dot two 32-byte chunks an instruction there (512 bits, `dot512`), but fold each
// super-block's lanes back to AVX2's 8 before the float steps (cpu_gguf_kfloat_avx2.h), which
// stay 256 bits wide: the same outputs. On both, the K-quants' in-register tile holds all 8
// decode tokens at once. Q8_0 on VNNI has a kernel of its own
// (`linearQ8_0`: its bytes dotted where they lie, at every M), whose float steps are its own, so
// its outputs differ from the AVX2 build's within the bound below (and are batch-invariant).
// tests/cpu/test_kernels_cpu_gguf.py holds this to a numpy model of the same integer scheme and
// to the float product within the bound above.

#include "cpu_gguf_blocks.h"

#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#if defined(__AVX512F__)
#define MINIVLLM_INT8_VNNI 1
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#endif
#include "cpu_gguf_kquant_avx2.h"
#include "cpu_gguf_xq_avx2.h"
#include "cpu_gguf_tile_avx2.h"
#include "cpu_gguf_krows_avx2.h"
#include "cpu_gguf_block32_avx2.h"
#include "cpu_gguf_rows32_avx2.h"
#include "cpu_gguf_q8_0_vnni.h"

namespace minivllm_gguf_avx2 {
namespace {

// ------------------------------------------------------------------------------ K-quant tiles

// The same outputs as tile_octet (cpu_gguf_krows_avx2.h), for rows [0, rows) of packed blocks w (row stride row_bytes) and
// tokens [t0, t0 + T), with every super-block unpacked in registers (X::dot) and dotted into the
// T tokens at once: no buffer is written or reread. Each row's weight bytes are read once, in
// order, so that a thread's rows are one stream that the hardware prefetcher follows.
template <class X, int T>
void tileK_in_registers(const uint8_t* w, int64_t row_bytes, int64_t rows, const Tokens& x,
                        int64_t t0, float* out, int64_t ldo) {
  const int64_t K = x.K, ns = x.blocks;
  const int8_t* xq = x.xq.data() + t0 * K;
  const float* dx = x.dx.data() + t0 * ns;
  const int16_t* bsums = x.bsums.data() + t0 * ns * 16;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    KSums<X, T> acc;
    for (int64_t s = 0; s < ns; ++s) {
      prefetch_ahead<X::Q::kBytes>(wr + s * X::Q::kBytes);
      __m256i sumi[T];
      for (int t = 0; t < T; ++t) sumi[t] = _mm256_setzero_si256();
#if defined(MINIVLLM_INT8_VNNI)
      const KScales k = X::template dot512<T>(wr + s * X::Q::kBytes, xq + 256 * s, K, sumi);
#else
      const KScales k = X::template dot<T>(wr + s * X::Q::kBytes, xq + 256 * s, K, sumi);
#endif
      acc.add(s, ns, sumi, k, bsums + s * 16, ns * 16, dx + s, ns);
    }
    acc.finish(out + r, ldo);
  }
}

// ------------------------------------------------------------------------------ the linear
constexpr int kTokens = 4;                   // tokens per register tile
constexpr int64_t kPanelBytes = 64 * 1024;   // x rows (int8) that the tiles reread: kept in L2
constexpr int64_t kGroupBytes = 128 * 1024;  // a thread's unpacked rows (1 to 2.2 bytes a weight)
// At up to kInRegisterTokens token rows every type skips the buffer (tileK_in_registers,
// tile32_in_registers): unpacking again for every tile of tokens costs less than writing and
// rereading the unpacked rows. Work items of kInRegisterRows rows, whose packed bytes stay in L2
// while each token tile rereads them.
constexpr int64_t kInRegisterTokens = 8, kInRegisterRows = 16;
// Tokens per in-register tile of the 32-weight types: AVX-512's 32 vector registers hold all 8
// tokens' sums, so that each block is unpacked once a step; AVX2's 16 hold 4. The K-quants' tile
// holds 8 tokens on AVX2 too (kInRegisterTileK): 8 int32 sums, a 32-byte chunk's two unpacked
// halves and their two scale vectors fit 16 registers, x is a memory operand of each dot, and
// each super-block is unpacked once a step instead of once per 4 tokens.
#if defined(MINIVLLM_INT8_VNNI)
constexpr int kInRegisterTile = 8;
#else
constexpr int kInRegisterTile = 4;
#endif
constexpr int kInRegisterTileK = 8;

// f(integral_constant<T>) for the next in-register tile's token count T = min(n, kMax).
template <int kMax, class F>
void with_tile_tokens(int64_t n, F&& f) {
  switch (std::min<int64_t>(kMax, n)) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4 <= kMax ? 4 : 1>{});
    case 5: return f(std::integral_constant<int, 5 <= kMax ? 5 : 1>{});
    case 6: return f(std::integral_constant<int, 6 <= kMax ? 6 : 1>{});
    case 7: return f(std::integral_constant<int, 7 <= kMax ? 7 : 1>{});
    default: return f(std::integral_constant<int, kMax>{});
  }
}

// Rows per work item: a buffer of about kGroupBytes, a multiple of 4, in a number of items that
// splits evenly over the threads.
int64_t group_rows(int64_t N, int64_t K, int64_t bytes_per_weight) {
  const int64_t threads = at::get_num_threads();
  const int64_t target = std::clamp<int64_t>(kGroupBytes / (bytes_per_weight * K), 4, 256);
  const int64_t groups = threads * ((N + threads * target - 1) / (threads * target));
  return (std::max<int64_t>(1, (N + groups - 1) / groups) + 3) / 4 * 4;
}

// The K-quants' many-token tiles (tile_octet): tokens a tile, x's bytes a token panel kept in L2,
// and a work item's packed octets (about kOctetGroupBytes, also kept in L2).
constexpr int kOctetTokens = 4;  // 4 int32 sums and 4 int16 ones live; 6 measured no faster, 8 slower
constexpr int64_t kOctetPanelBytes = 256 * 1024, kOctetGroupBytes = 256 * 1024;
// Rows per work item: whole octets of about kOctetGroupBytes, in a number of items that splits
// evenly over the threads.
int64_t octet_group_rows(int64_t N, int64_t octet_bytes) {
  const int64_t threads = at::get_num_threads(), octets = (N + kOctet - 1) / kOctet;
  const int64_t target = std::max<int64_t>(1, kOctetGroupBytes / octet_bytes);
  const int64_t groups = threads * ((octets + threads * target - 1) / (threads * target));
  return kOctet * std::max<int64_t>(1, (octets + groups - 1) / groups);
}

// The tiles over one group of unpacked rows: token panels of x that stay in L2; in a panel, each
// R rows (their buffer in L1) against every tile of kTokens tokens. `tile(r0, rows, t0, T)` runs
// the register tile of rows [r0, r0 + rows) and tokens [t0, t0 + T).
template <int R, class Tile>
void over_group(int64_t rows, int64_t M, int64_t K, Tile&& tile) {
  const int64_t panel = std::max<int64_t>(kTokens, kPanelBytes / K / kTokens * kTokens);
  for (int64_t p0 = 0; p0 < M; p0 += panel) {
    const int64_t p1 = std::min(M, p0 + panel);
    for (int64_t r0 = 0; r0 < rows; r0 += R)
      for (int64_t t0 = p0; t0 < p1; t0 += kTokens) {
        const int64_t n = std::min<int64_t>(R, rows - r0);
        switch (std::min<int64_t>(kTokens, p1 - t0)) {
          case 1: tile(std::integral_constant<int, 1>{}, r0, n, t0); break;
          case 2: tile(std::integral_constant<int, 2>{}, r0, n, t0); break;
          case 3: tile(std::integral_constant<int, 3>{}, r0, n, t0); break;
          default: tile(std::integral_constant<int, 4>{}, r0, n, t0); break;
        }
      }
  }
}

// Decode's few token rows (M <= kInRegisterTokens), for every type but VNNI's Q8_0: work items
// of kInRegisterRows weight rows against every tile of up to kTile tokens, each block unpacked in
// registers (`tile(integral_constant<int, T>, w, row_bytes, rows, x, t0, out, ldo)`:
// tileK_in_registers, rows32_in_registers).
template <int kTile, class Tile>
void linear_in_registers(float* out, const Tokens& tok, const uint8_t* w, int64_t M, int64_t N, int64_t row_bytes,
                         Tile&& tile) {
  at::parallel_for(0, (N + kInRegisterRows - 1) / kInRegisterRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin * kInRegisterRows; n0 < std::min(N, end * kInRegisterRows); n0 += kInRegisterRows) {
      const int64_t rows = std::min(kInRegisterRows, N - n0);
      for (int64_t t0 = 0; t0 < M; t0 += kTile)
        with_tile_tokens<kTile>(M - t0, [&](auto t_) {
          tile(t_, w + n0 * row_bytes, row_bytes, rows, tok, t0, out + t0 * N + n0, N);
        });
    }
  });
}

// The octet tiles past the in-register tokens, for the K-quants (tile_octet) and the unsigned
// 32-weight types (tile_octet32) alike: work items of G rows packed octet by octet
// (`pack(w, row_bytes, rows, blocks, dst)`, kOctetBlockBytes bytes an octet per block of x), then
// token panels that stay in L2 against each octet, kOctetTokens tokens a tile
// (`tile(integral_constant<int, T>, octet, blocks, rows, x, t0, out, ldo)`).
template <class X, int64_t kOctetBlockBytes, class Pack, class Tile>
void linear_octets(float* out, const Tokens& tok, const uint8_t* w, int64_t M, int64_t N, Pack&& pack,
                   Tile&& tile) {
  const int64_t nb = tok.blocks, row_bytes = nb * X::Q::kBytes, octet_bytes = nb * kOctetBlockBytes;
  const int64_t G = octet_group_rows(N, octet_bytes);
  const int64_t panel = std::max<int64_t>(kOctetTokens, kOctetPanelBytes / tok.ldq / kOctetTokens * kOctetTokens);
  at::parallel_for(0, (N + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> pk(G / kOctet * octet_bytes);  // [G / 8][nb][kOctetBlockBytes]
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * G, rows = std::min(G, N - n0), octets = (rows + kOctet - 1) / kOctet;
      for (int64_t o = 0; o < octets; ++o)
        pack(w + (n0 + kOctet * o) * row_bytes, row_bytes, std::min<int64_t>(kOctet, rows - kOctet * o), nb,
             pk.data() + o * octet_bytes);
      for (int64_t p0 = 0; p0 < M; p0 += panel) {
        const int64_t p1 = std::min(M, p0 + panel);
        for (int64_t o = 0; o < octets; ++o)
          for (int64_t t0 = p0; t0 < p1; t0 += kOctetTokens)
            with_tile_tokens<kOctetTokens>(p1 - t0, [&](auto t_) {
              tile(t_, pk.data() + o * octet_bytes, nb, std::min<int64_t>(kOctet, rows - kOctet * o), tok, t0,
                   out + t0 * N + n0 + kOctet * o, N);
            });
      }
    }
  });
}

template <class X>
void linear32(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N,
              int64_t K) {
  using Q = typename X::Q;
  const Tokens tok = quantize_tokens(x, ldx, M, K, 32);
  const int64_t nb = K / 32, nbp = padded8(nb), ldq = padded64(K), row_bytes = nb * Q::kBytes;
  if (M <= kInRegisterTokens) {
    linear_in_registers<kInRegisterTile>(out, tok, w, M, N, row_bytes, [](auto t_, auto&&... a) {
      rows32_in_registers<X, decltype(t_)::value>(a...);
    });
    return;
  }
  if constexpr (!X::kSigned) {  // the unsigned types: octets of interleaved rows (tile_octet32)
    linear_octets<X, kOctetBytes32>(
        out, tok, w, M, N, [](auto... a) { pack_octet32<X>(a...); },
        [](auto t_, auto&&... a) { tile_octet32<X, decltype(t_)::value>(a...); });
    return;
  }
  // Q8_0 past the in-register tokens: 2 weight rows x 4 tokens a register tile (8 float sums).
  constexpr int R = 2;
  const int64_t G = group_rows(N, K, R);
  at::parallel_for(0, (N + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> q(G * ldq, 0);  // [G][padded64(K)] this thread's rows, a byte a weight
    std::vector<float> A(G * nbp, 0.0f), B(G * nbp, 0.0f);  // [G][padded8(K / 32)]
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * G, rows = std::min(G, N - n0);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b)
          unpack<X>(w + (n0 + r) * row_bytes + b * Q::kBytes, q.data() + r * ldq + 32 * b,
                    A[r * nbp + b], B[r * nbp + b]);
      over_group<R>(rows, M, K, [&](auto t_, int64_t r0, int64_t n, int64_t t0) {
        const Rows32 rw{q.data() + r0 * ldq, A.data() + r0 * nbp, B.data() + r0 * nbp};
        tile32<X, R, decltype(t_)::value>(rw, n, tok, t0, out + t0 * N + n0 + r0, N);
      });
    }
  });
}

template <class X>
void linearK(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N,
             int64_t K) {
  using Q = typename X::Q;
  const Tokens tok = quantize_tokens(x, ldx, M, K, 256);
  const int64_t ns = K / 256, row_bytes = ns * Q::kBytes;
  if (M <= kInRegisterTokens) {
    linear_in_registers<kInRegisterTileK>(out, tok, w, M, N, row_bytes, [](auto t_, auto&&... a) {
      tileK_in_registers<X, decltype(t_)::value>(a...);
    });
    return;
  }
  linear_octets<X, kOctetBytes<X>>(
      out, tok, w, M, N, [](auto... a) { pack_octet<X>(a...); },
      [](auto t_, auto&&... a) { tile_octet<X, decltype(t_)::value>(a...); });
}

}  // namespace

// out[M, N] (contiguous) = x[M, K] (row stride ldx) · Wᵀ for GGUF blocks w [N, row_bytes] of a
// type that cpu_gguf_gemm.cpp's gguf_linear has checked (its GGML number, shapes and M, N > 0).
void gguf_linear_int8(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M,
                      int64_t N, int64_t K, int64_t qtype) {
  switch (qtype) {
    case Q4_0::kType: return linear32<Q4_0x>(out, x, ldx, w, M, N, K);
    case Q4_1::kType: return linear32<Q4_1x>(out, x, ldx, w, M, N, K);
    case Q5_0::kType: return linear32<Q5_0x>(out, x, ldx, w, M, N, K);
    case Q5_1::kType: return linear32<Q5_1x>(out, x, ldx, w, M, N, K);
#if defined(MINIVLLM_INT8_VNNI)
    case Q8_0::kType: return linearQ8_0(out, x, ldx, w, M, N, K);
#else
    case Q8_0::kType: return linear32<Q8_0x>(out, x, ldx, w, M, N, K);
#endif
    case Q4_K::kType: return linearK<Q4_Kx>(out, x, ldx, w, M, N, K);
    case Q5_K::kType: return linearK<Q5_Kx>(out, x, ldx, w, M, N, K);
    case Q6_K::kType: return linearK<Q6_Kx>(out, x, ldx, w, M, N, K);
    default: TORCH_CHECK(false, "gguf_linear_int8: GGML type ", qtype, " is not supported");
  }
}

}  // namespace minivllm_gguf_avx2
#if defined(__AVX512F__)
#pragma GCC pop_options
#endif
#endif  // __AVX2__
// The K-quants' int8 product (gguf_linear_int8) for prefill-sized calls on Intel AMX tiles, with
// every output bit for bit the AVX512-VNNI kernel's (cpu_gguf_gemm_avx2.cpp), hence batch-invariant.
//
// Why it can be exact. The int8 product rounds x to 8-bit blocks (cpu_gguf_xq_avx2.h, the same
// code here) and, per super-block of 256 weights, sums integer products before any float step
// (cpu_gguf_kfloat_avx2.h `KSums`):
//   S = Σ_g sc_g · Σ_{k in g} q_k · xq_k     M = Σ_j mn_j · bsums_j     (whole integers)
//   p = fma(S, d · dx, p); p = fma(-M, dmin · dx, p)     (Q6_K: fma(S - M, d · dx, p))
// into the output's partial p number s mod 8, and the 8 partials' fixed tree at the end
// (cpu_gguf_kfloat_avx2.h).
// An integer sum is the same in any order, so AMX's TDPBSUD / TDPBSSD (16 tokens x 16 weight rows
// x 64 bytes an instruction, int32 sums) may compute S for a whole tile of tokens and rows at once;
// AVX-512 then adds the mins (vpdpwssd) and runs the same float steps, in the same super-block
// order, vectorized over 16 weight rows instead of over tokens. llama.cpp's AMX backend
// (ggml-cpu/amx/mmq.cpp) also tiles its K-quants on TDPB*, with its own float steps.
//
// The scales inside S. sc_g multiplies its group's sum (32 weights for Q4_K and Q5_K, 16 for
// Q6_K) before the super-block's, and q · sc does not fit a byte; so each scale is split into
// parts of a few bits, sc = Σ_p part_p << (bits · p), and the packed weights hold q · part_p, one
// copy per part (Q4_K, Q5_K: 2 parts of 3 bits, q · 7 <= 217 unsigned, TDPBSUD; Q6_K: 4 parts of
// 2 bits on q - 32, the top part signed, TDPBSSD, which folds Q6_K's offset and gives S - M).
// One tile product per part and 64-byte step then sums the whole super-block, and
// S = Σ_p C_p << (bits · p): a shift and an add per part, no per-group multiply.
// Q4_K and Q5_K keep their mins apart: M = Σ_c m_c · (Σ xq over sub-block c), a vpdpwssd per two
// sub-blocks.
//
// Layout. Threads split the weight rows in items of a few blocks of 32 (two tiles of 16 columns
// sharing each x tile); a thread unpacks its blocks once (the VNNI kernel's `unpack`, then one
// gather per 16 rows x 4 bytes) into the tiles' layout, then runs L2-sized panels of x (token rows
// past M are zeros) over them, 16 tokens a tile.
// The tile registers are configured per thread (LDTILECFG is thread state), and only raw pointers
// and std::vector are touched in the parallel region. Linux lends the tile registers to a
// process that asks (arch_prctl ARCH_REQ_XCOMP_PERM), once; `gguf_has_amx` asks, and is false on
// CPUs without AMX-INT8 or kernels that refuse, where the VNNI kernel runs instead.
// tests/cpu/test_kernels_cpu_gguf_amx.py holds every output to the VNNI kernel's, bit for bit.
// Q4_0, Q4_1, Q5_0 and Q5_1 run the same idea per block of 32 weights (cpu_gguf_amx32.h, included
// below): whole-block integer sums from 32-byte tile products, then the VNNI kernel's float steps.

#include "cpu_gguf_blocks.h"

#include <vector>

#if defined(__AVX512F__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define MINIVLLM_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#pragma GCC push_options
#pragma GCC target("avx512vnni,amx-tile,amx-int8")
#include "cpu_amx_tiles.h"
#define MINIVLLM_INT8_VNNI 1
#include "cpu_gguf_kquant_avx2.h"
#include "cpu_gguf_xq_avx2.h"
#include "cpu_gguf_tile_avx2.h"
#include "cpu_gguf_block32_avx2.h"

namespace minivllm_gguf_amx {
namespace {

using minivllm_gguf_avx2::KBlock;
using minivllm_gguf_avx2::Tokens;
using minivllm_gguf_avx2::partials_tree;

// The tiles (minivllm_amx::configure_tiles: every tile 16 rows x 64 bytes): 0..3 int32 products
// [16 tokens][16 weight rows], 4 16 tokens x 64 bytes of xq, 5..7 16 rows of 16 weight rows x 4
// bytes.
constexpr int64_t kRows = 32;  // weight rows per block: two tiles' columns
constexpr int64_t kItemBytes = 256 * 1024;   // a work item's blocks in the tiles' layout
constexpr int64_t kPanelBytes = 512 * 1024;  // token rows of xq that the item's blocks reread

// The per-type facts: G, the weights of a scale group; kParts, the scale's parts of kBits bits
// (sc = Σ_p part_p << (kBits · p), the top part signed); whether q goes in as q - 32 (Q6_K).
template <class X> struct Amx {
  static constexpr int G = 32, kParts = 2, kBits = 3;  // sc in 0..63; q · 7 <= 217, a u8
  static constexpr bool kSigned = false;
};
template <> struct Amx<minivllm_gguf_avx2::Q6_Kx> {
  static constexpr int G = 16, kParts = 4, kBits = 2;  // sc in -128..127; (q - 32) · 3 a s8
  static constexpr bool kSigned = true;
};

// A block of kRows weight rows in the tiles' layout, ns super-blocks:
//   q  [ns][4 steps of 64][kParts][2][16][16][4]  bytes: q_k · part_p(sc of k's group), for weight
//       rows 0..15 and 16..31, dword k / 4 of the step, row, byte k % 4 (q - 32 for Q6_K)
//   mn [ns][4][2][16][2]  int16, mins of sub-blocks 2i, 2i + 1 (Q4_K, Q5_K)
//   d, dmin [ns][2][16]   float
// So one tile product per part and step gives Σ_k xq_k · q_k · part_p over the super-block, and
// S = Σ_p (that << kBits · p), every product exact within a byte.
template <class X>
struct WeightBlock {
  static constexpr int G = Amx<X>::G, NG = 256 / G, P = Amx<X>::kParts;
  std::vector<uint8_t> q;
  std::vector<int16_t> mn;
  std::vector<float> d, dmin;
  explicit WeightBlock(int64_t ns) : q(ns * 256 * P * kRows), mn(ns * 8 * kRows), d(ns * kRows), dmin(ns * kRows) {}

  // Rows [0, rows) of packed blocks w (row stride row_bytes); rows past them are zeros. Each
  // super-block of 16 rows is unpacked in weight order (qb), then turned into the tiles' layout
  // 16 rows x 4 bytes at a time (one gather), times each part of the rows' scales.
  void pack(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t ns) {
    alignas(64) uint8_t qb[16][256];
    alignas(64) int32_t scale[NG][16];  // [group][row]
    alignas(32) int16_t scb[128], mnb[16];
    float db, dminb;
    const __m512i row_at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(64));
    const __m512i low_bytes = _mm512_set1_epi16(0x00FF);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t s = 0; s < ns; ++s) {
        for (int64_t nn = 0; nn < 16; ++nn) {
          const int64_t n = 16 * h + nn;
          if (n >= rows) {
            std::memset(qb[nn], Amx<X>::kSigned ? 32 : 0, 256);
            for (int g = 0; g < NG; ++g) scale[g][nn] = 0;
            continue;
          }
          X::unpack(w + n * row_bytes + s * X::Q::kBytes, KBlock{qb[nn], scb, mnb, &db, &dminb});
          for (int g = 0; g < NG; ++g)  // chunk (g·G)/32's 16 int16 scales: 8 per 16 weights
            scale[g][nn] = scb[(g * G / 32) * 16 + (g * G % 32) / 2];
          for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 2; ++j) mn[(((s * 4 + i) * 2 + h) * 16 + nn) * 2 + j] = mnb[2 * (2 * i + j)];
          d[(s * 2 + h) * 16 + nn] = db, dmin[(s * 2 + h) * 16 + nn] = dminb;
        }
        for (int k4 = 0; k4 < 64; ++k4) {  // bytes 4 k4 .. 4 k4 + 3 of the 16 rows
          __m512i v = _mm512_i32gather_epi32(row_at, reinterpret_cast<const int*>(&qb[0][0]) + k4, 4);
          if (Amx<X>::kSigned) v = _mm512_sub_epi8(v, _mm512_set1_epi8(32));
          // each byte as an int16 (signed: q - 32, or q < 128), even bytes and odd apart
          const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), odd = _mm512_srai_epi16(v, 8);
          const __m512i sc = _mm512_load_si512(scale[4 * k4 / G]);
          for (int p = 0; p < P; ++p) {
            __m512i part = _mm512_srai_epi32(sc, Amx<X>::kBits * p);  // the top part keeps the sign
            if (p + 1 < P) part = _mm512_and_si512(part, _mm512_set1_epi32((1 << Amx<X>::kBits) - 1));
            part = _mm512_or_si512(_mm512_and_si512(part, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(part, 16));
            const __m512i bytes = _mm512_or_si512(_mm512_and_si512(_mm512_mullo_epi16(even, part), low_bytes),
                                                  _mm512_slli_epi16(_mm512_mullo_epi16(odd, part), 8));
            _mm512_storeu_si512(q.data() + ((((s * 4 + k4 / 16) * P + p) * 2 + h) * 16 + k4 % 16) * 64, bytes);
          }
        }
      }
  }
  const uint8_t* B(int64_t s, int step, int p, int h) const {
    return q.data() + (((s * 4 + step) * P + p) * 2 + h) * 1024;
  }
};

// The end of every AMX tile (`tile` here, block32_tile in cpu_gguf_amx32.h): each token's 8
// partials of weight rows 0..15 and 16..31 (acc [weight rows / 16][token][partial]) through the
// fixed tree, stored by mask to out[t · ldo + n] for tokens t < tokens and rows n < rows.
inline void store_block(const __m512 (&acc)[2][16][8], int64_t rows, int64_t tokens, float* out, int64_t ldo) {
  const __mmask16 lo = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
  const __mmask16 hi = rows >= 32 ? __mmask16(0xFFFF) : rows <= 16 ? 0 : __mmask16((1u << (rows - 16)) - 1);
  const auto add = [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); };
  for (int64_t t = 0; t < tokens; ++t) {
    _mm512_mask_storeu_ps(out + t * ldo, lo, partials_tree(acc[0][t], add));
    _mm512_mask_storeu_ps(out + t * ldo + 16, hi, partials_tree(acc[1][t], add));
  }
}

// out[t · ldo + n] for tokens t < tokens (<= 16, from token row m0 of xq) and weight rows
// n < rows (<= kRows) of the packed block.
template <class X>
void tile(const WeightBlock<X>& w, int64_t rows, const Tokens& x, const int32_t* bx, int64_t m0,
          int64_t tokens, int64_t ns, float* out, int64_t ldo) {
  const int64_t K = x.K;
  alignas(64) int32_t D[2][4][16][16];  // [weight rows / 16][part][token][weight row]
  __m512 acc[2][16][8];  // [weight rows / 16][token][partial s mod 8] (cpu_gguf_kfloat_avx2.h)
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 16; ++t)
      for (int l = 0; l < 8; ++l) acc[h][t][l] = _mm512_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
    const int8_t* xs = x.xq.data() + m0 * K + 256 * s;
    if (Amx<X>::kParts == 2) {  // Q4_K, Q5_K: tiles 2 p + h, both halves against each x tile
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int step = 0; step < 4; ++step) {
        _tile_loadd(4, xs + 64 * step, K);
        _tile_loadd(5, w.B(s, step, 0, 0), 64);
        _tile_loadd(6, w.B(s, step, 0, 1), 64);
        _tile_loadd(7, w.B(s, step, 1, 0), 64);
        _tile_dpbsud(0, 4, 5);
        _tile_dpbsud(1, 4, 6);
        _tile_dpbsud(2, 4, 7);
        _tile_loadd(5, w.B(s, step, 1, 1), 64);
        _tile_dpbsud(3, 4, 5);
      }
      _tile_stored(0, D[0][0], 64); _tile_stored(1, D[1][0], 64);
      _tile_stored(2, D[0][1], 64); _tile_stored(3, D[1][1], 64);
    } else {  // Q6_K: tiles p, one half at a time
      for (int h = 0; h < 2; ++h) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int step = 0; step < 4; ++step) {
          _tile_loadd(4, xs + 64 * step, K);
          _tile_loadd(5, w.B(s, step, 0, h), 64);
          _tile_loadd(6, w.B(s, step, 1, h), 64);
          _tile_loadd(7, w.B(s, step, 2, h), 64);
          _tile_dpbssd(0, 4, 5);
          _tile_dpbssd(1, 4, 6);
          _tile_dpbssd(2, 4, 7);
          _tile_loadd(5, w.B(s, step, 3, h), 64);
          _tile_dpbssd(3, 4, 5);
        }
        _tile_stored(0, D[h][0], 64); _tile_stored(1, D[h][1], 64);
        _tile_stored(2, D[h][2], 64); _tile_stored(3, D[h][3], 64);
      }
    }
    // S per token and weight row, then the float steps of `KSums`, 16 weight rows a vector
    for (int h = 0; h < 2; ++h) {
      const __m512 dv = _mm512_loadu_ps(w.d.data() + (s * 2 + h) * 16);
      const __m512 dminv = _mm512_loadu_ps(w.dmin.data() + (s * 2 + h) * 16);
      __m512i mn[4];
      for (int i = 0; i < 4; ++i) mn[i] = _mm512_loadu_si512(w.mn.data() + ((s * 4 + i) * 2 + h) * 32);
      for (int t = 0; t < 16; ++t) {
        __m512i S = _mm512_load_si512(D[h][0][t]);
        for (int p = 1; p < Amx<X>::kParts; ++p)
          S = _mm512_add_epi32(S, _mm512_slli_epi32(_mm512_load_si512(D[h][p][t]), Amx<X>::kBits * p));
        const __m512 dx = _mm512_set1_ps(x.dx[(m0 + t) * ns + s]);
        __m512& p = acc[h][t][s % 8];
        p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(dv, dx), p);
        if (!X::kFoldMins) {
          __m512i M = _mm512_setzero_si512();
          for (int i = 0; i < 4; ++i)
            M = _mm512_dpwssd_epi32(M, _mm512_set1_epi32(bx[((m0 + t) * ns + s) * 4 + i]), mn[i]);
          p = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(M), _mm512_mul_ps(dminv, dx), p);
        }
      }
    }
  }
  store_block(acc, rows, tokens, out, ldo);
}

// The AMX kernels' work (`linear` here, linear32 in cpu_gguf_amx32.h): threads split the weight
// rows in items of a few blocks of kRows rows (`Block(blocks of x)`, item_row_bytes a row in the
// tiles' layout: the item's blocks stay in L2), each packed once (`Block::pack`), then run over
// panels of x that stay in L2 while every block of the item rereads them, 16 token rows a tile:
// `tile(block, rows, m0, tokens, out + m0 · N + n0)`. `configure` sets the thread's tiles.
template <class Block, class Configure, class Tile>
void over_blocks(float* out, const uint8_t* w, int64_t M, int64_t N, const Tokens& tok, int64_t row_bytes,
                 int64_t item_row_bytes, Configure&& configure, Tile&& tile) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t per_item = std::clamp<int64_t>(kItemBytes / (kRows * item_row_bytes), 1, 16);
  const int64_t panel = std::max<int64_t>(16, kPanelBytes / tok.ldq / 16 * 16);
  at::parallel_for(0, (blocks + per_item - 1) / per_item, 1, [&](int64_t begin, int64_t end) {
    configure();
    std::vector<Block> wb(per_item, Block(tok.blocks));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b0 = item * per_item, b1 = std::min(blocks, b0 + per_item);
      for (int64_t b = b0; b < b1; ++b)
        wb[b - b0].pack(w + b * kRows * row_bytes, row_bytes, std::min(kRows, N - b * kRows), tok.blocks);
      for (int64_t p0 = 0; p0 < M; p0 += panel)
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n0 = b * kRows, rows = std::min(kRows, N - n0);
          for (int64_t m0 = p0; m0 < std::min(M, p0 + panel); m0 += 16)
            tile(wb[b - b0], rows, m0, std::min<int64_t>(16, M - m0), out + m0 * N + n0);
        }
    }
    _tile_release();
  });
}

template <class X>
void linear(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N, int64_t K) {
  using Q = typename X::Q;
  const int64_t ns = K / 256, row_bytes = ns * Q::kBytes, Mp = (M + 15) / 16 * 16;
  Tokens tok = minivllm_gguf_avx2::quantize_tokens(x, ldx, M, K, 256);
  tok.xq.resize(Mp * K, 0), tok.dx.resize(Mp * ns, 0.0f), tok.bsums.resize(Mp * ns * 16, 0);
  // Σ xq over each sub-block of 32, two sub-blocks an int32 as vpdpwssd pairs them: [Mp][ns][4]
  std::vector<int32_t> bx(Mp * ns * 4);
  for (int64_t i = 0; i < Mp * ns * 4; ++i) {
    const int16_t* b = tok.bsums.data() + 4 * i;
    bx[i] = int32_t(uint16_t(b[0] + b[1])) | int32_t(uint32_t(uint16_t(b[2] + b[3])) << 16);
  }
  over_blocks<WeightBlock<X>>(
      out, w, M, N, tok, row_bytes, Amx<X>::kParts * K, [] { minivllm_amx::configure_tiles(); },
      [&](const WeightBlock<X>& wb, int64_t rows, int64_t m0, int64_t tokens, float* o) {
        tile<X>(wb, rows, tok, bx.data(), m0, tokens, ns, o, N);
      });
}

#include "cpu_gguf_amx32.h"

}  // namespace

// AMX-INT8 on this CPU, and the tile registers granted to this process by Linux (asked once).
bool has_amx() {
  static const bool has = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), int8 = d & (1u << 25), vnni = c & (1u << 11);
    return tile && int8 && vnni && minivllm_amx::tile_data_granted();
  }();
  return has;
}

void linear_amx(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N,
                int64_t K, int64_t qtype) {
  switch (qtype) {
    case Q4_K::kType: return linear<minivllm_gguf_avx2::Q4_Kx>(out, x, ldx, w, M, N, K);
    case Q5_K::kType: return linear<minivllm_gguf_avx2::Q5_Kx>(out, x, ldx, w, M, N, K);
    case Q6_K::kType: return linear<minivllm_gguf_avx2::Q6_Kx>(out, x, ldx, w, M, N, K);
    case Q4_0::kType: return linear32<minivllm_gguf_avx2::Q4_0x>(out, x, ldx, w, M, N, K);
    case Q4_1::kType: return linear32<minivllm_gguf_avx2::Q4_1x>(out, x, ldx, w, M, N, K);
    case Q5_0::kType: return linear32<minivllm_gguf_avx2::Q5_0x>(out, x, ldx, w, M, N, K);
    case Q5_1::kType: return linear32<minivllm_gguf_avx2::Q5_1x>(out, x, ldx, w, M, N, K);
    default: TORCH_CHECK(false, "gguf_linear_amx: GGML type ", qtype, " has no AMX kernel (2, 3, 6, 7, 12, 13, 14)");
  }
}

}  // namespace minivllm_gguf_amx
#pragma GCC pop_options
#endif  // MINIVLLM_AMX

namespace {

bool gguf_has_amx() {
#if defined(MINIVLLM_AMX)
  return minivllm_gguf_amx::has_amx();
#else
  return false;
#endif
}

// out[M, N] = x[M, K] · Wᵀ on AMX tiles, for the K-quants and the 32-weight types but Q8_0; equal to gguf_linear_int8's out.
void gguf_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, int64_t qtype) {
  const char* op = "minivllm_cpu::gguf_linear_amx";
  TORCH_CHECK(gguf_has_amx(), op, ": this CPU (or this build, or the OS) has no AMX-INT8");
  TORCH_CHECK(qtype == 2 || qtype == 3 || qtype == 6 || qtype == 7 || qtype == 12 || qtype == 13 || qtype == 14,
              op, ": GGML type ", qtype, " has no AMX kernel (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 12 Q4_K, 13 Q5_K, 14 Q6_K)");
#if defined(MINIVLLM_AMX)
  with_type(qtype, op, [&](auto q) {
    using Q = decltype(q);
    const LinearShape shape = check_linear<Q>(out, x, qweight, op);
    const int64_t M = shape.M, N = shape.N, K = shape.K;
    if (M == 0 || N == 0) return;
    minivllm_gguf_amx::linear_amx(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0),
                                  qweight.data_ptr<uint8_t>(), M, N, K, qtype);
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("gguf_has_amx() -> bool", &gguf_has_amx);
  m.def("gguf_linear_amx(Tensor(a!) out, Tensor x, Tensor qweight, int qtype) -> ()", &gguf_linear_amx);
}

// The 32-weight types' int8 product (Q4_0, Q4_1, Q5_0, Q5_1: gguf_linear_int8) for prefill-sized
// calls on Intel AMX tiles, with every output bit for bit the AVX512-VNNI kernel's (`tile32`,
// cpu_gguf_block32_avx2.h), hence batch-invariant. Called by cpu_gguf_amx.cpp's op.
//
// What must match. `tile32` dots a pair of blocks (64 weights) into 8 int32 lanes, each the sum
// of 8 adjacent products (`pair_dot`: lanes | b 0-7, b 8-15, b+1 0-7, b+1 8-15 | b 16-23, b 24-31,
// b+1 16-23, b+1 24-31 |), and runs float steps on each lane apart:
//   acc_l = fma(float(S_l), A_l · dx_l, acc_l)   pair by pair, then   acc_l = fma(B_l, sx_l, acc_l)
// 8 blocks an FMA (the offsets), then one horizontal sum (`hsum`). Unlike the K-quants (whose
// super-block sums are whole before any float step, cpu_gguf_amx.cpp), the lanes here are
// eighths of a pair: an AMX product that summed a whole 64-byte step would be another number.
//
// So each lane is a column of its own. A tile product (TDPBSUD: 16 tokens x 16 columns x 64
// bytes, int32 sums) sums, for column c, the 64 bytes of x times the column's 64 bytes of B; here
// column c is (weight row 2g + c / 8, lane c % 8) and holds that row's quants only in the 8 bytes
// its lane sums, zeros elsewhere (`lane_of`). The product then gives every lane of two weight rows
// for 16 tokens, the same integers as `pair_dot` (exact in any order), in one row of 16 int32 per
// token: the two rows' lanes side by side, so that AVX-512 runs tile32's 256-bit float steps for
// both rows at once, lane for lane on the same operands. Seven of every eight bytes multiplied are
// zeros; the tiles still do 4x the useful products of VNNI's 32-byte dots, and the float steps
// (3 a token row per pair, as tile32's) bound the speed. Packing writes each tile row whole, one
// masked permute of the two rows' quants.
//
// Layout. Threads split the weight rows in items of blocks of 16 rows (8 groups of 2 rows); a
// thread packs an item's blocks once and runs L2-sized panels of x over them (token rows past M
// are zeros), 16 tokens and up to 4 pairs (4 accumulator tiles) at a time.
// Tile registers are thread state: configured per thread in the parallel region, which touches
// raw pointers and std::vector only. cpu_gguf_amx.cpp asks Linux for them (`has_amx`).
// tests/cpu/test_kernels_cpu_gguf_amx.py holds every output to the VNNI kernel's, bit for bit.

#include "cpu_gguf_blocks.h"

#include <vector>

#if defined(__AVX512F__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx512vnni,amx-tile,amx-int8")
#define MINIVLLM_INT8_VNNI 1
#include "cpu_gguf_kquant_avx2.h"
#include "cpu_gguf_xq_avx2.h"
#include "cpu_gguf_tile_avx2.h"
#include "cpu_gguf_block32_avx2.h"

namespace minivllm_gguf_amx {
namespace {

using minivllm_gguf_avx2::Tokens;

// LDTILECFG's 64 bytes: palette 1, then each tile's bytes per row and rows; every tile 16 x 64
// bytes: tiles 0..3 int32 sums [16 tokens][16 columns], 4 and 5 xq, 6 and 7 packed weights.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
void configure_tiles() {
  alignas(64) TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

constexpr int64_t kRows = 16;                // weight rows per block: 8 groups of 2
constexpr int64_t kItemBytes = 256 * 1024;   // a work item's packed blocks
constexpr int64_t kPanelBytes = 512 * 1024;  // token rows of xq that the item's blocks reread

// The lane of `pair_dot` that dword kd (bytes 4 kd .. 4 kd + 3) of a block pair's 64 bytes goes to.
constexpr int lane_of(int kd) {
  const int block = kd / 8, in_block = 4 * kd % 32;  // which block of the pair, byte in it
  return 4 * (in_block / 16) + 2 * block + (in_block % 16) / 8;
}

// A block of kRows weight rows, pairs = padded64(K) / 64 block pairs, nbp = padded8(K / 32):
//   q [8 groups][pairs][16 dwords][16 columns][4]  B tiles: column c is row 2g + c / 8's quants in
//       the dwords of lane c % 8 (two of the 16), zeros in the others
//   A [8][pairs][16]     the pair's scales in pair_lanes' order, row 2g then row 2g + 1
//   B [8][nbp / 8][16]   the offsets, 8 blocks of row 2g then the same 8 of row 2g + 1
struct WeightBlock {
  int64_t pairs, nbp;
  std::vector<uint8_t> q;
  std::vector<float> A, B;
  WeightBlock(int64_t pairs, int64_t nbp)
      : pairs(pairs), nbp(nbp), q(8 * pairs * 1024), A(8 * pairs * 16), B(8 * nbp * 2, 0.0f) {}

  // Rows [0, rows) of packed blocks w (row stride row_bytes); rows past them are zeros. A group's
  // pair is two 64-byte vectors of quants (rows 2g, 2g + 1, in weight order), and each of the
  // tile's 16 rows of 64 bytes (dword kd of every column) one masked permute of them: dword kd of
  // row 2g into column lane_of(kd), of row 2g + 1 into column 8 + lane_of(kd), zeros elsewhere.
  template <class X>
  void pack(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t nb) {
    using Q = typename X::Q;
    __m512i idx[16];
    __mmask16 keep[16];
    for (int kd = 0; kd < 16; ++kd) {
      idx[kd] = _mm512_add_epi32(_mm512_set1_epi32(kd), _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16,
                                                                          16, 16, 16, 16, 16, 16));
      keep[kd] = __mmask16((1u << lane_of(kd)) | (1u << (8 + lane_of(kd))));
    }
    for (int64_t g = 0; g < 8; ++g)
      for (int64_t j = 0; j < pairs; ++j) {
        __m512i qv[2];
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t n = 2 * g + h;
          __m256i q[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
          float a[2] = {0.0f, 0.0f}, b[2] = {0.0f, 0.0f};
          for (int64_t i = 0; i < 2; ++i)
            if (n < rows && 2 * j + i < nb) {
              const uint8_t* p = w + n * row_bytes + (2 * j + i) * Q::kBytes;
              q[i] = X::quants(p), X::scales(p, a[i], b[i]);
            }
          qv[h] = _mm512_inserti64x4(_mm512_castsi256_si512(q[0]), q[1], 1);
          _mm256_storeu_ps(A.data() + (g * pairs + j) * 16 + 8 * h,  // pair_lanes' order
                           _mm256_setr_ps(a[0], a[0], a[1], a[1], a[0], a[0], a[1], a[1]));
          for (int64_t i = 0; i < 2; ++i) {
            const int64_t blk = 2 * j + i;  // zeros past the last block stay as constructed
            B[(g * (nbp / 8) + blk / 8) * 16 + 8 * h + blk % 8] = b[i];
          }
        }
        uint8_t* tile = q.data() + (g * pairs + j) * 1024;
        for (int kd = 0; kd < 16; ++kd)
          _mm512_storeu_si512(tile + 64 * kd, _mm512_maskz_permutex2var_epi32(keep[kd], qv[0], idx[kd], qv[1]));
      }
  }
};

// out[t · ldo + 2 g + h] for tokens t < tokens (<= 16, from token row m0 of xq) and the group's
// rows h < 2 that are among the block's `rows`: tile32's float steps on the AMX lanes.
template <class X>
void group_tile(const WeightBlock& w, int64_t g, int64_t rows, const Tokens& x, int64_t m0,
                int64_t tokens, float* out, int64_t ldo) {
  const int64_t ldq = x.ldq, pairs = w.pairs, nbp = w.nbp;
  const int8_t* xs = x.xq.data() + m0 * ldq;
  const uint8_t* wq = w.q.data() + g * pairs * 1024;
  alignas(64) int32_t D[4][16][16];  // [pair][token][column]
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < pairs; j0 += 4) {
    const int64_t n = std::min<int64_t>(4, pairs - j0);  // tile ids are immediates: one branch each
    _tile_zero(0);
    _tile_loadd(4, xs + 64 * j0, ldq);
    _tile_loadd(6, wq + j0 * 1024, 64);
    _tile_dpbsud(0, 4, 6);
    if (n > 1) {
      _tile_zero(1);
      _tile_loadd(5, xs + 64 * (j0 + 1), ldq);
      _tile_loadd(7, wq + (j0 + 1) * 1024, 64);
      _tile_dpbsud(1, 5, 7);
    }
    if (n > 2) {
      _tile_zero(2);
      _tile_loadd(4, xs + 64 * (j0 + 2), ldq);
      _tile_loadd(6, wq + (j0 + 2) * 1024, 64);
      _tile_dpbsud(2, 4, 6);
    }
    if (n > 3) {
      _tile_zero(3);
      _tile_loadd(5, xs + 64 * (j0 + 3), ldq);
      _tile_loadd(7, wq + (j0 + 3) * 1024, 64);
      _tile_dpbsud(3, 5, 7);
    }
    _tile_stored(0, D[0], 64);
    if (n > 1) _tile_stored(1, D[1], 64);
    if (n > 2) _tile_stored(2, D[2], 64);
    if (n > 3) _tile_stored(3, D[3], 64);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj;
      const __m512 A = _mm512_loadu_ps(w.A.data() + (g * pairs + j) * 16);
      for (int t = 0; t < 16; ++t) {
        const __m512 dx = _mm512_broadcast_f32x8(_mm256_loadu_ps(x.dx.data() + ((m0 + t) * pairs + j) * 8));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(D[jj][t])), _mm512_mul_ps(A, dx), acc[t]);
      }
    }
  }
  if (X::kOffset)  // Σ B · sx, 8 blocks an FMA, as tile32
    for (int64_t b8 = 0; b8 < nbp / 8; ++b8) {
      const __m512 Bv = _mm512_loadu_ps(w.B.data() + (g * (nbp / 8) + b8) * 16);
      for (int t = 0; t < 16; ++t) {
        const __m512 sx = _mm512_broadcast_f32x8(_mm256_loadu_ps(x.sx.data() + (m0 + t) * nbp + 8 * b8));
        acc[t] = _mm512_fmadd_ps(Bv, sx, acc[t]);
      }
    }
  for (int64_t t = 0; t < tokens; ++t) {
    if (2 * g < rows) out[t * ldo + 2 * g] = minivllm_gguf_avx2::hsum(_mm512_castps512_ps256(acc[t]));
    if (2 * g + 1 < rows) out[t * ldo + 2 * g + 1] = minivllm_gguf_avx2::hsum(_mm512_extractf32x8_ps(acc[t], 1));
  }
}

template <class X>
void linear(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N, int64_t K) {
  using Q = typename X::Q;
  const int64_t nb = K / 32, row_bytes = nb * Q::kBytes, Mp = (M + 15) / 16 * 16;
  Tokens tok = minivllm_gguf_avx2::quantize_tokens(x, ldx, M, K, 32);
  const int64_t ldq = tok.ldq, pairs = ldq / 64, nbp = minivllm_gguf_avx2::padded8(nb);
  // token rows past M: zero quants and scales, so their sums are zeros (and dropped)
  tok.xq.resize(Mp * ldq, 0), tok.dx.resize(Mp * pairs * 8, 0.0f), tok.sx.resize(Mp * nbp, 0.0f);
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t per_item = std::clamp<int64_t>(kItemBytes / (8 * pairs * 1024), 1, 16);
  const int64_t panel = std::max<int64_t>(16, kPanelBytes / ldq / 16 * 16);
  at::parallel_for(0, (blocks + per_item - 1) / per_item, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<WeightBlock> wb(per_item, WeightBlock(pairs, nbp));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b0 = item * per_item, b1 = std::min(blocks, b0 + per_item);
      for (int64_t b = b0; b < b1; ++b)
        wb[b - b0].pack<X>(w + b * kRows * row_bytes, row_bytes, std::min(kRows, N - b * kRows), nb);
      for (int64_t p0 = 0; p0 < M; p0 += panel)
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n0 = b * kRows, rows = std::min(kRows, N - n0);
          for (int64_t g = 0; 2 * g < rows; ++g)  // the group's B tiles stay in L1 over the panel
            for (int64_t m0 = p0; m0 < std::min(M, p0 + panel); m0 += 16)
              group_tile<X>(wb[b - b0], g, rows, tok, m0, std::min<int64_t>(16, M - m0), out + m0 * N + n0, N);
        }
    }
    _tile_release();
  });
}

}  // namespace

// out[M, N] = x[M, K] · Wᵀ for 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1) on AMX tiles, equal to
// gguf_linear_int8's; cpu_gguf_amx.cpp checks the shapes, the type and that the CPU has AMX.
void linear_amx32(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N,
                  int64_t K, int64_t qtype) {
  switch (qtype) {
    case Q4_0::kType: return linear<minivllm_gguf_avx2::Q4_0x>(out, x, ldx, w, M, N, K);
    case Q4_1::kType: return linear<minivllm_gguf_avx2::Q4_1x>(out, x, ldx, w, M, N, K);
    case Q5_0::kType: return linear<minivllm_gguf_avx2::Q5_0x>(out, x, ldx, w, M, N, K);
    case Q5_1::kType: return linear<minivllm_gguf_avx2::Q5_1x>(out, x, ldx, w, M, N, K);
    default: TORCH_CHECK(false, "gguf_linear_amx: GGML type ", qtype, " has no 32-weight AMX kernel");
  }
}

}  // namespace minivllm_gguf_amx
#pragma GCC pop_options
#endif

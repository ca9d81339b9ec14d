// Float16 linears on AMX-BF16 tiles: y = epilogue(x · Wᵀ) with x, W and y float16, the products
// exact and summed in float32, as a float16 GEMM sums them.
//
// Why. A pooling model's default dtype is float16 (vLLM's rule, minivllm/model/resolver.py), and a
// CPU with AMX-BF16 but no AMX-FP16 (Sapphire Rapids, Emerald Rapids) multiplies float16 no faster
// than float32: oneDNN widens both operands and runs float32 FMAs, while its bfloat16 GEMM on the
// tiles runs an order of magnitude faster. A bfloat16 has 8 significant bits, a float16 11, so one
// bfloat16 cannot hold a float16; two can, exactly: hi = bf16(a) (rounded to nearest), lo = a - hi,
// whose at most 3 remaining bits fit a bfloat16 (whose exponent range covers float16's, subnormals
// included). Then
//     a · b = hi_a · hi_b + hi_a · lo_b + lo_a · hi_b + lo_a · lo_b,
// every product of two bfloat16 is exact in float32 (8 + 8 bits), and TDPBF16PS sums them in
// float32. The last term is below 2^-16 of |a · b|, 32 times below the float16 output's own
// rounding (2^-11), and is dropped: three tile products per 32-wide step of K (the "bf16x3" split
// that XLA and cuBLAS use to run float32 on bfloat16 units). The GEMM rounds once, to float16, after
// the epilogue (bias, GELU, residual add) has run on the float32 sums, as oneDNN's post-ops do;
// BERT's post-LayerNorm can follow, on the float16 rows the thread has just written.
//
// Layout. The weight is split and packed once, at load (minivllm/cpu/f16_amx.py `f16_amx_pack`):
// [N / 16, K / 32, 2 (hi, lo), 16, 32] bfloat16, one 1 KiB tile per (16 output columns, 32 inputs,
// hi or lo), in the tiles' pair-interleaved order (row r holds inputs 2r and 2r + 1 of each of the
// 16 columns). Work items of (a panel of kPanelRows rows of x, a run of kPairsPerItem column
// pairs) go over PyTorch's pool; a thread splits a panel's rows into hi and lo when its first item
// of the panel comes (zero padded to whole tiles), laid out as the tiles it will load: per 16 rows
// and 32 inputs, the hi tile then the lo tile, 1 KiB each, so that every tile load reads 16
// consecutive cache lines and a block's walk over K one sequential stream. The split stays in L2
// while its items walk the columns, 32 rows by 32 columns at a time (`gemm` says how the 8 tile
// registers are used).
// The tile registers are configured per thread (LDTILECFG is thread state), and Linux lends them to
// a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM), once; `f16_amx_available` asks, and is
// false on CPUs without AMX-BF16 or kernels that refuse, where oneDNN's float16 GEMM runs instead.
// tests/cpu/test_kernels_cpu_f16_amx.py holds the results to a float64 product of the same float16
// operands, within the float16 output's rounding.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define MINIVLLM_F16_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#pragma GCC push_options
#pragma GCC target("avx512bf16,amx-tile,amx-bf16")
#include "cpu_amx_tiles.h"

namespace minivllm_f16_amx {
namespace {

constexpr int64_t kTileRows = 16;       // rows of x (and of y) per tile
constexpr int64_t kBlockRows = 32;      // rows per block: two tiles' rows
constexpr int64_t kTileCols = 16;       // output columns per tile
constexpr int64_t kKStep = 32;          // inputs per tile product (16 rows x 64 bytes of bfloat16)
constexpr int64_t kTileElems = 512;     // bfloat16 per packed weight tile
constexpr int64_t kPanelRows = 64;      // rows of x whose hi and lo stay in L2 for an item
constexpr int64_t kPairsPerItem = 4;    // column pairs (32 columns each) per work item

enum Activation : int64_t { kNone = 0, kGeluErf = 1, kGeluTanh = 2 };

// The tiles (minivllm_amx::configure_tiles: all 16 x 64 bytes): 0-3 float32 sums [16 rows][16
// columns] of a 32 x 32 block; 4, 5: the two column halves' weight tiles [16 input pairs][16
// columns x 2]; 6, 7: the two row halves' x tiles [16 rows][32 inputs].

// x's rows [m_begin, m_end) split into bfloat16 hi and lo, in tile order:
// tiles[m / 16][k / 32][2 (hi, lo)][m % 16][k % 32] (a [16, 32] tile is 1 KiB). hi = bf16(x) rounded
// to nearest even, lo = bf16(x - hi), exact. Rows past M and inputs past K are zeros.
void split_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t k_pad,
                int64_t m_begin, int64_t m_end, uint16_t* tiles) {
  const int64_t k_steps = k_pad / kKStep;
  for (int64_t m = m_begin; m < m_end; ++m) {
    uint16_t* row = tiles + (m / kTileRows) * k_steps * 2 * kTileElems + (m % kTileRows) * kKStep;
    for (int64_t k0 = 0; k0 < k_pad; k0 += 16) {
      const int64_t valid = m < M ? std::clamp<int64_t>(K - k0, 0, 16) : 0;
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
      const __m512 f = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, x + m * ldx + k0));
      const __m256i hb = (__m256i)_mm512_cvtneps_pbh(f);
      const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16));
      const __m256i lb = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(f, hf));
      uint16_t* h = row + (k0 / kKStep) * 2 * kTileElems + k0 % kKStep;  // its hi tile's row
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), hb);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + kTileElems), lb);  // the lo tile's
    }
  }
}

struct Epilogue {
  const uint16_t* bias;      // [N] float16, or null
  const uint16_t* residual;  // [M, N] float16 rows ld_residual apart, or null
  int64_t ld_residual;
  int64_t activation;        // an Activation
  const uint16_t* ln_weight;  // [N] float16: LayerNorm of each rounded output row, or null
  const uint16_t* ln_bias;    // [N] float16 (with ln_weight)
  float ln_eps;
};

// LayerNorm over each of `rows` float16 rows of N (BERT's post-LayerNorm after the residual add),
// in place, on the rows this thread has just written (still in L1/L2): float32 arithmetic, the
// mean then the variance of the deviations (two passes over the row in cache), and one rounding to
// float16 after the weight and bias, as aten's float16 LayerNorm computes it.
void layer_norm_rows(uint16_t* out, int64_t ldo, int64_t rows, int64_t N, const Epilogue& e) {
  const auto mask_at = [N](int64_t j) {
    return static_cast<__mmask16>((1u << std::min<int64_t>(N - j, 16)) - 1u);
  };
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* y = out + r * ldo;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < N; j += 16) {
      sum = _mm512_add_ps(sum, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask_at(j), y + j)));
    }
    const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(sum) / static_cast<float>(N));
    __m512 squares = _mm512_setzero_ps();
    for (int64_t j = 0; j < N; j += 16) {
      const __mmask16 m = mask_at(j);
      const __m512 d = _mm512_maskz_sub_ps(m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, y + j)), mean);
      squares = _mm512_fmadd_ps(d, d, squares);
    }
    const float variance = _mm512_reduce_add_ps(squares) / static_cast<float>(N);
    const __m512 rstd = _mm512_set1_ps(1.f / std::sqrt(variance + e.ln_eps));
    for (int64_t j = 0; j < N; j += 16) {
      const __mmask16 m = mask_at(j);
      const __m512 x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, y + j));
      const __m512 g = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, e.ln_weight + j));
      const __m512 b = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, e.ln_bias + j));
      const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_sub_ps(x, mean), rstd), g, b);
      _mm256_mask_storeu_epi16(y + j, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
}

// GELU on 16 float32 sums in registers. erf is the rational approximation of Eigen's and XLA's
// float32 erf (x · P(x²) / Q(x²), odd P of degree 13 and even Q of degree 8, x clamped to ±4
// where float32's erf is ±1; absolute error below 5e-7, three orders under float16's rounding):
// a dozen FMAs and one reciprocal and no exp (an erf through exp, Abramowitz and Stegun's 7.1.26
// on glibc's vector expf, ran longer than the block's tile products on BERT's up projection). The
// reciprocal is RCP14 and one Newton step (relative error near 2^-27). The tanh GELU (below) is
// 1 - 2 / (exp(2u) + 1), which saturates to ±1 correctly at either infinity of exp.
inline __m512 reciprocal(__m512 q) {
  const __m512 r = _mm512_rcp14_ps(q);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(q, r, _mm512_set1_ps(2.f)));  // r (2 - q r)
}

inline __m512 gelu_erf(__m512 v) {
  const __m512 scaled = _mm512_mul_ps(v, _mm512_set1_ps(0.70710678118654752f));  // v / √2
  const __m512 x = _mm512_min_ps(_mm512_max_ps(scaled, _mm512_set1_ps(-4.f)), _mm512_set1_ps(4.f));
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_fmadd_ps(x2, _mm512_set1_ps(-2.72614225801306e-10f),
                             _mm512_set1_ps(2.77068142495902e-08f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-2.10102402082508e-06f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-5.69250639462346e-05f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-7.34990630326855e-04f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-2.95459980854025e-03f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-1.60960333262415e-02f));
  __m512 q = _mm512_fmadd_ps(x2, _mm512_set1_ps(-1.45660718464996e-05f),
                             _mm512_set1_ps(-2.13374055278905e-04f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(-1.68282697438203e-03f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(-7.37332916720468e-03f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(-1.42647390514189e-02f));
  const __m512 erf = _mm512_mul_ps(_mm512_mul_ps(x, p), reciprocal(q));
  const __m512 half_v = _mm512_mul_ps(v, _mm512_set1_ps(0.5f));
  return _mm512_fmadd_ps(half_v, erf, half_v);  // v/2 (1 + erf(v / √2))
}

void gelu_tanh(float* v, int64_t n) {  // a plain loop the compiler vectorizes (vector expf)
  for (int64_t j = 0; j < n; ++j) {
    const float u = 0.79788456080286536f * (v[j] + 0.044715f * v[j] * v[j] * v[j]);
    v[j] = 0.5f * v[j] * (2.f - 2.f / (std::exp(2.f * u) + 1.f));  // 1 + tanh(u)
  }
}

// Rows [r_begin, r_end) of a block of sums [32][32]: + bias, the activation, + residual, rounded
// once to float16.
void finish_rows(float* sums,  // [kBlockRows][32], overwritten by the tanh GELU
                 int64_t r_begin, int64_t r_end, int64_t cols, int64_t m0, int64_t n0,
                 const Epilogue& e, uint16_t* out, int64_t ldo) {
  const __mmask16 masks[2] = {
      static_cast<__mmask16>((1u << std::clamp<int64_t>(cols, 0, 16)) - 1u),
      static_cast<__mmask16>((1u << std::clamp<int64_t>(cols - 16, 0, 16)) - 1u)};
  __m512 bias[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  if (e.bias != nullptr) {
    for (int half = 0; half < 2; ++half) {
      bias[half] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(masks[half], e.bias + n0 + 16 * half));
    }
  }
  if (e.activation == kGeluTanh) {  // in place, the bias first (the loop below then adds none)
    for (int64_t r = r_begin; r < r_end; ++r) {
      float* row = sums + r * 2 * kTileCols;
      for (int half = 0; half < 2; ++half) {
        float* part = row + 16 * half;
        _mm512_store_ps(part, _mm512_add_ps(_mm512_load_ps(part), bias[half]));
      }
      gelu_tanh(row, 2 * kTileCols);
    }
    bias[0] = bias[1] = _mm512_setzero_ps();
  }
  for (int64_t r = r_begin; r < r_end; ++r) {
    for (int half = 0; half < 2; ++half) {
      __m512 y = _mm512_add_ps(_mm512_load_ps(sums + r * 2 * kTileCols + 16 * half), bias[half]);
      if (e.activation == kGeluErf) y = gelu_erf(y);
      if (e.residual != nullptr) {
        const uint16_t* res = e.residual + (m0 + r) * e.ld_residual + n0 + 16 * half;
        y = _mm512_add_ps(y, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(masks[half], res)));
      }
      const __m256i h = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_mask_storeu_epi16(out + (m0 + r) * ldo + n0 + 16 * half, masks[half], h);
    }
  }
}

// A block whose sums wait for their epilogue, finished a few rows at a time while the next
// block's tile products run: the epilogue is vector work and the products are the tile unit's,
// so interleaved in one instruction stream the two overlap, where a block finished before the
// next began left the tile unit idle for its epilogue (the erf GELU's most of all).
struct PendingBlock {
  float* sums = nullptr;  // [kBlockRows][32]
  int64_t rows = 0, cols = 0, m0 = 0, n0 = 0;
  int64_t done = 0;  // rows finished

  void finish(int64_t upto, const Epilogue& e, uint16_t* out, int64_t ldo) {
    upto = std::min(upto, rows);
    if (done < upto) finish_rows(sums, done, upto, cols, m0, n0, e, out, ldo);
    done = std::max(done, upto);
  }
};

// y[M, N] = epilogue(x · Wᵀ) from x [M, K] float16 and the packed weight.
// A block is 32 rows by 32 columns: four float32 accumulators (tiles 0-3), so that each tile
// product's latency hides behind three others, and per 32-input step the x tiles of both row
// halves and the weight tiles of both column halves (tiles 4-7), hi and lo in turn: ten tile
// loads for twelve tile products.
void gemm(uint16_t* out, int64_t ldo, const uint16_t* x, int64_t ldx, const uint16_t* w,
          int64_t M, int64_t N, int64_t K, int64_t k_pad, const Epilogue& e) {
  const int64_t k_steps = k_pad / kKStep;
  const int64_t pairs = (N + 2 * kTileCols - 1) / (2 * kTileCols);  // the pack pads N to 32
  const int64_t panels = (M + kPanelRows - 1) / kPanelRows;
  // A LayerNorm needs whole rows: then an item is a panel's every column pair.
  const int64_t pairs_per_item = e.ln_weight != nullptr ? pairs : kPairsPerItem;
  const int64_t runs = (pairs + pairs_per_item - 1) / pairs_per_item;
  const int64_t block_stride = k_steps * 2 * kTileElems;  // one 16-column block's tiles
  constexpr int64_t lda = kKStep * 2;                     // bytes between a split tile's rows
  at::parallel_for(0, panels * runs, 1, [&](int64_t begin, int64_t end) {
    minivllm_amx::configure_tiles();
    alignas(64) float sums[2][kBlockRows * 2 * kTileCols];  // a block's, and the pending one's
    PendingBlock pending;
    int current = 0;  // which of `sums` the next block stores into
    const int64_t rows_per_step = (kBlockRows + k_steps - 1) / k_steps;  // of the pending block
    // The panel's x split into hi and lo tiles (`split_rows`: [kPanelRows / 16, k_steps, 2, 16,
    // 32]), by this thread, when its first item of the panel comes: the split stays in L2 for the
    // panel's items.
    std::vector<uint16_t> split(2 * kPanelRows * k_pad);
    uint16_t* tiles = split.data();
    int64_t split_panel = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t panel = item / runs, run = item % runs;
      const int64_t m_begin = panel * kPanelRows, m_end = std::min(M, m_begin + kPanelRows);
      if (panel != split_panel) {
        split_rows(x + m_begin * ldx, ldx, M - m_begin, K, k_pad, 0, kPanelRows, tiles);
        split_panel = panel;
      }
      const int64_t p_end = std::min(pairs, (run + 1) * pairs_per_item);
      for (int64_t p = run * pairs_per_item; p < p_end; ++p) {
        const uint16_t* w0 = w + 2 * p * block_stride;  // column block 2p's tiles
        const uint16_t* w1 = w0 + block_stride;          // and 2p + 1's
        for (int64_t m0 = m_begin; m0 < m_end; m0 += kBlockRows) {
          // rows m0.. and m0 + 16..: their hi tiles, each followed by its lo tile
          const uint16_t* h0 = tiles + (m0 - m_begin) / kTileRows * k_steps * 2 * kTileElems;
          const uint16_t* h1 = h0 + k_steps * 2 * kTileElems;
          const uint16_t* l0 = h0 + kTileElems;
          const uint16_t* l1 = h1 + kTileElems;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t s = 0; s < k_steps; ++s) {
            const int64_t t = s * 2 * kTileElems;  // step s's hi tile, in x's split and in W's pack
            _tile_loadd(4, w0 + t, 64);  // hi · hi
            _tile_loadd(5, w1 + t, 64);
            _tile_loadd(6, h0 + t, lda);
            _tile_loadd(7, h1 + t, lda);
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(1, 6, 5);
            _tile_dpbf16ps(2, 7, 4);
            _tile_dpbf16ps(3, 7, 5);
            pending.finish((s + 1) * rows_per_step, e, out, ldo);
            _tile_loadd(6, l0 + t, lda);  // lo · hi
            _tile_loadd(7, l1 + t, lda);
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(1, 6, 5);
            _tile_dpbf16ps(2, 7, 4);
            _tile_dpbf16ps(3, 7, 5);
            _tile_loadd(4, w0 + t + kTileElems, 64);  // hi · lo
            _tile_loadd(5, w1 + t + kTileElems, 64);
            _tile_loadd(6, h0 + t, lda);
            _tile_loadd(7, h1 + t, lda);
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(1, 6, 5);
            _tile_dpbf16ps(2, 7, 4);
            _tile_dpbf16ps(3, 7, 5);
          }
          pending.finish(kBlockRows, e, out, ldo);
          float* block_sums = sums[current];
          current ^= 1;
          constexpr int64_t ld = 2 * kTileCols * sizeof(float);  // bytes between rows of sums
          _tile_stored(0, block_sums, ld);
          _tile_stored(1, block_sums + kTileCols, ld);
          _tile_stored(2, block_sums + kTileRows * 2 * kTileCols, ld);
          _tile_stored(3, block_sums + kTileRows * 2 * kTileCols + kTileCols, ld);
          pending = PendingBlock{block_sums, std::min(kBlockRows, M - m0), N - 2 * p * kTileCols,
                                 m0, 2 * p * kTileCols};
        }
      }
      if (e.ln_weight != nullptr) {  // the item wrote the panel's whole rows
        pending.finish(kBlockRows, e, out, ldo);
        layer_norm_rows(out + m_begin * ldo, ldo, m_end - m_begin, N, e);
      }
    }
    pending.finish(kBlockRows, e, out, ldo);
    _tile_release();
  });
}

}  // namespace

// AMX-BF16 and AVX512-BF16 on this CPU, and the tile registers granted by Linux (asked once).
bool available() {
  static const bool has = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx_bf16 = d & (1u << 22), tile = d & (1u << 24);
    unsigned a1, b1, c1, d1;
    if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) return false;
    const bool avx512_bf16 = a1 & (1u << 5);
    return amx_bf16 && tile && avx512_bf16 && minivllm_amx::tile_data_granted();
  }();
  return has;
}

// The LayerNorm in the tile loop needs an item to hold whole rows, which leaves fewer items than
// threads when M is a few panels (a short request served alone): then the GEMM splits its columns
// as it does without one, and the LayerNorm follows, rows over the threads. Each row's values are
// the same either way (`layer_norm_rows`, row by row).
void linear(uint16_t* out, int64_t ldo, const uint16_t* x, int64_t ldx, const uint16_t* w,
            int64_t M, int64_t N, int64_t K, int64_t k_pad, const Epilogue& e) {
  const int64_t panels = (M + kPanelRows - 1) / kPanelRows;
  if (e.ln_weight == nullptr || panels >= at::get_num_threads()) {
    gemm(out, ldo, x, ldx, w, M, N, K, k_pad, e);
    return;
  }
  Epilogue without_norm = e;
  without_norm.ln_weight = without_norm.ln_bias = nullptr;
  gemm(out, ldo, x, ldx, w, M, N, K, k_pad, without_norm);
  at::parallel_for(0, M, kTileRows, [&](int64_t begin, int64_t end) {
    layer_norm_rows(out + begin * ldo, ldo, end - begin, N, e);
  });
}

}  // namespace minivllm_f16_amx
#pragma GCC pop_options
#endif  // MINIVLLM_F16_AMX

namespace {

bool f16_amx_available() {
#if defined(MINIVLLM_F16_AMX)
  return minivllm_f16_amx::available();
#else
  return false;
#endif
}

void check_half(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kHalf && t.dim() == dim,
              "f16_amx_linear: ", name, " must be a ", dim, "-D float16 CPU tensor, got ",
              t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "f16_amx_linear: ", name,
              "'s last dim must be contiguous");
}

// out[M, N] = act(x · Wᵀ + bias) + residual, float16, from `f16_amx_pack`'s packed weight, then
// LayerNorm(out) with ln_weight, ln_bias and ln_eps if ln_weight is not empty. activation: 0 none,
// 1 GELU (erf), 2 GELU (tanh); bias, residual, ln_weight and ln_bias may be empty tensors.
void f16_amx_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                    const at::Tensor& bias, const at::Tensor& residual, int64_t activation,
                    const at::Tensor& ln_weight, const at::Tensor& ln_bias, double ln_eps) {
  TORCH_CHECK(f16_amx_available(), "f16_amx_linear: this CPU (or build, or OS) has no AMX-BF16");
  check_half(x, "x", 2);
  check_half(out, "out", 2);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M, "f16_amx_linear: out must have x's ", M, " rows, got ", out.size(0));
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 5 && packed.is_contiguous() &&
                  packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 32,
              "f16_amx_linear: packed must be f16_amx_pack's contiguous bfloat16 "
              "[N / 16, K / 32, 2, 16, 32], got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t k_pad = packed.size(1) * 32;
  TORCH_CHECK(packed.size(0) % 2 == 0 && packed.size(0) * 16 >= N && packed.size(0) * 16 < N + 32 &&
                  k_pad >= K && k_pad < K + 32,
              "f16_amx_linear: packed ", packed.sizes(), " does not hold a [", N, ", ", K,
              "] weight");
  TORCH_CHECK(activation >= 0 && activation <= 2, "f16_amx_linear: activation must be 0, 1 or 2, "
              "got ", activation);
  if (bias.numel() > 0) {
    check_half(bias, "bias", 1);
    TORCH_CHECK(bias.size(0) == N, "f16_amx_linear: bias must have ", N, " values, got ",
                bias.size(0));
  }
  if (residual.numel() > 0) {
    check_half(residual, "residual", 2);
    TORCH_CHECK(residual.size(0) == M && residual.size(1) == N,
                "f16_amx_linear: residual must be [", M, ", ", N, "], got ", residual.sizes());
  }
  const bool ln = ln_weight.numel() > 0;
  if (ln) {
    check_half(ln_weight, "ln_weight", 1);
    check_half(ln_bias, "ln_bias", 1);
    TORCH_CHECK(ln_weight.size(0) == N && ln_bias.size(0) == N,
                "f16_amx_linear: ln_weight and ln_bias must have ", N, " values, got ",
                ln_weight.size(0), " and ", ln_bias.size(0));
  }
  if (M == 0 || N == 0) return;
#if defined(MINIVLLM_F16_AMX)
  const auto half = [](const at::Tensor& t) {
    return t.numel() > 0 ? reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::Half>())
                         : nullptr;
  };
  const minivllm_f16_amx::Epilogue e{half(bias),
                                     half(residual),
                                     residual.numel() > 0 ? residual.stride(0) : 0,
                                     activation,
                                     ln ? half(ln_weight) : nullptr,
                                     ln ? half(ln_bias) : nullptr,
                                     static_cast<float>(ln_eps)};
  minivllm_f16_amx::linear(reinterpret_cast<uint16_t*>(out.data_ptr<at::Half>()), out.stride(0),
                           half(x), x.stride(0),
                           reinterpret_cast<const uint16_t*>(packed.const_data_ptr<at::BFloat16>()),
                           M, N, K, k_pad, e);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("f16_amx_available() -> bool", &f16_amx_available);
  m.def("f16_amx_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias, Tensor residual, "
        "int activation, Tensor ln_weight, Tensor ln_bias, float ln_eps) -> ()",
        &f16_amx_linear);
}

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
//   float32 rows as a block type of their own, `F32`). Not at::mm: an ATen op in a parallel
//   region runs without the caller's InferenceMode (below), and the tiles outran it on a chunk.
//
// The int8 path on AVX-512 is an op of its own (`gguf_linear_int8`), which the engine picks per
// block type. llama.cpp's CPU dots quantize x to int8 blocks and multiply with integer dot
// products. On AVX2 that is the build's product (below). An AVX-512 build compiles the same
// integer code with AVX512-VNNI's dots (`vpdpbusd`: 32 byte products into 8 int32 lanes, one
// instruction where AVX2 takes two; cpu_gguf_gemm_avx2.cpp) and runs it on CPUs that have them:
// the same int32 lanes and float steps, so a row's output is AVX2's and does not depend on the
// batch around it. There the K-quants (Q4_K, Q5_K, Q6_K) take it by default, in the Python path
// and the C++ decode loop alike (minivllm/cpu/op_forwards.py `gguf_dot`): at decode's rows each
// super-block is dotted in registers, its sub-block scales applied to int32 sums, not to every
// weight. So is Q8_0, whose bytes need no unpacking (dotted where they lie, at every M), and so
// are Q4_0 and Q4_1, whose block pairs are dotted in registers at decode's few rows (measured
// faster than their bf16 dot, docs/performance.md). Q5_0 and Q5_1 keep the float32 tiles here (or
// the bf16 dot). benchmarks/gguf_small_m.py times the three dots side by side; MINIVLLM_CPU_GGUF_DOT=float32|bf16|int8 forces one kind for every type.
//
// The block formats (their layouts, dequantization and unpacking) are in cpu_gguf_blocks.h.
//
// Which path a build has (`gguf_dot_kind`):
// - AVX-512 builds (where PyTorch detected AVX-512, minivllm/cpu/build.py): the float32 tiles here
//   (and, as gguf_linear_int8 on AVX512-VNNI CPUs, the integer dots of the AVX2 file, the
//   K-quants' default there).
// - AVX2 builds: 8-bit integer dots on x rounded to 8-bit blocks, as llama.cpp's CPU backend
//   (cpu_gguf_gemm_avx2.cpp); with 8 float lanes the float32 tiles would do 8 products an
//   instruction where the integer dots do 32.
// - any other build (aarch64, generic x86): the portable per-block loops (`dequantize`) into a
//   per-thread float32 chunk, and plain dot loops over it that the compiler vectorizes.
// Inside parallel regions every path touches raw pointers and std::vector only: worker threads do
// not carry the caller's InferenceMode, so an ATen op there (at::empty, at::mm_out on a view of an
// inference tensor) is refused or silently leaves the mode.
// tests/cpu/test_kernels_cpu_gguf.py holds both ops to gguf's numpy dequantization.

#include "cpu_gguf_blocks.h"

#include <string>
#include <vector>

#if defined(__AVX2__)
namespace minivllm_gguf_avx2 {  // cpu_gguf_gemm_avx2.cpp
void gguf_linear_int8(float* out, const float* x, int64_t ldx, const uint8_t* w, int64_t M,
                      int64_t N, int64_t K, int64_t qtype);
}
#if !defined(__AVX512F__)
#define MINIVLLM_GGUF_INT8 1
#endif
#endif

namespace {

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

#if !defined(__AVX512F__)
// out[t, n0 + r] = dot(x row t, y row r) for the chunk's rows r < rows (y: [rows, K] float32).
// The portable twin of the tiles: 4 rows at a time share each load of x, and the inner loop is a
// plain reduction that -O3 -ffast-math vectorizes at whatever SIMD width the build has.
void chunk_times_tokens(const float* x, int64_t ldx, int64_t M, const float* y, int64_t rows,
                        int64_t K, float* out, int64_t ldo) {
  for (int64_t t = 0; t < M; ++t) {
    const float* xt = x + t * ldx;
    float* ot = out + t * ldo;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float *y0 = y + r * K, *y1 = y0 + K, *y2 = y1 + K, *y3 = y2 + K;
      float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (int64_t k = 0; k < K; ++k) {
        s0 += xt[k] * y0[k], s1 += xt[k] * y1[k], s2 += xt[k] * y2[k], s3 += xt[k] * y3[k];
      }
      ot[r] = s0, ot[r + 1] = s1, ot[r + 2] = s2, ot[r + 3] = s3;
    }
    for (; r < rows; ++r) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += xt[k] * y[r * K + k];
      ot[r] = s;
    }
  }
}
#endif

// Each thread dequantizes chunks of rows into its own float32 scratch (std::vector: no ATen op in
// the parallel region) and multiplies every token row into them. x: [M, K], row stride ldx;
// xp: the packed tokens (AVX-512 only, else unused); out: [M, N] contiguous.
template <class Q>
void linear_by_chunks(float* out, const float* x, int64_t ldx, int64_t M, const float* xp,
                      const uint8_t* w, int64_t N, int64_t K) {
  const int64_t blocks = K / Q::kBlock, rows_per = chunk_rows(N, K);
  const int64_t chunks = (N + rows_per - 1) / rows_per;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(rows_per * K);  // [rows_per, K] float32
    float* y = scratch.data();
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n0 = c * rows_per, rows = std::min(rows_per, N - n0);
      dequantize_rows<Q>(w + n0 * blocks * Q::kBytes, rows, blocks, y, K);
#if defined(__AVX512F__)
      (void)x, (void)ldx;
      // Passes of kTokensPerPass tokens, so that their packed rows and the chunk share L2.
      for (int64_t t0 = 0; t0 < M; t0 += kTokensPerPass)
        rows_by_tokens<F32>(reinterpret_cast<const uint8_t*>(y), 4 * K, rows, xp + t0 * K,
                            std::min(kTokensPerPass, M - t0), K, out + t0 * N + n0, N);
#else
      (void)xp;
      for (int64_t t0 = 0; t0 < M; t0 += kTokensPerPass)
        chunk_times_tokens(x + t0 * ldx, ldx, std::min(kTokensPerPass, M - t0), y, rows, K,
                           out + t0 * N + n0, N);
#endif
    }
  });
}

// ---------------------------------------------------------------------------------- the ops
void gguf_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                 int64_t qtype) {
  const char* op = "minivllm_cpu::gguf_linear";
  with_type(qtype, op, [&](auto q) {
    using Q = decltype(q);
    const LinearShape shape = check_linear<Q>(out, x, qweight, op);
    const int64_t M = shape.M, N = shape.N, K = shape.K;
    if (M == 0 || N == 0) return;
    const uint8_t* w = qweight.data_ptr<uint8_t>();
    const float* xd = x.data_ptr<float>();
    float* od = out.data_ptr<float>();
#if defined(__AVX512F__)
    // The token tiles (pack_tokens); one token's tile is its row as it is.
    std::vector<float> packed(M == 1 ? 0 : M * K);
    const float* xp = xd;
    if (M > 1) pack_tokens(xd, x.stride(0), M, K, packed.data()), xp = packed.data();
    if (on_the_fly<Q>(M, K)) return linear_on_the_fly<Q>(w, xp, od, M, N, K);
    linear_by_chunks<Q>(od, xd, x.stride(0), M, xp, w, N, K);
#elif defined(MINIVLLM_GGUF_INT8)
    minivllm_gguf_avx2::gguf_linear_int8(od, xd, x.stride(0), w, M, N, K, Q::kType);
#else
    linear_by_chunks<Q>(od, xd, x.stride(0), M, nullptr, w, N, K);
#endif
  });
}

// Whether gguf_linear_int8 runs: on every AVX2 build (the same code as gguf_linear there), and on
// AVX-512 builds where the CPU has AVX512-VNNI (the code carries its target attribute).
bool gguf_has_int8_dot() {
#if defined(__AVX512F__)
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
#elif defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

void gguf_linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                      int64_t qtype) {
  const char* op = "minivllm_cpu::gguf_linear_int8";
  TORCH_CHECK(gguf_has_int8_dot(), op, ": this CPU (or this build) has no int8 dot");
#if defined(__AVX2__)
  with_type(qtype, op, [&](auto q) {
    using Q = decltype(q);
    const LinearShape shape = check_linear<Q>(out, x, qweight, op);
    const int64_t M = shape.M, N = shape.N, K = shape.K;
    if (M == 0 || N == 0) return;
    minivllm_gguf_avx2::gguf_linear_int8(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0),
                                         qweight.data_ptr<uint8_t>(), M, N, K, Q::kType);
  });
#endif
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

// The products gguf_linear takes in this build: "int8" (AVX2: x rounded to 8-bit blocks) or
// "float32" (AVX-512, portable). The bf16 and int8 ops are separate (gguf_has_bf16_dot,
// gguf_has_int8_dot).
std::string gguf_dot_kind() {
#if defined(MINIVLLM_GGUF_INT8)
  return "int8";
#else
  return "float32";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("gguf_dot_kind() -> str", &gguf_dot_kind);
  m.def("gguf_linear(Tensor(a!) out, Tensor x, Tensor qweight, int qtype) -> ()", &gguf_linear);
  m.def("gguf_linear_int8(Tensor(a!) out, Tensor x, Tensor qweight, int qtype) -> ()",
        &gguf_linear_int8);
  m.def("gguf_has_int8_dot() -> bool", &gguf_has_int8_dot);
  m.def("gguf_dequantize(Tensor(a!) out, Tensor qweight, int qtype) -> ()", &gguf_dequantize);
}

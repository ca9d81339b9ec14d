// Paged decode attention for CPUs: the paper's §4.1 kernel, one request's KV blocks at a time.
//
// The reference backend gathers every decode request's K/V into a padded contiguous tensor and then
// calls scaled_dot_product_attention: the context crosses memory three times (gather read, gather
// write, attention read). This kernel reads each key and value once, straight from the paged cache
// through the block table, so decode attention costs what its bytes cost. vLLM's CPU backend makes
// the same split: SDPA for prompt chunks, a C++ paged kernel for decodes (csrc/cpu/attention.cpp).
//
// Work item = one request, all heads: a block of the cache ([block_size, num_kv_heads, head_dim])
// is one contiguous run of memory, so reading it whole streams at the memory's speed (a work item
// per KV head would read a strided third of every row, which streams worse). Items run on
// PyTorch's own intra-op thread pool (at::parallel_for), never a second OpenMP runtime that would
// fight it for the cores.
//
// Built on first use by minivllm/cpu/build.py (torch.utils.cpp_extension), once per
// instruction-set level of minivllm/cpu/isa.py. The loops here are plain C++ that the compiler
// vectorizes: -O3 with the level's SIMD flags and -ffast-math, which lets it reorder the
// dot-product sums and call glibc's vector expf. Float32 scores and values have loops written
// for the avx2 and avx512 levels besides (`decode_loops` says which run). Scores are finite here (every
// key of a decode token is visible, no mask; a sliding window's skipped keys get weight 0, not a
// -inf score), which is all fast-math's finite-math assumes.
//
// Two passes over a request's context (all scores, one softmax, then the values) rather than
// flash-decoding's one pass with an online softmax: both read the same bytes, and the one-pass
// version, which rescales its sums and runs the softmax on one block's 16 scores at a time, was
// slower per core on cached data and no faster from memory (python benchmarks/cpu_decode.py).
//
// The file's second op, reshape_and_cache (vLLM's name), is the cache write that comes before
// the read: the new tokens' K and V into their slots, both caches in one call.
//
// The cache may be narrower than the activations (vLLM's kv_cache_dtype): a bfloat16 or float16
// cache under float32 queries. reshape_and_cache rounds each value to the cache's dtype as it
// writes (round to nearest even, as torch's `.to` does), and paged_decode widens each cached value
// to float32 as it reads it; scores, softmax and the weighted sum stay in float32, so the cache's
// rounding is the only difference from a float32 cache, and decode reads half the bytes.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

// The kernel's float32 loops written per instruction set, one source each with the same
// functions: cpu_attention_avx512.cpp has code in the avx512 build of minivllm/cpu/isa.py,
// cpu_attention_avx2.cpp in the avx2 build; in any other build `decode_<isa>_applies` is false.
namespace minivllm_cpu_avx512 {
bool decode_avx512_applies(int64_t head_dim);
void decode_scores(const float* q, const float* k_cache, const float* v_cache,
                   const int32_t* table, int64_t seq_len, int64_t block_size, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, float* scores);
void decode_values(const float* p, const float* v_cache, const int32_t* table, int64_t seq_len,
                   int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   float* acc);
// The same loops over a bfloat16 cache (its raw 16-bit patterns), widened to float32 on load.
void decode_scores(const float* q, const uint16_t* k_cache, const uint16_t* v_cache,
                   const int32_t* table, int64_t seq_len, int64_t block_size, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, float* scores);
void decode_values(const float* p, const uint16_t* v_cache, const int32_t* table, int64_t seq_len,
                   int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   float* acc);
}  // namespace minivllm_cpu_avx512
namespace minivllm_cpu_avx2 {
bool decode_avx2_applies(int64_t head_dim);
void decode_scores(const float* q, const float* k_cache, const float* v_cache,
                   const int32_t* table, int64_t seq_len, int64_t block_size, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, float* scores);
void decode_values(const float* p, const float* v_cache, const int32_t* table, int64_t seq_len,
                   int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   float* acc);
// The same loops over a bfloat16 cache (its raw 16-bit patterns), widened to float32 on load.
void decode_scores(const float* q, const uint16_t* k_cache, const uint16_t* v_cache,
                   const int32_t* table, int64_t seq_len, int64_t block_size, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, float* scores);
void decode_values(const float* p, const uint16_t* v_cache, const int32_t* table, int64_t seq_len,
                   int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   float* acc);
}  // namespace minivllm_cpu_avx2

namespace {

// Load the next block's rows into cache while this block is computed: blocks are scattered, so
// the hardware prefetcher, which follows addresses, cannot guess where the next one starts.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t row_elems) {
  constexpr int64_t per_line = 64 / sizeof(scalar_t);
  for (int64_t c = 0; c < row_elems; c += per_line) __builtin_prefetch(row + c);
}

// --8<-- [start:walk]
// PagedAttention's read: visit(t, row) for each of a request's seq_len cached tokens, in logical
// order, where row is token t's [num_kv_heads, head_dim] slice of the cache. Logical block j lives
// in physical block table[j]; walking blocks rather than tokens keeps a division per token out.
template <typename scalar_t, typename Visit>
inline void for_each_cached_token(
    const scalar_t* cache,  // [num_blocks, block_size, num_kv_heads, head_dim]
    const int32_t* table,   // [>= ceil(seq_len / block_size)] the request's block table
    int64_t seq_len, int64_t block_size, int64_t row_elems, Visit&& visit) {
  const int64_t block_elems = block_size * row_elems;
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  for (int64_t j = 0; j < num_blocks; ++j) {
    const scalar_t* block = cache + int64_t(table[j]) * block_elems;
    const scalar_t* next = cache + int64_t(table[std::min(j + 1, num_blocks - 1)]) * block_elems;
    const int64_t t0 = j * block_size, n = std::min(block_size, seq_len - t0);
    for (int64_t o = 0; o < n; ++o) {
      prefetch_row(next + o * row_elems, row_elems);
      visit(t0 + o, block + o * row_elems);
    }
  }
}
// --8<-- [end:walk]

// ---------------------------------------------------------------------------- which loops run
// A request's scores and values run the float32 loops of the library's instruction set
// (cpu_attention_avx512.cpp, cpu_attention_avx2.cpp) for float32 queries over a float32 or
// bfloat16 cache at the head sizes they are written for (32, 64, 128); anything else runs the
// portable loops below, which the compiler vectorizes as it can.
enum class DecodeLoops { portable, avx2, avx512 };

DecodeLoops decode_loops(at::ScalarType query, at::ScalarType cache, int64_t head_dim) {
  if (query != at::kFloat || (cache != at::kFloat && cache != at::kBFloat16))
    return DecodeLoops::portable;
  if (minivllm_cpu_avx512::decode_avx512_applies(head_dim)) return DecodeLoops::avx512;
  if (minivllm_cpu_avx2::decode_avx2_applies(head_dim)) return DecodeLoops::avx2;
  return DecodeLoops::portable;
}

// Those loops' view of a cache element: float32 as it is, bfloat16 as its 16-bit pattern.
template <typename cache_t>
using simd_elem_t = std::conditional_t<std::is_same_v<cache_t, c10::BFloat16>, uint16_t, float>;

// scores[h * seq_len + t] = q[h] · k_t by the loops `loops` names (avx2 or avx512); the first
// blocks of v_cache, which the values pass reads next, are pulled into L2 meanwhile.
template <typename elem_t>
void simd_decode_scores(DecodeLoops loops, const float* q, const elem_t* k_cache,
                        const elem_t* v_cache, const int32_t* table, int64_t seq_len,
                        int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, float* scores) {
  if (loops == DecodeLoops::avx512)
    minivllm_cpu_avx512::decode_scores(q, k_cache, v_cache, table, seq_len, block_size, num_heads,
                                       num_kv_heads, head_dim, scores);
  else
    minivllm_cpu_avx2::decode_scores(q, k_cache, v_cache, table, seq_len, block_size, num_heads,
                                     num_kv_heads, head_dim, scores);
}

// acc[h] += Σ_t p[h * seq_len + t] · v_t by the loops `loops` names (avx2 or avx512).
template <typename elem_t>
void simd_decode_values(DecodeLoops loops, const float* p, const elem_t* v_cache,
                        const int32_t* table, int64_t seq_len, int64_t block_size,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float* acc) {
  if (loops == DecodeLoops::avx512)
    minivllm_cpu_avx512::decode_values(p, v_cache, table, seq_len, block_size, num_heads,
                                       num_kv_heads, head_dim, acc);
  else
    minivllm_cpu_avx2::decode_values(p, v_cache, table, seq_len, block_size, num_heads,
                                     num_kv_heads, head_dim, acc);
}

// HEAD_DIM > 0 is head_dim known at compile time (0: read at run time). With it the compiler
// unrolls each 64-long dot product and value update into a few vector instructions with no loop
// or remainder handling.
// query_t is the activations' dtype, cache_t the cache's (kv_cache_dtype): the same, or a
// bfloat16 / float16 cache under float32 queries.
template <typename query_t, typename cache_t, int64_t HEAD_DIM>
void paged_decode_kernel(
    float* __restrict__ out,              // [T, num_heads, head_dim] float32 output rows
    const query_t* __restrict__ query,    // [T, num_heads, head_dim] at strides q_stride
    const cache_t* __restrict__ k_cache,  // [num_blocks, block_size, num_kv_heads, head_dim]
    const cache_t* __restrict__ v_cache,  // [num_blocks, block_size, num_kv_heads, head_dim]
    const int32_t* __restrict__ block_tables, // [B, max_blocks]
    const int32_t* __restrict__ seq_lens,     // [B]
    const int64_t* __restrict__ token_rows,   // [B] row of request b's query in query/out
    int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, const int64_t* q_stride, float scale,
    int64_t sliding_window,  // > 0: a row sees only its last sliding_window keys
    float softcap) {         // > 0: each score becomes softcap * tanh(score / softcap)
  const int64_t hd = HEAD_DIM > 0 ? HEAD_DIM : head_dim;  // the loops' head_dim
  const int64_t group = num_heads / num_kv_heads;        // query heads per KV head
  const int64_t row_elems = num_kv_heads * head_dim;     // one token's K (or V), all KV heads
  // The instruction set's own loops where they apply (`decode_loops`), else the portable ones.
  using simd_t = simd_elem_t<cache_t>;
  const DecodeLoops loops = decode_loops(c10::CppTypeToScalarType<query_t>::value,
                                         c10::CppTypeToScalarType<cache_t>::value, head_dim);
  // Load balance: a request costs its seq_len, and a decode batch mixes lengths 16..512, so the
  // contiguous ranges at::parallel_for hands each thread can leave one thread idle while the
  // other finishes. Instead every thread takes the next request from a shared counter, longest
  // first (greedy LPT scheduling): the short requests left at the end fill the gaps, and no
  // thread finishes more than one short request's time after the others.
  std::vector<int64_t> order(num_seqs);  // [B] requests, longest first
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return seq_lens[a] > seq_lens[b]; });
  std::atomic<int64_t> next{0};  // index into order of the next request to take
  // ATen runs the body once per thread (or once in all, inline when it cannot go parallel);
  // each run ignores its range and takes requests from the counter until none is left.
  at::parallel_for(0, num_seqs, 1, [&](int64_t, int64_t) {
    std::vector<float> q(num_heads * head_dim);    // [num_heads, head_dim] scaled queries
    std::vector<float> acc(num_heads * head_dim);  // [num_heads, head_dim] weighted values
    std::vector<float> inv_sum(num_heads);         // [num_heads] 1 / softmax denominator
    std::vector<float> scores;                     // [num_heads, seq_len]
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_seqs;) {
      const int64_t b = order[i];
      // A sliding window W: the row (the newest of its seq_lens[b] keys) sees only the last W.
      // The walk starts at the block of the first of them, so the blocks before it, which the
      // KV cache manager may have freed (a placeholder in the table), are never read; the
      // `skip` keys of that block before the window get weight 0. Without a window skip is 0.
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_lens[b] - sliding_window)
                                               : 0;
      const int64_t first_block = first / block_size;
      const int64_t skip = first - first_block * block_size;
      const int64_t seq_len = seq_lens[b] - first_block * block_size;  // keys walked
      const int32_t* table = block_tables + b * max_blocks + first_block;
      // The query is read once per request (num_heads * head_dim values), so its strides cost
      // nothing here and any layout the model hands over is read where it lies.
      const query_t* src = query + token_rows[b] * q_stride[0];  // [num_heads, head_dim]
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
          q[h * head_dim + d] = float(src[h * q_stride[1] + d * q_stride[2]]) * scale;
      scores.resize(num_heads * seq_len);

      if (loops != DecodeLoops::portable) {
        simd_decode_scores(loops, q.data(), reinterpret_cast<const simd_t*>(k_cache),
                           reinterpret_cast<const simd_t*>(v_cache), table, seq_len, block_size,
                           num_heads, num_kv_heads, head_dim, scores.data());
      } else {
        // --8<-- [start:scores]
        // Scores: q · k for every cached token. A request is one work item, so each block is read
        // as one contiguous run of memory; with GQA, the `group` query heads of a KV head meet its
        // K row one after the other, while it is in L1.
        for_each_cached_token(k_cache, table, seq_len, block_size, row_elems,
                              [&](int64_t t, const cache_t* k_row) {
          for (int64_t kv = 0, h = 0; kv < num_kv_heads; ++kv) {
            const cache_t* k = k_row + kv * hd;  // [head_dim]
            for (int64_t g = 0; g < group; ++g, ++h) {  // query heads kv * group + g
              const float* qh = q.data() + h * hd;
              float dot = 0.f;
              for (int64_t d = 0; d < hd; ++d) dot += qh[d] * float(k[d]);
              scores[h * seq_len + t] = dot;
            }
          }
        });
        // --8<-- [end:scores]
      }
      // Softmax per query head (max-subtracted, so exp never overflows) over the visible keys;
      // the skipped ones weigh 0 (no -inf: -ffast-math assumes finite numbers). A soft-cap
      // (Gemma 2) bounds each scaled score first, as transformers does before its mask.
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * seq_len;
        if (softcap > 0.f)
          for (int64_t t = skip; t < seq_len; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
        float m = s[skip];
        for (int64_t t = skip + 1; t < seq_len; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < skip; ++t) s[t] = 0.f;
        for (int64_t t = skip; t < seq_len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        inv_sum[h] = 1.f / sum;
      }
      // Output: the probability-weighted sum of the values, walked the same way.
      std::fill(acc.begin(), acc.end(), 0.f);
      if (loops != DecodeLoops::portable) {
        simd_decode_values(loops, scores.data(), reinterpret_cast<const simd_t*>(v_cache), table,
                           seq_len, block_size, num_heads, num_kv_heads, head_dim, acc.data());
      } else {
        for_each_cached_token(v_cache, table, seq_len, block_size, row_elems,
                              [&](int64_t t, const cache_t* v_row) {
          for (int64_t kv = 0, h = 0; kv < num_kv_heads; ++kv) {
            const cache_t* v = v_row + kv * hd;  // [head_dim]
            for (int64_t g = 0; g < group; ++g, ++h) {
              const float p = scores[h * seq_len + t];
              float* a = acc.data() + h * hd;
              for (int64_t d = 0; d < hd; ++d) a[d] += p * float(v[d]);
            }
          }
        });
      }
      float* dst = out + token_rows[b] * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d) dst[h * head_dim + d] = acc[h * head_dim + d] * inv_sum[h];
    }
  });
}

// Calls run(cache_t{}) with the cache's C++ type for activations of type act_t: the same type, or
// a bfloat16 / float16 cache under float32 activations (kv_cache_dtype); anything else is refused.
template <typename act_t, typename Run>
void dispatch_cache_type(at::ScalarType act, at::ScalarType cache, const char* op, Run&& run) {
  if (cache == act) return run(act_t{});
  if constexpr (std::is_same_v<act_t, float>) {
    if (cache == at::kBFloat16) return run(c10::BFloat16{});
    if (cache == at::kHalf) return run(c10::Half{});
  }
  TORCH_CHECK(false, op, ": a ", cache, " KV cache needs ", cache,
              " or float32 activations (kv_cache_dtype narrower than float32 weights), got ", act);
}

// out[token_rows[b]] = softmax(q · Kᵀ · scale) · V over request b's seq_lens[b] cached tokens,
// or (sliding_window W > 0) over the last W of them; softcap > 0 caps each score first.
void paged_decode_sliding(
    const at::Tensor& out,           // float32 [T, num_heads, head_dim]
    const at::Tensor& query,         // [T, num_heads, head_dim], any strides
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& block_tables,  // int32 [B, max_blocks]
    const at::Tensor& seq_lens,      // int32 [B]
    const at::Tensor& token_rows,    // int64 [B]
    double scale, int64_t sliding_window, double softcap) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat, "out: contiguous float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  // The query is a view of the fused qkv output, token-major (rows longer than one token's
  // query) or feature-major (strides (1, head_dim * T, T), the CPU linears' transposed output):
  // its strides are passed to the kernel instead of copying the queries out.
  TORCH_CHECK(query.dim() == 3, "query must be 3-D [T, num_heads, head_dim], got ", query.dim(),
              "-D");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && token_rows.scalar_type() == at::kLong,
              "block_tables/seq_lens int32, token_rows int64");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const auto lens = seq_lens.contiguous();
  const auto rows = token_rows.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
        using query_t = scalar_t;
        dispatch_cache_type<query_t>(query.scalar_type(), k_cache.scalar_type(), "paged_decode",
                                     [&](auto cache_tag) {
          using cache_t = decltype(cache_tag);
          auto kernel = head_dim == 64    ? paged_decode_kernel<query_t, cache_t, 64>
                        : head_dim == 128 ? paged_decode_kernel<query_t, cache_t, 128>
                        : head_dim == 32  ? paged_decode_kernel<query_t, cache_t, 32>
                                          : paged_decode_kernel<query_t, cache_t, 0>;
          kernel(
              out.data_ptr<float>(), query.const_data_ptr<query_t>(),
              k_cache.const_data_ptr<cache_t>(), v_cache.const_data_ptr<cache_t>(),
              block_tables.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(),
              rows.const_data_ptr<int64_t>(), block_tables.size(0), block_tables.size(1),
              num_heads, num_kv_heads, head_dim, block_size, query.strides().data(),
              static_cast<float>(scale), sliding_window, static_cast<float>(softcap));
        });
      });
}

// The op without a window, whose schema cpu_decode_layers.cpp calls by its typed handle.
void paged_decode(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& token_rows, double scale) {
  paged_decode_sliding(out, query, k_cache, v_cache, block_tables, seq_lens, token_rows, scale, 0,
                       0.0);
}

// Which loops paged_decode runs for these dtypes and head size: "avx512", "avx2" or "portable"
// (the tests ask it, so that each level's loops are known to be the ones they hold).
std::string paged_decode_loops(at::ScalarType query_dtype, at::ScalarType cache_dtype,
                               int64_t head_dim) {
  switch (decode_loops(query_dtype, cache_dtype, head_dim)) {
    case DecodeLoops::avx512: return "avx512";
    case DecodeLoops::avx2: return "avx2";
    default: return "portable";
  }
}

// ---------------------------------------------------------------------------------- cache write
// vLLM's reshape_and_cache: each new token's K and V rows go into their slot of the paged cache,
// both caches in one call. The reference backend does it with index_copy_ after a host-side
// check for skipped slots, a sync per layer; here a slot of -1 is skipped inside the loop.
// A cache narrower than the activations (kv_cache_dtype) is rounded to as it is written.
template <typename scalar_t, typename cache_t>
void reshape_and_cache_kernel(
    const scalar_t* __restrict__ key,    // [T, num_kv_heads, head_dim] at strides k_stride
    const scalar_t* __restrict__ value,  // [T, num_kv_heads, head_dim] at strides v_stride
    cache_t* __restrict__ k_cache,       // [num_slots, num_kv_heads, head_dim]
    cache_t* __restrict__ v_cache,       // [num_slots, num_kv_heads, head_dim]
    const int64_t* __restrict__ slots,   // [T] slot of token t, -1: skip
    int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, const int64_t* k_stride,
    const int64_t* v_stride) {
  const int64_t row_elems = num_kv_heads * head_dim;
  // One row is 192 values on SmolLM2: a decode step's few dozen tokens are copied faster by one
  // thread than the pool could be woken; long prompts share out in runs of 64 tokens.
  // Token t's row of src (at strides stride) into its slot's row of cache.
  auto copy_row = [&](const scalar_t* src, const int64_t* stride, cache_t* cache, int64_t t,
                      int64_t slot) {
    const scalar_t* row = src + t * stride[0];   // [num_kv_heads, head_dim] at stride[1:]
    cache_t* cached = cache + slot * row_elems;  // [num_kv_heads, head_dim]
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const scalar_t* in = row + h * stride[1];
      cache_t* o = cached + h * head_dim;
      // A token-major row is contiguous: a plain copy the compiler vectorizes. A feature-major
      // one (the CPU linears' transposed output, strides (1, head_dim * T, T)) has its values
      // T apart; consecutive tokens read the next value of the same lines of memory, so these
      // lines stay in L1 from one token to the next.
      if (stride[2] == 1) {
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<cache_t>(in[d]);
      } else {
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<cache_t>(in[d * stride[2]]);
      }
    }
  };
  // One row is 192 values on SmolLM2: a decode step's few dozen tokens are copied faster by one
  // thread than the pool could be woken; long prompts share out in runs of 64 tokens.
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // K/V already in cache (a prefix hit) or padding
      copy_row(key, k_stride, k_cache, t, slot);
      copy_row(value, v_stride, v_cache, t, slot);
    }
  });
}

// k_cache[slot_mapping[t]] = key[t], v_cache[slot_mapping[t]] = value[t] where slot_mapping[t] >= 0.
void reshape_and_cache(
    const at::Tensor& key,           // [T, num_kv_heads, head_dim], any strides
    const at::Tensor& value,         // [T, num_kv_heads, head_dim], any strides
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& slot_mapping)  // int64 [T]; slot = block * block_size + offset, -1: skip
{
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu() && slot_mapping.device().is_cpu(),
              "reshape_and_cache: CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "reshape_and_cache: k_cache and v_cache must be contiguous "
              "[num_blocks, block_size, num_kv_heads, head_dim] of one shape");
  const int64_t num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == num_kv_heads &&
                  key.size(2) == head_dim,
              "reshape_and_cache: key and value must be [T, ", num_kv_heads, ", ", head_dim,
              "], got ", key.sizes(), " and ", value.sizes());
  TORCH_CHECK(value.scalar_type() == key.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "reshape_and_cache: key and value must share a dtype, and so must the caches");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0),
              "reshape_and_cache: slot_mapping must be int64 [T] with T = ", key.size(0));
  const auto slots = slot_mapping.contiguous();
  const int64_t* s = slots.const_data_ptr<int64_t>();
  // Checked before anything is written, so a bad slot leaves the cache as it was.
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK_INDEX(s[t] >= -1 && s[t] < num_slots, "reshape_and_cache: slot_mapping[", t,
                      "] = ", s[t], " is not in [-1, ", num_slots, ")");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, key.scalar_type(), "reshape_and_cache", [&] {
        dispatch_cache_type<scalar_t>(key.scalar_type(), k_cache.scalar_type(),
                                      "reshape_and_cache", [&](auto cache_tag) {
          using cache_t = decltype(cache_tag);
          reshape_and_cache_kernel<scalar_t, cache_t>(
              key.const_data_ptr<scalar_t>(), value.const_data_ptr<scalar_t>(),
              k_cache.mutable_data_ptr<cache_t>(), v_cache.mutable_data_ptr<cache_t>(), s,
              key.size(0), num_kv_heads, head_dim, key.strides().data(), value.strides().data());
        });
      });
}

}  // namespace

TORCH_LIBRARY(minivllm_cpu, m) {
  m.def(
      "paged_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor token_rows, float scale) -> ()",
      &paged_decode);
  m.def(
      "paged_decode_sliding(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor token_rows, float scale, "
      "int sliding_window, float softcap=0.0) -> ()",
      &paged_decode_sliding);
  m.def("paged_decode_loops(ScalarType query_dtype, ScalarType cache_dtype, int head_dim) -> str",
        &paged_decode_loops);
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()",
      &reshape_and_cache);
}

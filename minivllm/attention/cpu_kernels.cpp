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
// per KV head would read a strided third of every row, measured 2x slower). Items run on
// PyTorch's own intra-op thread pool (at::parallel_for), never a second OpenMP runtime that would
// fight it for the cores.
//
// Built on first use by minivllm/attention/cpu.py (torch.utils.cpp_extension). The loops are
// plain C++ that the compiler vectorizes: -O3 with the host's SIMD flags and -ffast-math, which
// lets it reorder the dot-product sums and call glibc's vector expf. Scores are finite here (every
// key of a decode token is visible, no mask), which is all fast-math's finite-math assumes.
//
// Two passes over a request's context (all scores, one softmax, then the values) rather than
// flash-decoding's one pass with an online softmax: both read the same bytes, and the one-pass
// version, which rescales its sums and runs the softmax on one block's 16 scores at a time,
// measured 1.2x slower per core on cached data and no faster from memory
// (scripts/bench_paged_decode_cpu.py, SmolLM2 shapes).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <cstdint>
#include <vector>

namespace {

// Load the next block's rows into cache while this block is computed: blocks are scattered, so
// the hardware prefetcher, which follows addresses, cannot guess where the next one starts.
// Measured on 2 EPYC cores: 1.7x faster decode attention at 64 requests x 256 tokens.
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

// HEAD_DIM > 0 is head_dim known at compile time (0: read at run time). With it the compiler
// unrolls each 64-long dot product and value update into a few vector instructions with no loop
// or remainder handling: measured 1.2x faster per core on cached data (SmolLM2, float32).
template <typename scalar_t, int64_t HEAD_DIM>
void paged_decode_kernel(
    float* __restrict__ out,              // [T, num_heads, head_dim] float32 output rows
    const scalar_t* __restrict__ query,   // [T, num_heads, head_dim] at strides q_stride
    const scalar_t* __restrict__ k_cache, // [num_blocks, block_size, num_kv_heads, head_dim]
    const scalar_t* __restrict__ v_cache, // [num_blocks, block_size, num_kv_heads, head_dim]
    const int32_t* __restrict__ block_tables, // [B, max_blocks]
    const int32_t* __restrict__ seq_lens,     // [B]
    const int64_t* __restrict__ token_rows,   // [B] row of request b's query in query/out
    int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, const int64_t* q_stride, float scale) {
  const int64_t hd = HEAD_DIM > 0 ? HEAD_DIM : head_dim;  // the loops' head_dim
  const int64_t group = num_heads / num_kv_heads;        // query heads per KV head
  const int64_t row_elems = num_kv_heads * head_dim;     // one token's K (or V), all KV heads
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
      const int64_t seq_len = seq_lens[b];
      const int32_t* table = block_tables + b * max_blocks;
      // The query is read once per request (num_heads * head_dim values), so its strides cost
      // nothing here and any layout the model hands over is read where it lies.
      const scalar_t* src = query + token_rows[b] * q_stride[0];  // [num_heads, head_dim]
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
          q[h * head_dim + d] = float(src[h * q_stride[1] + d * q_stride[2]]) * scale;
      scores.resize(num_heads * seq_len);

      // --8<-- [start:scores]
      // Scores: q · k for every cached token. A request is one work item, so each block is read
      // as one contiguous run of memory; with GQA, the `group` query heads of a KV head meet its
      // K row one after the other, while it is in L1.
      for_each_cached_token(k_cache, table, seq_len, block_size, row_elems,
                            [&](int64_t t, const scalar_t* k_row) {
        for (int64_t kv = 0, h = 0; kv < num_kv_heads; ++kv) {
          const scalar_t* k = k_row + kv * hd;  // [head_dim]
          for (int64_t g = 0; g < group; ++g, ++h) {  // query heads kv * group + g
            const float* qh = q.data() + h * hd;
            float dot = 0.f;
            for (int64_t d = 0; d < hd; ++d) dot += qh[d] * float(k[d]);
            scores[h * seq_len + t] = dot;
          }
        }
      });
      // --8<-- [end:scores]
      // Softmax per query head (max-subtracted, so exp never overflows).
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * seq_len;
        float m = s[0];
        for (int64_t t = 1; t < seq_len; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < seq_len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        inv_sum[h] = 1.f / sum;
      }
      // Output: the probability-weighted sum of the values, walked the same way.
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_cached_token(v_cache, table, seq_len, block_size, row_elems,
                            [&](int64_t t, const scalar_t* v_row) {
        for (int64_t kv = 0, h = 0; kv < num_kv_heads; ++kv) {
          const scalar_t* v = v_row + kv * hd;  // [head_dim]
          for (int64_t g = 0; g < group; ++g, ++h) {
            const float p = scores[h * seq_len + t];
            float* a = acc.data() + h * hd;
            for (int64_t d = 0; d < hd; ++d) a[d] += p * float(v[d]);
          }
        }
      });
      float* dst = out + token_rows[b] * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d) dst[h * head_dim + d] = acc[h * head_dim + d] * inv_sum[h];
    }
  });
}

// out[token_rows[b]] = softmax(q · Kᵀ · scale) · V over request b's seq_lens[b] cached tokens.
void paged_decode(
    const at::Tensor& out,           // float32 [T, num_heads, head_dim]
    const at::Tensor& query,         // [T, num_heads, head_dim], any strides
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& block_tables,  // int32 [B, max_blocks]
    const at::Tensor& seq_lens,      // int32 [B]
    const at::Tensor& token_rows,    // int64 [B]
    double scale) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat, "out: contiguous float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  // The query is a view of the fused qkv output, token-major (rows longer than one token's
  // query) or feature-major (strides (1, head_dim * T, T), the CPU linears' transposed output):
  // its strides are passed to the kernel instead of copying the queries out.
  TORCH_CHECK(query.dim() == 3, "query must be 3-D [T, num_heads, head_dim], got ", query.dim(),
              "-D");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "query and caches must share a dtype");
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
        auto kernel = head_dim == 64    ? paged_decode_kernel<scalar_t, 64>
                      : head_dim == 128 ? paged_decode_kernel<scalar_t, 128>
                      : head_dim == 32  ? paged_decode_kernel<scalar_t, 32>
                                        : paged_decode_kernel<scalar_t, 0>;
        kernel(
            out.data_ptr<float>(), query.const_data_ptr<scalar_t>(),
            k_cache.const_data_ptr<scalar_t>(), v_cache.const_data_ptr<scalar_t>(),
            block_tables.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(),
            rows.const_data_ptr<int64_t>(), block_tables.size(0), block_tables.size(1),
            num_heads, num_kv_heads, head_dim, block_size, query.strides().data(),
            static_cast<float>(scale));
      });
}

}  // namespace

TORCH_LIBRARY(minivllm_cpu, m) {
  m.def(
      "paged_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor token_rows, float scale) -> ()",
      &paged_decode);
}

// Encoder-only attention for CPUs: every prompt of a step attends over its own rows, no KV cache.
//
// vLLM's AttentionType.ENCODER_ONLY (BERT's bidirectional attention): row t of prompt b sees every
// row of b and nothing else, softmax(q kᵀ · scale) v with no mask inside a prompt. The reference
// backend (minivllm/attention/backends/reference.py, `encoder_attention`) is its specification:
// torch's fused SDPA once per prompt. An embedding model's prompts are short (tens of tokens) and
// its heads small (MiniLM: 12 of 32), so per prompt and layer SDPA's work is a few 16-128-row
// problems, and its fixed cost per call (views, dispatch, its own thread team, the copy back into
// the flat batch) outweighs the arithmetic, which is a few percent of the layer's linears. Here one
// call per layer does the whole step: the work items are runs of the step's prompts of about
// equal work, one a thread of PyTorch's intra-op pool (at::parallel_for), and the worker threads
// touch raw pointers only, no ATen.
//
// Per prompt, its keys are turned into float32 columns (kᵀ: [head_dim, L], keys
// contiguous) and its values into float32 rows ([L, head_dim]), in a buffer of the thread's that
// stays in L1/L2 (L <= the model's positions: 512 x 32 x 4 B = 64 KiB for MiniLM's K and V
// each); then blocks of `kRows` query rows: their scores against every key, `kKeys` keys at a
// time held in registers (each key column loaded once for the block's rows), the softmax over
// the row (max-subtracted: exp never overflows, the scores are finite, as -ffast-math assumes),
// and the weighted sum of the value rows, each value row loaded once for the block's rows. The
// arithmetic is float32 for every dtype: bfloat16 and float16 inputs widen as they are read and
// the output rounds once, as SDPA's CPU kernel accumulates in float32 too.
//
// Plain C++ with GCC's vector extension for the register tiles (one source for every level of
// minivllm/cpu/isa.py), -O3 and -ffast-math, which lets the softmax's loop call glibc's vector expf.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 8;   // query rows per block: each key and value row loaded once for 8
constexpr int64_t kKeys = 16;  // keys per register tile of scores (one 512-bit float32 vector)

// kKeys floats as one value of GCC's vector extension: the compiler maps it to the level's
// registers (one zmm on AVX-512, two ymm on AVX2, four xmm on the generic build) and keeps a
// tile of them in registers, where its auto-vectorizer kept the same loops' sums in memory.
typedef float vfloat __attribute__((vector_size(kKeys * sizeof(float))));

inline vfloat load(const float* p) {  // p: [kKeys], any alignment
  vfloat x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void store(float* p, vfloat x) { std::memcpy(p, &x, sizeof(x)); }

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr int64_t kAlign = 64 / sizeof(float);  // floats per 64-byte cache line

inline float* align(float* p) {  // the first 64-byte boundary at or after p
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  return reinterpret_cast<float*>((address + 63) / 64 * 64);
}

// dst[i] = float(src[i]) * scale for one head's row, as vector conversions: a float16 row eight
// values an instruction (F16C; the generic build converts one at a time), a bfloat16 row as
// 16-bit shifts the compiler vectorizes. The products are the scalar conversions' bit for bit.
template <typename scalar_t>
inline void widen(const scalar_t* __restrict__ src, float* __restrict__ dst, int64_t n,
                  float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]) * scale;
}

template <>
inline void widen<at::BFloat16>(const at::BFloat16* __restrict__ src, float* __restrict__ dst,
                                int64_t n, float scale) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t wide = uint32_t(bits[i]) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof(f));
    dst[i] = f * scale;
  }
}

#if defined(__F16C__)
template <>
inline void widen<at::Half>(const at::Half* __restrict__ src, float* __restrict__ dst, int64_t n,
                            float scale) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(scale)));
  }
  for (; i < n; ++i) dst[i] = float(src[i]) * scale;
}
#endif

// dst[i] = scalar_t(src[i] * scale), one output row of a head: float16 eight values an
// instruction where F16C is (round to nearest even, as the scalar conversion).
template <typename scalar_t>
inline void narrow(const float* __restrict__ src, scalar_t* __restrict__ dst, int64_t n,
                   float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = scalar_t(src[i] * scale);
}

#if defined(__F16C__)
template <>
inline void narrow<at::Half>(const float* __restrict__ src, at::Half* __restrict__ dst, int64_t n,
                             float scale) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_mul_ps(_mm256_loadu_ps(src + i), _mm256_set1_ps(scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) dst[i] = at::Half(src[i] * scale);
}
#endif

// Where a prompt's rows are: q, k, v and out are [T, heads, head_dim] views, rows stride[0]
// apart, heads stride[1] apart, head_dim contiguous.
struct Layout {
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t out_stride[2], q_stride[2], k_stride[2], v_stride[2];
};

// One head of one prompt, on float32 copies: out[i] = sum_j softmax_j(q_i · k_j) v_j over its len
// rows (q already scaled).
template <typename scalar_t>
void attend_head(scalar_t* __restrict__ out,     // [len, ...] rows out_stride apart
                 const float* __restrict__ qf,   // [len, head_dim]
                 const float* __restrict__ kt,   // [head_dim, padded]  keys as columns, 0-padded
                 const float* __restrict__ vf,   // [len, head_dim]
                 float* __restrict__ s,          // [kRows, padded]  scratch: scores, then weights
                 float* __restrict__ acc,        // [kRows, head_dim]  scratch: weighted sums
                 int64_t len, int64_t padded, int64_t head_dim, int64_t out_stride) {
  for (int64_t i0 = 0; i0 < len; i0 += kRows) {
    const int64_t rows = std::min(kRows, len - i0);
    const float* qb[kRows];  // the block's query rows; a short last block repeats its last row
    for (int64_t r = 0; r < kRows; ++r) qb[r] = qf + (i0 + std::min(r, rows - 1)) * head_dim;
    // Scores: a [kRows, kKeys] tile of sums in registers over head_dim.
    for (int64_t j0 = 0; j0 < padded; j0 += kKeys) {
      vfloat tile[kRows] = {};
      for (int64_t d = 0; d < head_dim; ++d) {
        const vfloat kd = load(kt + d * padded + j0);  // [kKeys]
        for (int64_t r = 0; r < kRows; ++r) tile[r] += qb[r][d] * kd;
      }
      for (int64_t r = 0; r < kRows; ++r) store(s + r * padded + j0, tile[r]);
    }
    // Softmax over the row's len keys. exp runs over whole tiles (the padding's scores are 0,
    // finite), so that every key takes the vector expf and no scalar tail is left; the padding's
    // weights are then zeroed before the sum.
    float inv_sum[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      float* sr = s + r * padded;
      float m = sr[0];
      for (int64_t j = 1; j < len; ++j) m = std::max(m, sr[j]);
      for (int64_t j = 0; j < padded; ++j) sr[j] = std::exp(sr[j] - m);
      for (int64_t j = len; j < padded; ++j) sr[j] = 0.f;
      float sum = 0.f;
      for (int64_t j = 0; j < padded; ++j) sum += sr[j];
      inv_sum[r] = 1.f / sum;
    }
    // The weighted sum of the value rows, each row loaded once for the block: kKeys dims at a
    // time in registers, the last few (head_dim not a multiple of kKeys) in plain loops.
    const int64_t vec_dims = head_dim / kKeys * kKeys;
    for (int64_t d0 = 0; d0 < vec_dims; d0 += kKeys) {
      vfloat sums[kRows] = {};
      for (int64_t j = 0; j < len; ++j) {
        const vfloat vj = load(vf + j * head_dim + d0);  // [kKeys]
        for (int64_t r = 0; r < kRows; ++r) sums[r] += s[r * padded + j] * vj;
      }
      for (int64_t r = 0; r < kRows; ++r) store(acc + r * head_dim + d0, sums[r]);
    }
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t d = vec_dims; d < head_dim; ++d) {
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) sum += s[r * padded + j] * vf[j * head_dim + d];
        acc[r * head_dim + d] = sum;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      narrow(acc + r * head_dim, out + (i0 + r) * out_stride, head_dim, inv_sum[r]);
    }
  }
}

// One prompt, every head. Its rows are widened to float32 first, row after row: a row holds
// every head's q, k and v side by side, so the prompt streams in once; read a head at a time,
// each row's few bytes of that head would be a cache miss of their own. Each head's q and v are
// widened by vector conversions (`widen`). The keys go into kt's columns kKeys rows at a time:
// a head's kKeys rows widened into a small block that stays in L1, then each of its head_dim
// columns stored as one whole row segment of kt (one 64-byte line on AVX-512), where a key row
// stored value by value into its column wrote head_dim lines kKeys bytes apart per key, and the
// step's thousands of such strided stores missed L1.
template <typename scalar_t>
void attend_prompt(scalar_t* out, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                   int64_t len, const Layout& x, float scale, std::vector<float>& buffer) {
  const int64_t d_ = x.head_dim, padded = round_up(len, kKeys);  // keys padded to whole tiles
  // Every part starts on a 64-byte line, every row of kt and s too (padded: whole tiles): the
  // vectorized loops then split each row into vector and scalar parts at the same place whatever
  // the buffer's address, so a prompt's result does not depend on where the allocator put it
  // (glibc's vector and scalar expf differ in the last bit), nor on the other prompts of the step.
  const int64_t kv_elems = x.num_kv_heads * d_ * padded;
  const int64_t v_elems = round_up(x.num_kv_heads * len * d_, kKeys);
  const int64_t q_elems = round_up(x.num_heads * len * d_, kKeys);
  buffer.resize(kv_elems + v_elems + q_elems + kRows * padded + round_up(kRows * d_, kKeys) +
                kKeys * d_ + kAlign);
  float* kt = align(buffer.data());            // [num_kv_heads, head_dim, padded]  keys as columns
  float* vf = kt + kv_elems;                   // [num_kv_heads, len, head_dim]
  float* qf = vf + v_elems;                    // [num_heads, len, head_dim]  scaled
  float* s = qf + q_elems;                     // [kRows, padded]
  float* acc = s + kRows * padded;             // [kRows, head_dim]
  float* kb = acc + round_up(kRows * d_, kKeys);  // [kKeys, head_dim]  key rows, widened
  for (int64_t j = 0; j < len; ++j) {
    for (int64_t h = 0; h < x.num_kv_heads; ++h) {
      widen(v + j * x.v_stride[0] + h * x.v_stride[1], vf + (h * len + j) * d_, d_, 1.f);
    }
    for (int64_t h = 0; h < x.num_heads; ++h) {
      widen(q + j * x.q_stride[0] + h * x.q_stride[1], qf + (h * len + j) * d_, d_, scale);
    }
  }
  for (int64_t j0 = 0; j0 < padded; j0 += kKeys) {  // the keys, kKeys at a time, into kt's columns
    const int64_t rows = std::min(kKeys, len - j0);
    std::fill(kb + rows * d_, kb + kKeys * d_, 0.f);  // padding keys: 0, finite scores
    for (int64_t h = 0; h < x.num_kv_heads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        widen(k + (j0 + r) * x.k_stride[0] + h * x.k_stride[1], kb + r * d_, d_, 1.f);
      }
      for (int64_t d = 0; d < d_; ++d) {
        vfloat column;  // keys j0.. of dimension d
        for (int64_t r = 0; r < kKeys; ++r) column[r] = kb[r * d_ + d];
        store(kt + (h * d_ + d) * padded + j0, column);
      }
    }
  }
  const int64_t group = x.num_heads / x.num_kv_heads;  // query heads per KV head (GQA)
  for (int64_t h = 0; h < x.num_heads; ++h) {
    const int64_t kv = h / group;
    attend_head<scalar_t>(out + h * x.out_stride[1], qf + h * len * d_, kt + kv * d_ * padded,
                          vf + kv * len * d_, s, acc, len, padded, d_, x.out_stride[0]);
  }
}

// The step's prompts split into at most `parts` runs of consecutive prompts of about equal work:
// a prompt of L rows costs about L² (its scores and weighted sums) plus L (its widening), so an
// even split of the prompts would leave a thread with the long ones working while the other
// waits. first[p] is run p's first prompt; first[parts] = num_prompts.
std::vector<int64_t> split_by_work(const int32_t* starts, int64_t num_prompts, int64_t parts) {
  std::vector<double> work(num_prompts + 1, 0.0);  // work[b]: prompts 0..b-1's, in order
  for (int64_t b = 0; b < num_prompts; ++b) {
    const double len = starts[b + 1] - starts[b];
    work[b + 1] = work[b] + len * len + 32.0 * len;
  }
  std::vector<int64_t> first(parts + 1, num_prompts);
  first[0] = 0;
  for (int64_t p = 1; p < parts; ++p) {  // the first prompt that ends past p / parts of the work
    const double target = work[num_prompts] * double(p) / double(parts);
    int64_t b = std::lower_bound(work.begin(), work.end(), target) - work.begin();
    if (b > 0 && target - work[b - 1] < work[b] - target) --b;  // the nearer boundary
    first[p] = std::clamp(b, first[p - 1], num_prompts);
  }
  return first;
}

template <typename scalar_t>
void encoder_attention_kernel(scalar_t* out, const scalar_t* q, const scalar_t* k,
                              const scalar_t* v, const int32_t* starts, int64_t num_prompts,
                              const Layout& x, float scale) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_prompts));
  const std::vector<int64_t> first = split_by_work(starts, num_prompts, parts);
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> buffer;  // the thread's, reused across its prompts
    for (int64_t b = first[part_begin]; b < first[part_end]; ++b) {
      const int64_t start = starts[b], len = starts[b + 1] - starts[b];
      if (len == 0) continue;
      attend_prompt<scalar_t>(out + start * x.out_stride[0], q + start * x.q_stride[0],
                              k + start * x.k_stride[0], v + start * x.v_stride[0], len, x, scale,
                              buffer);
    }
  });
}

void check_qkv(const at::Tensor& t, const at::Tensor& query, const char* name) {
  const char* op = "encoder_attention";
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 3, op, ": ", name, " must be 3-D [T, heads, head_dim], got ", t.dim(),
              "-D");
  TORCH_CHECK(t.scalar_type() == query.scalar_type(), op, ": ", name,
              " must have the query's dtype ", query.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.size(0) == query.size(0) && t.size(2) == query.size(2), op, ": ", name,
              " must have the query's rows and head_dim, got ", t.sizes(), " against ",
              query.sizes());
  TORCH_CHECK(t.size(2) <= 1 || t.stride(2) == 1, op, ": ", name,
              "'s last dim must be contiguous (stride 1), got stride ", t.stride(2));
}

// out[t, h] = softmax(query[t, h] · key[rows of t's prompt, h / group]ᵀ · scale) · value[...]
void encoder_attention(const at::Tensor& out,                // [T, num_heads, head_dim]
                       const at::Tensor& query,              // [T, num_heads, head_dim]
                       const at::Tensor& key,                // [T, num_kv_heads, head_dim]
                       const at::Tensor& value,              // [T, num_kv_heads, head_dim]
                       const at::Tensor& query_start_loc,    // int32 [B + 1]
                       double scale) {
  check_qkv(query, query, "query");
  check_qkv(out, query, "out");
  check_qkv(key, query, "key");
  check_qkv(value, query, "value");
  TORCH_CHECK(out.sizes() == query.sizes(), "encoder_attention: out must have the query's shape ",
              query.sizes(), ", got ", out.sizes());
  TORCH_CHECK(key.sizes() == value.sizes(), "encoder_attention: key and value must have one shape, "
              "got ", key.sizes(), " and ", value.sizes());
  const int64_t num_heads = query.size(1), num_kv_heads = key.size(1);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "encoder_attention: num_heads (", num_heads, ") must be a multiple of num_kv_heads (",
              num_kv_heads, ")");
  TORCH_CHECK(query_start_loc.device().is_cpu() && query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.dim() == 1 && query_start_loc.is_contiguous() &&
                  query_start_loc.size(0) >= 1,
              "encoder_attention: query_start_loc must be a contiguous int32 [B + 1] CPU tensor");
  const int32_t* starts = query_start_loc.const_data_ptr<int32_t>();
  const int64_t num_prompts = query_start_loc.size(0) - 1;
  TORCH_CHECK(starts[0] == 0 && starts[num_prompts] == query.size(0),
              "encoder_attention: query_start_loc must run from 0 to T = ", query.size(0),
              ", got ", starts[0], " to ", starts[num_prompts]);
  for (int64_t b = 0; b < num_prompts; ++b) {
    TORCH_CHECK(starts[b] <= starts[b + 1], "encoder_attention: query_start_loc must not "
                "decrease, got ", starts[b], " then ", starts[b + 1]);
  }
  const Layout x{num_heads, num_kv_heads, query.size(2),
                 {out.stride(0), out.stride(1)}, {query.stride(0), query.stride(1)},
                 {key.stride(0), key.stride(1)}, {value.stride(0), value.stride(1)}};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "encoder_attention", [&] {
        encoder_attention_kernel<scalar_t>(
            out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(),
            key.const_data_ptr<scalar_t>(), value.const_data_ptr<scalar_t>(), starts,
            num_prompts, x, static_cast<float>(scale));
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def(
      "encoder_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, "
      "Tensor query_start_loc, float scale) -> ()",
      &encoder_attention);
}

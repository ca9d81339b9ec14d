// The entry points of a SIMD loop file of the CPU paged decode kernel (cpu_attention_avx512.cpp,
// cpu_attention_avx2.cpp), the functions that cpu_attention.cpp declares for each and calls:
// decode_scores and decode_values over a float32 or a bfloat16 cache, each running the file's
// scores_kernel / values_kernel of C = head_dim / MINIVLLM_DECODE_LANES vectors a head (head sizes
// 32, 64 and 128). One copy for both widths: only the vector's float lanes differ.
//
// Included at the end of each of those files, inside its namespace, with MINIVLLM_DECODE_LANES
// defined where the file's loops are compiled; elsewhere the entry points do nothing (they are
// never called there: the file's `decode_<isa>_applies` is false). No include guard: each file
// includes it once, into its own namespace.

// scores[h * seq_len + t] = q[h] · k_t for every query head h < num_heads and cached token
// t < seq_len; q is [num_heads, head_dim] (already scaled), the cache
// [num_blocks, block_size, num_kv_heads, head_dim], table the request's block table.
template <typename T>
static void decode_scores_impl(const float* q, const T* k_cache, const T* v_cache,
                               const int32_t* table, int64_t seq_len, int64_t block_size,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               float* scores) {
#if defined(MINIVLLM_DECODE_LANES)
  constexpr int kLanes = MINIVLLM_DECODE_LANES;
  auto kernel = head_dim == 32   ? scores_kernel<32 / kLanes, T>
                : head_dim == 64 ? scores_kernel<64 / kLanes, T>
                                 : scores_kernel<128 / kLanes, T>;
  kernel(q, k_cache, v_cache, table, seq_len, block_size, num_heads, num_kv_heads, scores);
#endif
}

void decode_scores(const float* q, const float* k_cache, const float* v_cache,
                   const int32_t* table, int64_t seq_len, int64_t block_size, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, float* scores) {
  decode_scores_impl(q, k_cache, v_cache, table, seq_len, block_size, num_heads, num_kv_heads,
                     head_dim, scores);
}

// The same over a bfloat16 cache, given as its 16-bit patterns.
void decode_scores(const float* q, const uint16_t* k_cache, const uint16_t* v_cache,
                   const int32_t* table, int64_t seq_len, int64_t block_size, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, float* scores) {
  decode_scores_impl(q, k_cache, v_cache, table, seq_len, block_size, num_heads, num_kv_heads,
                     head_dim, scores);
}

// acc[h] += Σ_t p[h * seq_len + t] · v_t over the request's cached tokens; acc is
// [num_heads, head_dim].
template <typename T>
static void decode_values_impl(const float* p, const T* v_cache, const int32_t* table,
                               int64_t seq_len, int64_t block_size, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, float* acc) {
#if defined(MINIVLLM_DECODE_LANES)
  constexpr int kLanes = MINIVLLM_DECODE_LANES;
  auto kernel = head_dim == 32   ? values_kernel<32 / kLanes, T>
                : head_dim == 64 ? values_kernel<64 / kLanes, T>
                                 : values_kernel<128 / kLanes, T>;
  kernel(p, v_cache, table, seq_len, block_size, num_heads, num_kv_heads, acc);
#endif
}

void decode_values(const float* p, const float* v_cache, const int32_t* table, int64_t seq_len,
                   int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   float* acc) {
  decode_values_impl(p, v_cache, table, seq_len, block_size, num_heads, num_kv_heads, head_dim,
                     acc);
}

// The same over a bfloat16 cache, given as its 16-bit patterns.
void decode_values(const float* p, const uint16_t* v_cache, const int32_t* table, int64_t seq_len,
                   int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   float* acc) {
  decode_values_impl(p, v_cache, table, seq_len, block_size, num_heads, num_kv_heads, head_dim,
                     acc);
}

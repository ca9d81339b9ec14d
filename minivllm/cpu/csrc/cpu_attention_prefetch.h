// The software prefetch of the CPU paged decode loops (cpu_attention_avx512.cpp and
// cpu_attention_avx2.cpp, one copy for both widths): a request's blocks are scattered over the
// cache, so the hardware prefetcher cannot guess where the next one starts, and the loops ask for
// it themselves while the current block is computed.
//
// Included by those two files where their loops are compiled (after <immintrin.h>); the functions
// have internal linkage, so that each build's copy is compiled with that build's flags.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace minivllm_cpu_decode {
namespace {

// Prefetches the next block a slice at a time: each of the block's passes (one per query head
// and tile of tokens) asks for the next `step` bytes, so the whole block is on its way by the time
// this one is done and the requests in flight never pile up (a block is 192 lines on SmolLM2;
// asked for at once, most of them were dropped).
template <bool kToL2>  // true: into L2 (_MM_HINT_T1), false: into L1
struct BlockPrefetcher {
  const char* next = nullptr;  // the next block, or null
  int64_t bytes = 0, done = 0, step = 0;  // its size, how much is asked for, bytes per pass

  template <typename T>
  void start(const T* block, int64_t elems, int64_t passes) {
    next = reinterpret_cast<const char*>(block);
    bytes = block == nullptr ? 0 : elems * int64_t(sizeof(T));
    done = 0;
    step = (bytes / passes + 63) & ~int64_t(63);
  }
  void pass() {
    const int64_t end = std::min(bytes, done + step);
    for (; done < end; done += 64) {
      if constexpr (kToL2) _mm_prefetch(next + done, _MM_HINT_T1);
      else _mm_prefetch(next + done, _MM_HINT_T0);
    }
  }
};

// The values pass reads V right after the scores pass has read K, and one block ahead is too
// little to hide the memory's latency when it starts: asked for only as the pass reaches them,
// its first blocks arrive one at a time. So the scores pass of a request's last blocks also
// pulls its first V blocks into L2 (`kValueLead` bytes of them, which a core's L2 holds beside
// the rest: each loop file says how much), and the values pass keeps asking that far ahead; L1
// still gets the next block.
// How many blocks of `block_bytes` the V stream runs ahead of the values pass.
template <int64_t kValueLead>
inline int64_t value_lead_blocks(int64_t num_blocks, int64_t block_bytes) {
  return std::min(num_blocks, std::max<int64_t>(1, kValueLead / block_bytes));
}

}  // namespace
}  // namespace minivllm_cpu_decode

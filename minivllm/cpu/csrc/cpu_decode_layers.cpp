// A decode step's decoder layers in one call: the CPU's answer to vLLM's CUDA graphs.
//
// A decode step does little work per op: at 1-64 rows a Llama layer is ~10 kernels of tens to
// hundreds of microseconds, and between two of them Python runs the layer's `forward` — module
// calls, custom-op dispatch, views, the wrappers' checks. That host work costs about the same at
// any row count, so it weighs most on the smallest steps. vLLM removes the same cost on a GPU by
// capturing the decode step into a CUDA graph that replays without the host; there is no such graph
// on a CPU, so here the host work itself moves to C++: this op runs every layer of the step,
// calling the very kernels `LlamaModel.forward` calls on the CPU fast path, in the same order, on
// the same layouts, so that its result is bit for bit the Python path's
// (tests/worker/test_kernels_cpu_decode_loop.py checks exactly that).
//
// Per layer, with T token rows, the same sequence as minivllm/model/models/llama.py (linear: oneDNN on a
// prepacked weight, the skinny GEMM on a plain one, on a GGUF model's blocks the gguf_linear op of
// each part's dot kind: float32, bf16 or int8, as the Python path picks it per block type):
//   input norm (the first layer: rms_norm; later: fused_add_rms_norm, adding the residual)
//   qkv = linear(hidden, W_qkv); rotary_embedding on its query and key heads, in place
//   reshape_and_cache(k, v); attention = paged_decode(q) over each request's blocks
//   hidden = linear(attention, W_o); post-attention fused_add_rms_norm
//   hidden = linear(silu_and_mul(linear(hidden, W_gate_up)), W_down)
// then the final fused_add_rms_norm. A model whose linears carry LoRA adapters
// (minivllm/lora/layers.py) adds, after each linear's product and before anything reads it, each
// of the linear's slices' Punica delta (shrink, then expand at the slice's offset), every row with
// its own adapter slot, a row of slot -1 untouched: all of a linear's slices in one call of
// cpu_lora_punica.cpp's add_lora_linear, whose elements are bit for bit those of the lora_shrink
// and lora_expand ops the Python wrappers call per slice on the CPU backend; where no row of the step has an
// adapter, no linear runs them, as the wrappers skip both when `LoRAMapping.has_lora` is false. minivllm/worker/cpu_decode_loop.py decides when it applies
// (decode-only steps, one device, no biases, prepacked weights, GGUF blocks, or plain float32
// ones on at most 64 rows) and hands it the weights. Where oneDNN packs them, a model's linear weights come in
// oneDNN's layout (an MKLDNN tensor, minivllm/cpu/op_forwards.py `prepack_linear`): those
// linears call oneDNN, as the Python path does. A bfloat16 model's attention output is computed
// in float32 and rounded to bf16, as the backend does.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <ATen/core/stack.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

using at::Tensor;
using CT = const Tensor&;

// A GGUF linear's products (`dots`), as minivllm/worker/cpu_decode_loop.py numbers them: the
// ops gguf_linear, gguf_linear_bf16 and gguf_linear_int8, and gguf_linear_int8 that takes AMX
// tiles (gguf_linear_amx, the same outputs) from kAmxMinRows rows, as `gguf_amx_applies` in
// minivllm/cpu/ops.py picks them (GGUF_AMX_MIN_ROWS there).
constexpr int64_t kDotFloat32 = 0, kDotBf16 = 1, kDotInt8 = 2, kDotInt8Amx = 3;
constexpr int64_t kAmxMinRows = 16;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The library's own ops, found once. They are called through the dispatcher, as from Python,
// so that each is the very kernel the Python path runs (and the profiler still sees each one).
struct Kernels {
  c10::TypedOperatorHandle<void(Tensor&, CT, CT)> skinny_gemm =
      find_op<void(Tensor&, CT, CT)>("minivllm_cpu::skinny_gemm");
  c10::TypedOperatorHandle<void(CT, CT, CT, double)> rms_norm =
      find_op<void(CT, CT, CT, double)>("minivllm_cpu::rms_norm");
  c10::TypedOperatorHandle<void(CT, CT, CT, double)> fused_add_rms_norm =
      find_op<void(CT, CT, CT, double)>("minivllm_cpu::fused_add_rms_norm");
  c10::TypedOperatorHandle<void(CT, CT)> silu_and_mul =
      find_op<void(CT, CT)>("minivllm_cpu::silu_and_mul");
  c10::TypedOperatorHandle<void(CT, CT, CT)> rotary_embedding =
      find_op<void(CT, CT, CT)>("minivllm_cpu::rotary_embedding");
  c10::TypedOperatorHandle<void(CT, CT, CT, CT, CT)> reshape_and_cache =
      find_op<void(CT, CT, CT, CT, CT)>("minivllm_cpu::reshape_and_cache");
  c10::TypedOperatorHandle<void(CT, CT, CT, CT, CT, CT, CT, double)> paged_decode =
      find_op<void(CT, CT, CT, CT, CT, CT, CT, double)>("minivllm_cpu::paged_decode");
  c10::TypedOperatorHandle<void(Tensor&, CT, CT, int64_t)> gguf_linear =
      find_op<void(Tensor&, CT, CT, int64_t)>("minivllm_cpu::gguf_linear");
  c10::TypedOperatorHandle<void(Tensor&, CT, CT, int64_t)> gguf_linear_bf16 =
      find_op<void(Tensor&, CT, CT, int64_t)>("minivllm_cpu::gguf_linear_bf16");
  c10::TypedOperatorHandle<void(Tensor&, CT, CT, int64_t)> gguf_linear_int8 =
      find_op<void(Tensor&, CT, CT, int64_t)>("minivllm_cpu::gguf_linear_int8");
  c10::TypedOperatorHandle<void(Tensor&, CT, CT, int64_t)> gguf_linear_amx =
      find_op<void(Tensor&, CT, CT, int64_t)>("minivllm_cpu::gguf_linear_amx");
  c10::TypedOperatorHandle<void(Tensor&, CT, at::TensorList, at::TensorList, CT, CT)>
      add_lora_linear = find_op<void(Tensor&, CT, at::TensorList, at::TensorList, CT, CT)>(
          "minivllm_cpu::add_lora_linear");

  static const Kernels& get() {
    static const Kernels kernels;  // after every op is registered: on the first call
    return kernels;
  }

  // oneDNN's linear on a prepacked weight (`mkldnn::_linear_pointwise`, what `packed_linear` in
  // minivllm/cpu/op_forwards.py calls), found on first use: a build without oneDNN lacks it.
  static Tensor onednn_linear(const Tensor& x, const Tensor& packed) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack;
    stack.reserve(6);
    stack.emplace_back(x.contiguous());
    stack.emplace_back(packed);
    stack.emplace_back(c10::IValue());  // no bias
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<std::optional<at::Scalar>>());
    stack.emplace_back(c10::IValue());
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }

  Tensor linear(const Tensor& x, const Tensor& weight) const {  // [T, K] x [N, K] -> [T, N]
    if (weight.is_mkldnn()) return onednn_linear(x, weight);
    Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
    skinny_gemm.call(out, x, weight);
    return out;
  }

  // The GGUF op of a dot kind (`dots`: kDotFloat32, kDotBf16, kDotInt8, kDotInt8Amx) for `rows`.
  const c10::TypedOperatorHandle<void(Tensor&, CT, CT, int64_t)>& gguf_op(int64_t dot,
                                                                         int64_t rows) const {
    TORCH_CHECK(dot >= kDotFloat32 && dot <= kDotInt8Amx, "minivllm_cpu::decode_layers: dot kind ",
                dot, " is none of 0 (float32), 1 (bf16), 2 (int8), 3 (int8, AMX from ",
                kAmxMinRows, " rows)");
    if (dot == kDotInt8Amx) return rows >= kAmxMinRows ? gguf_linear_amx : gguf_linear_int8;
    return dot == kDotBf16 ? gguf_linear_bf16 : dot == kDotInt8 ? gguf_linear_int8 : gguf_linear;
  }

  // A linear of `n` weights from `w`: one plain (qtype < 0) weight, or the GGUF block parts of a
  // quantized layer (qtypes[i] its GGML type), each multiplied by the op of its dot kind
  // (dots[i]) in float32 and their outputs side by side, as `gguf_linear_cpu` in
  // minivllm/cpu/op_forwards.py does.
  Tensor linear(const Tensor& x, const Tensor* w, const int64_t* qtypes, const int64_t* dots,
                int64_t n) const {
    if (qtypes[0] < 0) return linear(x, w[0]);
    const Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    std::vector<Tensor> outs;
    for (int64_t i = 0; i < n; ++i) {
      Tensor out = at::empty({x.size(0), w[i].size(0)}, xf.options());  // [T, rows of part i]
      gguf_op(dots[i], x.size(0)).call(out, xf, w[i], qtypes[i]);
      outs.push_back(std::move(out));
    }
    Tensor y = n == 1 ? outs[0] : at::cat(outs, 1);
    return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
  }
};

constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate_up, down
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down: those LoRA may wrap

// The LoRA adapters of a model's linears, as the op takes them: per linear (layer by layer, in
// the order qkv, o, gate_up, down) its slices' stacked A and B, one after the other, and its
// scales. What `BaseLinearLayerWithLoRA.add_lora` runs, with the same kernels.
struct LoRA {
  at::TensorList a;       // per slice: [L, R, in]  its stacked A, every slot
  at::TensorList b;       // per slice: [L, out_i, R]  its stacked B
  at::TensorList scales;  // per linear: [L]  each slot's scale
  std::vector<int64_t> start;  // linear j's slices are a[start[j]] .. a[start[j + 1] - 1]
  const Tensor* token_slots;   // int64 [T] each row's slot, -1 none; nullptr: no row has one

  // out[:, slice i] += each row's scale · (x Aᵢᵀ) Bᵢᵀ, in place, for linear j; x [T, in]: all
  // its slices in one call, the same elements as a shrink and an expand per slice.
  void add(const Kernels& k, const Tensor& x, Tensor& out, int64_t j) const {
    if (token_slots == nullptr) return;
    const Tensor xr = x.stride(1) == 1 ? x : x.contiguous();  // the kernel reads token rows
    const int64_t n = start[j + 1] - start[j];
    k.add_lora_linear.call(out, xr, a.slice(start[j], n), b.slice(start[j], n), *token_slots,
                           scales[j]);
  }
};

Tensor decode_layers(
    const Tensor& embeds,         // [T, hidden] the step's token embeddings
    const Tensor& positions,      // int64 [T]
    const Tensor& cos_sin,        // float32 [2, max_positions, head_dim]
    const Tensor& kv_caches,      // [layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    const Tensor& block_tables,   // int32 [T, max_blocks] each row's block table
    const Tensor& seq_lens,       // int32 [T]
    const Tensor& rows,           // int64 [T]
    const Tensor& slot_mapping,   // int64 [T]
    at::TensorList weights,       // kWeightsPerLayer slots per layer, in the order above
    const Tensor& final_norm,     // [hidden]
    double eps, double scale, int64_t num_heads,
    at::TensorList lora_a,        // per LoRA slice (see `LoRA`): its stacked A; [] no LoRA
    at::TensorList lora_b,        // per LoRA slice: its stacked B
    at::TensorList lora_scales,   // per linear (kLinearsPerLayer a layer): its scales
    at::IntArrayRef lora_slices,  // per linear: how many slices of lora_a / lora_b it takes
    const std::optional<Tensor>& token_slots,  // int64 [T]; None: no row has an adapter
    at::IntArrayRef qtypes,       // per tensor of `weights`: its GGML type, -1 plain; [] all plain
    at::IntArrayRef parts,        // per slot: how many tensors of `weights` it takes; [] one each
    at::IntArrayRef dots) {       // per tensor of `weights`: a GGUF part's dot kind; [] float32

  const char* op = "minivllm_cpu::decode_layers";
  const int64_t layers = kv_caches.size(0);
  TORCH_CHECK(embeds.dim() == 2 && embeds.is_contiguous() &&
                  (embeds.scalar_type() == at::kFloat || embeds.scalar_type() == at::kBFloat16),
              op, ": embeds must be contiguous float32 or bfloat16 [T, hidden]");
  TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(1) == 2, op,
              ": kv_caches must be [layers, 2, num_blocks, block_size, num_kv_heads, head_dim]");
  const int64_t slots = parts.empty() ? int64_t(weights.size()) : int64_t(parts.size());
  TORCH_CHECK(slots == kWeightsPerLayer * layers, op, ": expected ", kWeightsPerLayer * layers,
              " weights for ", layers, " layers, got ", slots);
  // Where slot s's tensors start in `weights` (and in `qtypes`).
  std::vector<int64_t> start(slots + 1, 0);
  for (int64_t i = 0; i < slots; ++i) start[i + 1] = start[i] + (parts.empty() ? 1 : parts[i]);
  TORCH_CHECK(start[slots] == int64_t(weights.size()), op, ": parts add up to ", start[slots],
              " tensors, but ", weights.size(), " weights were given");
  TORCH_CHECK(qtypes.empty() || qtypes.size() == weights.size(), op, ": qtypes must name ",
              weights.size(), " weights' types, got ", qtypes.size());
  TORCH_CHECK(dots.empty() || dots.size() == weights.size(), op, ": dots must name ",
              weights.size(), " weights' dot kinds, got ", dots.size());
  const std::vector<int64_t> plain(weights.size(), -1), float32(weights.size(), kDotFloat32);
  const int64_t* types = qtypes.empty() ? plain.data() : qtypes.data();
  const int64_t* kinds = dots.empty() ? float32.data() : dots.data();
  const Kernels& k = Kernels::get();
  const int64_t T = embeds.size(0);
  LoRA lora{lora_a, lora_b, lora_scales, std::vector<int64_t>(1, 0), nullptr};
  if (!lora_slices.empty()) {
    TORCH_CHECK(int64_t(lora_slices.size()) == kLinearsPerLayer * layers &&
                    lora_scales.size() == lora_slices.size(),
                op, ": lora_slices and lora_scales must name ", kLinearsPerLayer * layers,
                " linears, got ", lora_slices.size(), " and ", lora_scales.size());
    for (int64_t n : lora_slices) lora.start.push_back(lora.start.back() + n);
    TORCH_CHECK(lora.start.back() == int64_t(lora_a.size()) && lora_a.size() == lora_b.size(), op,
                ": lora_slices add up to ", lora.start.back(), " slices, but ", lora_a.size(),
                " A and ", lora_b.size(), " B were given");
    if (token_slots.has_value()) lora.token_slots = &*token_slots;  // the kernels check its rows
  }
  const int64_t num_kv_heads = kv_caches.size(4), head_dim = kv_caches.size(5);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;

  // The residual stream starts as the embeddings; each norm after the first adds the sublayer's
  // output into it, in place (vLLM's fused add + norm, as in LlamaDecoderLayer.forward).
  Tensor residual = embeds;
  Tensor hidden = at::empty_like(embeds);
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* slot = start.data() + kWeightsPerLayer * l;  // this layer's six slots
    const Tensor* w = weights.data();
    // Slot j (1, 2, 4, 5: the layer's linears), the layer's linear i (0-3) of LoRA's count.
    auto linear = [&](const Tensor& x, int j, int64_t i) {
      Tensor out =
          k.linear(x, w + slot[j], types + slot[j], kinds + slot[j], slot[j + 1] - slot[j]);
      if (!lora_slices.empty()) lora.add(k, x, out, kLinearsPerLayer * l + i);
      return out;
    };
    if (l == 0) {
      k.rms_norm.call(hidden, residual, w[slot[0]], eps);
    } else {
      k.fused_add_rms_norm.call(hidden, residual, w[slot[0]], eps);
    }
    Tensor qkv = linear(hidden, 1, 0);  // [T, q_size + 2 * kv_size]
    // RoPE turns the query and key heads, side by side in each row, in one pass.
    k.rotary_embedding.call(
        positions, qkv.narrow(1, 0, q_size + kv_size).view({T, num_heads + num_kv_heads, head_dim}),
        cos_sin);
    const Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    const Tensor key = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    const Tensor k_cache = kv_caches[l][0], v_cache = kv_caches[l][1];
    k.reshape_and_cache.call(key, value, k_cache, v_cache, slot_mapping);
    // The kernel writes float32 (it accumulates in float32); a bf16 model rounds it after.
    Tensor attention = at::empty({T, num_heads, head_dim}, embeds.options().dtype(at::kFloat));
    k.paged_decode.call(attention, q, k_cache, v_cache, block_tables, seq_lens, rows, scale);
    if (embeds.scalar_type() != at::kFloat) attention = attention.to(embeds.scalar_type());
    hidden = linear(attention.view({T, q_size}), 2, 1);
    k.fused_add_rms_norm.call(hidden, residual, w[slot[3]], eps);
    Tensor gate_up = linear(hidden, 4, 2);  // [T, 2 * intermediate]
    Tensor activation = at::empty({T, gate_up.size(1) / 2}, embeds.options());
    k.silu_and_mul.call(activation, gate_up);
    hidden = linear(activation, 5, 3);
  }
  k.fused_add_rms_norm.call(hidden, residual, final_norm, eps);
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def(
      "decode_layers(Tensor(b!) embeds, Tensor positions, Tensor cos_sin, Tensor(a!) kv_caches, "
      "Tensor block_tables, Tensor seq_lens, Tensor rows, Tensor slot_mapping, Tensor[] weights, "
      "Tensor final_norm, float eps, float scale, int num_heads, Tensor[] lora_a, "
      "Tensor[] lora_b, Tensor[] lora_scales, int[] lora_slices, Tensor? token_slots, "
      "int[] qtypes=[], int[] parts=[], int[] dots=[]) -> Tensor",
      &decode_layers);
}

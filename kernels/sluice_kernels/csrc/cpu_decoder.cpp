// The Llama decoder stack for decode steps on CPU, in one call.
//
// A decode step of a small model is a few hundred small kernel calls; made
// from Python, each costs more in dispatch than in arithmetic (about 10 ms
// per step for SmolLM2-135M's 30 layers on the development machine, against
// a few ms of work). This class holds the layers' weights and runs the same
// kernels, in the same order and on the same values as
// models/llama.py's forward does, so the hidden states it returns are
// bitwise the Python path's (tested in server/tests/test_cpu_decoder.py):
//
//   for each layer:
//     h, res = rms_norm(x, res)            q, k, v = split(qkv(h));  rotary(q, k)
//     cache[slot] = k, v                   a = paged_decode_attention(q, cache)
//     x = o(a);  h, res = rms_norm(x, res);  x = down(silu_mul(gate_up(h)))
//   return rms_norm(x, res)
//
// With LoRA adapters (set_lora gives a linear layer the adapter slots'
// packed stacks, which it reads in place, so loads and unloads show): a step
// whose rows use adapters passes their segments, and each adapted linear
// layer adds its rows' updates with the grouped matmul right after its own
// matmul, as the Python layers do (cpu_lora.cpp). The stacks are checked by
// the Python side when it hands them over and the segments once per step
// (sluice_kernels.lora.check_lora_args), not here per layer.
//
// Only decode steps (one new token per sequence) whose matmuls all run on
// GGUF blocks come here (the shard's models/llama_cpu_decoder.py builds this
// and its model runner picks the steps); prefill and larger steps keep the
// Python path.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "sluice_cpu.h"

namespace {

struct BlockLinear {
  // The blocks in q8_pack's record layouts: one packed weight, or several
  // whose outputs follow each other (a layer whose pieces have different
  // block types, each in its own layout: gguf_blocks.QuantizedParts).
  std::vector<at::Tensor> data;
  std::vector<int64_t> formats, outs;
  int64_t out_features = 0;
  bool int8 = false;
  std::optional<at::Tensor> bias;

  at::Tensor part(const at::Tensor& x, size_t i) const {
    return int8 ? sluice_cpu::q8_linear(x, data[i], formats[i], outs[i], 0)
                : sluice_cpu::exact_linear(x, data[i], formats[i], outs[i], 0);
  }

  at::Tensor matmul(const at::Tensor& x) const {
    if (data.size() == 1) return part(x, 0);
    std::vector<at::Tensor> ys;
    for (size_t i = 0; i < data.size(); ++i) ys.push_back(part(x, i));
    return at::cat(ys, 1);
  }

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y = matmul(x);
    if (bias.has_value()) y.add_(*bias);
    return y;
  }
};

// cache[slot[t]] = rows[t] for the T rows of [T, Hkv, D] (rows strided, each
// row's heads contiguous). A float32 cache takes the rows as they are; a
// bfloat16 one rounds them to nearest even, as torch's .to(torch.bfloat16)
// does (so the Python path's write_kv stores the same bits).
void store_rows(const at::Tensor& rows, const at::Tensor& cache, const int64_t* slot) {
  const int64_t T = rows.size(0), row = rows.size(1) * rows.size(2), stride = rows.stride(0);
  const float* src = rows.data_ptr<float>();
  if (cache.scalar_type() == at::kFloat) {
    float* dst = cache.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) std::memcpy(dst + slot[t] * row, src + t * stride, row * sizeof(float));
    return;
  }
  TORCH_CHECK(cache.scalar_type() == at::kBFloat16, "caches must be float32 or bfloat16");
  at::BFloat16* dst = cache.data_ptr<at::BFloat16>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < row; ++j) dst[slot[t] * row + j] = at::BFloat16(src[t * stride + j]);
}

// One linear layer's LoRA stacks, packed (cpu_lora.cpp has the layout).
struct LoraStacks {
  at::Tensor a, b, bounds, ranks;
};

// A step's adapter segments (int32 [G] each) and the slots' scales, read
// once per step; G = 0: no adapter rows.
struct LoraStep {
  const int32_t *starts = nullptr, *ends = nullptr, *slots = nullptr;
  const float* scales = nullptr;
  int64_t G = 0;
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  BlockLinear qkv, o, gate_up, down;
  // Per linear layer, in the order qkv, o, gate_up, down.
  std::optional<LoraStacks> lora[4];
};

// y += the adapter updates of x's rows (nothing without adapter rows).
void add_lora(const std::optional<LoraStacks>& stacks, const LoraStep& step, const at::Tensor& x, at::Tensor& y) {
  if (!stacks.has_value() || step.G == 0) return;
  sluice_cpu::lora_apply_unchecked(y, x, stacks->a, stacks->b, stacks->bounds.data_ptr<int32_t>(), step.starts,
                                   step.ends, step.slots, step.G, stacks->ranks.data_ptr<int32_t>(), step.scales);
}

// A column-parallel layer (qkv, gate_up) in the Python layers' order: matmul,
// bias, adapters.
at::Tensor column(const BlockLinear& linear, const std::optional<LoraStacks>& stacks, const LoraStep& step,
                  const at::Tensor& x) {
  at::Tensor y = linear(x);
  add_lora(stacks, step, x, y);
  return y;
}

// A row-parallel layer (o, down): the adapters come before the bias (which
// the Python layer adds after its all-reduce).
at::Tensor row(const BlockLinear& linear, const std::optional<LoraStacks>& stacks, const LoraStep& step,
               const at::Tensor& x) {
  at::Tensor y = linear.matmul(x);
  add_lora(stacks, step, x, y);
  if (linear.bias.has_value()) y.add_(*linear.bias);
  return y;
}

class LlamaDecoder : public torch::CustomClassHolder {
 public:
  LlamaDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, at::Tensor final_norm)
      : hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), eps_(eps), final_norm_(std::move(final_norm)) {}

  // Linear layers as (data, format, out_features, int8, bias?), in the order
  // qkv, o, gate_up, down; parts[i] (data, format, out_features) entries
  // in turn are linear layer i's packed pieces, their outputs in order.
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, std::vector<at::Tensor> data,
                 std::vector<int64_t> formats, std::vector<int64_t> out_features, bool int8,
                 std::vector<std::optional<at::Tensor>> biases, std::vector<int64_t> parts) {
    TORCH_CHECK(parts.size() == 4 && biases.size() == 4, "a layer has four linear layers: qkv, o, gate_up, down");
    const int64_t total = parts[0] + parts[1] + parts[2] + parts[3];
    TORCH_CHECK(total >= 4 && static_cast<int64_t>(data.size()) == total &&
                    static_cast<int64_t>(formats.size()) == total && static_cast<int64_t>(out_features.size()) == total,
                "one (data, format, out_features) per part of the four linear layers");
    BlockLinear l[4];
    for (int i = 0, at = 0; i < 4; at += parts[i], ++i) {
      TORCH_CHECK(parts[i] >= 1, "linear layer ", i, " has no parts");
      l[i].int8 = int8;
      l[i].bias = biases[i];
      for (int64_t j = at; j < at + parts[i]; ++j) {
        l[i].data.push_back(data[j]);
        l[i].formats.push_back(formats[j]);
        l[i].outs.push_back(out_features[j]);
        l[i].out_features += out_features[j];
      }
    }
    TORCH_CHECK(l[0].out_features == (hq_ + 2 * hkv_) * d_, "qkv has ", l[0].out_features, " outputs, not ",
                (hq_ + 2 * hkv_) * d_);
    layers_.push_back(Layer{std::move(input_norm), std::move(post_attention_norm), l[0], l[1], l[2], l[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // LoRA stacks of linear layer `linear` (0 qkv, 1 o, 2 gate_up, 3 down) of
  // layer `layer`, packed and checked (check_lora_args); held by reference
  // (the shard loads adapters in place).
  void set_lora(int64_t layer, int64_t linear, at::Tensor a, at::Tensor b, at::Tensor bounds, at::Tensor ranks) {
    TORCH_CHECK(0 <= layer && layer < num_layers() && 0 <= linear && linear < 4, "no linear layer ", linear,
                " in layer ", layer);
    layers_[layer].lora[linear] = LoraStacks{std::move(a), std::move(b), std::move(bounds), std::move(ranks)};
  }

  // x: [T, hidden] embeddings of the step's tokens (one per sequence);
  // cos/sin: [T, D/2]; slots [T], block_tables [T, nb], seq_lens [T] int64;
  // one key and one value cache per layer; with adapter rows, their
  // segments (int32 starts, ends, slots) and the slots' scales, else none.
  // Returns the final-norm hidden states.
  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, std::optional<at::Tensor> lora_starts,
                     std::optional<at::Tensor> lora_ends, std::optional<at::Tensor> lora_slots,
                     std::optional<at::Tensor> lora_scales) const {
    TORCH_CHECK(lora_starts.has_value() == (lora_ends.has_value() && lora_slots.has_value() && lora_scales.has_value()),
                "LoRA segments come as starts, ends, slots and scales together");
    LoraStep lora;
    if (lora_starts.has_value())
      lora = LoraStep{lora_starts->data_ptr<int32_t>(), lora_ends->data_ptr<int32_t>(), lora_slots->data_ptr<int32_t>(),
                      lora_scales->data_ptr<float>(), lora_starts->numel()};
    const int64_t T = x_in.size(0);
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "one cache per layer");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
                "slots must be int64 [T]");
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t kv_row = hkv_ * d_;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d_));
    at::Tensor x = x_in;
    std::optional<at::Tensor> residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto [h, res] = sluice_cpu::rms_norm(x, residual, layer.input_norm, eps_);
      residual = res;
      at::Tensor qkv = column(layer.qkv, layer.lora[0], lora, h);
      at::Tensor q = qkv.narrow(1, 0, hq_ * d_).view({T, hq_, d_});
      at::Tensor k = qkv.narrow(1, hq_ * d_, kv_row).view({T, hkv_, d_});
      at::Tensor v = qkv.narrow(1, (hq_ + hkv_) * d_, kv_row).view({T, hkv_, d_});
      sluice_cpu::rotary_(q, k, cos, sin);
      const at::Tensor& kc = k_caches[i];
      const at::Tensor& vc = v_caches[i];
      TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.size(2) * kc.size(3) == kv_row,
                  "layer ", i, ": caches must be contiguous [NB, BS, Hkv, D]");
      const int64_t capacity = kc.size(0) * kc.size(1);
      for (int64_t t = 0; t < T; ++t)
        TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " outside the cache");
      store_rows(k, kc, slot);
      store_rows(v, vc, slot);
      at::Tensor attn = at::empty({T, hq_, d_}, x.options());
      sluice_cpu::paged_decode_attention(attn, q, kc, vc, block_tables, seq_lens, scale, /*window=*/0);
      x = row(layer.o, layer.lora[1], lora, attn.view({T, hq_ * d_}));
      auto [h2, res2] = sluice_cpu::rms_norm(x, residual, layer.post_attention_norm, eps_);
      residual = res2;
      x = row(layer.down, layer.lora[3], lora, sluice_cpu::silu_mul(column(layer.gate_up, layer.lora[2], lora, h2)));
    }
    return std::get<0>(sluice_cpu::rms_norm(x, residual, final_norm_, eps_));
  }

 private:
  int64_t hq_, hkv_, d_;
  double eps_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.class_<LlamaDecoder>("LlamaDecoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, at::Tensor>())
      .def("add_layer", &LlamaDecoder::add_layer)
      .def("num_layers", &LlamaDecoder::num_layers)
      .def("set_lora", &LlamaDecoder::set_lora)
      .def("forward", &LlamaDecoder::forward);
}

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
  at::Tensor data;  // the blocks in q8_pack's record layout
  int64_t format = 0;
  int64_t out_features = 0;
  bool int8 = false;
  std::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y = int8 ? sluice_cpu::q8_linear(x, data, format, out_features, 0)
                        : sluice_cpu::exact_linear(x, data, format, out_features, 0);
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

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  BlockLinear qkv, o, gate_up, down;
};

class LlamaDecoder : public torch::CustomClassHolder {
 public:
  LlamaDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, at::Tensor final_norm)
      : hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), eps_(eps), final_norm_(std::move(final_norm)) {}

  // Linear layers as (data, format, out_features, int8, bias?), in the order
  // qkv, o, gate_up, down.
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, std::vector<at::Tensor> data,
                 std::vector<int64_t> formats, std::vector<int64_t> out_features, bool int8,
                 std::vector<std::optional<at::Tensor>> biases) {
    TORCH_CHECK(data.size() == 4 && formats.size() == 4 && out_features.size() == 4 && biases.size() == 4,
                "a layer has four linear layers: qkv, o, gate_up, down");
    BlockLinear l[4];
    for (int i = 0; i < 4; ++i) l[i] = BlockLinear{data[i], formats[i], out_features[i], int8, biases[i]};
    TORCH_CHECK(out_features[0] == (hq_ + 2 * hkv_) * d_, "qkv has ", out_features[0], " outputs, not ",
                (hq_ + 2 * hkv_) * d_);
    layers_.push_back(Layer{std::move(input_norm), std::move(post_attention_norm), l[0], l[1], l[2], l[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: [T, hidden] embeddings of the step's tokens (one per sequence);
  // cos/sin: [T, D/2]; slots [T], block_tables [T, nb], seq_lens [T] int64;
  // one key and one value cache per layer. Returns the final-norm hidden states.
  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches) const {
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
      at::Tensor qkv = layer.qkv(h);
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
      x = layer.o(attn.view({T, hq_ * d_}));
      auto [h2, res2] = sluice_cpu::rms_norm(x, residual, layer.post_attention_norm, eps_);
      residual = res2;
      x = layer.down(sluice_cpu::silu_mul(layer.gate_up(h2)));
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
      .def("forward", &LlamaDecoder::forward);
}

// The expert MLP of a mixture-of-experts layer on GGUF (or MXFP4) blocks,
// in one call per layer (reference: sluice_kernels.moe.expert_mlp_reference).
//
// Given each token's k experts (ids, ascending per token) and their weights,
//
//   rows   the T*k (token, slot) pairs sorted by expert, stably (counting sort):
//          expert e owns rows [offsets[e], offsets[e + 1])
//   h      = x[token(row)] W13_e^T (+ b13_e)        [T*k, 2I]  grouped_block_linear
//   a      = act(h)                                  [T*k, I]   silu(gate) * up, or gpt-oss's
//                                                               clamped SwiGLU (below)
//   y      = a W2_e^T (+ b2_e)                       [T*k, H]   grouped_block_linear
//   out[t] = w[t,0] y[row(t,0)] + w[t,1] y[row(t,1)] + ...      in slot order
//
// so each selected expert's weights are read once per step whatever the
// number of its tokens, and experts no token chose are not touched. The
// activations are those of sluice_kernels.moe.activate:
//
//   silu        gate / (1 + e^-gate) * up
//   swiglu_oai  g = min(gate, limit), u = clamp(up, -limit, limit):  (u + 1) * g / (1 + e^(-alpha g))
//
// A token's result depends only on its own row and experts (the block
// matmuls are row-independent), whatever else is in the step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "sluice_cpu.h"

namespace {

enum Activation : int64_t { SILU = 0, SWIGLU_OAI = 1 };

// Counting sort of the slots by expert: (row of each slot, token of each row, offsets).
struct Groups {
  std::vector<int64_t> row_of_slot, token_of_row, offsets;
};

Groups group_slots(const at::Tensor& ids, int64_t experts) {
  const int64_t T = ids.size(0), k = ids.size(1), slots = T * k;
  const int64_t* id = ids.data_ptr<int64_t>();
  Groups g{std::vector<int64_t>(slots), std::vector<int64_t>(slots), std::vector<int64_t>(experts + 1, 0)};
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(id[s] >= 0 && id[s] < experts, "expert id ", id[s], " out of range [0, ", experts, ")");
    ++g.offsets[id[s] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) g.offsets[e + 1] += g.offsets[e];
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t row = next[id[s]]++;
    g.row_of_slot[s] = row;
    g.token_of_row[row] = s / k;
  }
  return g;
}

// h [R, 2I] (+ bias of each row's expert) -> act [R, I].
at::Tensor activate(const at::Tensor& h, const Groups& g, const std::optional<at::Tensor>& b13, int64_t activation,
                    float alpha, float limit) {
  const int64_t R = h.size(0), I = h.size(1) / 2;
  at::Tensor out = at::empty({R, I}, h.options());
  const float* hp = h.data_ptr<float>();
  const float* bp = b13.has_value() ? b13->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t experts = static_cast<int64_t>(g.offsets.size()) - 1;
  at::parallel_for(0, experts, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const float* bias = bp ? bp + e * 2 * I : nullptr;
      for (int64_t r = g.offsets[e]; r < g.offsets[e + 1]; ++r) {
        const float* row = hp + r * 2 * I;
        for (int64_t i = 0; i < I; ++i) {
          float gate = row[i], up = row[I + i];
          if (bias) {
            gate += bias[i];
            up += bias[I + i];
          }
          if (activation == SILU) {
            op[r * I + i] = gate / (1.f + std::exp(-gate)) * up;
          } else {
            gate = std::min(gate, limit);
            up = std::clamp(up, -limit, limit);
            op[r * I + i] = (up + 1.f) * (gate / (1.f + std::exp(-alpha * gate)));
          }
        }
      }
    }
  });
  return out;
}

at::Tensor moe_block_mlp(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                         const at::Tensor& w13, int64_t format13, const at::Tensor& w2, int64_t format2,
                         int64_t intermediate, const std::optional<at::Tensor>& b13,
                         const std::optional<at::Tensor>& b2, int64_t activation, double alpha, double limit,
                         bool int8, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x must be contiguous float32 [T, H]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == x.size(0) && ids.is_contiguous(),
              "ids must be contiguous int64 [T, k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == ids.sizes() && weights.is_contiguous(),
              "weights must be contiguous float32 [T, k]");
  TORCH_CHECK(activation == SILU || activation == SWIGLU_OAI, "activation must be 0 (silu) or 1 (swiglu_oai)");
  const int64_t experts = w13.size(0), T = x.size(0), k = ids.size(1), H = x.size(1), I = intermediate;
  TORCH_CHECK(w2.dim() == 2 && w2.size(0) == experts, "w13 and w2 must hold the same experts");
  TORCH_CHECK(!b13.has_value() || (b13->scalar_type() == at::kFloat && b13->is_contiguous() &&
                                   b13->sizes() == at::IntArrayRef({experts, 2 * I})),
              "b13 must be contiguous float32 [E, 2I]");
  TORCH_CHECK(!b2.has_value() || (b2->scalar_type() == at::kFloat && b2->is_contiguous() &&
                                  b2->sizes() == at::IntArrayRef({experts, H})),
              "b2 must be contiguous float32 [E, H]");
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const Groups g = group_slots(ids, experts);
  const at::Tensor xs = x.index_select(0, at::tensor(g.token_of_row, ids.options()));
  const at::Tensor h = sluice_cpu::grouped_block_linear(xs, g.offsets, w13, format13, 2 * I, int8, isa);
  const at::Tensor a = activate(h, g, b13, activation, static_cast<float>(alpha), static_cast<float>(limit));
  const at::Tensor y = sluice_cpu::grouped_block_linear(a, g.offsets, w2, format2, H, int8, isa);
  const float* yp = y.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* bp = b2.has_value() ? b2->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // Each slot's (y + b2) times its weight, summed in slot order: the
  // reference's (per_slot * weight), then += slot by slot.
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = op + t * H;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = t * k + j;
        const float* row = yp + g.row_of_slot[s] * H;
        const float* bias = bp ? bp + id[s] * H : nullptr;
        const float w = wp[s];
        for (int64_t c = 0; c < H; ++c) {
          const float v = (bias ? row[c] + bias[c] : row[c]) * w;
          o[c] = j == 0 ? v : o[c] + v;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.def(
      "moe_block_mlp(Tensor x, Tensor ids, Tensor weights, Tensor w13, int format13, Tensor w2, int format2, "
      "int intermediate, Tensor? b13, Tensor? b2, int activation, float alpha, float limit, bool int8, "
      "int isa=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) { m.impl("moe_block_mlp", &moe_block_mlp); }

// The small per-token ops of a decoder layer for the CPU shard (float32), each
// one pass over its rows instead of the 3 to 16 eager torch ops it replaces
// (per-op dispatch dominates these at decode batch sizes):
//
//   rms_norm(x, residual?, weight, eps) -> (normed, sum)
//       sum = x + residual (or x); normed = sum * rsqrt(mean(sum^2) + eps) * weight
//   rotary_(q, k, cos, sin)        GPT-NeoX rotate-half, in place; token t uses row t
//   silu_mul(x) -> out             [T, 2I] -> silu(x[:, :I]) * x[:, I:] (ATen's
//                                  kernels, for the C++ decoder: the Python
//                                  forward runs the same two in torch)
//   argmax_rows(x) -> (max, index) per row of [B, V], what torch.max(x, -1)
//                                  returns (the first index of the maximum; a
//                                  row with a NaN: NaN and the first NaN's
//                                  index), for greedy sampling: torch's
//                                  reduction with indices ran 8-20x slower
//                                  than a plain max over a vocabulary

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "sluice_cpu.h"

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

void check_float_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [T, H] with contiguous rows");
}

}  // namespace

namespace sluice_cpu {

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  check_float_rows(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == H,
              "weight must be float32 [H]");
  at::Tensor sum = residual.has_value() ? at::empty({T, H}, x.options()) : x;
  if (residual.has_value()) {
    check_float_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have x's shape");
  }
  at::Tensor out = at::empty({T, H}, x.options());
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = x.data_ptr<float>() + t * x.stride(0);
      float* sr = sum.data_ptr<float>() + t * sum.stride(0);
      if (residual.has_value()) {
        const float* rr = residual->data_ptr<float>() + t * residual->stride(0);
        for (int64_t i = 0; i < H; ++i) sr[i] = xr[i] + rr[i];
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += sr[i] * sr[i];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
      float* o = out.data_ptr<float>() + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = w[i] * (sr[i] * r);
    }
  });
  return {out, sum};
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->dim() == 3 && x->stride(2) == 1,
                "q and k must be float32 [T, H, D] with contiguous head vectors");
  }
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(k.size(0) == T && k.size(2) == D, "q and k must agree on T and D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.sizes() == sin.sizes() &&
                  sin.is_contiguous() && cos.size(0) >= T && cos.size(1) == half,
              "cos/sin must be float32 [T, D/2]");
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (at::Tensor* x : {&q, &k}) {
      float* base = x->data_ptr<float>();
      const int64_t heads = x->size(1), st = x->stride(0), sh = x->stride(1);
      for (int64_t t = begin; t < end; ++t) {
        const float* ct = c + t * half;
        const float* sn = s + t * half;
        for (int64_t h = 0; h < heads; ++h) {
          float* x1 = base + t * st + h * sh;
          float* x2 = x1 + half;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * ct[i] - b * sn[i];
            x2[i] = b * ct[i] + a * sn[i];
          }
        }
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& x) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [T, 2I]");
  // ATen's silu is vectorized (a scalar exp loop here ran 3-9x slower, from
  // one decode row to a 2048-token prefill) and is the arithmetic of
  // transformers' F.silu(gate) * up, bit for bit.
  const int64_t I = x.size(1) / 2;
  at::Tensor out = at::silu(x.narrow(1, 0, I));
  out.mul_(x.narrow(1, I, I));
  return out;
}

std::tuple<at::Tensor, at::Tensor> argmax_rows(const at::Tensor& x) {
  check_float_rows(x, "x");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "x must have at least one column");
  at::Tensor values = at::empty({B}, x.options());
  at::Tensor indices = at::empty({B}, x.options().dtype(at::kLong));
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* r = x.data_ptr<float>() + b * x.stride(0);
      // Two passes, each a vector loop: the maximum (and whether a NaN is
      // there), then the first position that holds it.
      float m = -std::numeric_limits<float>::infinity();
      int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
      for (int64_t i = 0; i < V; ++i) {
        m = r[i] > m ? r[i] : m;
        nan |= r[i] != r[i];
      }
      int64_t at = 0;
      if (nan) {
        while (r[at] == r[at]) ++at;
        m = r[at];
      } else {
#if defined(__AVX512F__)
        const __m512 mv = _mm512_set1_ps(m);
        for (; at + 16 <= V; at += 16) {
          const __mmask16 hit = _mm512_cmpeq_ps_mask(_mm512_loadu_ps(r + at), mv);
          if (hit) break;
        }
#endif
        while (r[at] != m) ++at;
      }
      vp[b] = m;
      ip[b] = at;
    }
  });
  return {values, indices};
}

}  // namespace sluice_cpu

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
  m.impl("rms_norm", &sluice_cpu::rms_norm);
  m.impl("rotary_", &sluice_cpu::rotary_);
  m.impl("silu_mul", &sluice_cpu::silu_mul);
  m.impl("argmax_rows", &sluice_cpu::argmax_rows);
}

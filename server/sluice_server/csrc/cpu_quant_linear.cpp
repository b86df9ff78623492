// y = x W^T for weights kept in GGUF's block formats, for the few-row matmuls
// of decode steps on CPU, where reading float32 weights from memory is the
// whole cost: Q4_1 is 0.625 bytes per weight, Q8_0 1.0625, float32 4.
//
//   Q4_1 block (20 bytes, 32 weights):  fp16 d | fp16 m | 16 bytes of nibbles
//        weight j = d * q_j + m, q_j = byte[j] & 15 (j < 16), byte[j-16] >> 4 (j >= 16)
//   Q8_0 block (34 bytes, 32 weights):  fp16 d | 32 int8 q      weight j = d * q_j
//
// W is [N, K / 32] blocks (row n of the weight is K/32 consecutive blocks).
// Each block is expanded to 32 floats in registers once and multiplied into
// up to 8 rows of x at a time; work is split over output features.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "sluice_cpu.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SLUICE_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;
enum class Format { Q4_1, Q8_0 };

inline int64_t block_bytes(Format f) { return f == Format::Q4_1 ? 20 : 34; }

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// The 32 weights of one block, as floats.
inline void dequant_scalar(Format f, const uint8_t* blk, float* w) {
  const float d = half_to_float(blk);
  if (f == Format::Q4_1) {
    const float m = half_to_float(blk + 2);
    const uint8_t* qs = blk + 4;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(qs[j] & 15) + m;
      w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(qs[j]);
  }
}

#ifdef SLUICE_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline void dequant_avx2(Format f, const uint8_t* blk, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_f16c(blk));
  if (f == Format::Q4_1) {
    const __m256 m = _mm256_set1_ps(half_f16c(blk + 2));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), m);
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    const __m128i parts[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])));
  }
}

// out[r, n] for rows r < R (R <= 8) of x, one output feature n.
template <int R>
inline void row_dot(Format f, const uint8_t* wrow, int64_t nblocks, const float* x, int64_t x_stride, float* out,
                    int64_t out_stride, int64_t bb) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    __m256 w[4];
    dequant_avx2(f, wrow + b * bb, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * x_stride + b * QK;
      acc[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r]);
      acc[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r]);
      acc[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r]);
      acc[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]);
}

template <int R>
void rows_avx2(Format f, const uint8_t* wp, int64_t n0, int64_t n1, int64_t nblocks, const float* x,
               int64_t x_stride, float* out, int64_t out_stride) {
  const int64_t bb = block_bytes(f);
  for (int64_t n = n0; n < n1; ++n) row_dot<R>(f, wp + n * nblocks * bb, nblocks, x, x_stride, out + n, out_stride, bb);
}
#endif

void rows_scalar(Format f, const uint8_t* wp, int64_t n0, int64_t n1, int64_t nblocks, const float* x, int64_t M,
                 int64_t x_stride, float* out, int64_t out_stride) {
  const int64_t bb = block_bytes(f);
  float w[QK];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < M; ++r) out[r * out_stride + n] = 0.f;
    for (int64_t b = 0; b < nblocks; ++b) {
      dequant_scalar(f, wp + (n * nblocks + b) * bb, w);
      for (int64_t r = 0; r < M; ++r) {
        const float* xr = x + r * x_stride + b * QK;
        float s = 0.f;
        for (int j = 0; j < QK; ++j) s += w[j] * xr[j];
        out[r * out_stride + n] += s;
      }
    }
  }
}

}  // namespace

namespace sluice_cpu {

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t out_features) {
  TORCH_CHECK(format == 0 || format == 1, "format must be 0 (Q4_1) or 1 (Q8_0)");
  const Format f = format == 0 ? Format::Q4_1 : Format::Q8_0;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "x must be float32 [M, K]");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "weight must be contiguous uint8 blocks");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  const int64_t nblocks = K / QK;
  TORCH_CHECK(weight.numel() == N * nblocks * block_bytes(f), "weight holds ", weight.numel(),
              " bytes, not the ", N * nblocks * block_bytes(f), " of [", N, ", ", K, "] in this format");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += 8) {
      const int64_t R = std::min<int64_t>(8, M - r0);
      const float* xr = xp + r0 * xs;
      float* orow = op + r0 * N;
#ifdef SLUICE_AVX2
      switch (R) {
        case 1: rows_avx2<1>(f, wp, n0, n1, nblocks, xr, xs, orow, N); break;
        case 2: rows_avx2<2>(f, wp, n0, n1, nblocks, xr, xs, orow, N); break;
        case 3: rows_avx2<3>(f, wp, n0, n1, nblocks, xr, xs, orow, N); break;
        case 4: rows_avx2<4>(f, wp, n0, n1, nblocks, xr, xs, orow, N); break;
        case 5: rows_avx2<5>(f, wp, n0, n1, nblocks, xr, xs, orow, N); break;
        case 6: rows_avx2<6>(f, wp, n0, n1, nblocks, xr, xs, orow, N); break;
        case 7: rows_avx2<7>(f, wp, n0, n1, nblocks, xr, xs, orow, N); break;
        default: rows_avx2<8>(f, wp, n0, n1, nblocks, xr, xs, orow, N); break;
      }
#else
      rows_scalar(f, wp, n0, n1, nblocks, xr, R, xs, orow, N);
#endif
    }
  });
  return out;
}

}  // namespace sluice_cpu

namespace {

// The float32 weight [N, K] a block tensor stands for (tests, load-time checks).
at::Tensor dequantize(const at::Tensor& weight, int64_t format, int64_t out_features, int64_t in_features) {
  const Format f = format == 0 ? Format::Q4_1 : Format::Q8_0;
  TORCH_CHECK(in_features % QK == 0, "K must be a multiple of 32");
  const int64_t nblocks = in_features / QK;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.numel() == out_features * nblocks * block_bytes(f),
              "weight size does not match [N, K] in this format");
  at::Tensor out = at::empty({out_features, in_features}, weight.options().dtype(at::kFloat));
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_features * nblocks, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) dequant_scalar(f, wp + b * block_bytes(f), op + b * QK);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor weight, int format, int out_features) -> Tensor");
  m.def("dequantize(Tensor weight, int format, int out_features, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
  m.impl("quant_linear", &sluice_cpu::quant_linear);
  m.impl("dequantize", &dequantize);
}

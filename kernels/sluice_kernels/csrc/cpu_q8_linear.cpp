// y = x W^T on GGUF weight blocks with int8 activations: llama.cpp's
// arithmetic (Q4_1 x Q8_1, Q8_0 x Q8_0, ...), run with integer dot products.
//
// Activations: each row of x is cut into blocks of 32 values and quantized
// once per call, per block:  dx = max|x| / 127,  xq = round(x / dx) (int8),
// sx = dx * sum(xq) (and the same over each half of 16).  Weights: every GGUF
// format read here is, per run of 32 weights of a row (of 16 for Q6_K),
// w = sw * wq + cw  with wq unsigned (gguf_blocks.py unpacks each
// format into that form), so that, per output and block,
//   sum_j w_j x_j  ~  sw * dx * dot(wq, xq)  +  cw * sx
// where dot(u8, s8) is exact in int32 (VPDPBUSD / PMADDWD); with a pair per
// 16, the same for each half.
//
// Packed layout (built once at load by q8_pack): output rows in groups of 16,
// so one 512-bit register holds 16 outputs and a step needs no horizontal sum.
// For group g, block b, a record of
//
//   [ sw: 16 scales ][ cw: 16 scales ][ weights ]
//
// with the scales fp16 where that holds them exactly (Q4_0/1, Q5_0/1, Q8_0)
// and fp32 otherwise (the K-quants' d * scale products); U8_HALVES (Q6_K,
// alone or mixed in a layer) has a pair per half of 16, fp32:
//   [ sw lo ][ sw hi ][ cw lo ][ cw hi ][ weights ]
// and the weights
//   8-bit, chunk c = 0..7 (64 bytes each):  for n < 16: wq[n, 4c .. 4c+3]
//   4-bit, chunk c = 0..3 (64 bytes each):  for n < 16, i < 4:
//        byte = wq[n, 4c + i] | wq[n, 16 + 4c + i] << 4
//        (low nibbles: K-chunk c, high nibbles: K-chunk c + 4)
//
// The K-quants' scales are products: d * sc (d fp16, sc 6 or 8 bits), which
// need float32, and fp32 pairs per 32 weights cost a Q4_K layer 1.33x its
// file. So a layer all of Q4_K or all of Q6_K keeps the super-block's own
// fields instead, per group and super-block of 256 values (8 blocks):
//
//   U4_K  [ d: 16 fp16 ][ dmin: 16 fp16 ][ sc: 8 x 16 bytes ][ m: 8 x 16 bytes ]
//         then 8 blocks of 4-bit weights as above          (1.03x a Q4_K file)
//   U6_K  [ d: 16 fp16 ][ sc: 16 x 16 int8, one per run of 16 ]
//         then 8 blocks of: the low 4 bits as 4-bit weights, and two planes
//         of 64 bytes with the high 2 bits, plane p byte 4 n + i holding
//         those of chunks p, p + 2, p + 4, p + 6 at bits 0-1, 2-3, 4-5, 6-7
//                                                          (1.0x a Q6_K file)
//
// and the kernels form the block's pair, d * sc and -(dmin * m) or -32 d sc,
// in registers: the same float32 values the other layouts store (each
// product is exact), so the results are the same bits. One exception: for
// Q6_K's constant pair the AVX-512 and AVX2 kernels take the 32 off inside
// the integer dot product, sum (wq - 32) xq, and sum the two halves'
// products before the one multiply by dx; two FMAs fewer per row and block
// (Q6_K matmuls ran at 45-49% of the int8 rate, Q4_K's at 58-63%), and
// nearer the exact result, as the offset cancels in integers instead of
// float32. The AVX-512 kernel's direct and expanded (U6_X) forms share that
// arithmetic, so a row's result still does not depend on the step's other
// rows. (The portable kernel keeps the float32 pair.)
//
// The layouts are the codes below (the `format` argument of q8_linear).
//
// A K-chunk of 4 values of one activation row is broadcast to all 16 lanes and
// multiplied with the 16 outputs' 4 weights: one VPDPBUSD per chunk.
//
// Kernels: AVX-512 VNNI, AVX-VNNI (256-bit), AVX2 (PMADDUBSW on weights of
// at most 6 bits, see small_dots256 and, for steps of several rows,
// group_avx2_bytes; on 8-bit ones on their magnitudes, the signs moved to
// the activations, see signed_dots256) and
// scalar, each compiled with its own target attribute and chosen at run time
// from the CPU's features, so one build runs on any x86-64 host and the tests
// run every kernel the host can execute against the same reference.
//
// Batch invariance: an output's value depends only on its own row of x (the
// rows are quantized one by one, and each row's blocks are summed in order),
// so a token's result does not depend on the other rows of its matmul.
//
// (An AMX-INT8 version, one TDPBUSD per block of 32 with the block scales
// applied after it, measured slower than this kernel at every row count on a
// Sapphire Rapids host, and slower than oneDNN's bf16 AMX from 16 rows: the
// per-block scaling, not the tile unit, bounds it. Larger steps therefore use
// the dense bf16 weights instead; see cpu_matmuls.py.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "sluice_cpu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define SLUICE_X86 1
#endif

namespace {

constexpr int64_t QK = 32;  // values per block
constexpr int64_t NG = 16;  // outputs per group

// Record layouts: weight bits x scale width, then the two K-quant layouts
// that keep a super-block's own scale fields (see the top of the file).
enum Layout : int64_t { U4_F16 = 0, U8_F16 = 1, U4_F32 = 2, U8_F32 = 3, U8_HALVES = 4, U4_K = 5, U6_K = 6,
                        // Internal only, the copies run_item makes of a group for big steps: a U6_K
                        // group's (expand_group512, expand_bytes256), and for the AVX2 kernel
                        // without VNNI, a 4-bit one's with the weights unpacked to bytes (U8_F32's
                        // records, weights at most 15; see group_avx2_bytes).
                        U6_X = 7, U4_X = 8 };
enum Isa : int64_t { ISA_AUTO = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX_VNNI = 3, ISA_AVX512_VNNI = 4 };

// Super-block layouts: a header per 256 values, then 8 blocks' weights.
constexpr bool super_blocks(int64_t l) { return l == U4_K || l == U6_K; }
// The weights' low 4 bits are nibble-packed (U6_K adds a plane of 2 high bits).
constexpr bool four_bit(int64_t l) { return l == U4_F16 || l == U4_F32 || l == U4_K || l == U6_K; }
constexpr bool six_bit(int64_t l) { return l == U6_K; }
constexpr bool f32_scales(int64_t l) { return l == U4_F32 || l == U8_F32 || l == U8_HALVES || l == U6_X || l == U4_X; }
// A scale pair per 16 weights instead of per 32 (U6_X: a scale only).
constexpr bool halves(int64_t l) { return l == U8_HALVES || l == U6_K || l == U6_X; }
// Q6_K's weights are sw * (wq - 32): the AVX-512 and AVX2 kernels take the
// 32 off in integers (see group_avx512), so U6_X records need no cw.
constexpr bool q6_offset(int64_t l) { return l == U6_K || l == U6_X; }
// Weights of at most 6 bits, whatever their packing (see small_dots256).
constexpr bool narrow(int64_t l) { return four_bit(l) || l == U6_X || l == U4_X; }
constexpr int64_t scale_bytes(int64_t l) { return f32_scales(l) ? 4 : 2; }
// Scale vectors of 16 per record: (sw, cw), or (sw lo, sw hi, cw lo, cw hi).
constexpr int64_t scale_sets(int64_t l) { return l == U8_HALVES ? 4 : 2; }
constexpr int64_t weight_bytes(int64_t l) {
  return six_bit(l) ? NG * QK / 2 + NG * QK / 4 : four_bit(l) ? NG * QK / 2 : NG * QK;
}
// Where the K-quant headers keep their fields (d first in both, 16 fp16):
// U4_K's dmin, its 8 rows of 16 sc bytes and its 8 of m; U6_K's 16 rows of
// int8 scales, one per run of 16 values.
constexpr int64_t K4_DMIN = 2 * NG, K4_SC = 4 * NG, K4_M = K4_SC + 8 * NG, K4_END = K4_M + 8 * NG;
constexpr int64_t K6_SC = 2 * NG, K6_END = K6_SC + 16 * NG;
// Bytes before a record's weights; for super-block layouts, before its first block's.
constexpr int64_t header_bytes(int64_t l) {
  return l == U4_K ? K4_END : l == U6_K ? K6_END : scale_sets(l) * NG * scale_bytes(l);
}
constexpr int64_t record_bytes(int64_t l) { return header_bytes(l) + weight_bytes(l); }
constexpr int64_t SUPER = 8;  // blocks of 32 per K-quant super-block
// Bytes of one group's records for nb blocks of 32.
constexpr int64_t group_bytes(int64_t l, int64_t nb) {
  return super_blocks(l) ? nb / SUPER * (header_bytes(l) + SUPER * weight_bytes(l)) : nb * record_bytes(l);
}

// Block b of a group whose records start at `group`: its header (the
// record's, or its super-block's) and its weights.
inline void locate(int64_t l, const uint8_t* group, int64_t b, const uint8_t*& head, const uint8_t*& weights) {
  if (super_blocks(l)) {
    head = group + (b / SUPER) * (header_bytes(l) + SUPER * weight_bytes(l));
    weights = head + header_bytes(l) + (b % SUPER) * weight_bytes(l);
  } else {
    head = group + b * record_bytes(l);
    weights = head + header_bytes(l);
  }
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Output i's (< 16) scale pairs for block b: sw[h], cw[h] for the half h of
// 16 values (the same pair for both where the layout has one per 32). The
// K-quant layouts form them as the unpacking does (gguf_blocks.py): d * sc
// and -(dmin * m), or d * sc and -32 * (d * sc), each exact in float32.
inline void block_scales(int64_t layout, const uint8_t* head, int64_t b, int64_t i, float sw[2], float cw[2]) {
  const int64_t j = b % SUPER;
  if (layout == U4_K) {
    sw[0] = sw[1] = fp16(head + 2 * i) * static_cast<float>(head[K4_SC + j * NG + i]);
    cw[0] = cw[1] = -(fp16(head + K4_DMIN + 2 * i) * static_cast<float>(head[K4_M + j * NG + i]));
    return;
  }
  if (layout == U6_K) {
    for (int h = 0; h < 2; ++h) {
      sw[h] = fp16(head + 2 * i) * static_cast<float>(static_cast<int8_t>(head[K6_SC + (2 * j + h) * NG + i]));
      cw[h] = -32.f * sw[h];
    }
    return;
  }
  auto scale = [&](int which) {
    const uint8_t* p = head + (which * NG + i) * scale_bytes(layout);
    if (!f32_scales(layout)) return fp16(p);
    float v;
    std::memcpy(&v, p, 4);
    return v;
  };
  if (halves(layout)) {
    sw[0] = scale(0), sw[1] = scale(1), cw[0] = scale(2), cw[1] = scale(3);
  } else {
    sw[0] = sw[1] = scale(0);
    cw[0] = cw[1] = scale(1);
  }
}

// Output i's 32 weights (wq) of a block from its record's weight bytes.
inline void block_weights(int64_t layout, const uint8_t* w, int64_t i, uint8_t wq[QK]) {
  if (!four_bit(layout)) {
    for (int c = 0; c < 8; ++c)
      for (int k = 0; k < 4; ++k) wq[c * 4 + k] = w[c * 64 + i * 4 + k];
    return;
  }
  for (int c = 0; c < 4; ++c)
    for (int k = 0; k < 4; ++k) {
      const uint8_t byte = w[c * 64 + i * 4 + k];
      wq[c * 4 + k] = byte & 15;
      wq[16 + c * 4 + k] = byte >> 4;
    }
  if (six_bit(layout))  // chunk c's high bits: plane c % 2, bits 2 (c / 2) of each byte
    for (int c = 0; c < 8; ++c)
      for (int k = 0; k < 4; ++k) wq[c * 4 + k] |= ((w[256 + (c % 2) * 64 + i * 4 + k] >> (2 * (c / 2))) & 3) << 4;
}

// ---------------------------------------------------------------------------
// Packing (load time)

at::Tensor q8_pack(const at::Tensor& sw, const at::Tensor& cw, const at::Tensor& wq, int64_t layout) {
  TORCH_CHECK(layout >= U4_F16 && layout <= U8_HALVES, "layout must be 0..4");
  TORCH_CHECK(wq.scalar_type() == at::kByte && wq.dim() == 2 && wq.is_contiguous(), "wq must be contiguous uint8 [N, K]");
  const int64_t N = wq.size(0), K = wq.size(1);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  const int64_t nb = K / QK, per_block = halves(layout) ? 2 : 1;
  for (const at::Tensor* t : {&sw, &cw})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == nb * per_block,
                "sw and cw must be contiguous float32 [N, K/32] (K/16 for layout 4)");
  const int64_t groups = (N + NG - 1) / NG, rb = record_bytes(layout), sb = scale_bytes(layout);
  at::Tensor packed = at::zeros({groups * nb * rb}, wq.options());
  const float* swp = sw.data_ptr<float>();
  const float* cwp = cw.data_ptr<float>();
  const uint8_t* src = wq.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const bool four = four_bit(layout);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* rec = dst + (g * nb + b) * rb;
        uint8_t* w = rec + header_bytes(layout);
        for (int64_t i = 0; i < NG; ++i) {
          const int64_t n = g * NG + i;
          if (n >= N) break;  // padding rows stay zero: they add nothing
          float scales[4];
          for (int h = 0; h < per_block; ++h) {
            scales[h] = swp[(n * nb + b) * per_block + h];
            scales[per_block + h] = cwp[(n * nb + b) * per_block + h];
          }
          for (int which = 0; which < scale_sets(layout); ++which) {
            uint8_t* p = rec + (which * NG + i) * sb;
            if (f32_scales(layout)) {
              std::memcpy(p, &scales[which], 4);
            } else {
              const uint16_t h = c10::Half(scales[which]).x;
              std::memcpy(p, &h, 2);
            }
          }
          const uint8_t* q = src + n * K + b * QK;
          if (!four) {
            for (int c8 = 0; c8 < 8; ++c8)
              for (int k = 0; k < 4; ++k) w[c8 * 64 + i * 4 + k] = q[c8 * 4 + k];
          } else {
            for (int c4 = 0; c4 < 4; ++c4)
              for (int k = 0; k < 4; ++k)
                w[c4 * 64 + i * 4 + k] = (q[c4 * 4 + k] & 15) | static_cast<uint8_t>(q[16 + c4 * 4 + k] << 4);
          }
        }
      }
    }
  });
  return packed;
}

// ---------------------------------------------------------------------------
// Activation quantization: x [M, K] -> xq [M, K] int8, dx, sx [M, K/32].

struct QuantizedRows {
  at::Tensor xq;  // [M, K] int8
  // [6, M, K/32], 32 bits each, one allocation (a decode step makes a few
  // hundred of these): per block dx, sx, and dx * sum(xq) over each half of
  // 16 (float32), then sum(xq) over each half (int32).
  at::Tensor blocks;
  enum Field { DX, SX, SX_LO, SX_HI, SUM_LO, SUM_HI };

  float* f32(Field f) const { return blocks.data_ptr<float>() + f * blocks.size(1) * blocks.size(2); }
  int32_t* i32(Field f) const { return reinterpret_cast<int32_t*>(f32(f)); }
};

void quantize_block_scalar(const float* x, int8_t* q, float& d, float& s, int32_t& isum, int32_t& isum_lo) {
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  d = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int j = 0; j < QK; ++j) {
    const int v = static_cast<int>(std::nearbyint(x[j] * inv));
    q[j] = static_cast<int8_t>(v);
    sum += v;
    if (j == QK / 2 - 1) isum_lo = sum;
  }
  isum = sum;
  s = d * static_cast<float>(sum);
}

#ifdef SLUICE_X86
__attribute__((target("avx512f,avx512bw,avx512vl")))
void quantize_block_avx512(const float* x, int8_t* q, float& d, float& s, int32_t& isum, int32_t& isum_lo) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  d = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  // cvtps rounds to nearest even, as std::nearbyint does in the default mode.
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  isum_lo = _mm512_reduce_add_epi32(qa);
  isum = isum_lo + _mm512_reduce_add_epi32(qb);
  s = d * static_cast<float>(isum);
}
#endif

QuantizedRows quantize_rows(const at::Tensor& x, bool avx512) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  QuantizedRows r{at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({6, M, nb}, x.options())};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = r.xq.data_ptr<int8_t>();
  float* dp = r.f32(r.DX);
  float* sp = r.f32(r.SX);
  float* lo = r.f32(r.SX_LO);
  float* hi = r.f32(r.SX_HI);
  int32_t* sum_lo = r.i32(r.SUM_LO);
  int32_t* sum_hi = r.i32(r.SUM_HI);
  const int64_t xs = x.stride(0);
  at::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / nb, b = i % nb;
      const float* src = xp + m * xs + b * QK;
      int32_t isum, isum_lo;
#ifdef SLUICE_X86
      if (avx512)
        quantize_block_avx512(src, qp + i * QK, dp[i], sp[i], isum, isum_lo);
      else
#endif
        quantize_block_scalar(src, qp + i * QK, dp[i], sp[i], isum, isum_lo);
      lo[i] = dp[i] * static_cast<float>(isum_lo);
      hi[i] = dp[i] * static_cast<float>(isum - isum_lo);
      sum_lo[i] = isum_lo;
      sum_hi[i] = isum - isum_lo;
    }
  });
  return r;
}

// ---------------------------------------------------------------------------
// Kernels. Each computes y[r0 : r0 + R, 16 g : 16 g + 16] for one group.

struct Args {
  const uint8_t* packed;
  const int8_t* xq;
  const float* dx;
  const float* sx;
  const float* sx_lo;
  const float* sx_hi;
  const int32_t* sum_lo;
  const int32_t* sum_hi;
  float* y;
  int64_t K, nb, N, format;
  // This group's records where they are not at packed + g * group_bytes
  // (expand_group512's or expand_bytes256's copy, which run_item gives to
  // the AVX-512 kernel and group_avx2_bytes).
  const uint8_t* records = nullptr;

  Args(const uint8_t* packed, const QuantizedRows& q, float* y, int64_t K, int64_t N, int64_t format)
      : packed(packed), xq(q.xq.data_ptr<int8_t>()), dx(q.f32(q.DX)), sx(q.f32(q.SX)), sx_lo(q.f32(q.SX_LO)),
        sx_hi(q.f32(q.SX_HI)), sum_lo(q.i32(q.SUM_LO)), sum_hi(q.i32(q.SUM_HI)), y(y), K(K), nb(K / QK), N(N),
        format(format) {}

  // The same for the rows from row r on.
  Args from_row(int64_t r) const {
    Args a = *this;
    a.xq += r * K;
    a.dx += r * nb, a.sx += r * nb, a.sx_lo += r * nb, a.sx_hi += r * nb, a.sum_lo += r * nb, a.sum_hi += r * nb;
    a.y += r * N;
    return a;
  }
};

void group_scalar(const Args& a, int64_t g, int64_t r0, int64_t R) {
  const uint8_t* group = a.packed + g * group_bytes(a.format, a.nb);
  float acc[8][NG] = {};
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t *head, *w;
    locate(a.format, group, b, head, w);
    for (int64_t i = 0; i < NG; ++i) {
      uint8_t wq[QK];
      float sw[2], cw[2];
      block_weights(a.format, w, i, wq);
      block_scales(a.format, head, b, i, sw, cw);
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* xq = a.xq + (r0 + r) * a.K + b * QK;
        int32_t dot[2] = {0, 0};
        for (int j = 0; j < QK; ++j) dot[j / 16] += static_cast<int32_t>(wq[j]) * xq[j];
        const int64_t xi = (r0 + r) * a.nb + b;
        if (halves(a.format)) {
          const float sx[2] = {a.sx_lo[xi], a.sx_hi[xi]};
          for (int h = 0; h < 2; ++h) acc[r][i] += static_cast<float>(dot[h]) * (sw[h] * a.dx[xi]) + cw[h] * sx[h];
        } else {
          acc[r][i] += static_cast<float>(dot[0] + dot[1]) * (sw[0] * a.dx[xi]) + cw[0] * a.sx[xi];
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < NG && g * NG + i < a.N; ++i) a.y[(r0 + r) * a.N + g * NG + i] = acc[r][i];
}

#ifdef SLUICE_X86
// How far ahead of the block in use a matmul asks for its weights (past a
// group's end, the next group's: a thread's work items run in order), where
// the hardware prefetchers alone leave it waiting on memory:
// - group_avx2<1>, a one-row matmul (a decode step) on AVX2: it reads each
//   weight once and is bound by memory. The prefetchers alone left it at
//   20-22 GB/s on a Zen 3 host whose large copies run at 28-32; 3-8 KiB
//   ahead gave 27-29 GB/s (Q4_K, Q6_K), 1 KiB 23, and the 1B Q4_K_M decode
//   step went from 38.1-38.8 to 31.0 ms (benchmarks/README.md). Steps of 2+
//   rows there are bound by arithmetic: no gain.
// - group_avx512, the first register tile of a work item of 2+ rows on the
//   group's own blocks, not an expanded copy (the weights come from memory
//   once per item, the other tiles find them in L1): with AVX-512 a few
//   rows' arithmetic is fast enough to wait on each group's weights. Zen 4,
//   one 16,384 x 2,048 Q4_K layer, GOP/s: 4 rows 251 -> 348, 8: 323 -> 398,
//   16: 399 -> 463; 1B Q4_K_M decode steps of 4, 8 and 16 rows 25%, 16% and
//   7% shorter (2 and 8 KiB ahead within 3% of 4). Its one-row steps ask
//   for nothing: there the same prefetch was level 2 KiB ahead and 1-4%
//   slower 1 and 4 KiB ahead (400 pairs of steps taking turns); expanding a
//   group with it (expand_group512) gained 0-3%, so it does not.
constexpr int64_t PREFETCH_AHEAD = 4096;

// Asks for the weights of the block PREFETCH_AHEAD bytes past the one at wp.
template <int64_t F>
inline void ask_ahead(const uint8_t* wp) {
  for (int64_t o = 0; o < weight_bytes(F); o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH_AHEAD + o), _MM_HINT_T0);
}

// The vector forms of block_weights / block_scales: a block's weights for
// the group's 16 outputs as 8 chunks of 4 values, and its scale pairs.
template <int64_t F>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void weights512(const uint8_t* wp, __m512i w[8]) {
  if constexpr (!four_bit(F)) {
    for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(wp + 64 * c);
  } else {
    const __m512i mask = _mm512_set1_epi8(15);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wp + 64 * c);
      w[c] = _mm512_and_si512(v, mask);
      w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
    if constexpr (six_bit(F)) {
      // Plane p holds chunk p + 2t's high bits at bits 2t, 2t + 1: moved to 4, 5.
      const __m512i bits = _mm512_set1_epi8(0x30);
      for (int p = 0; p < 2; ++p) {
        const __m512i h = _mm512_loadu_si512(wp + 256 + 64 * p);
        w[p] = _mm512_or_si512(w[p], _mm512_and_si512(_mm512_slli_epi16(h, 4), bits));
        w[p + 2] = _mm512_or_si512(w[p + 2], _mm512_and_si512(_mm512_slli_epi16(h, 2), bits));
        w[p + 4] = _mm512_or_si512(w[p + 4], _mm512_and_si512(h, bits));
        w[p + 6] = _mm512_or_si512(w[p + 6], _mm512_and_si512(_mm512_srli_epi16(h, 2), bits));
      }
    }
  }
}

__attribute__((target("avx512f,f16c"))) inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A K-quant super-block's d (and dmin) for the 16 outputs, converted once per 8 blocks.
template <int64_t F>
__attribute__((target("avx512f,f16c"))) inline void super512(const uint8_t* head, __m512 dd[2]) {
  dd[0] = half16(head);
  if constexpr (F == U4_K) dd[1] = half16(head + K4_DMIN);
}

template <int64_t F>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline void scales512(const uint8_t* head, int64_t b,
                                                                                 const __m512 dd[2], __m512 sw[2],
                                                                                 __m512 cw[2]) {
  const int64_t j = b % SUPER;
  if constexpr (F == U4_K) {
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + K4_SC + NG * j))));
    const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + K4_M + NG * j))));
    sw[0] = sw[1] = _mm512_mul_ps(dd[0], sc);
    const __m512i product = _mm512_castps_si512(_mm512_mul_ps(dd[1], m));
    cw[0] = cw[1] = _mm512_castsi512_ps(_mm512_xor_si512(product, _mm512_set1_epi32(INT32_MIN)));  // -(dmin * m)
  } else if constexpr (F == U6_K) {
    for (int h = 0; h < 2; ++h) {
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(head + K6_SC + NG * (2 * j + h)));
      sw[h] = _mm512_mul_ps(dd[0], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
      cw[h] = _mm512_mul_ps(sw[h], _mm512_set1_ps(-32.f));
    }
  } else if constexpr (F == U6_X) {
    const float* s = reinterpret_cast<const float*>(head);
    sw[0] = _mm512_loadu_ps(s), sw[1] = _mm512_loadu_ps(s + 16);
    cw[0] = cw[1] = _mm512_setzero_ps();  // unused: q6_offset
  } else if constexpr (halves(F)) {
    const float* s = reinterpret_cast<const float*>(head);
    sw[0] = _mm512_loadu_ps(s), sw[1] = _mm512_loadu_ps(s + 16);
    cw[0] = _mm512_loadu_ps(s + 32), cw[1] = _mm512_loadu_ps(s + 48);
  } else if constexpr (f32_scales(F)) {
    sw[0] = sw[1] = _mm512_loadu_ps(head);
    cw[0] = cw[1] = _mm512_loadu_ps(head + 64);
  } else {
    sw[0] = sw[1] = half16(head);
    cw[0] = cw[1] = half16(head + 32);
  }
}

template <int R, int64_t F>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) void group_avx512(const Args& a, int64_t g,
                                                                                          int64_t r0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* group = a.records ? a.records : a.packed + g * group_bytes(F, a.nb);
  const int32_t* xq = reinterpret_cast<const int32_t*>(a.xq + r0 * a.K);
  const int64_t xq_row = a.K / 4;
  const float* dx = a.dx + r0 * a.nb;
  const float* sx = a.sx + r0 * a.nb;
  const float* sx_lo = a.sx_lo + r0 * a.nb;
  const float* sx_hi = a.sx_hi + r0 * a.nb;
  const int32_t* sum_lo = a.sum_lo + r0 * a.nb;
  const int32_t* sum_hi = a.sum_hi + r0 * a.nb;
  __m512 dd[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t *head, *wp;
    locate(F, group, b, head, wp);
    if (R > 1 && r0 == 0 && !a.records)  // the item's first tile: see PREFETCH_AHEAD
      ask_ahead<F>(wp);
    __m512i w[8];
    weights512<F>(wp, w);
    if constexpr (super_blocks(F))
      if (b % SUPER == 0) super512<F>(head, dd);
    __m512 sw[2], cw[2];
    scales512<F>(head, b, dd, sw, cw);
    if constexpr (q6_offset(F)) {
      // Q6_K: per half h, sw_h * dx * sum (wq - 32) xq, the 32 taken off in
      // the integer dot (its sum starts at -32 * sum(xq)), then both halves'
      // products summed before the one multiply by dx: the FMA pair with cw
      // and sx of the general layouts is gone (U6_K ran at 45-49% of the
      // int8 rate, the Q4_K layouts at 58-63%).
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = xq + r * xq_row + b * 8;
        const int64_t xi = r * a.nb + b;
        __m512i d0 = _mm512_set1_epi32(-32 * sum_lo[xi]), d1 = _mm512_set1_epi32(-32 * sum_hi[xi]);
        for (int c = 0; c < 4; ++c) {
          d0 = _mm512_dpbusd_epi32(d0, w[c], _mm512_set1_epi32(xr[c]));
          d1 = _mm512_dpbusd_epi32(d1, w[c + 4], _mm512_set1_epi32(xr[c + 4]));
        }
        const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), sw[1], _mm512_mul_ps(_mm512_cvtepi32_ps(d0), sw[0]));
        acc[r] = _mm512_fmadd_ps(both, _mm512_set1_ps(dx[xi]), acc[r]);
      }
      continue;
    }
    if constexpr (halves(F)) {
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = xq + r * xq_row + b * 8;
        __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {  // chunks 0-3: the low half of 16, 4-7: the high one
          d0 = _mm512_dpbusd_epi32(d0, w[c], _mm512_set1_epi32(xr[c]));
          d1 = _mm512_dpbusd_epi32(d1, w[c + 4], _mm512_set1_epi32(xr[c + 4]));
        }
        const int64_t xi = r * a.nb + b;
        const __m512 scale = _mm512_set1_ps(dx[xi]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(sw[0], scale), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(sw[1], scale), acc[r]);
        acc[r] = _mm512_fmadd_ps(cw[0], _mm512_set1_ps(sx_lo[xi]), acc[r]);
        acc[r] = _mm512_fmadd_ps(cw[1], _mm512_set1_ps(sx_hi[xi]), acc[r]);
      }
      continue;
    }
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = xq + r * xq_row + b * 8;
      __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        d0 = _mm512_dpbusd_epi32(d0, w[c], _mm512_set1_epi32(xr[c]));
        d1 = _mm512_dpbusd_epi32(d1, w[c + 1], _mm512_set1_epi32(xr[c + 1]));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sw[0], _mm512_set1_ps(dx[r * a.nb + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(cw[0], _mm512_set1_ps(sx[r * a.nb + b]), acc[r]);
    }
  }
  const int64_t n0 = g * NG;
  const __mmask16 keep = a.N - n0 >= NG ? __mmask16(0xFFFF) : __mmask16((1u << (a.N - n0)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(a.y + (r0 + r) * a.N + n0, keep, acc[r]);
}

// A group's K-quant records (U4_K, U6_K) rewritten as the records of
// expanded_layout (U4_F32; U6_X: U8_HALVES' without cw): the same weights
// and the same float32 scales, so the kernel computes the same values from
// them, bit for bit, without unpacking nibbles, high bits and scales again
// for every tile of rows. Worth it for a work item of many rows (a
// prefill's), whose tiles all read the group's records.
constexpr int64_t expanded_layout(int64_t l) { return l == U4_K ? U4_F32 : U6_X; }

template <int64_t F>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void expand_group512(const uint8_t* group, int64_t nb,
                                                                                uint8_t* out) {
  constexpr int64_t T = expanded_layout(F);
  __m512 dd[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *head, *wp;
    locate(F, group, b, head, wp);
    if (b % SUPER == 0) super512<F>(head, dd);
    __m512 sw[2], cw[2];
    scales512<F>(head, b, dd, sw, cw);
    uint8_t* rec = out + b * record_bytes(T);
    float* scales = reinterpret_cast<float*>(rec);
    if constexpr (T == U6_X) {
      _mm512_storeu_ps(scales, sw[0]), _mm512_storeu_ps(scales + 16, sw[1]);
    } else {
      _mm512_storeu_ps(scales, sw[0]), _mm512_storeu_ps(scales + 16, cw[0]);
    }
    if constexpr (four_bit(T)) {  // the same nibble records
      for (int c = 0; c < 4; ++c) _mm512_storeu_si512(rec + header_bytes(T) + 64 * c, _mm512_loadu_si512(wp + 64 * c));
    } else {
      __m512i w[8];
      weights512<F>(wp, w);
      for (int c = 0; c < 8; ++c) _mm512_storeu_si512(rec + header_bytes(T) + 64 * c, w[c]);
    }
  }
}

// 256-bit kernels: the 16 outputs of a group as two halves of 8. With
// AVX-VNNI, one VPDPBUSD per K-chunk and half; without it, small_dots256
// (weights of at most 6 bits) and signed_dots256 (8-bit ones) below.
__attribute__((target("avx2,avxvnni"))) inline __m256i dot_vnni256(__m256i acc, __m256i w, __m256i x) {
  return _mm256_dpbusd_avx_epi32(acc, w, x);
}

// AVX2 without VNNI, weights of at most 6 bits (every nibble-packed layout):
// PMADDUBSW's sums of two u8 x s8 products, at most 63 * 127 * 2 = 16,002,
// cannot saturate, so the products stay in 16 bits until one PMADDWD by ones
// widens them: 4-bit weights sum all 8 K-chunks in 16 bits (8 * 15 * 127 * 2
// = 30,480 < 2^15), 6-bit ones two chunks at a time. The int32 lanes hold the
// same exact sums as VPDPBUSD's, from about a quarter of the instructions
// of widening every product. d[k][h] += the dot of K-chunks 4k .. 4k+3
// (k = 0, 1) for the outputs' half h; with `split` false only d[0][h] is
// added to, with all 8.
template <int64_t F, bool split>
__attribute__((target("avx2"))) inline void small_dots256(const __m256i (&w)[8][2], const int32_t* xr,
                                                          __m256i (&d)[2][2]) {
  static_assert(narrow(F), "weights of at most 6 bits");
  static_assert(q6_offset(F) || !split, "a 4-bit block has one scale pair: no halves' sums");
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i x[8];
  for (int c = 0; c < 8; ++c) x[c] = _mm256_set1_epi32(xr[c]);
  auto pair = [&](int c, int h) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(w[c][h], x[c]), _mm256_maddubs_epi16(w[c + 1][h], x[c + 1]));
  };
  for (int h = 0; h < 2; ++h) {
    if constexpr (q6_offset(F)) {
      for (int k = 0; k < 2; ++k) {
        const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(pair(4 * k, h), ones),
                                           _mm256_madd_epi16(pair(4 * k + 2, h), ones));
        d[split ? k : 0][h] = _mm256_add_epi32(d[split ? k : 0][h], s);
      }
    } else {
      const __m256i s = _mm256_add_epi16(_mm256_add_epi16(pair(0, h), pair(2, h)),
                                         _mm256_add_epi16(pair(4, h), pair(6, h)));
      d[0][h] = _mm256_add_epi32(d[0][h], _mm256_madd_epi16(s, ones));
    }
  }
}

// AVX2 without VNNI, 8-bit weights (Q5_0, Q5_1, Q5_K, Q8_0, U8_HALVES):
// PMADDUBSW on wq itself could saturate (255 * 127 * 2 > 2^15), so each
// weight is taken as signed, ws = wq - 128 (wq ^ 0x80), and each product as
// |ws| * (x * sign(ws)), at most 128 * 127 per byte, 32,512 per pair: one
// PSIGNB and one PMADDUBSW per chunk and half, one PMADDWD by ones to widen,
// where both operands were unpacked to 16 bits for PMADDWD before (8
// instructions). The caller starts each sum at 128 * sum(xq) over its
// values, which makes it the same exact int32 dot(wq, xq) as VPDPBUSD's: the
// results did not change.
// (Per block, |ws| and ws are formed once for all rows of a tile.)
struct SignedWeights256 {
  __m256i abs[8][2], sign[8][2];
};

__attribute__((target("avx2"), always_inline)) inline void signed_weights256(const __m256i (&w)[8][2],
                                                                            SignedWeights256& s) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int c = 0; c < 8; ++c)
    for (int h = 0; h < 2; ++h) {
      s.sign[c][h] = _mm256_xor_si256(w[c][h], bias);
      s.abs[c][h] = _mm256_abs_epi8(s.sign[c][h]);
    }
}

// d[split ? c / 4 : 0][h] += dot of K-chunk c for the outputs' half h, all 8 chunks.
template <bool split>
__attribute__((target("avx2"), always_inline)) inline void signed_dots256(const SignedWeights256& s,
                                                                         const int32_t* xr, __m256i (&d)[2][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int c = 0; c < 8; ++c) {
    const __m256i xb = _mm256_set1_epi32(xr[c]);
    for (int h = 0; h < 2; ++h) {
      const __m256i p = _mm256_maddubs_epi16(s.abs[c][h], _mm256_sign_epi8(xb, s.sign[c][h]));
      d[split ? c / 4 : 0][h] = _mm256_add_epi32(d[split ? c / 4 : 0][h], _mm256_madd_epi16(p, ones));
    }
  }
}

// weights512 / scales512 for the 256-bit kernels: [chunk][which 8 outputs],
// and sw[k][h], cw[k][h] for the half k of 16 values and the outputs' half h.
// (Always inlined: GCC left U6_K's out of line, its 16 vectors passed through memory.)
template <int64_t F>
__attribute__((target("avx2"), always_inline)) inline void weights256(const uint8_t* wp, __m256i w[8][2]) {
  auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  if constexpr (!four_bit(F)) {
    for (int c = 0; c < 8; ++c)
      for (int h = 0; h < 2; ++h) w[c][h] = load(wp + 64 * c + 32 * h);
  } else {
    const __m256i mask = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = load(wp + 64 * c + 32 * h);
        w[c][h] = _mm256_and_si256(v, mask);
        w[c + 4][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
    if constexpr (six_bit(F)) {
      const __m256i bits = _mm256_set1_epi8(0x30);
      for (int p = 0; p < 2; ++p)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = load(wp + 256 + 64 * p + 32 * h);
          w[p][h] = _mm256_or_si256(w[p][h], _mm256_and_si256(_mm256_slli_epi16(v, 4), bits));
          w[p + 2][h] = _mm256_or_si256(w[p + 2][h], _mm256_and_si256(_mm256_slli_epi16(v, 2), bits));
          w[p + 4][h] = _mm256_or_si256(w[p + 4][h], _mm256_and_si256(v, bits));
          w[p + 6][h] = _mm256_or_si256(w[p + 6][h], _mm256_and_si256(_mm256_srli_epi16(v, 2), bits));
        }
    }
  }
}

template <int64_t F>
__attribute__((target("avx2,f16c"))) inline void scales256(const uint8_t* head, int64_t b, __m256 sw[2][2],
                                                           __m256 cw[2][2]) {
  const int64_t j = b % SUPER;
  auto half8 = [](const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  auto bytes8 = [](const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); };
  for (int h = 0; h < 2; ++h) {
    if constexpr (F == U4_K) {
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(head + K4_SC + NG * j + 8 * h)));
      const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(head + K4_M + NG * j + 8 * h)));
      sw[0][h] = sw[1][h] = _mm256_mul_ps(half8(head + 16 * h), sc);
      cw[0][h] = cw[1][h] = _mm256_xor_ps(_mm256_mul_ps(half8(head + K4_DMIN + 16 * h), m), _mm256_set1_ps(-0.f));
    } else if constexpr (F == U6_K) {
      const __m256 d = half8(head + 16 * h);
      for (int k = 0; k < 2; ++k) {
        sw[k][h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(head + K6_SC + NG * (2 * j + k) + 8 * h))));
        cw[k][h] = _mm256_mul_ps(sw[k][h], _mm256_set1_ps(-32.f));
      }
    } else if constexpr (halves(F)) {
      const float* s = reinterpret_cast<const float*>(head);
      for (int k = 0; k < 2; ++k) {
        sw[k][h] = _mm256_loadu_ps(s + 16 * k + 8 * h);
        cw[k][h] = _mm256_loadu_ps(s + 32 + 16 * k + 8 * h);
      }
    } else if constexpr (f32_scales(F)) {
      sw[0][h] = sw[1][h] = _mm256_loadu_ps(reinterpret_cast<const float*>(head + 32 * h));
      cw[0][h] = cw[1][h] = _mm256_loadu_ps(reinterpret_cast<const float*>(head + 64 + 32 * h));
    } else {
      sw[0][h] = sw[1][h] = half8(head + 16 * h);
      cw[0][h] = cw[1][h] = half8(head + 32 + 16 * h);
    }
  }
}

// The 256-bit kernels' results: rows r0 .. r0 + R - 1 of group g's 16
// outputs, as two halves of 8 (the last group's outputs may stop short).
template <int R>
__attribute__((target("avx2"))) inline void store_rows256(const __m256 (&acc)[R][2], const Args& a, int64_t g,
                                                          int64_t r0) {
  const int64_t n0 = g * NG;
  for (int r = 0; r < R; ++r) {
    float* out = a.y + (r0 + r) * a.N + n0;
    if (a.N - n0 >= NG) {
      _mm256_storeu_ps(out, acc[r][0]);
      _mm256_storeu_ps(out + 8, acc[r][1]);
    } else {
      alignas(32) float tmp[NG];
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      std::copy(tmp, tmp + (a.N - n0), out);
    }
  }
}

template <int R, int64_t F, bool VNNI>
__attribute__((target("avx2,fma,f16c,avxvnni"))) void group_avx2(const Args& a, int64_t g, int64_t r0) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint8_t* group = a.records ? a.records : a.packed + g * group_bytes(F, a.nb);
  const float* dx = a.dx + r0 * a.nb;
  const float* sx = a.sx + r0 * a.nb;
  const float* sx_lo = a.sx_lo + r0 * a.nb;
  const float* sx_hi = a.sx_hi + r0 * a.nb;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t *head, *wp;
    locate(F, group, b, head, wp);
    if (R == 1 && !a.records)  // a decode step's matmul: see PREFETCH_AHEAD
      ask_ahead<F>(wp);
    __m256i w[8][2];
    weights256<F>(wp, w);
    __m256 sw[2][2], cw[2][2];
    scales256<F>(head, b, sw, cw);
    if constexpr (q6_offset(F)) {  // as group_avx512 does: the 32 off in integers
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(a.xq + (r0 + r) * a.K + b * QK);
        const int64_t xi = (r0 + r) * a.nb + b;
        const __m256i lo = _mm256_set1_epi32(-32 * a.sum_lo[xi]), hi = _mm256_set1_epi32(-32 * a.sum_hi[xi]);
        __m256i d[2][2] = {{lo, lo}, {hi, hi}};
        if constexpr (VNNI) {
          for (int c = 0; c < 8; ++c) {
            const __m256i xb = _mm256_set1_epi32(xr[c]);
            for (int h = 0; h < 2; ++h) d[c / 4][h] = dot_vnni256(d[c / 4][h], w[c][h], xb);
          }
        } else {
          small_dots256<F, true>(w, xr, d);
        }
        const __m256 scale = _mm256_set1_ps(dx[r * a.nb + b]);
        for (int h = 0; h < 2; ++h) {
          const __m256 both = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[1][h]), sw[1][h],
                                              _mm256_mul_ps(_mm256_cvtepi32_ps(d[0][h]), sw[0][h]));
          acc[r][h] = _mm256_fmadd_ps(both, scale, acc[r][h]);
        }
      }
      continue;
    }
    [[maybe_unused]] SignedWeights256 sw8;
    if constexpr (!VNNI && !narrow(F)) signed_weights256(w, sw8);
    if constexpr (halves(F) && !q6_offset(F)) {
      // h: which 8 of the 16 outputs; k: which half of the 32 values.
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(a.xq + (r0 + r) * a.K + b * QK);
        __m256i d[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()},
                           {_mm256_setzero_si256(), _mm256_setzero_si256()}};
        if constexpr (!VNNI) {
          const int64_t xj = (r0 + r) * a.nb + b;
          d[0][0] = d[0][1] = _mm256_set1_epi32(128 * a.sum_lo[xj]);
          d[1][0] = d[1][1] = _mm256_set1_epi32(128 * a.sum_hi[xj]);
          signed_dots256<true>(sw8, xr, d);
        } else {
          for (int c = 0; c < 8; ++c) {
            const __m256i xb = _mm256_set1_epi32(xr[c]);
            for (int h = 0; h < 2; ++h) d[c / 4][h] = dot_vnni256(d[c / 4][h], w[c][h], xb);
          }
        }
        const int64_t xi = r * a.nb + b;
        const __m256 scale = _mm256_set1_ps(dx[xi]);
        const __m256 shift[2] = {_mm256_set1_ps(sx_lo[xi]), _mm256_set1_ps(sx_hi[xi])};
        for (int k = 0; k < 2; ++k)
          for (int h = 0; h < 2; ++h) {
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[k][h]), _mm256_mul_ps(sw[k][h], scale), acc[r][h]);
            acc[r][h] = _mm256_fmadd_ps(cw[k][h], shift[k], acc[r][h]);
          }
      }
      continue;
    }
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(a.xq + (r0 + r) * a.K + b * QK);
      __m256i d[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      if constexpr (!VNNI && narrow(F)) {
        __m256i dk[2][2] = {{d[0], d[1]}, {d[0], d[1]}};
        small_dots256<F, false>(w, xr, dk);
        d[0] = dk[0][0], d[1] = dk[0][1];
      } else if constexpr (!VNNI) {
        const int64_t xj = (r0 + r) * a.nb + b;
        const __m256i offset = _mm256_set1_epi32(128 * (a.sum_lo[xj] + a.sum_hi[xj]));
        __m256i dk[2][2] = {{offset, offset}, {offset, offset}};
        signed_dots256<false>(sw8, xr, dk);
        d[0] = dk[0][0], d[1] = dk[0][1];
      } else {
        for (int c = 0; c < 8; ++c) {
          const __m256i xb = _mm256_set1_epi32(xr[c]);
          for (int h = 0; h < 2; ++h) d[h] = dot_vnni256(d[h], w[c][h], xb);
        }
      }
      const __m256 scale = _mm256_set1_ps(dx[r * a.nb + b]), shift = _mm256_set1_ps(sx[r * a.nb + b]);
      for (int h = 0; h < 2; ++h) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[h]), _mm256_mul_ps(sw[0][h], scale), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(cw[0][h], shift, acc[r][h]);
      }
    }
  }
  store_rows256<R>(acc, a, g, r0);
}

// A nibble-packed group's records for group_avx2_bytes: the same float32
// scales (as scales256 forms them from the records) and the weights unpacked
// to bytes: U6_X from U6_K (expand_group512's copy), U4_X from the others.
template <int64_t F>
__attribute__((target("avx2,f16c"))) void expand_bytes256(const uint8_t* group, int64_t nb, uint8_t* out) {
  static_assert(four_bit(F), "a nibble-packed layout");
  constexpr int64_t T = six_bit(F) ? U6_X : U4_X;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *head, *wp;
    locate(F, group, b, head, wp);
    __m256 sw[2][2], cw[2][2];
    scales256<F>(head, b, sw, cw);
    uint8_t* rec = out + b * record_bytes(T);
    float* scales = reinterpret_cast<float*>(rec);
    for (int h = 0; h < 2; ++h) {  // U4_X: [sw][cw]; U6_X: [sw lo][sw hi]
      _mm256_storeu_ps(scales + 8 * h, sw[0][h]);
      _mm256_storeu_ps(scales + 16 + 8 * h, T == U6_X ? sw[1][h] : cw[0][h]);
    }
    __m256i w[8][2];
    weights256<F>(wp, w);
    for (int c = 0; c < 8; ++c)
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rec + header_bytes(T) + 64 * c + 32 * h), w[c][h]);
  }
}

// The AVX2 kernel without VNNI for big steps, on a group's records with
// the weights unpacked to bytes (U4_X from the 4-bit layouts, U6_X from
// U6_K, made once per work item by expand_bytes256): for each K-chunk, the
// two weight vectors of the group's 16 outputs are loaded once into
// registers and multiplied with the chunk of every row of the tile, into
// 16-bit sums that stay in registers (4-bit weights: all 8 chunks; Q6_K's:
// two at a time, as small_dots256 sums them). group_avx2 instead holds a
// whole block's 16 weight vectors, more than AVX2's 16 registers with its
// accumulators, and reloads them from the stack for every row; here a tile
// of 3 rows needs 2 weight vectors, a broadcast and 6 sums at a time. The
// int32 sums are group_avx2's, exactly, and the float32 arithmetic after
// them the same, so results are the same bits.
template <int R, int64_t F>
__attribute__((target("avx2,fma"))) void group_avx2_bytes(const Args& a, int64_t g, int64_t r0) {
  static_assert(F == U4_X || F == U6_X, "weights of at most 6 bits, one byte each");
  constexpr bool Q6 = F == U6_X;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int32_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = reinterpret_cast<const int32_t*>(a.xq + (r0 + r) * a.K);
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* rec = a.records + b * record_bytes(F);
    const int64_t xi = r0 * a.nb + b;
    // d[k][r][h]: Q6_K's dot of values 16k .. 16k + 15, with the 32 taken
    // off (see group_avx512); for 4-bit weights d[0] of all 32.
    __m256i s[R][2], d[2][R][2];
    if constexpr (Q6)
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < 2; ++k)
          d[k][r][0] = d[k][r][1] = _mm256_set1_epi32(-32 * (k ? a.sum_hi : a.sum_lo)[xi + r * a.nb]);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m256i w[2];
      for (int h = 0; h < 2; ++h) {
        w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + header_bytes(F) + 64 * c + 32 * h));
        asm("" : "+x"(w[h]));  // one load for all the tile's rows, not one folded into each product
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(x[r][8 * b + c]);
        for (int h = 0; h < 2; ++h) {
          const __m256i p = _mm256_maddubs_epi16(w[h], xb);
          s[r][h] = c % (Q6 ? 2 : 8) == 0 ? p : _mm256_add_epi16(s[r][h], p);
          asm("" : "+x"(s[r][h]));  // summed as it goes (GCC otherwise holds all 32 products, spilling them)
        }
      }
      if (c % 2 == 1 && (Q6 || c == 7))
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_madd_epi16(s[r][h], ones);
            d[Q6 ? c / 4 : 0][r][h] = Q6 ? _mm256_add_epi32(d[c / 4][r][h], v) : v;
          }
    }
    const float* scales = reinterpret_cast<const float*>(rec);
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(a.dx[xi + r * a.nb]);
      for (int h = 0; h < 2; ++h) {
        const __m256 sw = _mm256_loadu_ps(scales + 8 * h), second = _mm256_loadu_ps(scales + 16 + 8 * h);
        if constexpr (Q6) {
          const __m256 both = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[1][r][h]), second,
                                              _mm256_mul_ps(_mm256_cvtepi32_ps(d[0][r][h]), sw));
          acc[r][h] = _mm256_fmadd_ps(both, scale, acc[r][h]);
        } else {
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[0][r][h]), _mm256_mul_ps(sw, scale), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(second, _mm256_set1_ps(a.sx[xi + r * a.nb]), acc[r][h]);
        }
      }
    }
  }
  store_rows256<R>(acc, a, g, r0);
}

#endif

// ---------------------------------------------------------------------------
// Float activations on the same records (the exact path, --dtype float32):
// each record is expanded in registers to w = sw * wq + cw, the float32
// weight the layer holds (gguf_blocks.Records.expand): sw * wq needs
// at most 24 bits (fp16 d: 11, a K-quant scale: 7, wq: 6 with it, 8 without
// one), so it is exact and one fused multiply-add rounds once, as the
// separate product and sum do. Each expanded weight vector (one value of the
// block for the group's 16 outputs) is then multiplied into every row of the
// tile. A row's blocks are summed in order, so a row's result does not depend
// on the other rows.

struct FArgs {
  const uint8_t* packed;
  const float* x;
  int64_t x_stride;
  float* y;
  int64_t nb, N, format;
};

// Where value j (< 32) of a block sits in the record's weight chunks: chunk
// c of 64 bytes, 4 bytes per output; the value is (byte >> shift) & mask.
constexpr int value_chunk(int64_t l, int j) { return four_bit(l) ? (j % 16) / 4 : j / 4; }
constexpr int value_shift(int64_t l, int j) { return 8 * (j % 4) + (four_bit(l) ? 4 * (j / 16) : 0); }
// U6_K: value j's high 2 bits, in plane high_plane(j) (64 bytes each, after
// the nibbles) of the same 4-byte word, at bit high_shift(j).
constexpr int high_plane(int j) { return (j / 4) % 2; }
constexpr int high_shift(int j) { return 8 * (j % 4) + 2 * (j / 8); }

void fgroup_scalar(const FArgs& a, int64_t g, int64_t r0, int64_t R) {
  const uint8_t* group = a.packed + g * group_bytes(a.format, a.nb);
  float acc[8][NG] = {};
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t *head, *w;
    locate(a.format, group, b, head, w);
    for (int64_t i = 0; i < NG; ++i) {
      uint8_t wq[QK];
      float sw[2], cw[2];
      block_weights(a.format, w, i, wq);
      block_scales(a.format, head, b, i, sw, cw);
      for (int j = 0; j < QK; ++j) {
        const float wj = std::fma(static_cast<float>(wq[j]), sw[j / 16], cw[j / 16]);
        for (int64_t r = 0; r < R; ++r) acc[r][i] += wj * a.x[(r0 + r) * a.x_stride + b * QK + j];
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < NG && g * NG + i < a.N; ++i) a.y[(r0 + r) * a.N + g * NG + i] = acc[r][i];
}

#ifdef SLUICE_X86
template <int R, int64_t F>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void fgroup_avx512(const FArgs& a, int64_t g,
                                                                              int64_t r0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* group = a.packed + g * group_bytes(F, a.nb);
  const float* x = a.x + r0 * a.x_stride;
  const __m512i mask = _mm512_set1_epi32(four_bit(F) ? 15 : 255);
  __m512 dd[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b = 0; b < a.nb; ++b, x += QK) {
    const uint8_t *head, *wp;
    locate(F, group, b, head, wp);
    if constexpr (super_blocks(F))
      if (b % SUPER == 0) super512<F>(head, dd);
    __m512 sw[2], cw[2];
    scales512<F>(head, b, dd, sw, cw);
#pragma GCC unroll 32
    for (int j = 0; j < QK; ++j) {
      const __m512i chunk = _mm512_loadu_si512(wp + 64 * value_chunk(F, j));
      __m512i q = _mm512_and_si512(_mm512_srli_epi32(chunk, value_shift(F, j)), mask);
      if constexpr (six_bit(F)) {
        const __m512i high = _mm512_loadu_si512(wp + 256 + 64 * high_plane(j));
        q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, high_shift(j)),
                                                                  _mm512_set1_epi32(3)), 4));
      }
      const __m512 wj = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), sw[j / 16], cw[j / 16]);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wj, _mm512_set1_ps(x[r * a.x_stride + j]), acc[r]);
    }
  }
  const int64_t n0 = g * NG;
  const __mmask16 keep = a.N - n0 >= NG ? __mmask16(0xFFFF) : __mmask16((1u << (a.N - n0)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(a.y + (r0 + r) * a.N + n0, keep, acc[r]);
}

// The 16 outputs of a group as two halves of 8.
template <int R, int64_t F>
__attribute__((target("avx2,fma,f16c"))) void fgroup_avx2(const FArgs& a, int64_t g, int64_t r0) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint8_t* group = a.packed + g * group_bytes(F, a.nb);
  const float* x = a.x + r0 * a.x_stride;
  const __m256i mask = _mm256_set1_epi32(four_bit(F) ? 15 : 255);
  for (int64_t b = 0; b < a.nb; ++b, x += QK) {
    const uint8_t *head, *wp;
    locate(F, group, b, head, wp);
    __m256 sw[2][2], cw[2][2];  // [which half of the 32 values][which 8 outputs]
    scales256<F>(head, b, sw, cw);
#pragma GCC unroll 32
    for (int j = 0; j < QK; ++j) {
      for (int h = 0; h < 2; ++h) {
        const __m256i chunk =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 64 * value_chunk(F, j) + 32 * h));
        __m256i q = _mm256_and_si256(_mm256_srli_epi32(chunk, value_shift(F, j)), mask);
        if constexpr (six_bit(F)) {
          const __m256i high =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 256 + 64 * high_plane(j) + 32 * h));
          q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, high_shift(j)),
                                                                    _mm256_set1_epi32(3)), 4));
        }
        const __m256 wj = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sw[j / 16][h], cw[j / 16][h]);
        for (int r = 0; r < R; ++r)
          acc[r][h] = _mm256_fmadd_ps(wj, _mm256_set1_ps(x[r * a.x_stride + j]), acc[r][h]);
      }
    }
  }
  const int64_t n0 = g * NG;
  for (int r = 0; r < R; ++r) {
    float* out = a.y + (r0 + r) * a.N + n0;
    alignas(32) float tmp[NG];
    _mm256_store_ps(tmp, acc[r][0]);
    _mm256_store_ps(tmp + 8, acc[r][1]);
    std::copy(tmp, tmp + std::min<int64_t>(NG, a.N - n0), out);
  }
}
#endif

// Runs kernel(std::integral_constant<int, R>, r0) over M rows: tiles of T
// rows, then one of the R < T rows left (each R its own instantiation).
template <int R, typename Kernel>
void tile_remainder(int64_t left, int64_t r0, const Kernel& kernel) {
  if constexpr (R > 0) {
    if (left == R) return kernel(std::integral_constant<int, R>{}, r0);
    tile_remainder<R - 1>(left, r0, kernel);
  }
}

template <int T, typename Kernel>
void in_tiles(int64_t M, const Kernel& kernel) {
  int64_t r0 = 0;
  for (; r0 + T <= M; r0 += T) kernel(std::integral_constant<int, T>{}, r0);
  tile_remainder<T - 1>(M - r0, r0, kernel);
}

// Rows per register tile of each kernel: the int8 ones, then the float ones.
// (AVX2 without VNNI: 4 rows ran 8-12% faster than 2 from 16 rows on, one
// thread, Zen 3; the AVX-VNNI kernel, not measured on such a host, keeps 2.)
// AVX-512: 8 rows unpack a group's weights and scales once for 8 rows
// instead of twice; Zen 4, in-process decode steps taking turns with tiles
// of 4: 1B Q4_K_M batch 8 17% shorter, 16 6.5%, 4 2%; 135M Q4_1 batch 8 9%,
// 32 level; 256- and 512-row layers level. Q6_K's own records (U6_K, read
// directly below EXPAND_ROWS) too: batch 8 and 12 another 4% shorter. The
// expanded Q6_K copy (U6_X) and the pair-per-16 records of mixed layers
// (U8_HALVES) keep 4: U6_X's 256-row layers ran 8-13% slower with 8,
// U8_HALVES's were level.
constexpr int TILE_AVX512 = 8, TILE_AVX512_HALVES = 4, TILE_AVX2 = 2, TILE_AVX2_NO_VNNI = 4;
constexpr int FTILE_AVX512 = 8, FTILE_AVX2 = 4;
constexpr int tile_avx512(int64_t layout) {
  return layout == U6_X || layout == U8_HALVES ? TILE_AVX512_HALVES : TILE_AVX512;
}

template <int64_t F>
void run_group(Isa isa, const Args& a, int64_t g, int64_t M) {
#ifdef SLUICE_X86
  if (isa == ISA_AVX512_VNNI)
    return in_tiles<tile_avx512(F)>(M, [&](auto R, int64_t r0) { group_avx512<decltype(R)::value, F>(a, g, r0); });
  if (isa == ISA_AVX_VNNI)
    return in_tiles<TILE_AVX2>(M, [&](auto R, int64_t r0) { group_avx2<decltype(R)::value, F, true>(a, g, r0); });
  if (isa == ISA_AVX2)
    return in_tiles<TILE_AVX2_NO_VNNI>(M, [&](auto R, int64_t r0) { group_avx2<decltype(R)::value, F, false>(a, g, r0); });
#endif
  for (int64_t r0 = 0; r0 < M; r0 += 8) group_scalar(a, g, r0, std::min<int64_t>(8, M - r0));
}

template <int64_t F>
void run_fgroup(Isa isa, const FArgs& a, int64_t g, int64_t M) {
#ifdef SLUICE_X86
  if (isa == ISA_AVX512_VNNI)
    return in_tiles<FTILE_AVX512>(M, [&](auto R, int64_t r0) { fgroup_avx512<decltype(R)::value, F>(a, g, r0); });
  if (isa == ISA_AVX_VNNI || isa == ISA_AVX2)
    return in_tiles<FTILE_AVX2>(M, [&](auto R, int64_t r0) { fgroup_avx2<decltype(R)::value, F>(a, g, r0); });
#endif
  for (int64_t r0 = 0; r0 < M; r0 += 8) fgroup_scalar(a, g, r0, std::min<int64_t>(8, M - r0));
}

bool host_has(Isa isa) {
#ifdef SLUICE_X86
  switch (isa) {
    case ISA_AVX512_VNNI:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case ISA_AVX_VNNI:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("avxvnni");
    case ISA_AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    default:
      return true;
  }
#else
  return isa == ISA_SCALAR || isa == ISA_AUTO;
#endif
}

Isa best_isa() {
  static const Isa best = [] {
    for (Isa isa : {ISA_AVX512_VNNI, ISA_AVX_VNNI, ISA_AVX2})
      if (host_has(isa)) return isa;
    return ISA_SCALAR;
  }();
  return best;
}

// Checks the arguments common to both arithmetics; the kernel set to use.
Isa check_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t N, int64_t isa_code) {
  TORCH_CHECK(format >= U4_F16 && format <= U6_K, "format must be a record layout, 0..6");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "x must be float32 [M, K]");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  TORCH_CHECK(!super_blocks(format) || K % (SUPER * QK) == 0, "K must be a multiple of 256 in layout ", format);
  const int64_t groups = (N + NG - 1) / NG;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == groups * group_bytes(format, K / QK),
              "packed weight does not match [", N, ", ", K, "] in this layout (see q8_pack)");
  const Isa isa = isa_code == ISA_AUTO ? best_isa() : static_cast<Isa>(isa_code);
  TORCH_CHECK(isa >= ISA_SCALAR && isa <= ISA_AVX512_VNNI, "unknown isa code ", isa_code);
  TORCH_CHECK(host_has(isa), "this CPU cannot run isa code ", isa_code);
  return isa;
}

// Calls fn(std::integral_constant<int64_t, layout>): one instantiation of a
// kernel per record layout.
template <typename Fn>
void with_layout(int64_t format, const Fn& fn) {
  switch (format) {
    case U4_F16: return fn(std::integral_constant<int64_t, U4_F16>{});
    case U8_F16: return fn(std::integral_constant<int64_t, U8_F16>{});
    case U4_F32: return fn(std::integral_constant<int64_t, U4_F32>{});
    case U8_F32: return fn(std::integral_constant<int64_t, U8_F32>{});
    case U8_HALVES: return fn(std::integral_constant<int64_t, U8_HALVES>{});
    case U4_K: return fn(std::integral_constant<int64_t, U4_K>{});
    default: return fn(std::integral_constant<int64_t, U6_K>{});
  }
}

// Rows per work item from which the AVX-512 kernel expands a K-quant group
// first. (U4_K forms its scale pairs cheaply enough that 16-row decode steps
// ran 15% faster without the copy. U6_K once gained from 16 rows, when its
// direct tiles were of 4 rows; with tiles of 8, Zen 4, one thread, the
// direct records against the copy, GOP/s: the 49,152 x 2,048 LM head 16
// rows 157 -> 192, 24: 182 -> 197, 32 level, 64: 232 -> 201; a 2,048 x
// 8,192 down projection 16: 175 -> 190, 24 and 32 level, 64: 234 -> 193;
// 1B Q4_K_M decode steps of 16 rows 3.6% shorter, 24 and 32 level.)
constexpr int64_t EXPAND_ROWS = 32;
// The AVX2 kernel without VNNI: rows per work item from which a 4- or 6-bit
// group's weights are unpacked to bytes for group_avx2_bytes, and its tile.
// One thread, one 2,048 x 2,048 layer, Zen 3, GOP/s, the same call taking
// turns with group_avx2: Q4_K 4 rows 91 -> 83, 6: 83 -> 99, 16: 97 -> 141,
// 256: ~118 -> 179-187; Q6_K 8: 62 -> 82, 16: 92 -> 99, 256: ~111 -> 130-136.
// Tiles of 3 rows: 2 gave Q4_K 166-168 at 64-256 rows, 4 174-179.
constexpr int64_t BYTES_ROWS = 6;
constexpr int TILE_BYTES = 3;

// a for group g's records rewritten as `layout` by expand(group, out) into
// a buffer of the calling thread's (a work item's copy, see run_item).
template <typename Expand>
Args expanded_args(const Args& a, int64_t g, int64_t layout, const Expand& expand) {
  thread_local std::vector<uint8_t> scratch;
  scratch.resize(a.nb * record_bytes(layout));
  expand(a.packed + g * group_bytes(a.format, a.nb), scratch.data());
  Args sub = a;
  sub.records = scratch.data();
  sub.format = layout;
  return sub;
}

// One work item of q8_linear / grouped_block_linear: group g for a's M rows.
void run_item(Isa isa, const Args& a, int64_t g, int64_t M) {
#ifdef SLUICE_X86
  if (isa == ISA_AVX2 && four_bit(a.format) && M >= BYTES_ROWS) {
    const Args sub = expanded_args(a, g, six_bit(a.format) ? U6_X : U4_X, [&](const uint8_t* group, uint8_t* out) {
      with_layout(a.format, [&](auto F) {
        if constexpr (four_bit(decltype(F)::value)) expand_bytes256<decltype(F)::value>(group, a.nb, out);
      });
    });
    if (sub.format == U6_X)
      return in_tiles<TILE_BYTES>(M, [&](auto R, int64_t r0) { group_avx2_bytes<decltype(R)::value, U6_X>(sub, g, r0); });
    return in_tiles<TILE_BYTES>(M, [&](auto R, int64_t r0) { group_avx2_bytes<decltype(R)::value, U4_X>(sub, g, r0); });
  }
  // The AVX-VNNI kernel does not expand: not measured on a host that has it.
  if (isa == ISA_AVX512_VNNI && super_blocks(a.format) && M >= EXPAND_ROWS) {
    const Args sub = expanded_args(a, g, expanded_layout(a.format), [&](const uint8_t* group, uint8_t* out) {
      if (a.format == U4_K) expand_group512<U4_K>(group, a.nb, out);
      else expand_group512<U6_K>(group, a.nb, out);
    });
    if (a.format == U4_K) return run_group<U4_F32>(isa, sub, g, M);
    return in_tiles<tile_avx512(U6_X)>(M, [&](auto R, int64_t r0) { group_avx512<decltype(R)::value, U6_X>(sub, g, r0); });
  }
#endif
  with_layout(a.format, [&](auto F) { run_group<decltype(F)::value>(isa, a, g, M); });
}

// Runs fn(group, first row, rows) over work items (group, rows): few rows
// split over outputs only; many rows also over runs of rows of about equal
// size, whole register tiles where they can be (runs of 64 left a 200-row
// step, a chunk of prompt beside some decodes, a last item of 8 rows, which
// unpacked a K-quant group again for two tiles: 25-38% slower): a multiple
// of TILE_AVX512 rows, which the 4- and 2-row tiles divide too.
// At most this many rows per work item: a group's weights are read once per
// item, the item's quantized rows (512 KiB at K = 2,048) stay in L2.
constexpr int64_t MAX_ITEM_ROWS = 256;

inline int64_t item_rows(int64_t M) {
  const int64_t items = (M + MAX_ITEM_ROWS - 1) / MAX_ITEM_ROWS;
  static_assert(TILE_AVX512 % TILE_AVX512_HALVES == 0 && TILE_AVX512 % TILE_AVX2 == 0 &&
                TILE_AVX512 % TILE_AVX2_NO_VNNI == 0);
  return items <= 1 ? M : ((M + items - 1) / items + TILE_AVX512 - 1) / TILE_AVX512 * TILE_AVX512;
}

// A thread's share of the work items, [front, back) packed in one word so
// that its owner taking chunks from the front and another thread taking
// them from the back agree with one compare-and-swap.
struct alignas(64) Share {
  std::atomic<uint64_t> span{0};

  void set(uint64_t front, uint64_t back) { span.store(front | back << 32, std::memory_order_relaxed); }

  // Claims about an eighth of what is left (at least one item), from the
  // front or the back: false once nothing is left.
  bool take(bool from_back, int64_t& lo, int64_t& hi) {
    uint64_t s = span.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = s & 0xffffffffu, back = s >> 32;
      if (front >= back) return false;
      const uint64_t n = std::max<uint64_t>(1, (back - front) / 8);
      const uint64_t next = from_back ? front | (back - n) << 32 : (front + n) | back << 32;
      if (span.compare_exchange_weak(s, next, std::memory_order_acq_rel, std::memory_order_relaxed)) {
        lo = static_cast<int64_t>(from_back ? back - n : front);
        hi = lo + static_cast<int64_t>(n);
        return true;
      }
    }
  }
};

// Each thread starts on an equal, contiguous range of the items, so its
// weights stream in order and what it prefetches ahead is its own, and takes
// it a chunk at a time; a thread whose range is used up takes chunks from
// the far end of the others'. Equal ranges alone left each thread of a
// one-row step waiting for the other at the end of most matmuls (perf: 9% of
// a 1B decode step's samples on each), as the two rarely stream equally
// fast; one shared counter (tried earlier) scattered each thread's reads.
template <typename Fn>
void for_each_item(int64_t M, int64_t N, const Fn& fn) {
  const int64_t groups = (N + NG - 1) / NG, rows_per_item = item_rows(M);
  const int64_t row_items = (M + rows_per_item - 1) / rows_per_item, items = groups * row_items;
  const auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i % groups, r = (i / groups) * rows_per_item;
      fn(g, r, std::min(rows_per_item, M - r));
    }
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  if (threads <= 1 || at::in_parallel_region()) return run(0, items);
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t) shares[t].set(t * items / threads, (t + 1) * items / threads);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    int64_t lo, hi;
    for (int64_t t = t0; t < t1; ++t) {
      while (shares[t].take(false, lo, hi)) run(lo, hi);
      for (int64_t v = 1; v < threads; ++v)
        while (shares[(t + v) % threads].take(true, lo, hi)) run(lo, hi);
    }
  });
}

}  // namespace

namespace sluice_cpu {

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t N, int64_t isa_code) {
  const Isa isa = check_linear(x, packed, format, N, isa_code);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedRows q = quantize_rows(x, isa == ISA_AVX512_VNNI);
  const Args a(packed.data_ptr<uint8_t>(), q, y.data_ptr<float>(), K, N, format);
  for_each_item(M, N, [&](int64_t g, int64_t r, int64_t m) { run_item(isa, a.from_row(r), g, m); });
  return y;
}

at::Tensor exact_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t N, int64_t isa_code) {
  const Isa isa = check_linear(x, packed, format, N, isa_code);
  const int64_t M = x.size(0), nb = x.size(1) / QK;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const FArgs a{packed.data_ptr<uint8_t>(), x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), nb, N, format};
  for_each_item(M, N, [&](int64_t g, int64_t r, int64_t m) {
    FArgs sub = a;
    sub.x = a.x + r * a.x_stride;
    sub.y = a.y + r * N;
    with_layout(format, [&](auto F) { run_fgroup<decltype(F)::value>(isa, sub, g, m); });
  });
  return y;
}

// Rows `ids` of the [N, K] weight the records stand for, float32 [T, K]:
// an embedding lookup on the blocks. Each value is q * sw + cw rounded
// after the product and after the sum, as gguf_blocks.Records.expand (and
// so the model folder's float32 table) computes it; the product goes
// through a volatile so no compiler fuses the two into one rounding.
// QuantizedWeight.rows_reference is the same in plain torch.
at::Tensor block_rows(const at::Tensor& packed, int64_t format, int64_t N, const at::Tensor& ids) {
  TORCH_CHECK(format >= U4_F16 && format <= U6_K, "unknown record layout ", format);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids must be int64 [T]");
  // Bytes of a group's records per unit: a record of 32 values, or a super-block of 256.
  const int64_t unit = super_blocks(format) ? SUPER : 1, groups = (N + NG - 1) / NG;
  const int64_t rb = group_bytes(format, unit);
  TORCH_CHECK(N > 0 && packed.numel() % (groups * rb) == 0, "packed does not hold whole records of ", N, " rows");
  const int64_t nb = packed.numel() / (groups * rb) * unit, K = nb * QK, T = ids.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < N, "row ", id[t], " is not below ", N);
  at::Tensor out = at::empty({T, K}, at::kFloat);
  const uint8_t* base = packed.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t g = id[t] / NG, i = id[t] % NG;
      const uint8_t* group = base + g * group_bytes(format, nb);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *head, *w;
        locate(format, group, b, head, w);
        uint8_t wq[QK];
        float sw[2], cw[2];
        block_weights(format, w, i, wq);
        block_scales(format, head, b, i, sw, cw);
        for (int j = 0; j < QK; ++j) {
          volatile float product = static_cast<float>(wq[j]) * sw[j / 16];
          y[t * K + b * QK + j] = product + cw[j / 16];
        }
      }
    }
  });
  return out;
}

// The grouped form for mixture-of-experts layers (cpu_moe.cpp): x's rows
// come in runs, one per expert, and run e is multiplied by expert e's
// records (packed[e]):
//
//   rows   [offsets[0], offsets[1])  [offsets[1], offsets[2])  ...   (a run may be empty)
//   weight  packed[0]                  packed[1]                 ...
//
// The activations are quantized once for all runs; the work items are
// (expert, output group, tile of up to 64 of its rows), all in one parallel
// loop, so a decode step whose token chose 8 experts keeps every thread busy
// with one launch. Each row's result is what q8_linear / exact_linear give
// that row alone with its expert's weight.
at::Tensor grouped_block_linear(const at::Tensor& x, const std::vector<int64_t>& offsets, const at::Tensor& packed,
                                int64_t format, int64_t N, bool int8, int64_t isa_code) {
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) == static_cast<int64_t>(offsets.size()) - 1,
              "packed must be contiguous uint8 [experts, bytes], one row per run of offsets");
  TORCH_CHECK(offsets.front() == 0 && offsets.back() == x.size(0), "offsets must cover x's rows from 0");
  const Isa isa = check_linear(x, packed[0], format, N, isa_code);
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK, experts = packed.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  struct Item {
    int64_t expert, group, row, rows;
  };
  const int64_t groups = (N + NG - 1) / NG;
  std::vector<Item> items;
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(offsets[e + 1] >= offsets[e], "offsets must not decrease");
    const int64_t tile = item_rows(offsets[e + 1] - offsets[e]);  // 0 only for an empty run, which has no item
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += tile)
      for (int64_t g = 0; g < groups; ++g) items.push_back({e, g, r, std::min(tile, offsets[e + 1] - r)});
  }
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const int64_t stride = packed.stride(0);
  float* yp = y.data_ptr<float>();
  if (int8) {
    const QuantizedRows q = quantize_rows(x, isa == ISA_AVX512_VNNI);
    const Args a(base, q, yp, K, N, format);
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const Item& it = items[i];
        Args sub = a.from_row(it.row);
        sub.packed = base + it.expert * stride;
        run_item(isa, sub, it.group, it.rows);
      }
    });
    return y;
  }
  const FArgs a{base, x.data_ptr<float>(), x.stride(0), yp, nb, N, format};
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      FArgs sub = a;
      sub.packed = base + it.expert * stride;
      sub.x = a.x + it.row * a.x_stride;
      sub.y = yp + it.row * N;
      with_layout(format, [&](auto F) { run_fgroup<decltype(F)::value>(isa, sub, it.group, it.rows); });
    }
  });
  return y;
}

}  // namespace sluice_cpu

namespace {

// The activation quantization alone (tests compare it with a torch reference).
std::tuple<at::Tensor, at::Tensor, at::Tensor> q8_quantize(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % QK == 0,
              "x must be float32 [M, K] with K a multiple of 32");
  const QuantizedRows q = quantize_rows(x, host_has(ISA_AVX512_VNNI));
  return {q.xq, q.blocks[q.DX], q.blocks[q.SX]};
}

// The host's rate of the int8 dot products the kernels are made of, for
// benchmarks (step_bench.py's host limits): every thread runs `iterations`
// rounds of 12 independent multiply-accumulates of u8 x s8 pairs (VPDPBUSD
// into int32 lanes on 512 bits; on AVX2, PMADDUBSW into 16-bit lanes, as
// small_dots256 sums its 4-bit blocks), with nothing loaded from memory. Returns int8 operations (a
// multiply and an add per pair) per second over all threads.
#ifdef SLUICE_X86
// 12 accumulators named one by one (an array would live on the stack),
// each round kept by an empty asm that takes them all (no closed form).
#define DOT_ROUNDS(T, C, SET1, DOT, ADD)                                                              \
  T a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4), a5 = SET1(5), a6 = SET1(6),         \
    a7 = SET1(7), a8 = SET1(8), a9 = SET1(9), a10 = SET1(10), a11 = SET1(11);                                 \
  for (int64_t i = 0; i < iterations; ++i) {                                                                 \
    a0 = DOT(a0), a1 = DOT(a1), a2 = DOT(a2), a3 = DOT(a3), a4 = DOT(a4), a5 = DOT(a5);                       \
    a6 = DOT(a6), a7 = DOT(a7), a8 = DOT(a8), a9 = DOT(a9), a10 = DOT(a10), a11 = DOT(a11);                   \
    __asm__ volatile("" : "+" C(a0), "+" C(a1), "+" C(a2), "+" C(a3), "+" C(a4), "+" C(a5), "+" C(a6),        \
                     "+" C(a7), "+" C(a8), "+" C(a9), "+" C(a10), "+" C(a11));                                \
  }                                                                                                          \
  T sum = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7)));                                  \
  sum = ADD(sum, ADD(ADD(a8, a9), ADD(a10, a11)));                                                           \
  __asm__ volatile("" : : C(sum));

__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t dot_rounds_avx512(int64_t iterations) {
  const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-1);
#define DOT512(a) _mm512_dpbusd_epi32(a, w, x)
  DOT_ROUNDS(__m512i, "v", _mm512_set1_epi32, DOT512, _mm512_add_epi32)
#undef DOT512
  return 12 * 64 * 2;  // int8 operations per round
}

__attribute__((target("avx2"))) int64_t dot_rounds_avx2(int64_t iterations) {
  const __m256i w = _mm256_set1_epi8(3);
  // The signed operand is the accumulator itself: with two constants, the
  // product would be computed once, outside the loop, leaving only the adds.
#define DOT256(a) _mm256_add_epi16(a, _mm256_maddubs_epi16(w, a))
  DOT_ROUNDS(__m256i, "x", _mm256_set1_epi16, DOT256, _mm256_add_epi16)
#undef DOT256
  return 12 * 32 * 2;
}
#undef DOT_ROUNDS
#endif

double q8_dot_peak(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "iterations must be positive");
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> per_round(threads, 0);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
#ifdef SLUICE_X86
      if (host_has(ISA_AVX512_VNNI)) per_round[t] = dot_rounds_avx512(iterations);
      else if (host_has(ISA_AVX2)) per_round[t] = dot_rounds_avx2(iterations);
#endif
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double ops = 0;
  for (int64_t r : per_round) ops += static_cast<double>(r) * static_cast<double>(iterations);
  return ops / seconds;
}

// Which kernels this host runs: isa codes, best first.
std::vector<int64_t> q8_isas() {
  std::vector<int64_t> out;
  for (Isa isa : {ISA_AVX512_VNNI, ISA_AVX_VNNI, ISA_AVX2, ISA_SCALAR})
    if (host_has(isa)) out.push_back(isa);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.def("q8_pack(Tensor sw, Tensor cw, Tensor wq, int layout) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor packed, int format, int out_features, int isa=0) -> Tensor");
  m.def("exact_linear(Tensor x, Tensor packed, int format, int out_features, int isa=0) -> Tensor");
  m.def("q8_quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("block_rows(Tensor packed, int format, int out_features, Tensor ids) -> Tensor");
  m.def("q8_isas() -> int[]");
  m.def("q8_dot_peak(int iterations) -> float");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
  m.impl("q8_pack", &q8_pack);
  m.impl("q8_linear", &sluice_cpu::q8_linear);
  m.impl("exact_linear", &sluice_cpu::exact_linear);
  m.impl("q8_quantize", &q8_quantize);
  m.impl("block_rows", &sluice_cpu::block_rows);
}

TORCH_LIBRARY_IMPL(sluice_cpu, CatchAll, m) {
  m.impl("q8_isas", &q8_isas);
  m.impl("q8_dot_peak", &q8_dot_peak);
}

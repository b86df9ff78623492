// LoRA's grouped (segment) matmul on CPU: every row of a step gets its own
// adapter's low-rank update, all adapters of the step in one call
// (sluice_kernels/lora.py has the math, the torch reference, the packed
// layout below and `lora_pack_cpu`, which writes it):
//
//   lora_apply_(y, x, a, b, bounds, seg_starts, seg_ends, seg_slots, ranks, scales)
//     for segment g (rows [seg_starts[g], seg_ends[g]) on slot s = seg_slots[g]),
//     piece p with r = ranks[s, p] > 0, row t:
//       h[t, p, :r]                      = A[s, p, :r] x[t]                  (shrink)
//       y[t, bounds[p] .. bounds[p+1])  += scales[s] * (B[s, those rows, :r] h[t, p])  (expand)
//
// The stacks come packed once, at load, so that both phases stream them
// front to back and multiply along 16 lanes without a horizontal sum:
//
//   a  [S, P, RP/16, IN, 16]  panel j holds ranks 16j .. 16j+15 of every
//                             input column: a[s, p, j, i, l] = A[s, p, 16j + l, i]
//                             (RP: the stacks' rank R rounded up to 16; zeros
//                             past a slot's rank)
//   b  [S, NB, R, 64]         output block n holds outputs 64n .. 64n+63 of
//                             every rank: b[s, n, k, o] = B[s, 64n + o, k]
//                             (NB = ceil(OUT / 64); zeros past OUT)
//
// Two parallel phases, each over a flat range of independent items:
//
//   shrink  (segment, piece, chunk of KC inputs, block of kRowBlock rows):
//           a partial h over the chunk's inputs, 16 ranks per vector, one
//           multiply-add per input and row (rows in registers, 8 at a time)
//   expand  (segment, output block, block of kRowBlock rows): h summed over
//           the chunks, then one multiply-add per rank over the block's 64
//           outputs (4 rows x 4 vectors in registers), for each piece in the
//           block (only its own outputs are written)
//
// The chunks make a decode step (a few rows per adapter) parallel over the
// reduction: a segment of 1 row still gives P * ceil(IN / KC) shrink items.
// Chunk boundaries depend on IN alone and h is summed over them in order,
// so a row's update is the same whatever the other rows of the step, the
// segment's length or the number of threads. A decode step reads each
// adapter's A and B once per layer; pieces of rank 0 are skipped.
//
// The stacks are float32 or bfloat16 (--lora-dtype; both packed alike, a
// and b of one dtype); x, y, h and every sum are float32. A bfloat16
// element is widened exactly as it is read (its 16 bits are a float32's
// upper half), so the two dtypes differ only by the stacks' rounding, and a
// decode step reads half the bytes of stacks (most of its LoRA time where
// several adapters share it: each one's stacks are read once a layer). The
// vectors are GCC/Clang vector types, which -march=native lowers to the
// host's widest registers (AVX-512, AVX2, or SSE).
//
// No argument is checked here: sluice_kernels.lora.check_lora_args is the one
// validator (lora_apply_cpu calls it, and the decoder's Python side checks its
// stacks when it hands them over and its segments once per step).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "sluice_cpu.h"

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int64_t kLanes = 16;
constexpr int64_t kOutBlock = 64;   // outputs per packed B block (4 vectors)
constexpr int64_t kChunk = 192;     // inputs per shrink item (the chunk of the reduction)
constexpr int64_t kRowBlock = 64;   // rows per item

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 bfloat16 (their bits) widened to float32: each is a float32's upper half.
inline v16 load(const uint16_t* p) {
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
  v16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// acc[m] = sum_{i in [i0, i1)} x[m][i] * panel[i]  for M rows, one 16-rank panel
// of W (float, or bfloat16's bits).
template <int M, typename W>
void shrink_rows(const float* x, int64_t x_stride, const W* panel, int64_t i0, int64_t i1, float* out,
                 int64_t out_stride) {
  v16 acc[M] = {};
  for (int64_t i = i0; i < i1; ++i) {
    const v16 av = load(panel + i * kLanes);
    for (int m = 0; m < M; ++m) acc[m] += x[m * x_stride + i] * av;
  }
  for (int m = 0; m < M; ++m) store(out + m * out_stride, acc[m]);
}

// acc[m][0:64] = sum_{k < r} h[m][k] * block[k][0:64]  for M rows, then
// y[m][o] += scale * acc[m][o] on the block's outputs [lo, hi) (offsets in
// the block).
template <int M, typename W>
void expand_rows(const float* h, int64_t h_stride, const W* block, int64_t r, float* y, int64_t y_stride,
                 int64_t lo, int64_t hi, float scale) {
  v16 acc[M][4] = {};
  for (int64_t k = 0; k < r; ++k) {
    const W* bk = block + k * kOutBlock;
    const v16 b0 = load(bk), b1 = load(bk + 16), b2 = load(bk + 32), b3 = load(bk + 48);
    for (int m = 0; m < M; ++m) {
      const float hk = h[m * h_stride + k];
      acc[m][0] += hk * b0;
      acc[m][1] += hk * b1;
      acc[m][2] += hk * b2;
      acc[m][3] += hk * b3;
    }
  }
  for (int m = 0; m < M; ++m) {
    float* y_row = y + m * y_stride;
    if (lo == 0 && hi == kOutBlock) {
      for (int v = 0; v < 4; ++v) store(y_row + 16 * v, load(y_row + 16 * v) + acc[m][v] * scale);
    } else {
      float lanes[kOutBlock];
      for (int v = 0; v < 4; ++v) store(lanes + 16 * v, acc[m][v]);
      for (int64_t o = lo; o < hi; ++o) y_row[o] += lanes[o] * scale;
    }
  }
}

template <typename F>
void by_rows(int64_t rows, int64_t max_m, F&& f) {
  // f(row offset, count) over blocks of max_m rows, dispatched to a
  // compile-time count so that the accumulators stay in registers.
  for (int64_t t = 0; t < rows; t += max_m) f(t, std::min(max_m, rows - t));
}

// The kernel on stacks of element W (float, or uint16_t: bfloat16's bits).
template <typename W>
void lora_apply_impl(at::Tensor& y, const at::Tensor& x, const W* as, const W* bs, const at::Tensor& a,
                     const at::Tensor& b, const int32_t* bound, const int32_t* start, const int32_t* end,
                     const int32_t* slot, int64_t G, const int32_t* rank, const float* scale) {
  // a [S, P, RP/16, IN, 16], b [S, NB, R, 64], y [T, OUT] (module comment).
  const int64_t P = a.size(1), RP = a.size(2) * kLanes, IN = a.size(3), NB = b.size(1), R = b.size(2);
  const int64_t OUT = y.size(1);
  const int64_t NC = (IN + kChunk - 1) / kChunk;
  // Per segment: its first row in h, its first shrink and expand item.
  thread_local std::vector<int64_t> offsets;
  offsets.assign(3 * (G + 1), 0);
  int64_t* h_row = offsets.data();
  int64_t* shrink_first = h_row + G + 1;
  int64_t* expand_first = shrink_first + G + 1;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = end[g] - start[g], blocks = (rows + kRowBlock - 1) / kRowBlock;
    h_row[g + 1] = h_row[g] + rows;
    shrink_first[g + 1] = shrink_first[g] + P * NC * blocks;
    expand_first[g + 1] = expand_first[g] + NB * blocks;
  }
  if (h_row[G] == 0) return;
  // Partial h per row, piece and chunk: [rows, P, NC, RP]; entries of pieces
  // of rank 0 are never written nor read.
  thread_local std::vector<float> h_scratch;
  h_scratch.resize(h_row[G] * P * NC * RP);
  float* h = h_scratch.data();
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  const int64_t h_stride = P * NC * RP;  // between rows

  auto segment_of = [&](const int64_t* first, int64_t item) {
    return static_cast<int64_t>(std::upper_bound(first, first + G + 1, item) - first) - 1;
  };

  at::parallel_for(0, shrink_first[G], 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t g = segment_of(shrink_first, item);
      int64_t rest = item - shrink_first[g];
      const int64_t c = rest % NC;
      rest /= NC;
      const int64_t p = rest % P, block = rest / P;
      const int64_t s = slot[g], r = rank[s * P + p];
      if (r == 0) continue;
      const int64_t t0 = start[g] + block * kRowBlock, t1 = std::min<int64_t>(end[g], t0 + kRowBlock);
      const int64_t i0 = c * kChunk, i1 = std::min(IN, i0 + kChunk);
      for (int64_t pan = 0; pan * kLanes < r; ++pan) {
        const W* panel = as + ((s * P + p) * (RP / kLanes) + pan) * IN * kLanes;
        by_rows(t1 - t0, 8, [&](int64_t t, int64_t m) {
          const float* x_rows = xs + (t0 + t) * x_stride;
          float* out = h + (h_row[g] + t0 - start[g] + t) * h_stride + (p * NC + c) * RP + pan * kLanes;
          switch (m) {
            case 8: shrink_rows<8, W>(x_rows, x_stride, panel, i0, i1, out, h_stride); break;
            case 7: shrink_rows<7, W>(x_rows, x_stride, panel, i0, i1, out, h_stride); break;
            case 6: shrink_rows<6, W>(x_rows, x_stride, panel, i0, i1, out, h_stride); break;
            case 5: shrink_rows<5, W>(x_rows, x_stride, panel, i0, i1, out, h_stride); break;
            case 4: shrink_rows<4, W>(x_rows, x_stride, panel, i0, i1, out, h_stride); break;
            case 3: shrink_rows<3, W>(x_rows, x_stride, panel, i0, i1, out, h_stride); break;
            case 2: shrink_rows<2, W>(x_rows, x_stride, panel, i0, i1, out, h_stride); break;
            default: shrink_rows<1, W>(x_rows, x_stride, panel, i0, i1, out, h_stride); break;
          }
        });
      }
    }
  });
  at::parallel_for(0, expand_first[G], 1, [&](int64_t lo, int64_t hi) {
    // h of up to 4 rows of one piece, summed over the chunks: [4][R].
    thread_local std::vector<float> h_sum;
    h_sum.resize(4 * R);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t g = segment_of(expand_first, item);
      const int64_t rest = item - expand_first[g];
      const int64_t n = rest % NB, block = rest / NB;
      const int64_t s = slot[g];
      const int64_t t0 = start[g] + block * kRowBlock, t1 = std::min<int64_t>(end[g], t0 + kRowBlock);
      const int64_t o0 = n * kOutBlock, o1 = std::min(OUT, o0 + kOutBlock);
      int64_t p = 0;
      while (bound[p + 1] <= o0) ++p;
      for (; p < P && bound[p] < o1; ++p) {
        const int64_t r = rank[s * P + p];
        if (r == 0) continue;
        const int64_t lo_o = std::max<int64_t>(o0, bound[p]) - o0, hi_o = std::min<int64_t>(o1, bound[p + 1]) - o0;
        const W* out_block = bs + (s * NB + n) * R * kOutBlock;
        by_rows(t1 - t0, 4, [&](int64_t t, int64_t m) {
          for (int64_t mm = 0; mm < m; ++mm) {
            const float* part = h + (h_row[g] + t0 - start[g] + t + mm) * h_stride + p * NC * RP;
            float* sum = h_sum.data() + mm * R;
            for (int64_t k = 0; k < r; ++k) sum[k] = part[k];
            for (int64_t c = 1; c < NC; ++c)
              for (int64_t k = 0; k < r; ++k) sum[k] += part[c * RP + k];
          }
          float* y_rows = ys + (t0 + t) * y_stride + o0;
          const float sc = scale[s];
          switch (m) {
            case 4: expand_rows<4, W>(h_sum.data(), R, out_block, r, y_rows, y_stride, lo_o, hi_o, sc); break;
            case 3: expand_rows<3, W>(h_sum.data(), R, out_block, r, y_rows, y_stride, lo_o, hi_o, sc); break;
            case 2: expand_rows<2, W>(h_sum.data(), R, out_block, r, y_rows, y_stride, lo_o, hi_o, sc); break;
            default: expand_rows<1, W>(h_sum.data(), R, out_block, r, y_rows, y_stride, lo_o, hi_o, sc); break;
          }
        });
      }
    }
  });
}

}  // namespace

namespace sluice_cpu {

void lora_apply_unchecked(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                          const int32_t* bound, const int32_t* start, const int32_t* end, const int32_t* slot,
                          int64_t G, const int32_t* rank, const float* scale) {
  if (a.scalar_type() == at::kBFloat16) {
    const auto* as = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
    const auto* bs = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
    lora_apply_impl(y, x, as, bs, a, b, bound, start, end, slot, G, rank, scale);
  } else {
    lora_apply_impl(y, x, a.data_ptr<float>(), b.data_ptr<float>(), a, b, bound, start, end, slot, G, rank, scale);
  }
}

void lora_apply_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& bounds, const at::Tensor& seg_starts, const at::Tensor& seg_ends,
                 const at::Tensor& seg_slots, const at::Tensor& ranks, const at::Tensor& scales) {
  lora_apply_unchecked(y, x, a, b, bounds.data_ptr<int32_t>(), seg_starts.data_ptr<int32_t>(),
                       seg_ends.data_ptr<int32_t>(), seg_slots.data_ptr<int32_t>(), seg_starts.numel(),
                       ranks.data_ptr<int32_t>(), scales.data_ptr<float>());
}

}  // namespace sluice_cpu

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.def("lora_apply_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor bounds, Tensor seg_starts, "
        "Tensor seg_ends, Tensor seg_slots, Tensor ranks, Tensor scales) -> ()");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
  m.impl("lora_apply_", &sluice_cpu::lora_apply_);
}

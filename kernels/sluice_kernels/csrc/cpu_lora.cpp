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
// Two phases for a block of rows of one segment:
//
//   shrink  per piece and chunk of KC inputs: a partial h over the chunk's
//           inputs, 16 ranks per vector, one multiply-add per input and row
//           (rows in registers, 8 at a time)
//   expand  h summed over the chunks (and, multiplied in bfloat16 pairs,
//           rounded) once per row and piece; then per block of 64 outputs
//           one multiply-add per rank over the block's 64 outputs (4 rows x
//           4 vectors in registers), for each piece in the block (only its
//           own outputs are written)
//
// (That is the one-loop plan's order, where x, multiplied in bfloat16
// pairs, is also rounded once per row for every piece and chunk. The
// two-loop plan, whose blocks hold a row or two, rounds x once per chunk and
// sums h once per output block: a third parallel loop to share that sum
// would cost more than the sum.)
//
// and two ways to spread them over the threads (LoraKernel::run picks):
//
//   one loop    items (segment, block of rows), each running both phases for
//               its rows: one fork/join a call, where every thread gets a
//               block (several adapters in a decode step, a prefill). A
//               decode step's small calls (120 a step on the bundled model)
//               cost more in fork/joins than in arithmetic.
//   two loops   the shrink over (segment, piece, chunk, rows), then the expand
//               over (segment, output block, rows): a few rows on one adapter
//               (a decode step of one or two sequences), parallel over the
//               reduction, since a segment of 1 row still gives P * ceil(IN / KC)
//               shrink items.
//
// Chunk boundaries depend on IN alone and h is summed over them in order,
// and both ways run the same code on a row, so a row's update is the same
// whatever the other rows of the step, the segment's length, the way taken
// or the number of threads. A decode step reads each adapter's A and B once
// per layer (once per block of rows); pieces of rank 0 are skipped.
//
// The stacks are float32 or bfloat16 (--lora-dtype, a and b of one dtype);
// y and every sum are float32. bfloat16 stacks hold each panel and block in
// pairs (sluice_kernels.lora.to_pairs: two inputs, or two ranks, in each
// 32-bit lane), so a decode step reads half the bytes of stacks (most of its
// LoRA time where several adapters share it: each one's stacks are read
// once a layer). On a CPU with AVX512-BF16 they are multiplied with its pair
// dot product, x and h rounded to bfloat16 (Math::PAIRS_DP); elsewhere each
// pair is widened exactly (its 16 bits are a float32's upper half) and
// multiplied in float32 as float32 stacks are, in the same order, so the
// result is the float32 kernel's on the rounded stacks (Math::PAIRS). The
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
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define SLUICE_X86 1
#endif

#include "sluice_cpu.h"

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int64_t kLanes = 16;
constexpr int64_t kOutBlock = 64;   // outputs per packed B block (4 vectors)
constexpr int64_t kChunk = 192;     // inputs per shrink item (the chunk of the reduction)
constexpr int64_t kRowBlock = 64;   // rows per item
constexpr int64_t kMinBlockRows = 4;  // rows per item of the one-loop plan, at least (LoraKernel::run)

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// acc[m] = sum_{i in [i0, i1)} x[m][i] * panel[i]  for M rows, one 16-rank panel
// of W (float, or bfloat16's bits). Here and below, x[m][i] is
// x[m * x_stride + i - x_base]: the rows may hold the inputs from x_base on.
template <int M, typename W>
void shrink_rows(const float* x, int64_t x_stride, int64_t x_base, const W* panel, int64_t i0, int64_t i1, float* out,
                 int64_t out_stride) {
  v16 acc[M] = {};
  for (int64_t i = i0; i < i1; ++i) {
    const v16 av = load(panel + i * kLanes);
    for (int m = 0; m < M; ++m) acc[m] += x[m * x_stride + i - x_base] * av;
  }
  for (int m = 0; m < M; ++m) store(out + m * out_stride, acc[m]);
}

// y[m][o] += scale * acc[m][o] on a block's outputs [lo, hi) (offsets in
// the block), for M rows.
template <int M>
void add_scaled(const v16 (&acc)[M][4], float* y, int64_t y_stride, int64_t lo, int64_t hi, float scale) {
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

// acc[m][0:64] = sum_{k < r} h[m][k] * block[k][0:64]  for M rows, then
// add_scaled.
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
  add_scaled<M>(acc, y, y_stride, lo, hi, scale);
}

// bfloat16 stacks in pairs (sluice_kernels.lora.to_pairs): 32 bfloat16
// are 16 lanes of two values each, the lower one first. Widened exactly:
// the lower value's bits shifted up, the upper one's masked (each a
// float32's upper half).
inline void load_pairs(const uint16_t* p, v16& lower, v16& upper) {
  u32x16 w;
  std::memcpy(&w, p, sizeof w);
  const u32x16 lo_bits = w << 16, hi_bits = w & 0xFFFF0000u;
  std::memcpy(&lower, &lo_bits, sizeof lower);
  std::memcpy(&upper, &hi_bits, sizeof upper);
}

// shrink_rows on a panel of pairs (inputs 2i, 2i+1 of each rank), widened
// and multiplied in float32: the same sums, in the same order.
template <int M>
void shrink_pairs(const float* x, int64_t x_stride, int64_t x_base, const uint16_t* panel, int64_t i0, int64_t i1,
                  float* out, int64_t out_stride) {
  v16 acc[M] = {};
  for (int64_t i = i0; i < i1; i += 2) {
    v16 even, odd;
    load_pairs(panel + i * kLanes, even, odd);
    for (int m = 0; m < M; ++m) {
      acc[m] += x[m * x_stride + i - x_base] * even;
      acc[m] += x[m * x_stride + i + 1 - x_base] * odd;
    }
  }
  for (int m = 0; m < M; ++m) store(out + m * out_stride, acc[m]);
}

// expand_rows on a block of pairs (ranks 2k, 2k+1 of each output); h[m][r]
// must be 0 when r is odd.
template <int M>
void expand_pairs(const float* h, int64_t h_stride, const uint16_t* block, int64_t r, float* y, int64_t y_stride,
                  int64_t lo, int64_t hi, float scale) {
  v16 acc[M][4] = {};
  for (int64_t k = 0; k < r; k += 2) {
    const uint16_t* bk = block + k * kOutBlock;
    for (int v = 0; v < 4; ++v) {
      v16 even, odd;
      load_pairs(bk + 32 * v, even, odd);
      for (int m = 0; m < M; ++m) {
        acc[m][v] += h[m * h_stride + k] * even;
        acc[m][v] += h[m * h_stride + k + 1] * odd;
      }
    }
  }
  add_scaled<M>(acc, y, y_stride, lo, hi, scale);
}

#ifdef SLUICE_X86
#define LORA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// n float32 to bfloat16, rounded to nearest even (VCVTNEPS2BF16).
LORA_BF16_TARGET inline void to_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + j));
    _mm256_mask_storeu_epi16(out + j, mask, reinterpret_cast<const __m256i&>(v));
  }
}

// shrink_rows with AVX512-BF16's pair dot product on x rounded to bfloat16
// (xb, rounded once for all the panels and pieces that read it): each lane's
// pair of products added to its float32 sum.
template <int M>
LORA_BF16_TARGET void shrink_pairs_dp(const uint16_t* xb, int64_t x_stride, int64_t x_base, const uint16_t* panel,
                                        int64_t i0, int64_t i1, float* out, int64_t out_stride) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t i = i0; i < i1; i += 2) {
    const __m512bh av = (__m512bh)_mm512_loadu_si512(panel + i * kLanes);
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, xb + m * x_stride + i - x_base, 4);
      acc[m] = _mm512_dpbf16_ps(acc[m], av, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * out_stride, acc[m]);
}

// expand_rows with the pair dot product on h rounded to bfloat16 (hb, rounded
// once for every output block; hb[m][r] must be 0 when r is odd).
template <int M>
LORA_BF16_TARGET void expand_pairs_dp(const uint16_t* hb, int64_t h_stride, const uint16_t* block, int64_t r,
                                        float* y, int64_t y_stride, int64_t lo, int64_t hi, float scale) {
  const int64_t r2 = (r + 1) / 2 * 2;
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < r2; k += 2) {
    const uint16_t* bk = block + k * kOutBlock;
    __m512bh b[4];
    for (int v = 0; v < 4; ++v) b[v] = (__m512bh)_mm512_loadu_si512(bk + 32 * v);
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, hb + m * h_stride + k, 4);
      const __m512bh hp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], b[v], hp);
    }
  }
  v16 out[M][4];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) std::memcpy(&out[m][v], &acc[m][v], sizeof(v16));
  add_scaled<M>(out, y, y_stride, lo, hi, scale);
}
#endif

// Whether this CPU has AVX512-BF16 (bfloat16 stacks are then multiplied in
// bfloat16 pairs).
bool bf16_products() {
#ifdef SLUICE_X86
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

// The arithmetic of a call: float32 stacks; bfloat16 pairs widened; or
// bfloat16 pairs multiplied in pairs (AVX512-BF16).
enum class Math { FLOAT, PAIRS, PAIRS_DP };

// What the products read x and h as: float32, or bfloat16's bits where
// they are multiplied in bfloat16 pairs.
template <Math K>
using Operand = std::conditional_t<K == Math::PAIRS_DP, uint16_t, float>;

// n values of each of `rows` rows (x_stride apart) rounded to bfloat16, into
// out (out_stride apart): x and h as Math::PAIRS_DP multiplies them.
inline void round_rows(const float* x, int64_t x_stride, int64_t rows, int64_t n, uint16_t* out, int64_t out_stride) {
#ifdef SLUICE_X86
  for (int64_t m = 0; m < rows; ++m) to_bf16(x + m * x_stride, n, out + m * out_stride);
#endif
}

// shrink_rows / shrink_pairs / shrink_pairs_dp for M rows, by Math.
template <Math K, int M, typename W>
void shrink(const Operand<K>* x, int64_t x_stride, int64_t x_base, const W* panel, int64_t i0, int64_t i1, float* out,
            int64_t out_stride) {
  if constexpr (K == Math::FLOAT) {
    shrink_rows<M, W>(x, x_stride, x_base, panel, i0, i1, out, out_stride);
  } else if constexpr (K == Math::PAIRS) {
    shrink_pairs<M>(x, x_stride, x_base, panel, i0, i1, out, out_stride);
  } else {
#ifdef SLUICE_X86
    shrink_pairs_dp<M>(x, x_stride, x_base, panel, i0, i1, out, out_stride);
#endif
  }
}

template <Math K, int M, typename W>
void expand(const Operand<K>* h, int64_t h_stride, const W* block, int64_t r, float* y, int64_t y_stride, int64_t lo,
            int64_t hi, float scale) {
  if constexpr (K == Math::FLOAT) {
    expand_rows<M, W>(h, h_stride, block, r, y, y_stride, lo, hi, scale);
  } else if constexpr (K == Math::PAIRS) {
    expand_pairs<M>(h, h_stride, block, r, y, y_stride, lo, hi, scale);
  } else {
#ifdef SLUICE_X86
    expand_pairs_dp<M>(h, h_stride, block, r, y, y_stride, lo, hi, scale);
#endif
  }
}

template <typename F>
void by_rows(int64_t rows, int64_t max_m, F&& f) {
  // f(row offset, count) over blocks of max_m rows, dispatched to a
  // compile-time count so that the accumulators stay in registers.
  for (int64_t t = 0; t < rows; t += max_m) f(t, std::min(max_m, rows - t));
}

// The kernel on stacks of element W (float, or uint16_t: bfloat16's bits).
//
// Both plans below run the same two helpers, shrink_chunk and
// expand_block, on the same rows in the same order of sums, so a row's
// update is bitwise the same whichever plan a call takes.
template <Math K, typename W>
class LoraKernel {
 public:
  LoraKernel(at::Tensor& y, const at::Tensor& x, const W* as, const W* bs, const at::Tensor& a, const at::Tensor& b,
             const int32_t* bound, const int32_t* start, const int32_t* end, const int32_t* slot, int64_t G,
             const int32_t* rank, const float* scale)
      : as_(as), bs_(bs), bound_(bound), start_(start), end_(end), slot_(slot), G_(G), rank_(rank), scale_(scale),
        P_(a.size(1)), RP_(a.size(2) * kLanes), IN_(a.size(3)), NB_(b.size(1)), R_(b.size(2)), OUT_(y.size(1)),
        NC_((IN_ + kChunk - 1) / kChunk), h_stride_(P_ * NC_ * RP_), R2_((R_ + 1) / 2 * 2), hp_stride_(P_ * R2_),
        xs_(x.data_ptr<float>()),
        ys_(y.data_ptr<float>()), x_stride_(x.stride(0)), y_stride_(y.stride(0)) {}

  void run() {
    // Plan 1, one parallel loop: items of (segment, block of rows), each
    // running both phases for its rows on its own partial h. A decode step
    // on several adapters (a segment each), one adapter's rows of a bigger
    // step, or a prefill take it: one fork/join a call, and each item
    // streams one adapter's stacks front to back. A block has at most
    // kRowBlock rows and, where the step is small, half a thread's share of
    // the rows, but no fewer than kMinBlockRows: a block reads its adapter's
    // stacks again (from cache, mostly).
    const int64_t threads = at::get_num_threads();
    int64_t rows = 0;
    for (int64_t g = 0; g < G_; ++g) rows += end_[g] - start_[g];
    if (rows == 0) return;
    const int64_t block_rows = std::clamp<int64_t>((rows + 2 * threads - 1) / (2 * threads), kMinBlockRows, kRowBlock);
    int64_t items = 0;
    for (int64_t g = 0; g < G_; ++g) items += (end_[g] - start_[g] + block_rows - 1) / block_rows;
    if (items >= threads) return fused(block_rows);
    // Plan 2, too few rows to give every thread a block (a decode step of
    // a few sequences on one adapter): the two phases each split over their
    // own items, the shrink over chunks of the inputs (module comment).
    two_phase();
  }

 private:
  using X = Operand<K>;

  // h partial of piece p, chunk c for rows [t0, t1) of segment g: x_rows
  // holds row t0's inputs from x_base on (rows x_stride apart, as the
  // products read them: Operand<K>); h_rows points at row t0's h (rows
  // h_stride_ apart), laid out [P, NC, RP].
  void shrink_chunk(int64_t g, int64_t p, int64_t c, int64_t t0, int64_t t1, const X* x_rows, int64_t x_stride,
                    int64_t x_base, float* h_rows) const {
    const int64_t s = slot_[g], r = rank_[s * P_ + p];
    if (r == 0) return;
    const int64_t i0 = c * kChunk, i1 = std::min(IN_, i0 + kChunk);
    for (int64_t pan = 0; pan * kLanes < r; ++pan) {
      const W* panel = as_ + ((s * P_ + p) * (RP_ / kLanes) + pan) * IN_ * kLanes;
      by_rows(t1 - t0, 8, [&](int64_t t, int64_t m) {
        const X* x = x_rows + t * x_stride;
        float* out = h_rows + t * h_stride_ + (p * NC_ + c) * RP_ + pan * kLanes;
        switch (m) {
          case 8: shrink<K, 8, W>(x, x_stride, x_base, panel, i0, i1, out, h_stride_); break;
          case 7: shrink<K, 7, W>(x, x_stride, x_base, panel, i0, i1, out, h_stride_); break;
          case 6: shrink<K, 6, W>(x, x_stride, x_base, panel, i0, i1, out, h_stride_); break;
          case 5: shrink<K, 5, W>(x, x_stride, x_base, panel, i0, i1, out, h_stride_); break;
          case 4: shrink<K, 4, W>(x, x_stride, x_base, panel, i0, i1, out, h_stride_); break;
          case 3: shrink<K, 3, W>(x, x_stride, x_base, panel, i0, i1, out, h_stride_); break;
          case 2: shrink<K, 2, W>(x, x_stride, x_base, panel, i0, i1, out, h_stride_); break;
          default: shrink<K, 1, W>(x, x_stride, x_base, panel, i0, i1, out, h_stride_); break;
        }
      });
    }
  }

  // Rows [t0, t1)'s x as the products read it, for a shrink over inputs
  // [i0, i1): x itself, or (PAIRS_DP) those inputs rounded into `scratch`.
  // Sets x_stride and x_base (shrink_chunk).
  const X* x_operand(int64_t t0, int64_t t1, int64_t i0, int64_t i1, std::vector<uint16_t>& scratch, int64_t& x_stride,
                     int64_t& x_base) const {
    if constexpr (K == Math::PAIRS_DP) {
      scratch.resize((t1 - t0) * (i1 - i0));
      round_rows(xs_ + t0 * x_stride_ + i0, x_stride_, t1 - t0, i1 - i0, scratch.data(), i1 - i0);
      x_stride = i1 - i0;
      x_base = i0;
      return scratch.data();
    } else {
      x_stride = x_stride_;
      x_base = 0;
      return xs_ + t0 * x_stride_;
    }
  }

  // Piece p's h of rows [t0, t1) of segment g as the expand reads it: the
  // partials (h_rows, as in shrink_chunk) summed over the chunks in order,
  // the pair of an odd last rank zeroed, and (PAIRS_DP) rounded; into
  // h_out + row * hp_stride_ + p * R2_. The one-loop plan prepares a block
  // of rows once for all its output blocks; the two-loop plan once per
  // output block's item (module comment).
  void prepare_h(int64_t g, int64_t p, int64_t t0, int64_t t1, const float* h_rows, X* h_out,
                 std::vector<float>& sum_scratch) const {
    const int64_t r = rank_[slot_[g] * P_ + p];
    if (r == 0) return;
    const int64_t r2 = (r + 1) / 2 * 2;
    sum_scratch.resize(R2_);
    for (int64_t t = 0; t < t1 - t0; ++t) {
      const float* part = h_rows + t * h_stride_ + p * NC_ * RP_;
      float* sum;
      if constexpr (K == Math::PAIRS_DP)
        sum = sum_scratch.data();
      else
        sum = h_out + t * hp_stride_ + p * R2_;
      for (int64_t k = 0; k < r; ++k) sum[k] = part[k];
      for (int64_t c = 1; c < NC_; ++c)
        for (int64_t k = 0; k < r; ++k) sum[k] += part[c * RP_ + k];
      if (K != Math::FLOAT && r % 2) sum[r] = 0.f;  // the pair of the last rank
      if constexpr (K == Math::PAIRS_DP) round_rows(sum, 0, 1, r2, h_out + t * hp_stride_ + p * R2_, 0);
    }
  }

  // y[t, 64n .. 64n+63] += scale * B h for rows [t0, t1) of segment g, each
  // piece in the block writing its own outputs, from h prepared by
  // prepare_h (hp: row t0's).
  void expand_block(int64_t g, int64_t n, int64_t t0, int64_t t1, const X* hp) const {
    const int64_t s = slot_[g];
    const int64_t o0 = n * kOutBlock, o1 = std::min(OUT_, o0 + kOutBlock);
    int64_t p = 0;
    while (bound_[p + 1] <= o0) ++p;
    for (; p < P_ && bound_[p] < o1; ++p) {
      const int64_t r = rank_[s * P_ + p];
      if (r == 0) continue;
      const int64_t lo_o = std::max<int64_t>(o0, bound_[p]) - o0, hi_o = std::min<int64_t>(o1, bound_[p + 1]) - o0;
      const W* out_block = bs_ + (s * NB_ + n) * R_ * kOutBlock;
      by_rows(t1 - t0, 4, [&](int64_t t, int64_t m) {
        const X* h = hp + t * hp_stride_ + p * R2_;
        float* y_rows = ys_ + (t0 + t) * y_stride_ + o0;
        const float sc = scale_[s];
        switch (m) {
          case 4: expand<K, 4, W>(h, hp_stride_, out_block, r, y_rows, y_stride_, lo_o, hi_o, sc); break;
          case 3: expand<K, 3, W>(h, hp_stride_, out_block, r, y_rows, y_stride_, lo_o, hi_o, sc); break;
          case 2: expand<K, 2, W>(h, hp_stride_, out_block, r, y_rows, y_stride_, lo_o, hi_o, sc); break;
          default: expand<K, 1, W>(h, hp_stride_, out_block, r, y_rows, y_stride_, lo_o, hi_o, sc); break;
        }
      });
    }
  }

  void fused(int64_t block_rows) const {
    struct Item {
      int64_t g, t0, t1;
    };
    std::vector<Item> items;
    for (int64_t g = 0; g < G_; ++g)
      for (int64_t t = start_[g]; t < end_[g]; t += block_rows) items.push_back({g, t, std::min<int64_t>(end_[g], t + block_rows)});
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
      thread_local std::vector<float> h, sums;
      thread_local std::vector<X> hp;
      thread_local std::vector<uint16_t> xb;
      for (int64_t i = lo; i < hi; ++i) {
        const Item& it = items[i];
        const int64_t rows = it.t1 - it.t0;
        int64_t x_stride, x_base;
        const X* x = x_operand(it.t0, it.t1, 0, IN_, xb, x_stride, x_base);  // every input, rounded once
        h.resize(rows * h_stride_);
        for (int64_t p = 0; p < P_; ++p)
          for (int64_t c = 0; c < NC_; ++c) shrink_chunk(it.g, p, c, it.t0, it.t1, x, x_stride, x_base, h.data());
        hp.resize(rows * hp_stride_);
        for (int64_t p = 0; p < P_; ++p) prepare_h(it.g, p, it.t0, it.t1, h.data(), hp.data(), sums);
        for (int64_t n = 0; n < NB_; ++n) expand_block(it.g, n, it.t0, it.t1, hp.data());
      }
    });
  }

  void two_phase() const {
    // Per segment: its first row in h, its first shrink and expand item.
    std::vector<int64_t> offsets(3 * (G_ + 1), 0);
    int64_t* h_row = offsets.data();
    int64_t* shrink_first = h_row + G_ + 1;
    int64_t* expand_first = shrink_first + G_ + 1;
    for (int64_t g = 0; g < G_; ++g) {
      const int64_t rows = end_[g] - start_[g], blocks = (rows + kRowBlock - 1) / kRowBlock;
      h_row[g + 1] = h_row[g] + rows;
      shrink_first[g + 1] = shrink_first[g] + P_ * NC_ * blocks;
      expand_first[g + 1] = expand_first[g] + NB_ * blocks;
    }
    // Partial h per row, piece and chunk: [rows, P, NC, RP]; entries of
    // pieces of rank 0 are never written nor read.
    thread_local std::vector<float> h_scratch;
    h_scratch.resize(h_row[G_] * h_stride_);
    float* h = h_scratch.data();
    auto segment_of = [&](const int64_t* first, int64_t item) {
      return static_cast<int64_t>(std::upper_bound(first, first + G_ + 1, item) - first) - 1;
    };
    // The rows of block `block` of segment g, and their h.
    auto rows_of = [&](int64_t g, int64_t block, int64_t& t0, int64_t& t1) {
      t0 = start_[g] + block * kRowBlock;
      t1 = std::min<int64_t>(end_[g], t0 + kRowBlock);
      return h + (h_row[g] + t0 - start_[g]) * h_stride_;
    };
    at::parallel_for(0, shrink_first[G_], 1, [&](int64_t lo, int64_t hi) {
      thread_local std::vector<uint16_t> xb;
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t g = segment_of(shrink_first, item);
        const int64_t rest = item - shrink_first[g], c = rest % NC_, p = (rest / NC_) % P_;
        int64_t t0, t1, x_stride, x_base;
        float* h_rows = rows_of(g, rest / NC_ / P_, t0, t1);
        const int64_t i0 = c * kChunk, i1 = std::min(IN_, i0 + kChunk);
        const X* x = x_operand(t0, t1, i0, i1, xb, x_stride, x_base);
        shrink_chunk(g, p, c, t0, t1, x, x_stride, x_base, h_rows);
      }
    });
    at::parallel_for(0, expand_first[G_], 1, [&](int64_t lo, int64_t hi) {
      thread_local std::vector<float> sums;
      thread_local std::vector<X> hp;
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t g = segment_of(expand_first, item);
        const int64_t rest = item - expand_first[g], n = rest % NB_;
        int64_t t0, t1;
        const float* h_rows = rows_of(g, rest / NB_, t0, t1);
        // The pieces with outputs in block n, prepared for its rows.
        hp.resize((t1 - t0) * hp_stride_);
        const int64_t o0 = n * kOutBlock, o1 = std::min(OUT_, o0 + kOutBlock);
        for (int64_t p = 0; p < P_; ++p)
          if (bound_[p] < o1 && bound_[p + 1] > o0) prepare_h(g, p, t0, t1, h_rows, hp.data(), sums);
        expand_block(g, n, t0, t1, hp.data());
      }
    });
  }

  const W *as_, *bs_;
  const int32_t *bound_, *start_, *end_, *slot_;
  const int64_t G_;
  const int32_t* rank_;
  const float* scale_;
  // a [S, P, RP/16, IN, 16], b [S, NB, R, 64], y [T, OUT] (module comment).
  const int64_t P_, RP_, IN_, NB_, R_, OUT_;
  const int64_t NC_;        // chunks of the inputs
  const int64_t h_stride_;  // floats of partial h per row: P * NC * RP
  const int64_t R2_;        // prepared h per row and piece: R rounded up to even
  const int64_t hp_stride_;  // prepared h per row: P * R2
  const float* xs_;
  float* ys_;
  const int64_t x_stride_, y_stride_;
};

template <Math K, typename W>
void lora_apply_impl(at::Tensor& y, const at::Tensor& x, const W* as, const W* bs, const at::Tensor& a,
                     const at::Tensor& b, const int32_t* bound, const int32_t* start, const int32_t* end,
                     const int32_t* slot, int64_t G, const int32_t* rank, const float* scale) {
  LoraKernel<K, W>(y, x, as, bs, a, b, bound, start, end, slot, G, rank, scale).run();
}

}  // namespace

namespace sluice_cpu {

void lora_apply_with(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                     const int32_t* bound, const int32_t* start, const int32_t* end, const int32_t* slot, int64_t G,
                     const int32_t* rank, const float* scale, bool pair_products);

void lora_apply_unchecked(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                          const int32_t* bound, const int32_t* start, const int32_t* end, const int32_t* slot,
                          int64_t G, const int32_t* rank, const float* scale) {
  lora_apply_with(y, x, a, b, bound, start, end, slot, G, rank, scale, bf16_products());
}

void lora_apply_with(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                     const int32_t* bound, const int32_t* start, const int32_t* end, const int32_t* slot, int64_t G,
                     const int32_t* rank, const float* scale, bool pair_products) {
  if (a.scalar_type() == at::kBFloat16) {
    const auto* as = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
    const auto* bs = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
    if (pair_products)
      lora_apply_impl<Math::PAIRS_DP>(y, x, as, bs, a, b, bound, start, end, slot, G, rank, scale);
    else
      lora_apply_impl<Math::PAIRS>(y, x, as, bs, a, b, bound, start, end, slot, G, rank, scale);
  } else {
    lora_apply_impl<Math::FLOAT>(y, x, a.data_ptr<float>(), b.data_ptr<float>(), a, b, bound, start, end, slot, G,
                                 rank, scale);
  }
}

// pair_products: how bfloat16 stacks are multiplied (None: this CPU's best;
// false: widened to float32; true: AVX512-BF16's pair products, where the
// CPU has them). Tests ask for each.
void lora_apply_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& bounds, const at::Tensor& seg_starts, const at::Tensor& seg_ends,
                 const at::Tensor& seg_slots, const at::Tensor& ranks, const at::Tensor& scales,
                 std::optional<bool> pair_products) {
  const bool pairs = pair_products.value_or(bf16_products());
  TORCH_CHECK(!pairs || bf16_products(), "this CPU has no AVX512-BF16 pair products");
  lora_apply_with(y, x, a, b, bounds.data_ptr<int32_t>(), seg_starts.data_ptr<int32_t>(),
                  seg_ends.data_ptr<int32_t>(), seg_slots.data_ptr<int32_t>(), seg_starts.numel(),
                  ranks.data_ptr<int32_t>(), scales.data_ptr<float>(), pairs);
}

}  // namespace sluice_cpu

namespace {

bool lora_bf16_products() { return bf16_products(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.def("lora_bf16_products() -> bool");
  m.def("lora_apply_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor bounds, Tensor seg_starts, "
        "Tensor seg_ends, Tensor seg_slots, Tensor ranks, Tensor scales, bool? pair_products=None) -> ()");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
  m.impl("lora_apply_", &sluice_cpu::lora_apply_);
}

TORCH_LIBRARY_IMPL(sluice_cpu, CatchAll, m) {
  m.impl("lora_bf16_products", &lora_bf16_products);
}

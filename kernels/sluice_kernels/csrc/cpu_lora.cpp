// LoRA's grouped (segment) matmul on CPU: every row of a step gets its own
// adapter's low-rank update, all adapters of the step in one call
// (sluice_kernels/lora.py has the layout, the math and the torch reference):
//
//   lora_apply_(y, x, a, b, bounds, seg_starts, seg_ends, seg_slots, ranks, scales)
//     for segment g (rows [seg_starts[g], seg_ends[g]) on slot s = seg_slots[g]),
//     piece p with r = ranks[s, p] > 0, row t:
//       h[t, p, :r]                      = A[s, p, :r] x[t]                  (shrink)
//       y[t, bounds[p] .. bounds[p+1])  += scales[s] * (B[s, those rows, :r] h[t, p])  (expand)
//
// Two parallel phases, each over a flat list of independent items:
//
//   shrink  items (g, p, k), k < r: the dot of A[s, p, k] with every row of
//           the segment (the A row is read once for all of them)
//   expand  items (g, block of 64 output rows): the block's B rows are
//           transposed once, then every row t of the segment adds
//           sum_k h[t, p, k] B[s, o, k] along the block's outputs o (split
//           where a piece ends)
//
// A decode step reads each adapter's A and B once per layer, whatever the
// number of its rows; pieces an adapter leaves alone (rank 0) are skipped.
// Dots run 16 lanes of partial sums, which the compiler vectorizes
// (-march=native) without reassociating anything. float32 throughout.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "sluice_cpu.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kOutBlock = 64;

inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += a[i + j] * b[i + j];
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void check_int32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous int32 CPU tensor");
}

}  // namespace

namespace sluice_cpu {

void lora_apply_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& bounds, const at::Tensor& seg_starts, const at::Tensor& seg_ends,
                 const at::Tensor& seg_slots, const at::Tensor& ranks, const at::Tensor& scales) {
  TORCH_CHECK(a.dim() == 4 && b.dim() == 3, "a must be [S, P, R, IN] and b [S, OUT, R]");
  const int64_t S = a.size(0), P = a.size(1), R = a.size(2), IN = a.size(3), OUT = b.size(1);
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.is_contiguous() &&
                  b.is_contiguous(), "a and b must be contiguous float32");
  TORCH_CHECK(b.size(0) == S && b.size(2) == R, "b must be [S, OUT, R] with a's S and R");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) == IN,
              "x must be float32 [T, IN] with contiguous rows");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.stride(1) == 1 && y.size(1) == OUT &&
                  y.size(0) == x.size(0), "y must be float32 [T, OUT] with contiguous rows");
  for (auto [t, name] : {std::pair{&bounds, "bounds"}, {&seg_starts, "seg_starts"}, {&seg_ends, "seg_ends"},
                         {&seg_slots, "seg_slots"}, {&ranks, "ranks"}})
    check_int32(*t, name);
  TORCH_CHECK(bounds.numel() == P + 1, "bounds must hold P + 1 = ", P + 1, " row boundaries");
  TORCH_CHECK(ranks.numel() == S * P, "ranks must be [S, P]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == S,
              "scales must be float32 [S]");
  const int64_t G = seg_starts.numel();
  TORCH_CHECK(seg_ends.numel() == G && seg_slots.numel() == G, "one start, end and slot per segment");

  const int32_t* bound = bounds.data_ptr<int32_t>();
  const int32_t* start = seg_starts.data_ptr<int32_t>();
  const int32_t* end = seg_ends.data_ptr<int32_t>();
  const int32_t* slot = seg_slots.data_ptr<int32_t>();
  const int32_t* rank = ranks.data_ptr<int32_t>();
  const float* scale = scales.data_ptr<float>();
  TORCH_CHECK(bound[0] == 0 && bound[P] == OUT, "bounds must run from 0 to OUT");
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(bound[p] <= bound[p + 1], "bounds must not decrease");
  const int64_t T = x.size(0);
  // Rows of segment g sit at h_row[g] .. in the shrunk rows h [rows, P, R].
  std::vector<int64_t> h_row(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(0 <= start[g] && start[g] <= end[g] && end[g] <= T, "segment ", g, " is not inside the ", T, " rows");
    TORCH_CHECK(0 <= slot[g] && slot[g] < S, "segment ", g, ": slot ", slot[g], " is not below ", S);
    for (int64_t p = 0; p < P; ++p)
      TORCH_CHECK(0 <= rank[slot[g] * P + p] && rank[slot[g] * P + p] <= R, "ranks must be in [0, R]");
    h_row[g + 1] = h_row[g] + end[g] - start[g];
  }
  if (h_row[G] == 0) return;

  struct Shrink { int64_t g, p, k; };
  std::vector<Shrink> shrinks;
  struct Expand { int64_t g, first; };
  std::vector<Expand> expands;
  for (int64_t g = 0; g < G; ++g) {
    bool any = false;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t r = rank[slot[g] * P + p];
      for (int64_t k = 0; k < r; ++k) shrinks.push_back({g, p, k});
      any = any || r > 0;
    }
    if (any)
      for (int64_t o = 0; o < OUT; o += kOutBlock) expands.push_back({g, o});
  }

  at::Tensor h_tensor = at::empty({h_row[G], P, R}, x.options());
  float* h = h_tensor.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  const float* as = a.data_ptr<float>();
  const float* bs = b.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);

  at::parallel_for(0, static_cast<int64_t>(shrinks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const auto [g, p, k] = shrinks[i];
      const float* a_row = as + ((slot[g] * P + p) * R + k) * IN;
      for (int64_t t = start[g]; t < end[g]; ++t)
        h[((h_row[g] + t - start[g]) * P + p) * R + k] = dot(a_row, xs + t * x_stride, IN);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(expands.size()), 1, [&](int64_t lo, int64_t hi) {
    // B's rows of the block, transposed ([r][n]), so that each row t's
    // update runs along the outputs: n lanes of sums, one multiply-add
    // per rank, no horizontal reduction per output.
    std::vector<float> bt(R * kOutBlock);
    float acc[kOutBlock];
    for (int64_t i = lo; i < hi; ++i) {
      const auto [g, first] = expands[i];
      const int64_t s = slot[g];
      const int64_t last = std::min(first + kOutBlock, OUT);
      int64_t p = 0;
      for (int64_t o0 = first; o0 < last;) {
        while (o0 >= bound[p + 1]) ++p;
        const int64_t o1 = std::min<int64_t>(last, bound[p + 1]);
        const int64_t r = rank[s * P + p], n = o1 - o0;
        if (r > 0) {
          const float* b_rows = bs + (s * OUT + o0) * R;
          for (int64_t j = 0; j < n; ++j)
            for (int64_t k = 0; k < r; ++k) bt[k * n + j] = b_rows[j * R + k];
          for (int64_t t = start[g]; t < end[g]; ++t) {
            const float* h_piece = h + ((h_row[g] + t - start[g]) * P + p) * R;
            for (int64_t j = 0; j < n; ++j) acc[j] = 0.f;
            for (int64_t k = 0; k < r; ++k) {
              const float hk = h_piece[k];
              const float* bk = bt.data() + k * n;
              for (int64_t j = 0; j < n; ++j) acc[j] += hk * bk[j];
            }
            float* y_row = ys + t * y_stride + o0;
            for (int64_t j = 0; j < n; ++j) y_row[j] += acc[j] * scale[s];
          }
        }
        o0 = o1;
      }
    }
  });
}

}  // namespace sluice_cpu

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.def("lora_apply_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor bounds, Tensor seg_starts, "
        "Tensor seg_ends, Tensor seg_slots, Tensor ranks, Tensor scales) -> ()");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
  m.impl("lora_apply_", &sluice_cpu::lora_apply_);
}

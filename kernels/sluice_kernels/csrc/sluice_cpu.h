// The CPU kernels as C++ functions, for code that composes them without a
// trip through Python (cpu_decoder.cpp). Each is also registered as the op
// torch.ops.sluice_cpu.<name>; the .cpp files document them.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace sluice_cpu {

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps);
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& x);
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t window, const std::optional<at::Tensor>& sinks = std::nullopt);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t N, int64_t isa_code);
at::Tensor exact_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t N, int64_t isa_code);
at::Tensor grouped_block_linear(const at::Tensor& x, const std::vector<int64_t>& offsets, const at::Tensor& packed,
                                int64_t format, int64_t N, bool int8, int64_t isa_code);
// LoRA's grouped matmul (cpu_lora.cpp) on stacks packed by
// sluice_kernels.lora.lora_pack_cpu; nothing is checked (check_lora_args in
// sluice_kernels/lora.py is the validator). The decoder calls the unchecked
// form with its step's segments as raw int32 arrays of G entries each.
void lora_apply_unchecked(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                          const int32_t* bounds, const int32_t* starts, const int32_t* ends, const int32_t* slots,
                          int64_t G, const int32_t* ranks, const float* scales);
void lora_apply_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& bounds, const at::Tensor& seg_starts, const at::Tensor& seg_ends,
                 const at::Tensor& seg_slots, const at::Tensor& ranks, const at::Tensor& scales,
                 std::optional<bool> pair_products);

}  // namespace sluice_cpu

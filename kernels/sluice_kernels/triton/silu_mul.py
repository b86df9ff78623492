"""SiLU-and-mul, the Llama MLP's activation on the fused gate/up projection:

    x [T, 2I] = [ gate | up ]   ->   out [T, I] = silu(gate) * up

computed in float32, rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (rows may be strided, last dim contiguous) -> [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul expects [T, 2I], got {tuple(x.shape)}")
    assert x.stride(1) == 1, "silu_mul needs the last dim contiguous"
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter, BLOCK=block)
    return out


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul expects [T, 2I], got {tuple(x.shape)}")
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)

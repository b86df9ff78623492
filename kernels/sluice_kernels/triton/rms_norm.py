"""RMSNorm fused with the residual add (the pre-norm block pattern):

    s   = x + residual                       (rounded to the model dtype: the new residual)
    out = weight * (s * rsqrt(mean(s^2) + eps))   normalized in float32, as in
                                             transformers' LlamaRMSNorm: the normalized
                                             value is rounded to the dtype, then scaled.

One program per token row; the hidden size fits one tile (next power of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum as the unfused `x + residual` does, so both paths
        # normalize (and carry forward) the same residual.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x, weight, residual):
    if x.dim() != 2:
        raise ValueError(f"rms_norm expects x [T, H], got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (+ residual [T, H]) -> (normed [T, H], new residual [T, H]),
    both in x's dtype; with residual None the new residual is x itself."""
    _check(x, weight, residual)
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1), "rows must be contiguous"
    assert weight.is_contiguous()
    num_tokens, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = x if residual is None else torch.empty_like(out)
    if num_tokens == 0:
        return out, res_out
    res = x if residual is None else residual
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, res_out,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
    )
    return out, res_out


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight, residual)
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype), x

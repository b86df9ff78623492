"""LoRA's grouped (segment) matmul on CUDA: every row of a step gets its own
adapter's low-rank update (sluice_kernels/lora.py has the layout, the math
and `lora_apply_reference`, which this module's tests compare against).

Two kernels, one launch each per layer and step:

    shrink   grid (segment, row tile, piece):      h[t, p, :r] = x[t] A[s, p, :r]^T
    expand   grid (segment, row tile, output tile): y[t, n] += scale[s] * h[t, p(n), :r] B[s, n, :r]^T

A program of a segment's row tile past the segment's end returns at once
(the grid is sized by the longest segment). h is float32 [T, P, R]; rows in
no segment are never written or read. An expand program loops over the P
pieces (a tile may straddle two), each contributing only to its own output
columns. Ranks below R are masked (zeros in, zeros out), a piece of rank 0
is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice_kernels.lora import check_lora_args, lora_apply_reference
from sluice_kernels.triton import triton_interpreting

__all__ = ["lora_apply_triton", "lora_apply_reference"]


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, starts_ptr, ends_ptr, slots_ptr, ranks_ptr,
    stride_x, IN, P: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    g = tl.program_id(0)
    p = tl.program_id(2)
    start = tl.load(starts_ptr + g)
    end = tl.load(ends_ptr + g)
    first = start + tl.program_id(1) * BLOCK_M
    s = tl.load(slots_ptr + g).to(tl.int64)
    r = tl.load(ranks_ptr + s * P + p)
    if first >= end or r == 0:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    ks = tl.arange(0, BLOCK_R)
    k_ok = ks < r
    a_rows = a_ptr + ((s * P + p) * R + ks) * IN
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for i in range(0, IN, BLOCK_K):
        cols = i + tl.arange(0, BLOCK_K)
        col_ok = cols < IN
        xs = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        at = tl.load(a_rows[None, :] + cols[:, None], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_UPCAST:
            xs, at = xs.to(tl.float32), at.to(tl.float32)
        acc += tl.dot(xs.to(at.dtype), at, input_precision=DOT_PRECISION)
    h_rows = h_ptr + (rows[:, None].to(tl.int64) * P + p) * R + ks[None, :]
    tl.store(h_rows, acc, mask=row_ok[:, None] & (ks[None, :] < R))


@triton.jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr, bounds_ptr, starts_ptr, ends_ptr, slots_ptr, ranks_ptr, scales_ptr,
    stride_y, OUT, P: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    g = tl.program_id(0)
    start = tl.load(starts_ptr + g)
    end = tl.load(ends_ptr + g)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    s = tl.load(slots_ptr + g).to(tl.int64)
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p in tl.static_range(P):
        r = tl.load(ranks_ptr + s * P + p)
        lo = tl.load(bounds_ptr + p)
        hi = tl.load(bounds_ptr + p + 1)
        col_ok = (cols >= lo) & (cols < hi)
        k_ok = ks < r
        hs = tl.load(h_ptr + (rows[:, None].to(tl.int64) * P + p) * R + ks[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + (s * OUT + cols[None, :]) * R + ks[:, None],
                     mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(hs, bt, input_precision="ieee")
    scale = tl.load(scales_ptr + s)
    out_ok = row_ok[:, None] & (cols[None, :] < OUT)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    y = tl.load(y_ptrs, mask=out_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc * scale).to(y_ptr.dtype.element_ty), mask=out_ok)


def lora_apply_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    max_rows: int,
) -> None:
    """y += each row's adapter update, in place (layout: sluice_kernels.lora).
    Index tensors int32 on y's device; `max_rows`: the longest segment (the
    host knows it; the grid is sized by it)."""
    d = check_lora_args(y, x, a, b, bounds, seg_starts, seg_ends, seg_slots, ranks, scales, packed=False)
    P, R, IN, OUT = d.pieces, d.rank, d.in_features, d.out_features
    groups = seg_starts.numel()
    if groups == 0 or max_rows == 0:
        return
    # Triton's CPU interpreter multiplies 16-bit floats in tl.dot wrongly
    # (triton 3.x): there the operands go in as float32, the same numbers.
    upcast = triton_interpreting() and a.dtype != torch.float32
    precision = "ieee" if a.dtype == torch.float32 or upcast else "tf32"
    block_m = 16
    block_r = max(16, triton.next_power_of_2(R))
    h = torch.empty(x.shape[0], P, R, dtype=torch.float32, device=x.device)
    row_tiles = triton.cdiv(max_rows, block_m)
    _shrink_kernel[(groups, row_tiles, P)](
        x, a, h, seg_starts, seg_ends, seg_slots, ranks,
        x.stride(0), IN, P=P, R=R,
        BLOCK_M=block_m, BLOCK_K=64, BLOCK_R=block_r, DOT_PRECISION=precision, DOT_UPCAST=upcast,
    )
    block_n = 64
    _expand_kernel[(groups, row_tiles, triton.cdiv(OUT, block_n))](
        y, h, b, bounds, seg_starts, seg_ends, seg_slots, ranks, scales,
        y.stride(0), OUT, P=P, R=R,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
    )

"""The grouped expert MLP of mixture-of-experts layers on CUDA (see
sluice_kernels/moe.py for what it computes and its plain-torch reference).

The step's T*k slots (token t, its j-th expert) are sorted by expert, and
each expert's run is padded to a multiple of BLOCK_M rows, so a row tile
belongs to one expert (`align_tiles`):

    expert          0               1         2
    tile rows   | s3 s0 s7 s1 | s4 -- -- -- | s2 s5 s6 -- |     (BLOCK_M = 4; -- padding)
    tile_expert     0             1           2

One launch of `_grouped_matmul_kernel` then multiplies every tile by its
expert's weight (grid: tiles x output blocks), gathering its A rows through
the slot indices and writing C rows at the same slots:

    first  A = x [T, H], row slot // k      B = W13 [E, 2I, H]   C = h [T*k, 2I] (+ b13)
    second A = act(h) [T*k, I], row slot    B = W2 [E, H, I]     C = y [T*k, H]  (+ b2)

Experts no token chose get no tile, so their weights are never read. The
activation between the two and the weighted sum over each token's k slots
(in slot order, as the reference adds them) are torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice_kernels.moe import Activation, expert_mlp_reference, weighted_sum
from sluice_kernels.triton import triton_interpreting


@triton.jit
def _grouped_matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, rows_ptr, tile_expert_ptr,
    N, K, row_div,
    stride_am, stride_be, stride_bn, stride_cm, stride_bias_e,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """C[slot] = A[slot // row_div] B[e]^T (+ bias[e]) for the slots of one row
    tile (-1: padding) and one block of outputs; B[e] is [N, K] row-major."""
    tile = tl.program_id(0)
    block_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    slots = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots >= 0
    a_rows = tl.where(valid, slots // row_div, 0).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None],
            mask=col_ok[None, :] & k_ok[:, None], other=0.0,
        )
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + slots.to(tl.int64)[:, None] * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :],
    )


def align_tiles(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (rows [tiles * block_m] int32: the slots of each tile, -1
    for padding; tile_expert [tiles] int32). The picture is in the module
    docstring; a slot's order within its expert is its order in `ids`."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    tiles = (counts + block_m - 1) // block_m
    starts = torch.cumsum(counts, 0) - counts  # of each expert's run, unpadded
    padded_starts = (torch.cumsum(tiles, 0) - tiles) * block_m
    experts = flat[order]
    within = torch.arange(flat.numel(), device=ids.device) - starts[experts]
    total = int(tiles.sum())  # the one host sync: the launch's size
    rows = torch.full((total * block_m,), -1, dtype=torch.int32, device=ids.device)
    rows[padded_starts[experts] + within] = order.to(torch.int32)
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=ids.device, dtype=torch.int32), tiles)
    return rows, tile_expert


def grouped_matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor, tile_expert: torch.Tensor,
    num_slots: int, row_div: int, block_m: int,
) -> torch.Tensor:
    """c [num_slots, N]: c[slot] = a[slot // row_div] @ b[e]^T (+ bias[e]) for
    the slots of each tile of expert e (rows never listed are left unset)."""
    assert a.stride(1) == 1 and b.stride(2) == 1, "a's rows and b's rows must be contiguous"
    n, k = b.shape[1], b.shape[2]
    c = torch.empty(num_slots, n, dtype=a.dtype, device=a.device)
    if tile_expert.numel() == 0:
        return c
    block_n, block_k = min(64, max(16, triton.next_power_of_2(n))), min(64, max(16, triton.next_power_of_2(k)))
    # Under the interpreter 16-bit dots are unreliable (as in paged_attention): compute in float32 there.
    upcast = triton_interpreting() and a.dtype != torch.float32
    if upcast:
        a, b = a.float(), b.float()
        bias = None if bias is None else bias.float()
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    out = c.float() if upcast else c
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        a, b, out, out if bias is None else bias, rows, tile_expert,
        n, k, row_div,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0), 0 if bias is None else bias.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, DOT_PRECISION=precision,
    )
    return out.to(c.dtype) if upcast else c


def fused_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    act: Activation,
    block_m: int = 16,
) -> torch.Tensor:
    """expert_mlp_reference's result: x [T, H], ids/weights [T, k], w13 [E,
    2I, H], w2 [E, H, I], biases [E, 2I] / [E, H] or None -> [T, H]."""
    if x.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)} disagree")
    if w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1] or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden size {x.shape[1]}")
    t, k = ids.shape
    rows, tile_expert = align_tiles(ids, w13.shape[0], block_m)
    x = x.contiguous()
    h = grouped_matmul(x, w13, b13, rows, tile_expert, t * k, k, block_m)
    y = grouped_matmul(act(h).contiguous(), w2, b2, rows, tile_expert, t * k, 1, block_m)
    return weighted_sum(y, weights)


fused_moe_reference = expert_mlp_reference

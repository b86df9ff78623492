"""LoRA's grouped (segment) matmul: every row of a step gets the low-rank
update of its own adapter, all adapters in one call.

A layer's adapters are stacked by slot; a layer that fuses several matrices
(q/k/v, gate/up) has one A per piece and one B whose rows are the pieces'
outputs, each reading its own piece of the shrunk row:

    a       [S, P, R, IN]   S slots, P pieces, R the stacks' rank
    b       [S, OUT, R]     rows [bounds[p], bounds[p+1]) belong to piece p
    ranks   [S, P] int32    slot s's rank on piece p; 0: s leaves p alone
    scales  [S] float32     lora_alpha / r (or / sqrt(r))

The step's rows come grouped by slot; segment g is rows
[seg_starts[g], seg_ends[g]) on slot seg_slots[g], and rows in no segment
(the base model's) are left alone:

    rows       0  1  2  3  4  5  6  7
    segments      [1, 3) s2   [4, 8) s0

For each segment, r = ranks[s, p], and each of its rows t:

    shrink   h[p] = A[s, p, :r] x[t]                         (r numbers per piece)
    expand   y[t, bounds[p]:bounds[p+1]] += scales[s] * (B[s, rows of p, :r] h[p])

in PEFT's order (the update, then the scale). Implementations:

    lora_apply_reference   plain torch, a loop over segments and pieces
    lora_apply_cpu         csrc/cpu_lora.cpp: one call, both phases
                           parallel over (segment, piece, rank) and (segment,
                           block of outputs); float32
    triton.lora            lora_apply_triton: a shrink and an expand kernel,
                           one program per (segment, row tile, piece or
                           output tile)
"""

from __future__ import annotations

import torch


def lora_apply_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: list[int],
    seg_starts: list[int],
    seg_ends: list[int],
    seg_slots: list[int],
    ranks: list[list[int]],
    scales: torch.Tensor,
) -> None:
    """y += each row's adapter update (module docstring), in place.
    Segments and ranks as Python lists; the rest as the kernels take them."""
    for start, end, s in zip(seg_starts, seg_ends, seg_slots):
        rows = x[start:end].to(a.dtype)
        for p in range(a.shape[1]):
            r = ranks[s][p]
            if r == 0:
                continue
            lo, hi = bounds[p], bounds[p + 1]
            update = (rows @ a[s, p, :r].T) @ b[s, lo:hi, :r].T
            y[start:end, lo:hi] += (update * scales[s]).to(y.dtype)


def lora_apply_cpu(
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
) -> None:
    """The C++ kernel (`cpu_kernels.load()` first): every index tensor int32,
    y, x, a, b, scales float32 with contiguous rows."""
    torch.ops.sluice_cpu.lora_apply_(y, x, a, b, bounds, seg_starts, seg_ends, seg_slots, ranks, scales)

"""LoRA in the linear layers: each row of a step gets the low-rank update of
the adapter its request uses, all adapters of the step in one grouped matmul.

An adapted layer holds every slot's adapter, stacked (zeros where a slot is
empty, or where its adapter leaves this module alone):

    a  [slots, pieces, R, in]   float, R = --max-lora-rank; pieces: the
                                matrices fused in the layer (q, k, v of
                                qkv_proj; gate, up of gate_up_proj; else 1)
    b  [slots, out, R]          the output rows of piece p read piece p's
                                part of the shrunk row

and a row t whose request uses slot s (rank r, scale from adapter_config.json) gets

    h      = A[s, :, :r] x[t]                       shrink:  [pieces * r]
    y[t]  += scale[s] * B[s, rows of p, :r] h[p]    expand:  each piece p into its rows

The step's rows are grouped by slot (batch.build_batch sorts decodes and
prefill chunks by slot), so each adapter is one segment of consecutive rows
[start, end); rows of the base model belong to no segment and are left alone:

    rows     0  1  2  3  4  5 | 6  7  8  9  10      decodes | prefill chunks
    slot     -  1  1  2  2  3 | -  -  1  1  1       (- = the base model)
    segments [1, 3) s1   [3, 5) s2   [5, 6) s3   [8, 11) s1

`LoraSegments` is that table, built once per step and shared by every layer
through the slots' `LoraContext`; a step without adapter rows has none, and
the layers then skip LoRA entirely. `lora_apply_reference` is the plain-torch
computation (a loop over segments), the reference the kernels are tested
against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraSegments:
    """A step's runs of rows that share an adapter, base-model rows left out.

    Segment i is rows [starts[i], ends[i]) on stack index slots[i] (the
    proto's adapter slot - 1). The int32 tensors hold the same numbers on the
    model's device, for kernels."""

    starts: list[int]
    ends: list[int]
    slots: list[int]
    starts_t: torch.Tensor
    ends_t: torch.Tensor
    slots_t: torch.Tensor

    @property
    def rows(self) -> int:
        """Rows that get an adapter's update."""
        return sum(e - s for s, e in zip(self.starts, self.ends))


def build_segments(query_lens: list[int], slots: list[int], device: torch.device) -> LoraSegments | None:
    """The segments of a step whose sequence i has query_lens[i] rows on
    adapter slot slots[i] (0: the base model), sequences in batch order.
    Consecutive sequences on one slot merge into one segment. None when no
    row uses an adapter."""
    starts: list[int] = []
    ends: list[int] = []
    stack: list[int] = []
    row = 0
    for q_len, slot in zip(query_lens, slots):
        if slot > 0:
            if stack and stack[-1] == slot - 1 and ends[-1] == row:
                ends[-1] = row + q_len
            else:
                starts.append(row)
                ends.append(row + q_len)
                stack.append(slot - 1)
        row += q_len
    if not stack:
        return None

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device)

    return LoraSegments(starts, ends, stack, tensor(starts), tensor(ends), tensor(stack))


@dataclass
class LoraContext:
    """What every adapted layer shares: each slot's scale and rank, and the
    segments of the step being run (None outside a step with adapter rows)."""

    # [slots] float32: lora_alpha / r (or / sqrt(r) with rslora); 0 when empty.
    scales: torch.Tensor
    # Per slot: the adapter's rank (0 when empty).
    ranks: list[int]
    segments: LoraSegments | None = None


@dataclass
class LoraWeights:
    """One linear layer's stacked adapters (see the module comment).

    `pieces` gives each fused piece's [start, end) output rows on this rank."""

    a: torch.Tensor
    b: torch.Tensor
    pieces: list[tuple[int, int]]
    context: LoraContext = field(repr=False)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def zero_slot_(self, stack_index: int) -> None:
        self.a[stack_index].zero_()
        self.b[stack_index].zero_()

    def apply_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Adds the step's adapter updates to y [T, out] (in place) for x [T, in]."""
        segments = self.context.segments
        if segments is not None:
            lora_apply_reference(y, x, self.a, self.b, self.pieces, segments, self.context)


def lora_apply_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    pieces: list[tuple[int, int]],
    segments: LoraSegments,
    context: LoraContext,
) -> None:
    """y[rows of segment] += scale * expand(shrink(x)), segment by segment,
    with PEFT's order of operations: (x A^T) B^T, then the scale."""
    for start, end, s in zip(segments.starts, segments.ends, segments.slots):
        r = context.ranks[s]
        if r == 0:
            continue
        rows = x[start:end].to(a.dtype)
        h = rows @ a[s, :, :r].reshape(-1, a.shape[-1]).T  # [n, pieces * r]
        for p, (lo, hi) in enumerate(pieces):
            update = h[:, p * r : (p + 1) * r] @ b[s, lo:hi, :r].T
            y[start:end, lo:hi] += (update * context.scales[s]).to(y.dtype)

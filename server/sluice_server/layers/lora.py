"""LoRA in the linear layers: each row of a step gets the low-rank update of
the adapter its request uses, all adapters of the step in one grouped matmul
per layer (sluice_kernels.lora: the layout, the math, the kernels).

An adapted layer holds every slot's adapter, stacked (zeros where a slot is
empty, rank 0 where its adapter leaves a piece of the layer alone):

    a      [slots, pieces, R, in]   R = --max-lora-rank; pieces: the matrices
                                    fused in the layer (q, k, v of qkv_proj;
                                    gate, up of gate_up_proj; else 1)
    b      [slots, out, R]          piece p's output rows read piece p's h
    ranks  [slots, pieces]

For the C++ kernel the stacks are held in its packed layout instead
(sluice_kernels.lora: A in panels of 16 ranks along the inputs, B in
blocks of 64 outputs along the ranks), written as adapters load, so no
step reorders them; `LoraWeights.write_` hides which layout a layer holds.
Its stacks are float32 or bfloat16 (--lora-dtype, chosen by
model_runner.choose_lora_dtype); the other kernels' are the model's dtype.

The step's rows are grouped by slot (batch.build_batch sorts decodes and
prefill chunks by slot), so each adapter is one segment of consecutive rows
[start, end); rows of the base model belong to no segment and are left alone:

    rows     0  1  2  3  4  5 | 6  7  8  9  10      decodes | prefill chunks
    slot     -  1  1  2  2  3 | -  -  1  1  1       (- = the base model)
    segments [1, 3) s1   [3, 5) s2   [5, 6) s3   [8, 11) s1

`LoraSegments` is that table, built (and its int32 tensors made) once per
step and shared by every layer through the slots' `LoraContext`; a step
without adapter rows has none, and the layers then skip LoRA entirely. Which implementation runs is chosen once,
with the stacks: the Triton kernel on CUDA (and under Triton's interpreter
with the triton backend), the C++ kernel on CPU in float32 when the CPU
kernels are loaded, else the plain-torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sluice_kernels.lora import (
    check_rows,
    check_segments,
    lora_apply_reference,
    lora_dims,
    lora_pack_cpu,
    lora_write_cpu_,
)

KERNELS = ("torch", "cpu", "triton")


@dataclass
class LoraSegments:
    """A step's runs of rows that share an adapter, base-model rows left out.

    Segment i is rows [starts[i], ends[i]) on stack index slots[i] (the
    proto's adapter slot - 1), of the step's `step_rows` rows. The int32
    tensors hold the same numbers on the model's device, for the kernels."""

    starts: list[int]
    ends: list[int]
    slots: list[int]
    starts_t: torch.Tensor
    ends_t: torch.Tensor
    slots_t: torch.Tensor
    step_rows: int

    def check(self, slots: int) -> None:
        """ValueError unless every segment lies in the step's rows, on a
        stack index below `slots`: once per step, for every layer's call."""
        check_segments(self.starts_t, self.ends_t, self.slots_t, self.step_rows, slots)

    @property
    def rows(self) -> int:
        """Rows that get an adapter's update."""
        return sum(e - s for s, e in zip(self.starts, self.ends))

    @property
    def max_rows(self) -> int:
        """The longest segment."""
        return max(e - s for s, e in zip(self.starts, self.ends))


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

    return LoraSegments(starts, ends, stack, tensor(starts), tensor(ends), tensor(stack), row)


@dataclass
class LoraContext:
    """What every adapted layer shares: each slot's scale, the implementation,
    and the segments of the step being run (None outside a step with adapter
    rows)."""

    # [slots] float32: lora_alpha / r (or / sqrt(r) with rslora); 0 when empty.
    scales: torch.Tensor
    # One of KERNELS.
    kernel: str = "torch"
    segments: LoraSegments | None = None


@dataclass
class LoraWeights:
    """One linear layer's stacked adapters (see the module comment), in the
    layout of the context's kernel (packed for "cpu")."""

    a: torch.Tensor
    b: torch.Tensor
    # [pieces + 1] output-row boundaries of the fused pieces on this rank.
    bounds: list[int]
    context: LoraContext = field(repr=False)
    # [slots, pieces] int32, and the same as lists (host side).
    ranks: torch.Tensor = field(init=False)
    rank_lists: list[list[int]] = field(init=False)
    bounds_t: torch.Tensor = field(init=False)

    @classmethod
    def zeros(cls, slots: int, pieces: int, rank: int, in_features: int, bounds: list[int], dtype: torch.dtype,
              device: torch.device, context: LoraContext) -> "LoraWeights":
        """Empty stacks of `dtype` for every slot, in the layout
        `context.kernel` reads."""
        a = torch.zeros(slots, pieces, rank, in_features, dtype=dtype, device=device)
        b = torch.zeros(slots, bounds[-1], rank, dtype=dtype, device=device)
        if context.kernel == "cpu":
            a, b = lora_pack_cpu(a, b, dtype)
        return cls(a=a, b=b, bounds=bounds, context=context)

    def __post_init__(self):
        self.packed = self.context.kernel == "cpu"
        dims = lora_dims(self.a, self.b, self.packed, self.bounds[-1])
        self.dims = dims
        self.rank = dims.rank
        slots, pieces = dims.slots, dims.pieces
        self.ranks = torch.zeros(slots, pieces, dtype=torch.int32, device=self.a.device)
        self.rank_lists = [[0] * pieces for _ in range(slots)]
        self.bounds_t = torch.tensor(self.bounds, dtype=torch.int32, device=self.a.device)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def set_rank(self, stack_index: int, piece: int, rank: int) -> None:
        if not 0 <= rank <= self.rank:
            raise ValueError(f"rank {rank} is not in [0, {self.rank}]")
        self.ranks[stack_index, piece] = rank
        self.rank_lists[stack_index][piece] = rank

    def write_(self, stack_index: int, piece: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """One piece's A [r, in] and B [piece's out, r] into slot stack_index."""
        r = a.shape[0]
        lo = self.bounds[piece]
        if self.packed:
            lora_write_cpu_(self.a, self.b, stack_index, piece, lo, a, b)
        else:
            self.a[stack_index, piece, :r].copy_(a)
            self.b[stack_index, lo : lo + b.shape[0], :r].copy_(b)
        self.set_rank(stack_index, piece, r)

    def zero_slot_(self, stack_index: int) -> None:
        self.a[stack_index].zero_()
        self.b[stack_index].zero_()
        for piece in range(len(self.bounds) - 1):
            self.set_rank(stack_index, piece, 0)

    def apply_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Adds the step's adapter updates to y [T, out] (in place) for x [T, in]."""
        seg = self.context.segments
        if seg is None:
            return
        kernel = self.context.kernel
        if kernel == "cpu":
            # The stacks were checked when made (lora_dims), the segments
            # when the step began (AdapterSlots.applied): only the rows here.
            check_rows(y, x, self.dims, seg.step_rows, packed=True)
            torch.ops.sluice_cpu.lora_apply_(y, x, self.a, self.b, self.bounds_t, seg.starts_t, seg.ends_t,
                                             seg.slots_t, self.ranks, self.context.scales)
        elif kernel == "triton":
            from sluice_kernels.triton.lora import lora_apply_triton

            lora_apply_triton(y, x, self.a, self.b, self.bounds_t, seg.starts_t, seg.ends_t, seg.slots_t,
                              self.ranks, self.context.scales, seg.max_rows)
        else:
            lora_apply_reference(y, x, self.a, self.b, self.bounds, seg.starts, seg.ends, seg.slots,
                                 self.rank_lists, self.context.scales)

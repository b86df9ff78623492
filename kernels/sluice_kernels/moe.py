"""The grouped expert MLP of mixture-of-experts layers: the plain-torch
reference and the kernels that compute the same.

Given a step's tokens x [T, H], each token's k experts (ids [T, k], in
ascending order per token) and their weights [T, k]:

    slots  (t, j) for t < T, j < k           ids[t, j] = expert of slot j
    rows   the T*k slots sorted by expert (stable): expert e owns rows
           [offsets[e], offsets[e + 1]) of the gathered input x[token(row)]

    expert   0        1     2            (E = 4; expert 3 chose no token)
    rows   | t0 t3 | t1 | t0 t2 t3 |     offsets = [0, 2, 3, 6, 6]

    h = x[token(row)] W13_e^T (+ b13_e)     [T*k, 2I], rows [gate | up]
    y = act(h) W2_e^T (+ b2_e)              [T*k, H]
    out[t] = sum_j weights[t, j] y[row(t, j)], added in slot order

Each selected expert's weights are read once per step whatever the number of
its tokens; experts no token chose are not touched. The memory is that of
T*k rows however the tokens are routed.

    expert_mlp_reference   plain torch, one matmul pair per expert with rows
    QuantizedExperts.mlp   CPU: every expert's GGUF / MXFP4 blocks, one C++
                           call per layer (csrc/cpu_moe.cpp: a counting sort,
                           two grouped block matmuls in one parallel loop
                           each, the activation and the weighted sum)
    triton.moe.fused_moe   CUDA: a grouped GEMM over expert-aligned row tiles

Activations (`Activation`): silu (silu(gate) * up) and gpt-oss's clamped
SwiGLU, "swiglu_oai": gate clamped above at `limit`, up to [-limit, limit],
(up + 1) * gate * sigmoid(alpha * gate).

MXFP4 (gpt-oss's expert format: 32 4-bit FP4 codes and one power-of-two
scale per block) maps exactly onto the block records: twice an FP4 value is
an integer in [-12, 12], so  w = 2^(e - 128) * (q + 12) - 12 * 2^(e - 128)
with q + 12 in [0, 24] (`mxfp4_records`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sluice_kernels import gguf_blocks

ACTIVATIONS = ("silu", "swiglu_oai")
# FP4 (e2m1) code -> value.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Activation:
    kind: str = "silu"
    # swiglu_oai's constants (gpt-oss: alpha 1.702, limit 7).
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.kind!r} is not supported ({', '.join(ACTIVATIONS)})")

    @property
    def code(self) -> int:
        """The C++ kernel's code for it."""
        return ACTIVATIONS.index(self.kind)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """[R, 2 I] (gate | up) -> [R, I]."""
        gate, up = h.chunk(2, dim=-1)
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass
class ExpertGroups:
    """A step's slots grouped by expert (the picture in the module docstring)."""

    # [T*k] int64: the slots (t * k + j) in expert order.
    order: torch.Tensor
    # [T*k] int64: the token of each row.
    tokens: torch.Tensor
    # [E + 1] on the host: expert e's rows are [offsets[e], offsets[e + 1]).
    offsets: list[int]

    def active(self) -> list[tuple[int, int, int]]:
        """(expert, first row, end row) of each expert that has rows."""
        o = self.offsets
        return [(e, o[e], o[e + 1]) for e in range(len(o) - 1) if o[e + 1] > o[e]]


def group_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    return ExpertGroups(order, order // ids.shape[1], offsets)


def combine(rows: torch.Tensor, groups: ExpertGroups, weights: torch.Tensor) -> torch.Tensor:
    """rows [T*k, H] in expert order -> [T, H] (weighted_sum of them in slot order)."""
    per_slot = torch.empty_like(rows)
    per_slot[groups.order] = rows
    return weighted_sum(per_slot, weights)


def weighted_sum(per_slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """per_slot [T*k, H] in slot order, weights [T, k] -> [T, H]: each token's
    k outputs times their weights, added slot by slot (the order the C++
    kernel adds them in)."""
    t, k = weights.shape
    scaled = per_slot.view(t, k, -1) * weights.unsqueeze(-1).to(per_slot.dtype)
    out = scaled[:, 0].clone()
    for j in range(1, k):
        out += scaled[:, j]
    return out


def expert_mlp_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    act: Activation,
) -> torch.Tensor:
    """The expert MLP in plain torch: x [T, H], ids/weights [T, k], w13 [E,
    2I, H], w2 [E, H, I], biases [E, 2I] / [E, H] or None -> [T, H]."""
    groups = group_by_expert(ids, w13.shape[0])
    xs = x[groups.tokens]
    rows = torch.empty(xs.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    for e, start, end in groups.active():
        h = F.linear(xs[start:end], w13[e], None if b13 is None else b13[e])
        rows[start:end] = F.linear(act(h), w2[e], None if b2 is None else b2[e])
    return combine(rows, groups, weights)


@dataclass
class QuantizedExperts:
    """One expert layer's weights as block records (gguf_blocks), every
    expert's gate|up and down, each projection in one record layout."""

    # uint8 [E, bytes]: expert e's packed records (gguf_blocks.pack).
    w13: torch.Tensor
    w2: torch.Tensor
    formats: tuple[int, int]
    # Each expert's intermediate size I (w13 has 2I outputs, w2 I inputs).
    intermediate: int
    # Activations quantized to int8 (llama.cpp's arithmetic), else each
    # record expanded exactly to the float32 weight.
    int8: bool

    def handles(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu"

    def tensors(self) -> list[torch.Tensor]:
        """What this holds in memory (for the shard's weight count)."""
        return [self.w13, self.w2]

    def mlp(self, x, ids, weights, b13, b2, act: Activation) -> torch.Tensor:
        """expert_mlp_reference's result, on the records (csrc/cpu_moe.cpp)."""
        return torch.ops.sluice_cpu.moe_block_mlp(
            x.contiguous(), ids.contiguous(), weights.float().contiguous(), self.w13, self.formats[0], self.w2,
            self.formats[1], self.intermediate, None if b13 is None else b13.float().contiguous(),
            None if b2 is None else b2.float().contiguous(), act.code, act.alpha, act.limit, self.int8,
        )


def pack_experts(records: list[gguf_blocks.Records], types: set[str]) -> tuple[torch.Tensor, int]:
    """Every expert's records of one projection -> (uint8 [E, bytes], the one
    record layout that holds all of them exactly)."""
    whole = gguf_blocks.Records.concat(records)
    layout = gguf_blocks.layout(types, whole)
    return torch.stack([gguf_blocks.pack(r, layout) for r in records]), layout


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] uint8 and scales [..., G] uint8 -> the
    weights [..., G * 32] in `dtype`, exactly (each a small power of two
    times an FP4 value). In each byte the low nibble is the earlier value."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    low, high = (blocks & 0x0F).long(), (blocks >> 4).long()
    values = torch.stack([lut[low], lut[high]], dim=-1).flatten(-2)
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1).to(values.dtype)).flatten(-2)


# FP4 code -> 2 x its value + 12, in [0, 24].
_MXFP4_CODES = np.array([int(2 * v) + 12 for v in FP4_VALUES], dtype=np.uint8)


def mxfp4_records(blocks: torch.Tensor, scales: torch.Tensor) -> gguf_blocks.Records:
    """One matrix's MXFP4 blocks [N, G, 16] and scales [N, G] -> records
    [N, 32 G] whose expansion is dequantize_mxfp4's weight (module docstring)."""
    raw = blocks.numpy()
    codes = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
    step = np.ldexp(np.float32(1.0), scales.numpy().astype(np.int32) - 128).astype(np.float32)
    sw = np.repeat(step, 2, axis=1)  # one pair per 16 values
    return gguf_blocks.Records(sw, -12.0 * sw, _MXFP4_CODES[codes])

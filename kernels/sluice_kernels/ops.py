"""The small per-token ops of a decoder layer, in plain torch or fused Triton.

The model code calls these through its layers (RMSNorm, the rotary step
tables, the MLP); which implementation runs is decided once, by the attention
backend the shard selected (its `layers.backends.get_backend`), so the model
file is the same for all:

    TorchOps   - the reference: eager torch.
    CpuOps     - CPU: float32 through the C++ kernels of `cpu_kernels`
                 (one pass per op), else TorchOps.
    TritonOps  - CUDA, or CPU under TRITON_INTERPRET=1: the kernels of
                 `sluice_kernels.triton` (rms_norm with the residual add
                 fused, rotary in place on q and k, silu_mul, the grouped
                 expert MLP of mixture-of-experts layers).

Rotary tables: both compute the cos/sin of the step's own positions once per
step (T x D/2 floats, shared by every layer), so no table over the whole
context is kept. The Triton kernel indexes its tables by position; it is given
row t for token t (positions 0..T-1 into the step's table):

    positions [T]  ->  cos/sin [T, D/2]   token t uses row t
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice_kernels.moe import expert_mlp_reference


@dataclass
class RotaryTables:
    """cos/sin of one step's positions, float32 [T, D/2] each; `rows` = arange(T)."""

    cos: torch.Tensor
    sin: torch.Tensor
    rows: torch.Tensor


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> RotaryTables:
    angles = positions.float().unsqueeze(-1) * inv_freq.float()
    rows = torch.arange(positions.numel(), device=positions.device)
    return RotaryTables(angles.cos().contiguous(), angles.sin().contiguous(), rows)


class TorchOps:
    name = "torch"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * weight, x + residual): normalize in float32,
        scale in the model dtype (as transformers' Llama)."""
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight * normed, x

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, tables: RotaryTables) -> None:
        """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (GPT-NeoX rotate-half)."""
        cos = tables.cos.unsqueeze(1)
        sin = tables.sin.unsqueeze(1)
        for x in (q, k):
            x1, x2 = x.float().chunk(2, dim=-1)
            x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    # Gemma's variants. No fused kernel yet: every backend runs these in torch.

    def rms_norm_one_plus(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma's RMSNorm, whose checkpoint weight w scales by (1 + w):
        (norm(x + residual) * (1 + w), x + residual), computed in float32 and
        rounded to x's dtype once (as transformers' Gemma 3)."""
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (1.0 + weight.float())).to(x.dtype), x

    def gelu_tanh_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate | up) -> gelu_tanh(gate) * up, [T, I] (GeGLU)."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def expert_mlp(self, x, ids, weights, w13, w2, b13, b2, act):
        """A mixture-of-experts layer's grouped expert MLP (sluice_kernels.moe):
        x [T, H], each token's experts ids [T, k] and weights [T, k] -> [T, H]."""
        return expert_mlp_reference(x, ids, weights, w13, w2, b13, b2, act)


def _cpu_f32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


class CpuOps(TorchOps):
    """TorchOps with float32 CPU tensors sent to the C++ kernels of
    `cpu_kernels` (one pass each); anything else takes the torch path.
    Built only once `cpu_kernels.load()` succeeded."""

    name = "cpu"

    def rms_norm(self, x, weight, eps, residual):
        if x.dim() == 2 and _cpu_f32(x, weight) and (residual is None or _cpu_f32(residual)):
            return torch.ops.sluice_cpu.rms_norm(x, residual, weight, eps)
        return super().rms_norm(x, weight, eps, residual)

    def rotary_(self, q, k, tables):
        if _cpu_f32(q, k):
            torch.ops.sluice_cpu.rotary_(q, k, tables.cos, tables.sin)
        else:
            super().rotary_(q, k, tables)



class TritonOps(TorchOps):
    name = "triton"

    def __init__(self):
        # Imported here: the CPU path never imports triton.
        from sluice_kernels.triton.rms_norm import rms_norm
        from sluice_kernels.triton.rotary import rotary_embedding_
        from sluice_kernels.triton.moe import fused_moe
        from sluice_kernels.triton.silu_mul import silu_mul

        self._rms_norm, self._rotary, self._silu_mul = rms_norm, rotary_embedding_, silu_mul
        self._fused_moe = fused_moe

    def rms_norm(self, x, weight, eps, residual):
        return self._rms_norm(x, weight, eps, residual)

    def rotary_(self, q, k, tables):
        self._rotary(tables.rows, q, k, tables.cos, tables.sin)

    def silu_mul(self, x):
        return self._silu_mul(x)

    def expert_mlp(self, x, ids, weights, w13, w2, b13, b2, act):
        return self._fused_moe(x, ids, weights, w13, w2, b13, b2, act)

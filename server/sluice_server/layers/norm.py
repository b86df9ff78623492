"""RMSNorm as in Llama: normalize in float32, scale in the model dtype; and
Gemma's (1 + w) variant.

The arithmetic is the backend's (`sluice_kernels.ops`): eager torch, or one fused
Triton kernel that also adds the residual.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice_kernels.ops import TorchOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: TorchOps | None = None):
        super().__init__()
        self.eps = eps
        self.ops = ops or TorchOps()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = lambda p, ckpt, shard_id=0: p.data.copy_(ckpt[:])

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the pre-norm block pattern.

        With `residual` None the sum is just `x`.
        """
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class OnePlusRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint's weight w (initialised at 0) scales by
    1 + w, and the whole computation stays in float32 until the end."""

    def __init__(self, hidden_size: int, eps: float, ops: TorchOps | None = None):
        super().__init__(hidden_size, eps, ops)
        self.weight.data.zero_()

    def forward(self, x, residual=None):
        return self.ops.rms_norm_one_plus(x, self.weight, self.eps, residual)

"""Chooses the attention backend (and with it the small ops) for a device.

    auto    triton on CUDA, torch on CPU
    torch   `torch_attention.TorchAttention` (the C++ kernels on CPU, when the
            shard uses them: --cpu-kernels)
    triton  `triton_attention.TritonAttention`
"""

from __future__ import annotations

import torch

from sluice_kernels.triton import triton_interpreting
from sluice_server.layers.attention import AttentionBackend
from sluice_server.layers.torch_attention import TorchAttention


BACKENDS = ("auto", "torch", "triton")


def resolve_backend_name(requested: str, device: torch.device) -> str:
    """`auto`: triton on CUDA, torch on CPU. Triton on CPU runs only under
    Triton's interpreter (TRITON_INTERPRET=1: tests), never by accident."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if requested == "triton" and device.type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device (device is {device.type}); "
            "on CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1)"
        )
    return requested


def get_backend(device: torch.device, requested: str = "auto", cpu_kernels: bool = True) -> AttentionBackend:
    """The attention backend (and its small ops) for `device`; see
    resolve_backend_name. `cpu_kernels`: on CPU, the torch backend runs the
    C++ kernels (where they load)."""
    if resolve_backend_name(requested, device) == "torch":
        return TorchAttention(cpu_kernels=cpu_kernels and device.type == "cpu")
    try:
        from sluice_server.layers.triton_attention import TritonAttention
    except ImportError as e:
        raise ValueError(f"attention backend 'triton' is unavailable: {e}") from None
    return TritonAttention()

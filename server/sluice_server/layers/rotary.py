"""Rotary position embeddings (RoPE), GPT-NeoX layout as in transformers' Llama.

A head vector of size D is split in halves (x1 | x2); position p rotates the
pair (x1[i], x2[i]) by angle p * inv_freq[i]:

    out = x * cos + rotate_half(x) * sin,  rotate_half(x1 | x2) = (-x2 | x1)

cos/sin are computed once per step for the step's positions (T x D floats,
cheap) and shared by every layer, so there is no cache to size.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sluice_server.layers.ops import RotaryTables, rotary_tables


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config.json, old (rope_theta + rope_scaling) or new
    (rope_parameters) transformers layout, as one dict with at least rope_theta
    and rope_type."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/D), rescaled for rope_type llama3. float32 [D/2]."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, llama3)")
    # Llama 3.1: wavelengths longer than the original context are stretched by
    # `factor`, short ones kept, and the band between interpolated smoothly.
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    def __init__(self, head_dim: int, params: dict[str, Any], device: torch.device):
        self.inv_freq = inverse_frequencies(head_dim, params).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, 1, D] in `dtype`."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def tables(self, positions: torch.Tensor) -> RotaryTables:
        """The step's cos/sin for `ops.rotary_` (float32 [T, D/2])."""
        return rotary_tables(positions, self.inv_freq)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by per-token (cos, sin) [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

"""Rotary position embeddings (RoPE), GPT-NeoX layout as in transformers' Llama.

A head vector of size D is split in halves (x1 | x2); position p rotates the
pair (x1[i], x2[i]) by angle p * inv_freq[i]:

    out = x * cos + rotate_half(x) * sin,  rotate_half(x1 | x2) = (-x2 | x1)

cos/sin are computed once per step for the step's positions (T x D floats,
cheap) and shared by every layer, so there is no cache to size.

Scaled variants (`rope_type`), as transformers computes them:

    default    inv_freq[i] = theta^(-2i/D)
    linear     inv_freq / factor                       (Gemma 3's global layers)
    llama3     long wavelengths stretched by factor    (Llama 3.1+)
    longrope   inv_freq / ext[i], cos/sin x mscale     (Phi-3 "su"/"longrope")
    yarn       per-frequency blend of inv_freq and     (gpt-oss, Qwen3 / DeepSeek
               inv_freq / factor, cos/sin x mscale      long context)
    dynamic    default, with a larger base             (NTK-aware; see below)

Each type also fixes the longest context the model serves
(`context_length`): yarn and dynamic serve factor x their original context.

`dynamic`: transformers recomputes the base from the length of each forward
call (unchanged up to max_position_embeddings, larger past it). A server
cannot: the cache holds keys rotated in earlier steps, and one sequence would
mix bases. Sluice fixes the base once, for the longest context it serves
(factor x max_position_embeddings), as vLLM does: a forward over that whole
length equals transformers; shorter sequences run with the same, larger base.

A partial_rotary_factor f < 1 rotates only the first f*D dims of each head
(Phi-4-mini); the tables then have f*D/2 columns.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# RotaryTables is the kernels' form of a step's cos/sin; the models take it from here.
from sluice_kernels.ops import RotaryTables, rotary_tables


ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "dynamic")


def rope_parameters(config: dict[str, Any], params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rope settings of a config.json, old (rope_theta + rope_scaling) or new
    (rope_parameters) transformers layout, as one dict with at least rope_theta
    and rope_type. `params` overrides where they come from (Gemma 3 keeps one
    dict per layer type).

    LongRoPE and YaRN also need the context lengths:
    `original_max_position_embeddings` (Phi-3 keeps it at the top level,
    which then wins, as in transformers) and `max_position_embeddings`;
    dynamic NTK the latter. An unknown rope_type is refused here, at start,
    with its name."""
    if params is None:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = dict(params)
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = "longrope" if rope_type == "su" else rope_type
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if params["rope_type"] in ("longrope", "yarn"):
        if config.get("original_max_position_embeddings"):
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    if params["rope_type"] in ("longrope", "yarn", "dynamic"):
        params.setdefault("max_position_embeddings", config["max_position_embeddings"])
    return params


def check_rope_types(config: dict[str, Any]) -> None:
    """Raises, naming it, for a rope type of config.json (any layout: one
    dict, or Gemma 3's one per layer type) that no rotary here implements."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    for p in [v for v in params.values() if isinstance(v, dict)] or [params]:
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ROPE_TYPES + ("su",):
            raise ValueError(f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def context_length(params: dict[str, Any], max_position_embeddings: int) -> int:
    """The longest context the model serves under its rope settings: what
    config.json says (`max_position_embeddings`), except for the types that
    extend a context by a factor (yarn: its original context x factor;
    dynamic: max_position_embeddings x factor)."""
    rope_type = params["rope_type"]
    if rope_type == "yarn" and params.get("factor"):
        return int(params["original_max_position_embeddings"] * float(params["factor"]))
    if rope_type == "dynamic":
        return int(max_position_embeddings * float(params["factor"]))
    return max_position_embeddings


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """How many leading dims of a head are rotated."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def inverse_frequencies(dim: int, params: dict[str, Any]) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/dim), rescaled per rope_type. float32 [dim/2]."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rope_type = params["rope_type"]
    if rope_type == "longrope":
        return 1.0 / (torch.tensor(longrope_factors(params), dtype=torch.float32) * base**exponents)
    if rope_type == "dynamic":
        base = dynamic_base(dim, params)
    inv_freq = 1.0 / (base**exponents)
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "yarn":
        return yarn_frequencies(base**exponents, dim, params)
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
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


def yarn_factor(params: dict[str, Any]) -> float:
    """YaRN's scale: `factor`, else the ratio of the served to the original context."""
    if params.get("factor"):
        return float(params["factor"])
    return params["max_position_embeddings"] / params["original_max_position_embeddings"]


def yarn_frequencies(wavelengths: torch.Tensor, dim: int, params: dict[str, Any]) -> torch.Tensor:
    """YaRN (NTK-by-parts): frequencies that turn fewer than beta_slow times
    over the original context are interpolated (inv_freq / factor), those
    that turn more than beta_fast times kept, and a linear ramp over the
    dimensions between blends the two:

        dims   0 ........ low ........ high ........ dim/2
               kept       ramp: kept -> divided       divided by factor

    low and high are the dims whose wavelengths turn beta_fast and
    beta_slow times in the original context (rounded outwards unless
    `truncate` is false, as gpt-oss sets). `wavelengths`: theta^(2i/dim)
    (each divided into 1 here, as transformers does, so the frequencies
    are its bits)."""
    base = float(params["rope_theta"])
    factor = yarn_factor(params)
    original = params["original_max_position_embeddings"]
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_turning(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return 1.0 / (factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


def dynamic_base(dim: int, params: dict[str, Any]) -> float:
    """Dynamic NTK's base for the longest served context, factor x
    max_position_embeddings (the module docstring says why it is fixed):
    base * (factor * L / max_pos - (factor - 1)) ** (dim / (dim - 2))."""
    factor = float(params["factor"])
    served = factor * params["max_position_embeddings"]
    ratio = factor * served / params["max_position_embeddings"] - (factor - 1)
    return float(params["rope_theta"]) * ratio ** (dim / (dim - 2))


def longrope_factors(params: dict[str, Any]) -> list[float]:
    """LongRoPE's per-frequency divisors: `long_factor` when the model serves
    contexts past its pretraining length, else `short_factor`.

    transformers picks them per forward call from the longest position in it,
    which a server cannot do: keys in the cache were rotated by earlier steps,
    and one sequence would mix both. So the choice is made once, from the
    served context (max_position_embeddings): a long-context checkpoint
    (Phi-3-*-128k) always runs its long factors, equal to transformers on any
    sequence longer than original_max_position_embeddings."""
    long = params["max_position_embeddings"] > params["original_max_position_embeddings"]
    return [float(f) for f in params["long_factor" if long else "short_factor"]]


def attention_scaling(params: dict[str, Any]) -> float:
    """The factor LongRoPE and YaRN multiply cos/sin by (1 for the other types)."""
    if params["rope_type"] == "yarn":
        return yarn_attention_factor(params)
    if params["rope_type"] != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def yarn_attention_factor(params: dict[str, Any]) -> float:
    """YaRN's cos/sin scale ("mscale"): `attention_factor` when given, else
    0.1 ln(factor) + 1, or DeepSeek's ratio of two such terms when the
    config names `mscale` and `mscale_all_dim`."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = yarn_factor(params)

    def mscale(weight: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(params["mscale"]) / mscale(params["mscale_all_dim"]))
    return mscale()


class RotaryEmbedding:
    def __init__(self, head_dim: int, params: dict[str, Any], device: torch.device):
        self.dim = rotary_dim(head_dim, params)
        self.inv_freq = inverse_frequencies(self.dim, params).to(device)
        self.scaling = attention_scaling(params)

    def tables(self, positions: torch.Tensor) -> RotaryTables:
        """The step's cos/sin for `ops.rotary_` (float32 [T, dim/2])."""
        tables = rotary_tables(positions, self.inv_freq)
        if self.scaling != 1.0:
            tables.cos.mul_(self.scaling)
            tables.sin.mul_(self.scaling)
        return tables


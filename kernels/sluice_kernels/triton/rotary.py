"""Rotary position embedding, GPT-NeoX / transformers-Llama layout, in place on q and k.

A head vector of size D is two halves (x1 | x2); the token at position p
rotates each pair (x1[i], x2[i]) by the angle p * inv_freq[i]:

    x1' = x1 * cos - x2 * sin          cos = cos_cache[p, i]
    x2' = x2 * cos + x1 * sin          sin = sin_cache[p, i]      i in [0, D/2)

which is `x * cos + rotate_half(x) * sin` with cos/sin duplicated over both
halves. The tables are float32 [P, D/2], indexed by each token's position, so
one table built at start-up serves every step (see `cos_sin_cache`); a caller
with per-step tables passes positions = arange(T).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, token, num_heads, half, cos, sin,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first = x_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + half, mask=mask).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_kv_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + pos * stride_cache + dims, mask=dims < half).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cache + dims, mask=dims < half).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, num_q_heads, half, cos, sin, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, num_kv_heads, half, cos, sin, BLOCK_HK, BLOCK_HALF)


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_freq [D/2] -> (cos, sin), each float32 [max_positions, D/2]."""
    angles = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device).unsqueeze(1) * inv_freq.float()
    return angles.cos(), angles.sin()


def _check(positions, q, k, cos, sin):
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [T, Hq, D] and k [T, Hkv, D] expected, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"head_dim must be even, got {q.shape[2]}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [T={q.shape[0]}], got {tuple(positions.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != q.shape[2] // 2:
        raise ValueError(f"cos/sin must both be [P, D/2={q.shape[2] // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")


def rotary_embedding_(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (token/head strides free,
    last dim contiguous: views into a fused qkv output work) by the tables
    cos/sin [P, D/2] at positions [T] (each < P; not checked on device)."""
    _check(positions, q, k, cos, sin)
    assert q.stride(2) == 1 and k.stride(2) == 1, "q/k must be contiguous in the head dim"
    assert cos.is_contiguous() and sin.is_contiguous()
    num_tokens, num_q_heads, dim = q.shape
    if num_tokens == 0:
        return
    half = dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        num_q_heads, k.shape[1], half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
    )


def rotary_embedding_reference_(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    _check(positions, q, k, cos, sin)
    c = cos[positions.long()].float().unsqueeze(1)
    s = sin[positions.long()].float().unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))

"""The KV-cache write: each new token's k/v row goes to its slot in the paged cache.

    cache  [num_blocks, block_size, Hkv, D]  viewed flat as [num_blocks * block_size, Hkv, D]
    slot   = block_id * block_size + offset   (from batch.build_batch's slot_mapping)

    k[t] (Hkv x D) ──► cache_flat[slot_mapping[t]]      a negative slot means "skip"
                                                        (padding tokens, e.g. CUDA graphs)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    num_tokens, num_heads, head_dim,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # A tile is BLOCK_T tokens x (every head and dim of a token, flattened):
    # column c is head c // BLOCK_D, dim c % BLOCK_D.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H * BLOCK_D)
    heads = cols // BLOCK_D
    dims = cols % BLOCK_D
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    mask = (slots >= 0)[:, None] & ((heads < num_heads) & (dims < head_dim))[None, :]
    rows = tokens.to(tl.int64)[:, None]
    k = tl.load(k_ptr + rows * stride_kt + (heads * stride_kh + dims)[None, :], mask=mask)
    v = tl.load(v_ptr + rows * stride_vt + (heads * stride_vh + dims)[None, :], mask=mask)
    # The cache is contiguous: one slot is num_heads * head_dim elements.
    dst = slots[:, None] * (num_heads * head_dim) + (heads * head_dim + dims)[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(k, v, k_cache, v_cache, slot_mapping):
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]")
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache heads/dim {tuple(k_cache.shape[2:])} != k's {tuple(k.shape[1:])}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k/v [T, Hkv, D] (any token/head strides, last dim contiguous) into
    k_cache/v_cache [num_blocks, block_size, Hkv, D] (contiguous) at
    slot_mapping [T] (int32/int64; < 0 skips the token). In place."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v rows must be contiguous in the head dim"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV cache must be contiguous"
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    # About 4K elements per program: a few tokens of a GQA model's k/v.
    block_t = max(1, min(16, 4096 // (block_h * block_d)))
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_tokens, num_heads, head_dim,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
    )


def reshape_and_cache_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _check(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    heads, dim = k_cache.shape[2:]
    k_cache.view(-1, heads, dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, heads, dim)[slots] = v[keep].to(v_cache.dtype)

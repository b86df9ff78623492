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
    num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (dims < head_dim)
        # The cache is contiguous: one slot is num_heads * head_dim elements.
        dst = slot * num_heads * head_dim + heads * head_dim + dims
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
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
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
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

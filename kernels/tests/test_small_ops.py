"""RMSNorm(+residual), rotary, SiLU-and-mul and reshape-and-cache against
their torch references (and the torch ops the model layers run, `ops.TorchOps`,
where they exist)."""

from __future__ import annotations

import pytest
import torch

from sluice_kernels.triton.reshape_and_cache import reshape_and_cache, reshape_and_cache_reference
from sluice_kernels.triton.rms_norm import rms_norm, rms_norm_reference
from sluice_kernels.triton.rotary import cos_sin_cache, rotary_embedding_, rotary_embedding_reference_
from sluice_kernels.triton.silu_mul import silu_mul, silu_mul_reference
from sluice_kernels.ops import TorchOps, rotary_tables

from .kernel_cases import TOLERANCES, device

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rounding_tolerance(dtype):
    """Exact, except bfloat16 under the interpreter, which rounds float32 to
    bfloat16 toward zero where GPUs (and torch) round to nearest even."""
    if dtype == torch.bfloat16 and device().type == "cpu":
        return TOLERANCES[dtype]
    return dict(atol=0, rtol=0)


def inverse_frequencies(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Default rotary frequencies theta^(-2i/D), float32 [D/2]."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device()).float() / head_dim))


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device())


# --- RMSNorm ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])  # 576 (SmolLM2) is no power of two
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    x = randn(7, hidden, dtype=dtype, seed=1) * 3
    residual = randn(7, hidden, dtype=dtype, seed=2) if with_residual else None
    weight = randn(hidden, dtype=dtype, seed=3)
    out, res = rms_norm(x, weight, 1e-5, residual)
    want_out, want_res = rms_norm_reference(x, weight, 1e-5, residual)
    # The residual sum is rounded as torch rounds it.
    torch.testing.assert_close(res, want_res, **rounding_tolerance(dtype))
    # One rounding step of the dtype, from a different rsqrt.
    torch.testing.assert_close(out, want_out, **TOLERANCES[dtype])
    # And the torch RMSNorm the model layers run agrees.
    layer_out, layer_res = TorchOps().rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, layer_out, **TOLERANCES[dtype])
    torch.testing.assert_close(res, layer_res, **rounding_tolerance(dtype))


def test_rms_norm_strided_rows_and_bad_shapes():
    wide = randn(5, 200)
    x = wide[:, :96]  # rows 200 apart
    weight = randn(96, seed=4)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6)[0], rms_norm_reference(x, weight, 1e-6)[0])
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, randn(95), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, weight, 1e-6, randn(4, 96))


# --- rotary ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", [(64, 4, 4), (128, 3, 1), (64, 8, 2)])
def test_rotary_in_place(dtype, head_dim, num_q_heads, num_kv_heads):
    tokens = 6
    # q and k as views into a fused qkv projection output, like the model's.
    qkv = randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=head_dim)
    q = qkv[:, : num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    inv_freq = inverse_frequencies(head_dim)
    cos, sin = cos_sin_cache(inv_freq, 5000)
    positions = torch.tensor([0, 1, 17, 1000, 4999, 3], device=device())
    q_ref, k_ref = q.clone(), k.clone()
    untouched = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].clone()
    rotary_embedding_(positions, q, k, cos, sin)
    rotary_embedding_reference_(positions, q_ref, k_ref, cos, sin)
    torch.testing.assert_close(q, q_ref, **TOLERANCES[dtype])
    torch.testing.assert_close(k, k_ref, **TOLERANCES[dtype])
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim :], untouched), "v must not change"
    # The torch rotary the model layers run (rotate-half on the step's own
    # tables) gives the same, in float32.
    if dtype == torch.float32:
        original = randn(tokens, num_q_heads, head_dim, seed=99)
        rotated, want = original.clone(), original.clone()
        rotary_embedding_(positions, rotated, original[:, :num_kv_heads].clone(), cos, sin)
        TorchOps().rotary_(want, original[:, :num_kv_heads].clone(), rotary_tables(positions, inv_freq))
        torch.testing.assert_close(rotated, want, atol=1e-4, rtol=1e-4)


def test_rotary_bad_shapes():
    q, k = randn(3, 2, 64), randn(3, 1, 64)
    cos, sin = cos_sin_cache(torch.ones(32, device=device()), 10)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding_(torch.zeros(2, dtype=torch.int64, device=device()), q, k, cos, sin)
    with pytest.raises(ValueError, match="cos/sin"):
        rotary_embedding_(torch.zeros(3, dtype=torch.int64, device=device()), q, k, cos[:, :16], sin[:, :16])


# --- SiLU-and-mul ----------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 1536])  # 1536 > one 1024-wide tile
def test_silu_mul(dtype, inter):
    x = randn(5, 2 * inter, dtype=dtype, seed=inter) * 4
    torch.testing.assert_close(silu_mul(x), silu_mul_reference(x), **TOLERANCES[dtype])
    want = torch.nn.functional.silu(x[:, :inter].float()) * x[:, inter:].float()
    torch.testing.assert_close(silu_mul(x).float(), want, **TOLERANCES[dtype])


def test_silu_mul_bad_shape():
    with pytest.raises(ValueError, match="2I"):
        silu_mul(randn(3, 7))


# --- reshape-and-cache -----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 64), (32, 1, 128), (16, 3, 80)])
def test_reshape_and_cache(dtype, block_size, num_kv_heads, head_dim):
    tokens = 9
    # k/v as strided views of a fused projection, as the model passes them.
    kv = randn(tokens, 2 * num_kv_heads * head_dim + 8, dtype=dtype, seed=block_size)
    k = kv[:, : num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    num_blocks = 5
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[4] = -1  # a padding token: skipped
    slots = slots.to(device())
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device()) for _ in range(4)]
    reshape_and_cache(k, v, caches[0], caches[1], slots)
    reshape_and_cache_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = caches[0].view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[slots[0]], k[0]) and flat.count_nonzero() == (tokens - 1) * num_kv_heads * head_dim


def test_reshape_and_cache_bad_shapes():
    cache = torch.zeros(2, 16, 2, 64, device=device())
    with pytest.raises(ValueError, match="heads/dim"):
        reshape_and_cache(randn(3, 1, 64), randn(3, 1, 64), cache, cache.clone(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(randn(3, 2, 64), randn(3, 2, 64), cache, cache.clone(), torch.zeros(2, dtype=torch.int64))


# Larger shapes, compiled on a GPU only (skipped without CUDA; see conftest.py).
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large_small_ops(dtype):
    tokens, hidden, inter = 4096, 4096, 14336
    x, r, w = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype, seed=1), randn(hidden, dtype=dtype)
    out, res = rms_norm(x, w, 1e-5, r)
    want_out, want_res = rms_norm_reference(x, w, 1e-5, r)
    torch.testing.assert_close(out, want_out, **TOLERANCES[dtype])
    torch.testing.assert_close(res, want_res, **rounding_tolerance(dtype))
    gu = randn(tokens, 2 * inter, dtype=dtype, seed=2)
    torch.testing.assert_close(silu_mul(gu), silu_mul_reference(gu), **TOLERANCES[dtype])
    q, k = randn(tokens, 32, 128, dtype=dtype), randn(tokens, 8, 128, dtype=dtype, seed=3)
    cos, sin = cos_sin_cache(inverse_frequencies(128), 8192)
    pos = torch.randint(0, 8192, (tokens,), device=device())
    q2, k2 = q.clone(), k.clone()
    rotary_embedding_(pos, q, k, cos, sin)
    rotary_embedding_reference_(pos, q2, k2, cos, sin)
    torch.testing.assert_close(q, q2, **TOLERANCES[dtype])
    torch.testing.assert_close(k, k2, **TOLERANCES[dtype])

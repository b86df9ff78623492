"""The C++ CPU kernels (`sluice_kernels/csrc`, loaded by `cpu_kernels`)
against plain-torch references: decode attention against a dense float64
softmax(QK^T)V over the un-paged keys (`kernel_cases.dense_attention`), a
prompt's causal attention against the same in float64, and
`ops.CpuOps`' RMSNorm, rotary and SiLU-and-mul against `ops.TorchOps`, the
torch code they replace. The matmuls on GGUF blocks have their own module,
test_cpu_q8_linear.py.

scripts/install.sh installs the C++ compiler they need, so in CI this module
never skips."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sluice_kernels import cpu_kernels
from sluice_kernels.ops import CpuOps, TorchOps, rotary_tables

from .kernel_cases import TOLERANCES, dense_attention, make_batch


# Skipped only where the kernels cannot be built at all (no compiler, no
# ninja); where a compiler exists a build error raises here, at collection,
# and fails the run.
if not cpu_kernels.load():
    pytest.skip(f"CPU kernels not built: {cpu_kernels.unavailable_reason()}", allow_module_level=True)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def decode_batch(seq_lens: list[int], hq: int, hkv: int, dim: int, cache_dtype: torch.dtype, seed: int):
    """A decode step (one new token per sequence) with its k/v already in a
    cache of `cache_dtype` (the model writes them before attending), blocks
    scattered and never-written slots NaN, plus the dense reference's view of
    the same keys (rounded to the cache's dtype, as the kernel reads them)."""
    batch = make_batch([(n - 1, 1) for n in seq_lens], hq, hkv, dim, 16, torch.float32, seed, torch.device("cpu"))
    for cache, new in ((batch.k_cache, batch.k_new), (batch.v_cache, batch.v_new)):
        cache.view(-1, hkv, dim)[batch.slot_mapping] = new
    rounded = lambda ts: [t.to(cache_dtype).float() for t in ts]  # noqa: E731
    return dataclasses.replace(
        batch,
        k_cache=batch.k_cache.to(cache_dtype),
        v_cache=batch.v_cache.to(cache_dtype),
        keys=rounded(batch.keys),
        values=rounded(batch.values),
    )


@pytest.mark.parametrize(
    "hq,hkv,dim",
    [(9, 3, 64), (8, 8, 64), (8, 2, 128), (4, 1, 40)],  # SmolLM2; MHA; Llama-like; D not a multiple of 16
)
@pytest.mark.parametrize("seq_lens", [[1], [5, 17, 16, 33], [300, 2, 129], [1000]])
@pytest.mark.parametrize("window", [None, 1, 16, 100])  # sliding windows: from a block boundary and mid-block
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_matches_dense_attention(hq, hkv, dim, seq_lens, window, cache_dtype):
    """Against float64 attention over the un-paged keys. A bfloat16 cache
    holds the same values for both (the reference reads the keys rounded as
    the cache holds them, the kernel widens each row it reads), so the
    tolerance is float32's either way. q is a strided view of a fused qkv
    output, the way the model passes it."""
    batch = decode_batch(seq_lens, hq, hkv, dim, cache_dtype, seed=len(seq_lens) + dim)
    qkv = torch.cat([batch.q.reshape(len(seq_lens), -1), randn(len(seq_lens), 2 * hkv * dim, seed=3)], dim=1)
    q = qkv[:, : hq * dim].view(len(seq_lens), hq, dim)
    out = torch.full_like(batch.q, float("nan"))
    cpu_kernels.paged_decode_attention(
        out, q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, dim**-0.5, window
    )
    torch.testing.assert_close(out.double(), dense_attention(batch, window), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("seq_lens,window", [([1], None), ([5, 300, 129], None), ([700, 40], 100)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_with_sinks(seq_lens, window, cache_dtype):
    """gpt-oss's attention sinks: the merge of the key parts adds each head's
    e^sink to the denominator (one part, several, and with a window)."""
    hq, hkv, dim = 8, 2, 64
    batch = decode_batch(seq_lens, hq, hkv, dim, cache_dtype, seed=9)
    sinks = torch.linspace(-3.0, 4.0, hq)
    out = torch.full_like(batch.q, float("nan"))
    cpu_kernels.paged_decode_attention(
        out, batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, dim**-0.5, window, sinks
    )
    torch.testing.assert_close(out.double(), dense_attention(batch, window, sinks), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_does_not_depend_on_the_batch(cache_dtype):
    """A sequence's result is bitwise the same alone and among others (its
    keys are split into parts by its own length only)."""
    hq, hkv, dim = 9, 3, 64
    seq_lens = [700, 3, 130, 257]
    batch = decode_batch(seq_lens, hq, hkv, dim, cache_dtype, seed=7)
    q, tables, lens = batch.q, batch.block_tables, batch.seq_lens
    out = torch.empty_like(q)
    op = torch.ops.sluice_cpu.paged_decode_attention
    op(out, q, batch.k_cache, batch.v_cache, tables, lens, dim**-0.5)
    for i in range(len(seq_lens)):
        alone = torch.empty_like(q[i : i + 1])
        op(alone, q[i : i + 1], batch.k_cache, batch.v_cache, tables[i : i + 1], lens[i : i + 1], dim**-0.5)
        assert torch.equal(alone, out[i : i + 1])


def test_paged_decode_attention_rejects_bad_inputs():
    q, out = randn(1, 4, 64), torch.empty(1, 4, 64)
    cache = randn(4, 16, 2, 64)
    ok_tables, lens = torch.tensor([[0, 1]]), torch.tensor([20])
    op = torch.ops.sluice_cpu.paged_decode_attention
    op(out, q, cache, cache, ok_tables, lens, 0.125)  # the valid call runs
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(out, q, cache, cache, torch.tensor([[0, 9]]), lens, 0.125)
    with pytest.raises(RuntimeError, match="seq_len out of the block table's range"):
        op(out, q, cache, cache, ok_tables, torch.tensor([40]), 0.125)
    with pytest.raises(RuntimeError, match="q and out must be float32"):
        op(out.double(), q.double(), cache, cache, ok_tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="caches must both be float32 or both bfloat16"):
        op(out, q, cache, cache.bfloat16(), ok_tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="caches must both be float32 or both bfloat16"):
        op(out, q, cache.half(), cache.half(), ok_tables, lens, 0.125)


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale Q K^T) V in float64 for the T new tokens of S, new token
    t seeing keys [0, S - T + t], each kv head shared by Hq / Hkv query
    heads. [T, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    scores = (qd @ kd.transpose(1, 2)) * scale
    T, S = q.shape[0], k.shape[0]
    scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(S - T + 1), float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1)


@pytest.mark.parametrize(
    "hq,hkv,dim",
    [(9, 3, 64), (32, 8, 64), (8, 2, 128), (4, 4, 128), (6, 2, 40)],  # SmolLM2; 1B; Llama-like; MHA; odd D
)
@pytest.mark.parametrize("tokens", [1, 3, 7, 16, 17, 33, 100, 300])  # tiles of 16 positions (AVX2: rows 6+6+4, 2+1), chunks of 32 keys
@pytest.mark.parametrize("cached", [0, 1, 45])  # a fresh prompt; a later chunk or prefix-cache hit
def test_prefill_attention_matches_causal_attention(hq, hkv, dim, tokens, cached):
    """q is a strided view of a fused qkv output and out a view of a larger
    buffer, and cached keys come [S, Hkv, D] with the heads apart (a gather
    from the cache, transposed back), as the attention backend passes them."""
    qkv = randn(tokens, (hq + 2 * hkv) * dim, seed=tokens + dim)
    q = qkv[:, : hq * dim].view(tokens, hq, dim)
    k = randn(tokens + cached, hkv, dim, seed=1).bfloat16().float()
    v = randn(tokens + cached, hkv, dim, seed=2).bfloat16().float()
    if cached:
        k, v = k.transpose(0, 1).contiguous().transpose(0, 1), v.transpose(0, 1).contiguous().transpose(0, 1)
    buffer = torch.full((tokens + 3, hq, dim), float("nan"))
    out = buffer[2 : 2 + tokens]
    cpu_kernels.prefill_attention(out, q, k, v, dim**-0.5)
    torch.testing.assert_close(out.double(), causal_reference(q, k, v, dim**-0.5), **TOLERANCES[torch.float32])
    assert buffer[:2].isnan().all() and buffer[2 + tokens :].isnan().all()  # nothing written outside out


def test_prefill_attention_positions_do_not_see_later_tokens():
    """Position t's result is bitwise the same for any prompt that shares its
    first t + 1 tokens (the causal mask, and each row's own softmax)."""
    hq, hkv, dim = 8, 2, 64
    q, k, v = randn(200, hq, dim, seed=4), randn(200, hkv, dim, seed=5), randn(200, hkv, dim, seed=6)
    full = torch.empty_like(q)
    cpu_kernels.prefill_attention(full, q, k, v, 0.125)
    for n in (1, 37, 128):
        part = torch.empty_like(q[:n])
        cpu_kernels.prefill_attention(part, q[:n], k[:n], v[:n], 0.125)
        assert torch.equal(part, full[:n])


def test_prefill_attention_rejects_bad_inputs():
    q, k, out = randn(5, 4, 64), randn(5, 2, 64), torch.empty(5, 4, 64)
    op = torch.ops.sluice_cpu.prefill_attention
    op(out, q, k, k, 0.125)  # the valid call runs
    with pytest.raises(RuntimeError, match="must be float32"):
        op(out, q.double(), k, k, 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        op(out, q, randn(5, 3, 64), randn(5, 3, 64), 0.125)
    with pytest.raises(RuntimeError, match=r"k and v must be \[S, Hkv, D\] with S >= q's tokens"):
        op(out, q, k[:4], k[:4], 0.125)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        op(out, q.transpose(1, 2).contiguous().transpose(1, 2), k, k, 0.125)
    with pytest.raises(RuntimeError, match="rows must be contiguous"):
        op(out, q, k.transpose(1, 2).contiguous().transpose(1, 2), k, 0.125)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm(with_residual, rows):
    wide = randn(rows, 700, seed=1) * 3
    x = wide[:, :576]  # strided rows
    residual = randn(rows, 576, seed=2) if with_residual else None
    weight = randn(576, seed=3)
    got = CpuOps().rms_norm(x, weight, 1e-5, residual)
    want = TorchOps().rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the sum is exact
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 23])
def test_rotary_in_place_on_fused_qkv_views(rows):
    hq, hkv, dim = 9, 3, 64
    qkv = randn(rows, (hq + 2 * hkv) * dim, seed=4)
    positions = torch.randint(0, 4000, (rows,), generator=torch.Generator().manual_seed(5))
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, dim, 2).float() / dim))
    tables = rotary_tables(positions, inv_freq)
    want = qkv.clone()
    for ops, buf in ((TorchOps(), want), (CpuOps(), qkv)):
        q = buf[:, : hq * dim].view(rows, hq, dim)
        k = buf[:, hq * dim : (hq + hkv) * dim].view(rows, hkv, dim)
        ops.rotary_(q, k, tables)
    torch.testing.assert_close(qkv, want, atol=1e-5, rtol=1e-5)
    # v is untouched.
    assert torch.equal(qkv[:, (hq + hkv) * dim :], randn(rows, (hq + 2 * hkv) * dim, seed=4)[:, (hq + hkv) * dim :])


@pytest.mark.parametrize("rows", [1, 19, 300])
def test_silu_mul_is_the_torch_arithmetic(rows):
    """The C++ decoder's silu_mul and the Python forward's give the same bits."""
    x = randn(rows, 2 * 1536, seed=6) * 4
    assert torch.equal(torch.ops.sluice_cpu.silu_mul(x), TorchOps().silu_mul(x))


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (8, 49152), (5, 37), (3, 16)])
def test_argmax_rows_is_torch_max(rows, vocab):
    """Greedy sampling's kernel returns torch.max(x, -1): the maximum and its
    first index, with ties anywhere in a row (also inside one vector of 16 and
    in the scalar tail), a row of -inf, and NaN rows (NaN and its first index)."""
    x = randn(rows, vocab + 5, seed=9)[:, :vocab]  # strided rows
    x[0, vocab // 3] = x[0, vocab - 1] = 50.0  # a tie far apart: the first wins
    if rows > 1:
        x[1, 2] = x[1, 3] = 50.0  # a tie in one vector
    if rows > 2:
        x[2] = -float("inf")
    if rows > 3:
        x[3, vocab // 2] = float("nan")
        x[3, vocab - 1] = float("nan")
    if rows > 4:
        x[4, vocab - 1] = 60.0  # the maximum in the last position
    values, indices = torch.ops.sluice_cpu.argmax_rows(x)
    want_values, want_indices = x.max(dim=-1)
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(values, want_values, atol=0, rtol=0, equal_nan=True)


def test_other_dtypes_take_the_torch_path():
    x = randn(3, 64, seed=7).to(torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    got = CpuOps().rms_norm(x, weight, 1e-6, None)
    want = TorchOps().rms_norm(x, weight, 1e-6, None)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)

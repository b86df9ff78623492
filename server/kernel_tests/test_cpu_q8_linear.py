"""The int8-activation matmul on GGUF blocks (`csrc/cpu_q8_linear.cpp`)
against a plain-torch reference of the same arithmetic, for every kernel this
host can run (AVX-512 VNNI, AVX-VNNI, AVX2, scalar): the kernels differ from
the reference only in float summation order, and a row's result does not
depend on the other rows of its matmul.

The reference (`reference_q8_linear`) spells the arithmetic out: each row of x
is quantized per block of 32 (dx = max|x| / 127, xq = round(x / dx)), each
weight block is expanded to (sw, cw, wq), and

    y[r, n] = sum_b  sw * dx * dot(wq, xq)  +  cw * dx * sum(xq)

It is checked in turn against the float matmul: the int8 rounding of x is the
only difference, bounded here by a tolerance from its size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice_server.layers import cpu_kernels

from .kernel_cases import random_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")

FORMATS = {"Q4_1": 0, "Q8_0": 1}
ISA_NAMES = {1: "scalar", 2: "avx2", 3: "avx-vnni", 4: "avx512-vnni"}
ALL_ISAS = [1, 2, 3, 4]


def host_isas() -> list[int]:
    return list(torch.ops.sluice_cpu.q8_isas()) if cpu_kernels.load() else []


def isa_param(code: int):
    marks = []
    if code not in host_isas():
        marks.append(pytest.mark.skip(reason=f"this CPU lacks the instructions of the {ISA_NAMES[code]} kernel"))
    return pytest.param(code, id=ISA_NAMES[code], marks=marks)



def expand_blocks(blocks: np.ndarray, fmt: str, n: int, k: int):
    """GGUF blocks -> (sw [n, nb], cw [n, nb], wq [n, k]) float64/int64."""
    nb = k // 32
    raw = blocks.reshape(n, nb, -1)
    sw = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if fmt == "Q4_1":
        cw = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        qs = raw[..., 4:20].astype(np.int64)
        wq = np.concatenate([qs & 15, qs >> 4], axis=-1)
    else:
        wq = raw[..., 2:34].view(np.int8).astype(np.int64) + 128
        cw = -128.0 * sw
    return sw, cw, wq.reshape(n, k)


def reference_quantize(x: torch.Tensor):
    """x [M, K] -> (xq [M, K] int64, dx [M, K/32] float64): round half to even."""
    m, k = x.shape
    blocks = x.double().view(m, k // 32, 32)
    amax = blocks.abs().amax(-1)
    dx = (amax.float() / 127.0).double()
    inv = torch.where(amax > 0, (127.0 / amax.float()).double(), torch.zeros_like(amax))
    xq = torch.round((blocks.float() * inv.float().unsqueeze(-1))).long()
    return xq.view(m, k), dx


def reference_q8_linear(x: torch.Tensor, blocks: np.ndarray, fmt: str, n: int) -> torch.Tensor:
    m, k = x.shape
    nb = k // 32
    sw, cw, wq = (torch.from_numpy(a) for a in expand_blocks(blocks, fmt, n, k))
    xq, dx = reference_quantize(x)
    dots = torch.einsum("mbj,nbj->mnb", xq.view(m, nb, 32).double(), wq.view(n, nb, 32).double())
    sx = dx * xq.view(m, nb, 32).sum(-1).double()
    y = (dots * sw.unsqueeze(0) * dx.unsqueeze(1)).sum(-1) + sx @ cw.T
    return y.float()


def q8_linear(x, blocks: np.ndarray, fmt: str, n: int, k: int, isa: int = 0) -> torch.Tensor:
    packed = torch.ops.sluice_cpu.q8_pack(torch.from_numpy(blocks).reshape(-1), FORMATS[fmt], n, k)
    return torch.ops.sluice_cpu.q8_linear(x, packed, FORMATS[fmt], n, isa)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_quantize_matches_the_reference():
    x = randn(7, 576, seed=3) * torch.linspace(0.01, 5, 576)
    x[2, 64:96] = 0.0  # an all-zero block: scale 0, quants 0
    xq, dx, sx = torch.ops.sluice_cpu.q8_quantize(x)
    want_q, want_d = reference_quantize(x)
    assert torch.equal(xq.long(), want_q)
    torch.testing.assert_close(dx.double(), want_d, rtol=1e-6, atol=0)
    torch.testing.assert_close(sx.double(), want_d * want_q.view(7, 18, 32).sum(-1).double(), rtol=1e-6, atol=1e-9)
    assert xq.abs().max() <= 127


@pytest.mark.parametrize("isa", [isa_param(c) for c in ALL_ISAS])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
# Rows: single decodes, register-tile remainders, and more than one row item (64).
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 70])
def test_kernels_match_the_reference(isa, fmt, rows):
    n, k = 45, 576  # 45: a partial group of 16 outputs
    blocks = random_blocks(fmt, n, k, seed=rows)
    x = randn(rows, k + 64, seed=2)[:, :k]  # strided rows
    got = q8_linear(x, blocks, fmt, n, k, isa)
    want = reference_q8_linear(x.contiguous(), blocks, fmt, n)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_a_row_does_not_depend_on_the_other_rows(fmt):
    n, k = 77, 1536
    blocks = random_blocks(fmt, n, k, seed=11)
    x = randn(300, k, seed=12) * torch.linspace(0.1, 3, k)  # > 64 rows: several work items
    all_rows = q8_linear(x, blocks, fmt, n, k)
    for rows in (slice(5, 6), slice(100, 117), slice(250, 300)):
        assert torch.equal(all_rows[rows], q8_linear(x[rows], blocks, fmt, n, k))


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_int8_activations_stay_close_to_the_float_matmul(fmt):
    """The only approximation: x rounded to 8 bits per block of 32. Its error
    per product is at most dx / 2; summed over K it stays far below the
    size of the outputs."""
    n, k = 64, 1536
    blocks = random_blocks(fmt, n, k, seed=5)
    weight = torch.ops.sluice_cpu.dequantize(torch.from_numpy(blocks).reshape(-1), FORMATS[fmt], n, k)
    x = randn(4, k, seed=6)
    got = q8_linear(x, blocks, fmt, n, k)
    exact = x @ weight.T
    rel = (got - exact).norm() / exact.norm()
    assert rel < 0.01, f"relative error {rel:.4f}"


def test_pack_and_linear_reject_mismatched_shapes():
    blocks = torch.from_numpy(random_blocks("Q4_1", 4, 64, seed=3)).reshape(-1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.sluice_cpu.q8_pack(blocks, 0, 4, 48)
    with pytest.raises(RuntimeError, match="must be contiguous uint8"):
        torch.ops.sluice_cpu.q8_pack(blocks, 0, 8, 64)
    packed = torch.ops.sluice_cpu.q8_pack(blocks, 0, 4, 64)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.sluice_cpu.q8_linear(randn(1, 128), packed, 0, 4)
    with pytest.raises(RuntimeError, match="format must be"):
        torch.ops.sluice_cpu.q8_linear(randn(1, 64), packed, 7, 4)

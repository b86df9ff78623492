"""The matmuls on GGUF blocks (`csrc/cpu_q8_linear.cpp`), for every kernel
this host can run (AVX-512 VNNI, AVX-VNNI, AVX2, and the portable C++ that
every host runs) and every block type and record layout, in both arithmetics
on the same packed records:

- int8 activations (`q8_linear`) against a plain-torch reference of the same
  arithmetic;
- float activations (`exact_linear`, the --dtype float32 path) against the
  float matmul with the expanded weight, which it must hold bit for bit.

The kernels differ from their reference only in float summation order, and a
row's result does not depend on the other rows of its matmul.

The blocks' unpacking into (sw, cw, wq) (gguf_blocks.py) is checked
against the gguf package's dequantizer first. The reference
(`reference_q8_linear`) spells the arithmetic out: each row of x is quantized
per block of 32 (dx = max|x| / 127, xq = round(x / dx)), and

    y[r, n] = sum_b  sw * dx * dot(wq, xq)  +  cw * dx * sum(xq)

It is checked in turn against the float matmul: the int8 rounding of x is the
only difference, bounded here by a tolerance from its size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice_kernels import cpu_kernels, gguf_blocks

from .kernel_cases import random_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")

# Every type the kernel reads, and the record layout each gets alone
# (0: 4-bit weights, fp16 scales; 1: 8-bit, fp16; 2: 4-bit, fp32; 3: 8-bit,
# fp32; 4: 8-bit, a fp32 scale pair per 16 weights; 5, 6: the K-quant
# super-block layouts, Q4_K's and Q6_K's own fields).
LAYOUTS = {"Q4_0": 0, "Q4_1": 0, "Q5_0": 1, "Q5_1": 1, "Q8_0": 1, "Q4_K": 5, "Q5_K": 3, "Q6_K": 6}
# The per-block layout each K-quant type gets where it cannot have its own
# (a layer mixing it with other types): the same values, other records.
PER_BLOCK = {"Q4_K": gguf_blocks.U4_F32, "Q6_K": gguf_blocks.U8_HALVES}
# Each kernel is forced by its isa code, the portable one too, so every path
# this CPU has runs here (conftest.py reports which ran, and fails the run
# when no SIMD path did).
ALL_ISAS = sorted(cpu_kernels.ISA_NAMES)


def isa_param(code: int):
    marks = [pytest.mark.isa(cpu_kernels.ISA_NAMES[code])]
    if cpu_kernels.loaded() and code not in cpu_kernels.host_isas():
        reason = f"this CPU lacks the instructions of the {cpu_kernels.ISA_NAMES[code]} kernel"
        marks.append(pytest.mark.skip(reason=reason))
    return pytest.param(code, id=cpu_kernels.ISA_NAMES[code], marks=marks)


def records(fmt: str, n: int, k: int, seed: int) -> gguf_blocks.Records:
    return gguf_blocks.unpack(fmt, random_blocks(fmt, n, k, seed), k)


def reference_quantize(x: torch.Tensor):
    """x [M, K] -> (xq [M, K] int64, dx [M, K/32] float64): round half to even."""
    m, k = x.shape
    blocks = x.double().view(m, k // 32, 32)
    amax = blocks.abs().amax(-1)
    dx = (amax.float() / 127.0).double()
    inv = torch.where(amax > 0, (127.0 / amax.float()).double(), torch.zeros_like(amax))
    xq = torch.round((blocks.float() * inv.float().unsqueeze(-1))).long()
    return xq.view(m, k), dx


def reference_q8_linear(x: torch.Tensor, w: gguf_blocks.Records) -> torch.Tensor:
    """Per run of 16 weights (the records' scale granularity; x's scale is per 32)."""
    m, k = x.shape
    n, runs = w.sw.shape
    sw, cw = torch.from_numpy(w.sw).double(), torch.from_numpy(w.cw).double()
    wq = torch.from_numpy(w.wq.astype(np.int64))
    xq, dx = reference_quantize(x)
    dx = dx.repeat_interleave(2, dim=1)
    dots = torch.einsum("mbj,nbj->mnb", xq.view(m, runs, 16).double(), wq.view(n, runs, 16).double())
    sx = dx * xq.view(m, runs, 16).sum(-1).double()
    y = (dots * sw.unsqueeze(0) * dx.unsqueeze(1)).sum(-1) + sx @ cw.T
    return y.float()


def q8_linear(x, w: gguf_blocks.Records, layout: int, isa: int = 0) -> torch.Tensor:
    return torch.ops.sluice_cpu.q8_linear(x, gguf_blocks.pack(w, layout), layout, w.wq.shape[0], isa)


def exact_linear(x, w: gguf_blocks.Records, layout: int, isa: int = 0) -> torch.Tensor:
    return torch.ops.sluice_cpu.exact_linear(x, gguf_blocks.pack(w, layout), layout, w.wq.shape[0], isa)


def assert_float_matmul(got: torch.Tensor, x: torch.Tensor, w: gguf_blocks.Records) -> None:
    """got equals x @ W.T up to float32 summation, in whatever order: each
    output within K * 2^-24 * sum_j |x_j w_j| of the exact sum (the standard
    bound for K - 1 additions), plus the final rounding."""
    weight = torch.from_numpy(w.expand()).double()
    exact = x.double() @ weight.T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ weight.abs().T) + 2.0**-24 * exact.abs()
    excess = (got.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"beyond the summation bound by up to {excess.max().item():.3g}"


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


@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
def test_unpacked_blocks_are_the_gguf_packages_weights(fmt):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = 9, 512
    blocks = random_blocks(fmt, n, k, seed=4)
    w = gguf_blocks.unpack(fmt, blocks, k)
    assert np.array_equal(w.expand(), dequantize(blocks, GGMLQuantizationType[fmt]).reshape(n, k))
    assert w.wq.max() < (16 if fmt in gguf_blocks.FOUR_BIT else 256)
    assert gguf_blocks.layout({fmt}, w) == LAYOUTS[fmt]


@pytest.mark.parametrize("isa", [isa_param(c) for c in ALL_ISAS])
@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
# Rows: single decodes, register-tile remainders, and more than one row item (64).
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 70])
def test_kernels_match_the_reference(isa, fmt, rows):
    n, k = 45, 512  # 45: a partial group of 16 outputs
    w = records(fmt, n, k, seed=rows)
    x = randn(rows, k + 64, seed=2)[:, :k]  # strided rows
    got = q8_linear(x, w, LAYOUTS[fmt], isa)
    want = reference_q8_linear(x.contiguous(), w)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


# Where each type's quants sit in its block (set to 0xFF, every weight is at
# its type's largest value: 15, or 63 for Q6_K).
QUANT_BYTES = {"Q4_0": slice(2, 18), "Q4_1": slice(4, 20), "Q4_K": slice(16, 144), "Q6_K": slice(0, 192),
               "Q8_0": slice(2, 34)}
# (type, the byte every weight byte is set to, the wq that gives): the
# largest 4- and 6-bit weights, and Q8_0's int8 -128 and 127 (wq 0 and 255,
# the AVX2 kernel's |wq - 128| at 128 and 127).
EXTREMES = [("Q4_0", 0xFF, 15), ("Q4_1", 0xFF, 15), ("Q4_K", 0xFF, 15), ("Q6_K", 0xFF, 63),
            ("Q8_0", 0x80, 0), ("Q8_0", 0x7F, 255)]


@pytest.mark.parametrize("isa", [isa_param(c) for c in ALL_ISAS])
@pytest.mark.parametrize("fmt,fill,wq", EXTREMES)
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("rows", [1, 40])  # 40: past both K-quant layouts' expansion thresholds
def test_the_largest_weights_and_activations_stay_exact(isa, fmt, fill, wq, sign, rows):
    """Largest weights times activations of +-127: the AVX2 kernel keeps
    PMADDUBSW's sums in 16 bits (all 8 chunks of a 4-bit block, two of a
    6-bit one; one chunk of 8-bit weights, as |wq - 128| times x with wq's
    sign), which must then be at their largest without wrapping."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    n, k = 32, 512
    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    blocks = random_blocks(fmt, n, k, seed=3).reshape(n, k // values, size)
    blocks[..., QUANT_BYTES[fmt]] = fill
    w = gguf_blocks.unpack(fmt, np.ascontiguousarray(blocks.reshape(n, -1)), k)
    assert (w.wq == wq).all()
    x = torch.full((rows, k), float(sign))
    got = q8_linear(x, w, LAYOUTS[fmt], isa)
    torch.testing.assert_close(got, reference_q8_linear(x, w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("isa", [isa_param(c) for c in ALL_ISAS])
@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 17, 70])
def test_exact_kernels_match_the_float_matmul(isa, fmt, rows):
    n, k = 45, 512
    w = records(fmt, n, k, seed=rows)
    x = randn(rows, k + 64, seed=2)[:, :k]  # strided rows
    assert_float_matmul(exact_linear(x, w, LAYOUTS[fmt], isa), x, w)


@pytest.mark.parametrize("isa", [isa_param(c) for c in ALL_ISAS])
@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
def test_exact_kernels_expand_the_weight_bit_for_bit(isa, fmt):
    """One-hot rows pick single weights out of the sums (every other product
    is a zero): what comes out is the expansion itself, which must equal the
    gguf package's dequantized weight exactly."""
    n, k = 45, 256
    w = records(fmt, n, k, seed=9)
    assert torch.equal(exact_linear(torch.eye(k), w, LAYOUTS[fmt], isa), torch.from_numpy(w.expand()).T)


def mixed_layers():
    """Q4_K_M files mix types within a layer (q/k and v of one attention):
    the records of all of them in a layout that holds every type's."""
    for types, want in ((("Q4_K", "Q8_0", "Q5_0"), 3), (("Q4_K", "Q6_K", "Q8_0"), 4)):
        parts = [records(t, 8 + 5 * i, 512, seed=i) for i, t in enumerate(types)]
        w = gguf_blocks.Records(*(np.concatenate(a) for a in zip(*((p.sw, p.cw, p.wq) for p in parts))))
        layout = gguf_blocks.layout(set(types), w)
        assert layout == want
        yield w, layout


@pytest.mark.parametrize("isa", [isa_param(c) for c in ALL_ISAS])
def test_a_layer_of_mixed_types(isa):
    x = randn(3, 512, seed=8)
    for w, layout in mixed_layers():
        torch.testing.assert_close(q8_linear(x, w, layout, isa), reference_q8_linear(x, w), rtol=2e-5, atol=2e-5)
        assert_float_matmul(exact_linear(x, w, layout, isa), x, w)


@pytest.mark.parametrize("linear", [q8_linear, exact_linear], ids=["int8", "exact"])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_a_row_does_not_depend_on_the_other_rows(fmt, linear):
    n, k = 77, 1536
    w = records(fmt, n, k, seed=11)
    x = randn(300, k, seed=12) * torch.linspace(0.1, 3, k)  # > 256 rows: several work items
    all_rows = linear(x, w, LAYOUTS[fmt])
    for rows in (slice(5, 6), slice(100, 117), slice(250, 300)):
        assert torch.equal(all_rows[rows], linear(x[rows], w, LAYOUTS[fmt]))


@pytest.mark.parametrize("linear", [q8_linear, exact_linear], ids=["int8", "exact"])
@pytest.mark.parametrize("n", [16, 40, 1000])  # one group of outputs (fewer than the threads), 3, 63
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_the_threads_share_the_work_items_whatever_their_number(linear, n, rows):
    """Items go to the threads in ranges that a thread done early takes from
    at the far end: every output is computed once and is the same bits with
    1, 2 or 3 threads (a lost chunk leaves the output's uninitialized memory;
    the one-thread result is checked against the reference by the tests above)."""
    w = records("Q4_K", n, 512, seed=13)
    x = randn(rows, 512, seed=14)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = linear(x, w, LAYOUTS["Q4_K"])
        for t in (2, 3):
            torch.set_num_threads(t)
            for _ in range(5):
                assert torch.equal(linear(x, w, LAYOUTS["Q4_K"]), want), t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
def test_int8_activations_stay_close_to_the_float_matmul(fmt):
    """The only approximation: x rounded to 8 bits per block of 32. Its error
    per product is at most dx / 2; summed over K it stays far below the
    size of the outputs."""
    n, k = 64, 1536
    w = records(fmt, n, k, seed=5)
    x = randn(4, k, seed=6)
    got = q8_linear(x, w, LAYOUTS[fmt])
    exact = x @ torch.from_numpy(w.expand()).T
    rel = (got - exact).norm() / exact.norm()
    assert rel < 0.01, f"relative error {rel:.4f}"


@pytest.mark.parametrize("isa", [isa_param(c) for c in ALL_ISAS])
@pytest.mark.parametrize("fmt", sorted(PER_BLOCK))
# 32 rows and more: the AVX-512 kernel expands each group's super-blocks
# first; up to 31 rows read them directly (16: two whole tiles of 8);
# 17/33/70: tile remainders, 70 also in two items.
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 70])
def test_super_block_layouts_give_the_per_block_layouts_results(isa, fmt, rows):
    """U4_K / U6_K form each block's scale pair from the super-block's d and
    6- or 8-bit scales inside the kernel: exactly the float32 pair the
    per-block layouts store, so both arithmetics give the same bits. Except
    one: the SIMD int8 kernels take Q6_K's constant 32 off inside their
    integer dot products (U8_HALVES has a general cw per half, summed in
    float32 against x's sums): the two differ by float32 rounding, and U6_K's
    result is the nearer to the exact one, as it cancels in integers."""
    n, k = 45, 768
    w = records(fmt, n, k, seed=rows)
    x = randn(rows, k, seed=3)
    for linear in (q8_linear, exact_linear):
        got, per_block = linear(x, w, LAYOUTS[fmt], isa), linear(x, w, PER_BLOCK[fmt], isa)
        if fmt == "Q6_K" and linear is q8_linear and cpu_kernels.ISA_NAMES[isa] != "portable":
            want = reference_q8_linear(x, w)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            assert (got - want).norm() < (per_block - want).norm()
        else:
            assert torch.equal(got, per_block)


@pytest.mark.parametrize("fmt", sorted(PER_BLOCK))
def test_super_block_layouts_hold_about_the_files_bytes(fmt):
    n, k = 64, 2048
    w = records(fmt, n, k, seed=1)
    file_bytes = n * k // 256 * gguf_blocks.BLOCK_BYTES[fmt]
    packed = gguf_blocks.pack(w, LAYOUTS[fmt]).numel()
    # Q4_K: 2 bytes more per 32 weights (the scale pair unpacked to bytes), d and dmin per 16 rows' super-block.
    assert packed <= 1.03 * file_bytes, (packed, file_bytes)
    assert packed < 0.8 * gguf_blocks.pack(w, PER_BLOCK[fmt]).numel()


def test_k_quant_fields_survive_row_order_and_stacking():
    a, b = records("Q4_K", 16, 256, seed=1), records("Q4_K", 21, 256, seed=2)
    order = np.arange(21)[::-1]
    stacked = gguf_blocks.Records.concat([a, b.take(order)])
    assert stacked.kquant == "Q4_K" and gguf_blocks.layout({"Q4_K"}, stacked) == gguf_blocks.U4_K
    x = randn(3, 256, seed=4)
    want = torch.cat([q8_linear(x, a, gguf_blocks.U4_F32), q8_linear(x, b, gguf_blocks.U4_F32)[:, order.copy()]], 1)
    assert torch.equal(q8_linear(x, stacked, gguf_blocks.U4_K), want)
    mixed = gguf_blocks.Records.concat([a, records("Q6_K", 16, 256, seed=3)])
    assert mixed.kquant is None and gguf_blocks.layout({"Q4_K", "Q6_K"}, mixed) == gguf_blocks.U8_HALVES
    with pytest.raises(ValueError, match="holds Q4_K records only"):
        gguf_blocks.pack(mixed, gguf_blocks.U4_K)


def test_super_block_layouts_need_whole_super_blocks():
    w = records("Q4_K", 16, 512, seed=1)
    packed = gguf_blocks.pack(w, gguf_blocks.U4_K)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.sluice_cpu.q8_linear(randn(1, 288), packed, gguf_blocks.U4_K, 16)


def test_pack_and_linear_reject_mismatched_shapes():
    w = records("Q4_1", 4, 64, seed=3)
    sw, cw, wq = (torch.from_numpy(a) for a in (w.sw, w.cw, w.wq))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.sluice_cpu.q8_pack(sw, cw, wq[:, :48].contiguous(), 0)
    with pytest.raises(RuntimeError, match="must be contiguous float32"):
        torch.ops.sluice_cpu.q8_pack(sw[:2], cw, wq, 0)
    with pytest.raises(RuntimeError, match="must be contiguous float32"):  # one pair per 32, not 16
        torch.ops.sluice_cpu.q8_pack(sw[:, ::2].contiguous(), cw[:, ::2].contiguous(), wq, 4)
    with pytest.raises(RuntimeError, match="layout must be"):
        torch.ops.sluice_cpu.q8_pack(sw, cw, wq, 5)
    packed = gguf_blocks.pack(w, 0)
    for linear in (torch.ops.sluice_cpu.q8_linear, torch.ops.sluice_cpu.exact_linear):
        with pytest.raises(RuntimeError, match="does not match"):
            linear(randn(1, 128), packed, 0, 4)
        with pytest.raises(RuntimeError, match="does not match"):
            linear(randn(1, 64), packed, 2, 4)
        with pytest.raises(RuntimeError, match="multiple of 32"):
            linear(randn(1, 48), packed, 0, 4)
    with pytest.raises(RuntimeError, match="format must be"):
        torch.ops.sluice_cpu.q8_linear(randn(1, 64), packed, 7, 4)


def test_the_dot_product_rate_is_measured_on_this_host():
    """benchmarks/step_bench.py's int8 limit: a rate on any host with a SIMD
    kernel, and a clear refusal of a count that measures nothing."""
    rate = torch.ops.sluice_cpu.q8_dot_peak(10_000)
    simd = set(cpu_kernels.host_isas()) - {1}  # 1: the portable kernel, which has no such loop
    assert (rate > 1e9) if simd else rate == 0.0
    with pytest.raises(RuntimeError, match="iterations must be positive"):
        torch.ops.sluice_cpu.q8_dot_peak(0)

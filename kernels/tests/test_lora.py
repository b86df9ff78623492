"""LoRA's grouped matmul: the C++ kernel and the Triton kernel (under the
interpreter without a GPU) against `lora_apply_reference`, which is itself
checked against each row's own update computed densely. Irregular shapes:
fused pieces of unequal size, ranks below the stacks' R and 0 (a piece the
adapter leaves alone), an input size no power of two, segments of 1 row and
of more rows than a tile, base-model rows between them. The C++ kernel's
stacks may be bfloat16 (--lora-dtype): it then equals the reference on the
stacks rounded to bfloat16, its sums still float32."""

from __future__ import annotations

import pytest
import torch

from sluice_kernels import cpu_kernels
from sluice_kernels.lora import (
    check_rows,
    cpu_bfloat16_products,
    lora_apply_cpu,
    lora_apply_reference,
    lora_dims,
    lora_pack_cpu,
    lora_write_cpu_,
)

from .kernel_cases import TOLERANCES, device

S, R, IN = 3, 8, 70
BOUNDS = [0, 24, 31, 37]  # three pieces: 24, 7 and 6 output rows
RANKS = [[8, 0, 8], [3, 3, 3], [0, 0, 0]]  # slot 2 holds nothing
# Segments [start, end) on a slot; rows 0, 6, 7 and 29.. are the base model's.
SEGMENTS = [(1, 2, 1), (2, 6, 0), (8, 29, 1)]
ROWS = 31


def case(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(S, len(BOUNDS) - 1, R, IN, generator=g) / IN**0.5
    b = torch.randn(S, BOUNDS[-1], R, generator=g)
    for s, ranks in enumerate(RANKS):  # what loading leaves past a piece's rank
        for p, r in enumerate(ranks):
            a[s, p, r:] = 0
            b[s, BOUNDS[p] : BOUNDS[p + 1], r:] = 0
    x = torch.randn(ROWS, IN, generator=g)
    y = torch.randn(ROWS, BOUNDS[-1], generator=g)
    scales = torch.tensor([0.5, 2.0, 0.0])
    return [t.to(dtype) for t in (y, x, a, b)] + [scales]


def index_tensors(dev):
    starts, ends, slots = (torch.tensor([seg[i] for seg in SEGMENTS], dtype=torch.int32, device=dev) for i in range(3))
    bounds = torch.tensor(BOUNDS, dtype=torch.int32, device=dev)
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=dev)
    return bounds, starts, ends, slots, ranks


def reference(y, x, a, b, scales, products=None):
    out = y.clone()
    lora_apply_reference(
        out, x, a, b, BOUNDS, [s[0] for s in SEGMENTS], [s[1] for s in SEGMENTS], [s[2] for s in SEGMENTS],
        RANKS, scales, products,
    )
    return out


def test_reference_is_each_rows_own_update():
    y, x, a, b, scales = case(torch.float64)
    want = y.clone()
    for start, end, s in SEGMENTS:
        for t in range(start, end):
            for p in range(len(BOUNDS) - 1):
                lo, hi = BOUNDS[p], BOUNDS[p + 1]
                want[t, lo:hi] += scales[s].double() * (b[s, lo:hi] @ (a[s, p] @ x[t]))
    torch.testing.assert_close(reference(y, x, a, b, scales), want, atol=1e-12, rtol=1e-12)
    # Base-model rows are untouched, adapter rows changed.
    got = reference(y, x, a, b, scales)
    assert torch.equal(got[[0, 6, 7, 29, 30]], y[[0, 6, 7, 29, 30]])
    assert not torch.allclose(got[2:6], y[2:6])


STACK_DTYPES = pytest.mark.parametrize("stacks", [torch.float32, torch.bfloat16])


def rounded(t: torch.Tensor, stacks: torch.dtype) -> torch.Tensor:
    """t as the kernel reads it from stacks of `stacks` (float32 values)."""
    return t.to(stacks).float()


def products(stacks: torch.dtype) -> torch.dtype | None:
    """What the C++ kernel rounds x and h to on stacks of `stacks`: bfloat16
    where this CPU multiplies bfloat16 stacks in pairs, else nothing."""
    return torch.bfloat16 if stacks == torch.bfloat16 and cpu_bfloat16_products() else None


def assert_kernel_close(got: torch.Tensor, want: torch.Tensor, y: torch.Tensor, stacks: torch.dtype) -> None:
    """got equals the reference `want` (y plus the updates) to float32's
    precision; where x and h are rounded to bfloat16, an h that the two round
    to neighbouring values moves its outputs by up to bfloat16's step, so
    there the bound is 2^-7 of the largest update."""
    if products(stacks) is None:
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
    else:
        assert (got - want).abs().max() <= 2**-7 * (want - y).abs().max()


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels not built")
@STACK_DTYPES
def test_cpu_kernel_matches_the_reference(stacks):
    y, x, a, b, scales = case(torch.float32, seed=1)
    want = reference(y, x, rounded(a, stacks), rounded(b, stacks), scales, products(stacks))
    packed = lora_pack_cpu(a, b, stacks)
    assert all(t.dtype == stacks for t in packed)
    got = y.clone()
    lora_apply_cpu(got, x, *packed, *index_tensors("cpu"), scales)
    assert_kernel_close(got, want, y, stacks)


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels not built")
def test_bfloat16_pairs_widened_are_the_float32_arithmetic_on_rounded_stacks():
    """Without AVX512-BF16 (asked for here on any CPU) the pairs of
    bfloat16 stacks are widened exactly and multiplied in float32: the
    float32 kernel's result on the stacks rounded to bfloat16, bit for bit.
    With it (where the CPU has it), x and h are rounded to bfloat16 too."""
    y, x, a, b, scales = case(torch.float32, seed=3)
    exact = y.clone()
    lora_apply_cpu(exact, x, *lora_pack_cpu(rounded(a, torch.bfloat16), rounded(b, torch.bfloat16)),
                   *index_tensors("cpu"), scales)
    widened = y.clone()
    lora_apply_cpu(widened, x, *lora_pack_cpu(a, b, torch.bfloat16), *index_tensors("cpu"), scales,
                   pair_products=False)
    assert torch.equal(widened, exact)
    if cpu_bfloat16_products():
        paired = y.clone()
        lora_apply_cpu(paired, x, *lora_pack_cpu(a, b, torch.bfloat16), *index_tensors("cpu"), scales,
                       pair_products=True)
        want = reference(y, x, rounded(a, torch.bfloat16), rounded(b, torch.bfloat16), scales, torch.bfloat16)
        assert not torch.equal(paired, exact)
        assert_kernel_close(paired, want, y, torch.bfloat16)
    else:
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            lora_apply_cpu(y.clone(), x, *lora_pack_cpu(a, b, torch.bfloat16), *index_tensors("cpu"), scales,
                           pair_products=True)


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels not built")
def test_bfloat16_stacks_are_half_the_bytes_and_close_to_float32():
    """The rounding of bfloat16 stacks is the whole difference: the update
    moves by about bfloat16's relative precision (2^-8) of its size."""
    y, x, a, b, scales = case(torch.float32, seed=6)
    full, half = lora_pack_cpu(a, b), lora_pack_cpu(a, b, torch.bfloat16)
    assert [t.nbytes for t in half] == [t.nbytes // 2 for t in full]
    exact, got = y.clone(), y.clone()
    lora_apply_cpu(exact, x, *full, *index_tensors("cpu"), scales)
    lora_apply_cpu(got, x, *half, *index_tensors("cpu"), scales)
    update = (exact - y).abs().max()
    assert update > 0
    assert 0 < (got - exact).abs().max() <= 2**-7 * update


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels not built")
@STACK_DTYPES
def test_cpu_kernel_at_model_shapes_and_many_rows(stacks):
    """Shapes past the small case's blocks: several chunks of inputs (one
    partial), ranks over two panels (R = 24: a rank of 20 and one of 16),
    output blocks that straddle pieces and a partial last block, segments
    longer than a block of rows; and a row's update does not depend on the
    other rows of the step."""
    g = torch.Generator().manual_seed(5)
    S, R, IN, bounds = 3, 24, 600, [0, 100, 164, 300]
    ranks = [[20, 16, 0], [0, 7, 24], [5, 5, 5]]
    a = torch.randn(S, 3, R, IN, generator=g) / IN**0.5
    b = torch.randn(S, bounds[-1], R, generator=g)
    for s, row in enumerate(ranks):
        for p, r in enumerate(row):
            a[s, p, r:] = 0
            b[s, bounds[p] : bounds[p + 1], r:] = 0
    rows = 150
    x = torch.randn(rows, IN, generator=g)
    y = torch.randn(rows, bounds[-1], generator=g)
    scales = torch.tensor([0.5, 2.0, 1.5])
    segments = [(0, 70, 1), (70, 71, 0), (75, 150, 2)]
    want = y.clone()
    lora_apply_reference(want, x, rounded(a, stacks), rounded(b, stacks), bounds,
                         *([seg[i] for seg in segments] for i in range(3)), ranks, scales, products(stacks))
    index = [torch.tensor([seg[i] for seg in segments], dtype=torch.int32) for i in range(3)]
    packed = lora_pack_cpu(a, b, stacks)
    got = y.clone()
    lora_apply_cpu(got, x, *packed, torch.tensor(bounds, dtype=torch.int32), *index,
                   torch.tensor(ranks, dtype=torch.int32), scales)
    assert_kernel_close(got, want, y, stacks)
    alone = y[70:71].clone()
    lora_apply_cpu(alone, x[70:71], *packed, torch.tensor(bounds, dtype=torch.int32),
                   *(torch.tensor([v], dtype=torch.int32) for v in (0, 1, 0)), torch.tensor(ranks, dtype=torch.int32),
                   scales)
    assert torch.equal(alone, got[70:71])


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels not built")
@STACK_DTYPES
def test_cpu_kernel_rows_are_the_same_in_every_plan_and_thread_count(stacks):
    """The kernel spreads a call over the threads in one loop (items of a
    segment's rows, both phases each) or in two (shrink, then expand), by
    the call's rows and the threads (cpu_lora.cpp): a row's update is
    bitwise the same in every case. The calls here: decode-like steps of 8
    rows on one adapter, of 2 rows on each of 4 adapters, a row alone, and
    a 150-row step, each at 1 and 2 threads."""
    g = torch.Generator().manual_seed(9)
    S, R, IN, bounds = 4, 16, 450, [0, 96, 128, 200]
    a = torch.randn(S, 3, R, IN, generator=g) / IN**0.5
    b = torch.randn(S, bounds[-1], R, generator=g)
    ranks = torch.tensor([[16, 16, 16], [8, 0, 16], [16, 4, 4], [1, 16, 9]], dtype=torch.int32)
    for s, row in enumerate(ranks.tolist()):
        for p, r in enumerate(row):
            a[s, p, r:] = 0
            b[s, bounds[p] : bounds[p + 1], r:] = 0
    packed = lora_pack_cpu(a, b, stacks)
    bounds_t, scales = torch.tensor(bounds, dtype=torch.int32), torch.tensor([0.5, 2.0, 1.5, 1.0])
    rows = 150
    x = torch.randn(rows, IN, generator=g)
    y = torch.randn(rows, bounds[-1], generator=g)

    def run(first: int, segments: list[tuple[int, int, int]]) -> torch.Tensor:
        """Rows first.. of x through one call whose segments are given in those rows' numbering."""
        end = max(e for _, e, _ in segments)
        out = y[first : first + end].clone()
        index = [torch.tensor([seg[i] for seg in segments], dtype=torch.int32) for i in range(3)]
        lora_apply_cpu(out, x[first : first + end], *packed, bounds_t, *index, ranks, scales)
        return out

    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            whole = run(0, [(0, 70, 1), (70, 71, 0), (75, 150, 2), (150, 150, 3)])
            one_adapter = run(8, [(0, 8, 2)])
            four_adapters = run(0, [(0, 2, 3), (2, 4, 1), (4, 6, 0), (6, 8, 2)])
            for i in range(8):  # each row alone: a segment of one row
                slot = [3, 3, 1, 1, 0, 0, 2, 2][i]
                assert torch.equal(run(i, [(0, 1, slot)]), four_adapters[i : i + 1]), (t, i)
                assert torch.equal(run(8 + i, [(0, 1, 2)]), one_adapter[i : i + 1]), (t, i)
            for i in (0, 37, 69, 70, 100, 149):
                slot = 1 if i < 70 else 0 if i == 70 else 2
                assert torch.equal(run(i, [(0, 1, slot)]), whole[i : i + 1]), (t, i)
            assert torch.equal(whole[71:75], y[71:75])  # rows of no segment are left alone
    finally:
        torch.set_num_threads(threads)


@STACK_DTYPES
def test_packed_writes_match_packing_the_stacks(stacks):
    """lora_write_cpu_ (one slot's piece at a time, as adapters load) gives
    the bytes lora_pack_cpu gives for the whole stacks."""
    y, x, a, b, scales = case(torch.float32, seed=4)
    want_a, want_b = lora_pack_cpu(a, b, stacks)
    got_a, got_b = torch.zeros_like(want_a), torch.zeros_like(want_b)
    for s, ranks in enumerate(RANKS):
        for p, r in enumerate(ranks):
            lo, hi = BOUNDS[p], BOUNDS[p + 1]
            lora_write_cpu_(got_a, got_b, s, p, lo, a[s, p, :r], b[s, lo:hi, :r])
    assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b)


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels not built")
def test_cpu_kernel_on_strided_rows_and_bad_inputs():
    """y and x may be views with strided rows (the qkv output is one); what
    does not fit the layout is refused with the reason, not read out of bounds."""
    y, x, a, b, scales = case(torch.float32, seed=2)
    wide_x = torch.zeros(ROWS, IN + 5)
    wide_x[:, 2 : 2 + IN] = x
    wide_y = torch.zeros(ROWS, BOUNDS[-1] + 3)
    wide_y[:, 1 : 1 + BOUNDS[-1]] = y
    pa, pb = lora_pack_cpu(a, b)
    lora_apply_cpu(wide_y[:, 1 : 1 + BOUNDS[-1]], wide_x[:, 2 : 2 + IN], pa, pb, *index_tensors("cpu"), scales)
    torch.testing.assert_close(wide_y[:, 1 : 1 + BOUNDS[-1]], reference(y, x, a, b, scales), **TOLERANCES[torch.float32])
    bounds, starts, ends, slots, ranks = index_tensors("cpu")
    with pytest.raises(ValueError, match="inside the 31 rows"):
        lora_apply_cpu(y, x, pa, pb, bounds, starts, ends + 5, slots, ranks, scales)
    with pytest.raises(ValueError, match="is not below 3"):
        lora_apply_cpu(y, x, pa, pb, bounds, starts, ends, slots + 3, ranks, scales)
    with pytest.raises(ValueError, match="ranks must be in"):
        lora_apply_cpu(y, x, pa, pb, bounds, starts, ends, slots, ranks + R, scales)
    with pytest.raises(ValueError, match="int32"):
        lora_apply_cpu(y, x, pa, pb, bounds.long(), starts, ends, slots, ranks, scales)
    with pytest.raises(ValueError, match="lora_pack_cpu"):
        lora_apply_cpu(y, x, a, b, bounds, starts, ends, slots, ranks, scales)
    with pytest.raises(ValueError, match="share one dtype"):
        lora_apply_cpu(y, x, pa.bfloat16(), pb, bounds, starts, ends, slots, ranks, scales)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        lora_pack_cpu(a, b, torch.float16)


def test_check_rows_refuses_what_the_kernel_would_misread():
    """The per-call check of callers that check stacks and segments once:
    rows, widths, contiguous rows and (packed) float32."""
    y, x, a, b, scales = case(torch.float32, seed=7)
    dims = lora_dims(*lora_pack_cpu(a, b, torch.bfloat16), packed=True, out_features=BOUNDS[-1])
    check_rows(y, x, dims, ROWS, packed=True)
    for bad_y, bad_x, rows in ((y, x, ROWS - 1), (y[:, :-1], x, ROWS), (y, x.t().contiguous().t(), ROWS),
                               (y.double(), x, ROWS)):
        with pytest.raises(ValueError):
            check_rows(bad_y, bad_x, dims, rows, packed=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_the_reference(dtype):
    from sluice_kernels.triton.lora import lora_apply_triton

    dev = device()
    y, x, a, b, scales = case(dtype, seed=3)
    want = reference(y.float(), x.float(), a.float(), b.float(), scales)
    y, x, a, b, scales = (t.to(dev) for t in (y, x, a, b, scales))
    max_rows = max(end - start for start, end, _ in SEGMENTS)
    lora_apply_triton(y, x, a, b, *index_tensors(dev), scales, max_rows)
    # bfloat16: the inputs and the output are rounded; h stays float32.
    tolerance = TOLERANCES[dtype] if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(y.float().cpu(), want, **tolerance)

"""The grouped expert MLP (moe.py): the plain-torch reference against the
definition (token by token), the C++ kernel on block records
(`csrc/cpu_moe.cpp`) against the reference, for every instruction-set path
this host runs, both arithmetics, both activations, with and without biases,
on irregular shapes (one token, tokens on few experts, experts with none);
and MXFP4's records against its dequantization."""

from __future__ import annotations

import pytest
import torch

from sluice_kernels import cpu_kernels, gguf_blocks, moe

from .kernel_cases import random_blocks
from .test_cpu_q8_linear import ALL_ISAS, isa_param

# K-quant rows are 256 values: H and I are multiples.
E, H, I, K = 6, 256, 256, 3
SWIGLU = moe.Activation("swiglu_oai", alpha=1.702, limit=0.5)


def routing(tokens: int, seed: int, experts: int = E, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (ids [T, k] ascending per token, weights [T, k]); with few
    tokens most experts get none."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).sort(-1).values
    return ids, torch.rand(tokens, k, generator=g)


def naive(x, ids, weights, w13, w2, b13, b2, act) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = w13[e] @ x[t] + (0 if b13 is None else b13[e])
            out[t] += weights[t, j] * (w2[e] @ act(h.unsqueeze(0))[0] + (0 if b2 is None else b2[e]))
    return out


@pytest.mark.parametrize("act", [moe.Activation(), SWIGLU], ids=["silu", "swiglu_oai"])
@pytest.mark.parametrize("tokens", [1, 3, 29])
def test_reference_is_the_definition(act, tokens):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    ids, weights = routing(tokens, tokens)
    got = moe.expert_mlp_reference(x, ids, weights, w13, w2, b13, b2, act)
    torch.testing.assert_close(got, naive(x, ids, weights, w13, w2, b13, b2, act), atol=1e-4, rtol=1e-5)


def test_groups_cover_every_slot_once():
    ids, _ = routing(17, 0)
    groups = moe.group_by_expert(ids, E)
    assert groups.offsets[0] == 0 and groups.offsets[-1] == 17 * K
    assert sorted(groups.order.tolist()) == list(range(17 * K))
    for e, start, end in groups.active():
        assert torch.all(ids.reshape(-1)[groups.order[start:end]] == e)
        assert torch.equal(groups.tokens[start:end], groups.order[start:end] // K)


# --- the C++ kernel on block records --------------------------------------

def expert_records(fmt: str, rows: int, cols: int, seed: int) -> list[gguf_blocks.Records]:
    return [gguf_blocks.unpack(fmt, random_blocks(fmt, rows, cols, seed + e), cols) for e in range(E)]


def quantized_experts(fmt13: str, fmt2: str, int8: bool):
    """(QuantizedExperts, the float32 weights its records expand to)."""
    r13, r2 = expert_records(fmt13, 2 * I, H, 10), expert_records(fmt2, H, I, 20)
    (w13, f13), (w2, f2) = moe.pack_experts(r13, {fmt13}), moe.pack_experts(r2, {fmt2})
    dense13 = torch.stack([torch.from_numpy(r.expand()) for r in r13])
    dense2 = torch.stack([torch.from_numpy(r.expand()) for r in r2])
    return moe.QuantizedExperts(w13, w2, (f13, f2), I, int8), dense13, dense2


def per_expert_reference(blocks: moe.QuantizedExperts, x, ids, weights, b13, b2, act, isa: int) -> torch.Tensor:
    """The same arithmetic as the kernel from the tested one-matrix kernels,
    expert by expert: the grouped matmuls must give each row what its
    expert's q8_linear / exact_linear gives it alone."""
    linear = torch.ops.sluice_cpu.q8_linear if blocks.int8 else torch.ops.sluice_cpu.exact_linear
    groups = moe.group_by_expert(ids, E)
    xs = x[groups.tokens]
    rows = torch.empty(xs.shape[0], H)
    for e, start, end in groups.active():
        h = linear(xs[start:end].contiguous(), blocks.w13[e], blocks.formats[0], 2 * I, isa)
        h = h if b13 is None else h + b13[e]
        y = linear(act(h).contiguous(), blocks.w2[e], blocks.formats[1], H, isa)
        rows[start:end] = y if b2 is None else y + b2[e]
    return moe.combine(rows, groups, weights)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")
@pytest.mark.parametrize("isa", [isa_param(c) for c in ALL_ISAS])
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("act,bias", [(moe.Activation(), False), (SWIGLU, True)], ids=["silu", "swiglu_oai+bias"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_block_kernel_matches_its_reference(isa, int8, act, bias, tokens):
    blocks, dense13, dense2 = quantized_experts("Q4_K", "Q6_K", int8)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, H, generator=g)
    b13 = torch.randn(E, 2 * I, generator=g) * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if bias else None
    ids, weights = routing(tokens, tokens)
    got = torch.ops.sluice_cpu.moe_block_mlp(
        x, ids, weights, blocks.w13, blocks.formats[0], blocks.w2, blocks.formats[1], I, b13, b2,
        act.code, act.alpha, act.limit, int8, isa,
    )
    want = per_expert_reference(blocks, x, ids, weights, b13, b2, act, isa)
    # The matmuls are the same; the activation's exp may round differently.
    assert (got - want).norm() <= 1e-6 * want.norm()
    if not int8:  # exact: the float model with the expanded weights, up to the order of sums
        dense = moe.expert_mlp_reference(x, ids, weights, dense13, dense2, b13, b2, act)
        assert (got - dense).norm() <= 1e-5 * dense.norm()


@pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")
def test_block_kernel_row_results_do_not_depend_on_the_step():
    """A token's output is the same alone or among others (batch invariance)."""
    blocks, _, _ = quantized_experts("Q8_0", "Q4_0", int8=True)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(7))
    ids, weights = routing(9, 3)
    whole = blocks.mlp(x, ids, weights, None, None, moe.Activation())
    for t in (0, 4, 8):
        alone = blocks.mlp(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], None, None, moe.Activation())
        assert torch.equal(alone[0], whole[t])


@pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")
def test_block_kernel_refuses_an_expert_id_out_of_range():
    blocks, _, _ = quantized_experts("Q8_0", "Q8_0", int8=True)
    ids = torch.tensor([[0, 1, E]])
    with pytest.raises(RuntimeError, match=f"expert id {E} out of range"):
        blocks.mlp(torch.randn(1, H), ids, torch.ones(1, 3), None, None, moe.Activation())


# --- MXFP4 -----------------------------------------------------------------

def random_mxfp4(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 135, (rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_records_expand_to_the_dequantized_weight():
    blocks, scales = random_mxfp4(40, 96, 0)
    records = moe.mxfp4_records(blocks, scales)
    want = moe.dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(torch.from_numpy(records.expand()), want)
    # Two FP4 codes a byte, the earlier in the low nibble: 0x21 is codes 1 then 2, 0.5 then 1.0.
    one = moe.dequantize_mxfp4(torch.full((1, 1, 16), 0x21, dtype=torch.uint8), torch.tensor([[127]]), torch.float32)
    assert one[0, :4].tolist() == [0.5, 1.0, 0.5, 1.0]


@pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")
def test_mxfp4_experts_run_exactly_on_their_records():
    r13 = [moe.mxfp4_records(*random_mxfp4(2 * I, H, e)) for e in range(E)]
    r2 = [moe.mxfp4_records(*random_mxfp4(H, I, 50 + e)) for e in range(E)]
    (w13, f13), (w2, f2) = moe.pack_experts(r13, {"MXFP4"}), moe.pack_experts(r2, {"MXFP4"})
    blocks = moe.QuantizedExperts(w13, w2, (f13, f2), I, int8=False)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(1)) * 0.01
    ids, weights = routing(4, 1)
    dense13 = torch.stack([torch.from_numpy(r.expand()) for r in r13])
    dense2 = torch.stack([torch.from_numpy(r.expand()) for r in r2])
    want = moe.expert_mlp_reference(x, ids, weights, dense13, dense2, None, None, SWIGLU)
    assert (blocks.mlp(x, ids, weights, None, None, SWIGLU) - want).norm() <= 1e-5 * want.norm()

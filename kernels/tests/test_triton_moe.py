"""The Triton grouped expert MLP (triton/moe.py) against the plain-torch
reference, under Triton's interpreter on CPU (on the GPU where there is
one): one token, tokens on few experts, experts with none, biases, both
activations, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from sluice_kernels import moe
from sluice_kernels.triton.moe import align_tiles, fused_moe

from .kernel_cases import TOLERANCES
from .test_moe import routing


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_tiles_hold_one_expert_each():
    ids, _ = routing(11, 2, experts=5, k=2)
    rows, tile_expert = align_tiles(ids, 5, 4)
    flat = ids.reshape(-1)
    assert sorted(r for r in rows.tolist() if r >= 0) == list(range(22))
    for tile, expert in enumerate(tile_expert.tolist()):
        slots = [s for s in rows[tile * 4 : tile * 4 + 4].tolist() if s >= 0]
        assert slots and all(flat[s] == expert for s in slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,bias", [(moe.Activation(), False), (moe.Activation("swiglu_oai", limit=0.5), True)],
                         ids=["silu", "swiglu_oai+bias"])
@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (5, 4, 2), (33, 8, 3)])
def test_fused_moe_matches_the_reference(dtype, act, bias, tokens, experts, k):
    g = torch.Generator().manual_seed(tokens)
    h, i = 48, 40  # not powers of two: masked tails
    x = torch.randn(tokens, h, generator=g)
    w13, w2 = torch.randn(experts, 2 * i, h, generator=g) * 0.2, torch.randn(experts, h, i, generator=g) * 0.2
    b13 = torch.randn(experts, 2 * i, generator=g) if bias else None
    b2 = torch.randn(experts, h, generator=g) if bias else None
    ids, weights = routing(tokens, tokens, experts, k)
    to = lambda t: None if t is None else t.to(device(), dtype)  # noqa: E731
    got = fused_moe(to(x), ids.to(device()), to(weights), to(w13), to(w2), to(b13), to(b2), act)
    # The reference in the same dtype: its matmuls accumulate in float32 and
    # round each result to it, as the kernel stores h and y.
    cpu = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    want = moe.expert_mlp_reference(cpu(x), ids, cpu(weights), cpu(w13), cpu(w2), cpu(b13), cpu(b2), act)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want.float(), **TOLERANCES[dtype])

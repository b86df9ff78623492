"""Rows read out of the packed GGUF records (`QuantizedWeight.rows`, the
embedding lookup on the blocks: the C++ `block_rows`, and
`rows_reference` in plain torch) against `Records.expand`, the float32
weight the records stand for: bit for bit, in every record layout, for
irregular row counts (a last group of 16 that is not full) and repeated or
unordered ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice_kernels import cpu_kernels, gguf_blocks

from .kernel_cases import random_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")

LAYOUTS = {"Q4_0": 0, "Q4_1": 0, "Q5_0": 1, "Q5_1": 1, "Q8_0": 1, "Q4_K": 5, "Q5_K": 3, "Q6_K": 6}


def weight(records: gguf_blocks.Records, layout: int) -> gguf_blocks.QuantizedWeight:
    return gguf_blocks.QuantizedWeight(gguf_blocks.pack(records, layout), layout, len(records.wq), True, 1)


@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
def test_rows_are_the_expanded_weight_bit_for_bit(fmt):
    n, k = 45, 512
    records = gguf_blocks.unpack(fmt, random_blocks(fmt, n, k, 4), k)
    assert gguf_blocks.layout({fmt}, records) == LAYOUTS[fmt]
    ids = torch.tensor([44, 0, 17, 17, 31, 32, 3, 44])
    w = weight(records, LAYOUTS[fmt])
    want = torch.from_numpy(records.expand())[ids]
    for got in (w.rows(ids), w.rows_reference(ids)):
        assert got.dtype == torch.float32 and got.shape == (len(ids), k)
        assert torch.equal(got, want)


def test_rows_of_a_layer_of_mixed_types():
    """Q6_K beside Q8_0 and Q4_K: one scale pair per 16 weights (layout 4)."""
    types = ("Q4_K", "Q6_K", "Q8_0")
    parts = [gguf_blocks.unpack(t, random_blocks(t, 8 + 5 * i, 256, i), 256) for i, t in enumerate(types)]
    records = gguf_blocks.Records(*(np.concatenate(a) for a in zip(*((p.sw, p.cw, p.wq) for p in parts))))
    layout = gguf_blocks.layout(set(types), records)
    assert layout == gguf_blocks.U8_HALVES
    ids = torch.arange(len(records.wq)).flip(0)
    w = weight(records, layout)
    assert torch.equal(w.rows(ids), torch.from_numpy(records.expand())[ids])
    assert torch.equal(w.rows_reference(ids), torch.from_numpy(records.expand())[ids])


def test_rows_outside_the_weight_are_refused():
    records = gguf_blocks.unpack("Q4_1", random_blocks("Q4_1", 20, 64, 1), 64)
    for bad in (20, -1):
        with pytest.raises(RuntimeError, match="not below 20"):
            weight(records, 0).rows(torch.tensor([3, bad]))


def test_no_rows():
    records = gguf_blocks.unpack("Q4_1", random_blocks("Q4_1", 20, 64, 1), 64)
    assert weight(records, 0).rows(torch.empty(0, dtype=torch.long)).shape == (0, 64)

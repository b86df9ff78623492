"""The packed CPU linear (layers.linear) computes what F.linear computes, on
irregular shapes, through benchmarks/packed_linear.py's own comparison (so
the script that times the two layouts keeps running)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from sluice_server.layers.linear import can_pack_for_cpu

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "packed_linear.py"


def load_script():
    spec = importlib.util.spec_from_file_location("packed_linear", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_plain(dtype):
    if not can_pack_for_cpu(torch.empty(1, 1, dtype=dtype)):
        pytest.skip(f"this torch build cannot pack {dtype} weights (no oneDNN linear ops)")
    bench = load_script()
    shapes = [("a", 37, 19, 2), ("b", 5, 64, 1), ("c", 130, 7, 1)]
    results = bench.compare(shapes, rows=[1, 3, 17], dtype=dtype, repeats=1)
    assert [r["rows"] for r in results] == [1, 3, 17]
    assert all(r["plain_ms"] > 0 and r["packed_ms"] > 0 for r in results)


def test_shapes_of_a_llama_config():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=3, vocab_size=100)
    shapes = {name: (out, inp, n) for name, out, inp, n in load_script().model_shapes(config)}
    assert shapes == {"qkv_proj": (64 + 2 * 32, 64, 3), "o_proj": (64, 64, 3), "gate_up_proj": (192, 64, 3),
                      "down_proj": (64, 96, 3), "lm_head": (100, 64, 1)}


@pytest.mark.parametrize("rows", [40, 300])
def test_mlp_keeps_its_intermediate_in_the_packed_dtype(rows):
    """Dense bfloat16 weights under float32 activations (the CPU `auto` path
    above the block rows): in prefill-sized steps gate_up's output stays
    bfloat16 into the activation and down_proj (decode-sized ones keep
    float32), and the MLP returns float32 close to the float32 MLP."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from sluice_server.distributed import SINGLE
    from sluice_server.layers.linear import pack_linear_weights
    from sluice_kernels.ops import TorchOps
    from sluice_server.models.llama import LlamaMLP

    if not can_pack_for_cpu(torch.empty(1, 1, dtype=torch.bfloat16)):
        pytest.skip("this torch build cannot pack bfloat16 weights (no oneDNN linear ops)")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, mlp_bias=False)
    mlp = LlamaMLP(cfg, SINGLE, SimpleNamespace(ops=TorchOps()))
    g = torch.Generator().manual_seed(0)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.weight.data = torch.randn(layer.weight.shape, generator=g) * 0.1
    x = torch.randn(rows, 64, generator=g)
    want = mlp(x)
    seen = []
    act = mlp.act_mul
    mlp.act_mul = lambda h: seen.append(h.dtype) or act(h)
    pack_linear_weights(mlp, torch.bfloat16)
    got = mlp(x)
    from sluice_server.models.llama import MIN_ROWS_PACKED_DTYPE_MLP

    assert seen == [torch.bfloat16 if rows >= MIN_ROWS_PACKED_DTYPE_MLP else torch.float32]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)

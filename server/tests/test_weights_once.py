"""Weights once: a matrix served on its GGUF blocks holds no dense form the
plan never multiplies with, and one (counted) where it does.

    plan's row limit      a block-served layer holds        dense_copy_bytes
    ALL_ROWS              the blocks                        0
    below                 the blocks + one packed form      the packed forms

and the embedding looks its rows up in the blocks (the LM head's, when
tied), with no float32 table.
"""

from __future__ import annotations

import pytest
import torch

from sluice_kernels.cpu_matmuls import ALL_ROWS
from sluice_server.layers.linear import ColumnParallelLinear, blocks_take_every_step
from sluice_server.options import ShardOptions

from conftest import make_tiny_model
from test_gguf_files import decode_logits_match_transformers, pieces, with_blocks


@pytest.fixture
def kernels():
    from sluice_kernels import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip(f"GGUF blocks need the CPU kernels: {cpu_kernels.unavailable_reason()}")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def check_one_form_per_step_kind(runner) -> None:
    """Each block-served layer holds its blocks and at most one dense form,
    none where the blocks take every step; an embedding with blocks has no
    dense table (nor does the LM head tied to it); dense_copy_bytes counts
    exactly the dense forms held beside blocks, and weight_bytes is those,
    the blocks and the model's other parameters (norms)."""
    model = runner.model
    served = [m for m in pieces(runner).values() if m.quantized is not None]
    assert served
    copies = 0
    for module in served:
        assert module.weight.numel() == 0, module
        if blocks_take_every_step(module):
            assert module.packed is None, module
        else:
            assert module.packed is not None, module
            copies += nbytes([module.packed])
    embedding = model.model.embed_tokens
    if embedding.quantized is not None:
        served.append(embedding)
        assert embedding.weight.numel() == 0
        assert embedding.dense_shape == (model.config.vocab_size, model.config.hidden_size)
    assert runner.dense_copy_bytes == copies
    blocks = nbytes({id(t): t for m in served for t in m.quantized.tensors()}.values())
    others = nbytes({id(p): p for p in model.parameters()}.values())  # tied ones once; freed ones are empty
    assert runner.weight_bytes == blocks + copies + others


def test_bundled_gguf_holds_each_matrix_once_for_the_plan_it_runs(smollm2_dir, smollm2_gguf, kernels):
    """--dtype auto on the bundled Q4_1 model, with this host's plan (every
    step on the blocks with VNNI and no AMX; dense above a row limit
    elsewhere). With every step on the blocks the weights are the file's
    blocks and the norms: within 1.2x of the file."""
    from sluice_server.model_runner import ModelRunner

    runner = ModelRunner(smollm2_dir, dtype="auto")
    assert runner.model.model.embed_tokens.quantized is runner.model.lm_head.quantized  # tied: one set of blocks
    check_one_form_per_step_kind(runner)
    if runner.cpu_matmuls.block_rows >= ALL_ROWS:
        assert runner.dense_copy_bytes == 0
        assert runner.weight_bytes < 1.2 * smollm2_gguf.stat().st_size


@pytest.mark.parametrize("block_rows", [ALL_ROWS, 4])
def test_every_forward_path_runs_on_what_the_layers_hold(tmp_path, kernels, block_rows):
    """The exact block arithmetic (--dtype float32), so logits are
    transformers' to float32 rounding: blocks only (the dense weights
    freed), or blocks for <= 4 rows and packed float32 above; prefill and
    decodes through the model's forward and the C++ decoder."""
    from sluice_server.model_runner import ModelRunner

    # An untied head and embedding, each with its own blocks.
    folder = with_blocks(make_tiny_model(tmp_path / "m", "llama", seed=5), embedding=True)
    runner = ModelRunner(folder, dtype="float32", block_size=4, options=ShardOptions(cpu_block_rows=block_rows))
    assert all(m.quantized is not None for m in [*pieces(runner).values(), runner.model.model.embed_tokens])
    check_one_form_per_step_kind(runner)
    assert (runner.dense_copy_bytes == 0) == (block_rows >= ALL_ROWS)
    decode_logits_match_transformers(folder, runner)


def test_a_blocks_only_layer_names_what_it_cannot_multiply(tmp_path, kernels):
    from sluice_server.model_runner import ModelRunner

    folder = with_blocks(make_tiny_model(tmp_path / "m", "llama", seed=5))
    runner = ModelRunner(folder, dtype="float32", options=ShardOptions(cpu_block_rows=ALL_ROWS))
    layer = runner.model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, ColumnParallelLinear) and layer.weight.numel() == 0
    x = torch.randn(3, layer.input_size)
    assert torch.equal(layer(x), layer.quantized.linear(x))
    with pytest.raises(RuntimeError, match="GGUF blocks only.*bfloat16"):
        layer(x.bfloat16())

"""--max-weight-memory: the bytes a shard's weights may take (Info.weight_bytes).

    limit                                   the shard holds                  dense_copy_bytes
    unset, or >= blocks + the plan's copies  the plan as it is                the plan's copies
    below that, >= the blocks (and norms)    every step on the blocks         0
    below the blocks                        nothing: it refuses to start     -

The plan decides before any dense form of a block-served matrix is packed,
so a dropped copy is never made; the outputs are the same tokens, computed
on the blocks (the exact expansion under --dtype float32).
"""

from __future__ import annotations

import logging

import pytest

from sluice_kernels.cpu_matmuls import ALL_ROWS, EXACT_ROWS
from sluice_server.layers import embedding, linear
from sluice_server.options import ShardOptions

from conftest import Driver, make_tiny_model
from test_gguf_files import with_blocks
from test_weights_once import check_one_form_per_step_kind

# Longer than the exact path's row limit, so that the unlimited run's
# prefill multiplies the packed float32 copies and the limited one's the blocks.
PROMPT = [1, *range(200, 200 + 2 * EXACT_ROWS)]


@pytest.fixture
def kernels():
    from sluice_kernels import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip(f"GGUF blocks need the CPU kernels: {cpu_kernels.unavailable_reason()}")


@pytest.fixture
def packs(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the weights packed for oneDNN from now on (linear layers and the LM head)."""
    shapes = []

    def spy(weight, dtype=None):
        shapes.append(tuple(weight.shape))
        return pack_for_cpu(weight, dtype)

    pack_for_cpu = linear.pack_for_cpu
    monkeypatch.setattr(linear, "pack_for_cpu", spy)
    monkeypatch.setattr(embedding, "pack_for_cpu", spy)
    return shapes


def greedy(runner, prompt: list[int], n: int) -> list[int]:
    """`n` tokens decoded greedily after `prompt`, prefilled in one step."""
    d = Driver(runner)
    r = d.request(1, prompt + [0] * n)
    d.step([(r, len(prompt))])
    out = []
    for pos in range(len(prompt), len(prompt) + n):
        out.append(int(d.logits[1][pos - 1].argmax()))
        r.token_ids[pos] = out[-1]
        d.step([(r, 1)])
    return out


def test_bundled_model_drops_its_dense_copies_to_fit_and_says_so(smollm2_dir, kernels, packs, caplog):
    """--dtype float32 on the bundled Q4_1 model keeps packed float32 copies
    for steps above 16 rows; a limit between the blocks and blocks + copies
    drops them before any is packed, and the greedy tokens stay the same."""
    from sluice_server.model_runner import ModelRunner

    full = ModelRunner(smollm2_dir, dtype="float32")
    assert full.cpu_matmuls.block_rows == EXACT_ROWS and full.dense_copy_bytes > 0 and packs
    blocks_only = full.weight_bytes - full.dense_copy_bytes
    limit = blocks_only + full.dense_copy_bytes // 2
    want = greedy(full, PROMPT, 8)
    del full

    packs.clear()
    with caplog.at_level(logging.INFO, logger="sluice_server.model_runner"):
        runner = ModelRunner(smollm2_dir, dtype="float32", options=ShardOptions(max_weight_memory=limit))
    assert packs == []  # every matrix is block-served: nothing was packed
    assert runner.dense_copy_bytes == 0 and runner.weight_bytes == blocks_only <= limit
    assert runner.cpu_matmuls.block_rows == ALL_ROWS
    assert "every step" in runner.cpu_matmuls.describe()
    check_one_form_per_step_kind(runner)
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and "--max-weight-memory" in dropped[0] and "MiB saved" in dropped[0], dropped
    assert greedy(runner, PROMPT, 8) == want


def test_a_limit_at_or_above_the_plan_changes_nothing(smollm2_dir, kernels):
    from sluice_server.model_runner import ModelRunner

    full = ModelRunner(smollm2_dir, dtype="float32")
    runner = ModelRunner(smollm2_dir, dtype="float32", options=ShardOptions(max_weight_memory=full.weight_bytes))
    assert runner.cpu_matmuls == full.cpu_matmuls
    assert (runner.weight_bytes, runner.dense_copy_bytes) == (full.weight_bytes, full.dense_copy_bytes)


def test_a_limit_below_the_blocks_is_refused_with_both_sizes(smollm2_dir, kernels, packs):
    from sluice_server.model_runner import ModelRunner, WeightMemoryError

    full = ModelRunner(smollm2_dir, dtype="float32")
    blocks_only = full.weight_bytes - full.dense_copy_bytes
    packs.clear()
    with pytest.raises(WeightMemoryError) as refused:
        ModelRunner(smollm2_dir, dtype="float32", options=ShardOptions(max_weight_memory=blocks_only - 1))
    message = str(refused.value)
    assert f"take {blocks_only} bytes" in message and f"--max-weight-memory {blocks_only - 1} bytes" in message
    assert "no dense copy" in message
    assert packs == []  # refused before packing anything


def test_weights_matched_by_content_drop_their_copies_too(tmp_path, kernels):
    """A folder of float32 weights whose blocks are attached after loading
    (the families converted through transformers): the copies are dropped
    before packing, and the logits are still transformers'."""
    from sluice_server.model_runner import ModelRunner
    from test_gguf_files import decode_logits_match_transformers

    folder = with_blocks(make_tiny_model(tmp_path / "m", "llama", seed=5))
    rows = ShardOptions(cpu_block_rows=4)
    full = ModelRunner(folder, dtype="float32", block_size=4, options=rows)
    assert full.dense_copy_bytes > 0
    limit = full.weight_bytes - full.dense_copy_bytes
    runner = ModelRunner(folder, dtype="float32", block_size=4,
                         options=ShardOptions(cpu_block_rows=4, max_weight_memory=limit))
    assert (runner.dense_copy_bytes, runner.weight_bytes) == (0, limit)
    check_one_form_per_step_kind(runner)
    decode_logits_match_transformers(folder, runner)


@pytest.mark.parametrize("pack_weights", [True, False])
def test_a_dense_model_over_the_limit_is_refused(tmp_path, pack_weights):
    """No blocks to fall back on: the weights as the shard would hold them
    (packed, or as allocated where nothing packs) against the limit."""
    from sluice_server.model_runner import ModelRunner, WeightMemoryError

    folder = make_tiny_model(tmp_path / "m", "llama", seed=5)
    held = ModelRunner(folder, dtype="float32", pack_weights=pack_weights).weight_bytes
    assert ModelRunner(folder, dtype="float32", pack_weights=pack_weights,
                       options=ShardOptions(max_weight_memory=held)).weight_bytes == held
    with pytest.raises(WeightMemoryError, match=f"take {held} bytes .*, more than --max-weight-memory {held - 1} "):
        ModelRunner(folder, dtype="float32", pack_weights=pack_weights, options=ShardOptions(max_weight_memory=held - 1))


def test_the_limit_must_be_positive():
    with pytest.raises(ValueError, match="--max-weight-memory must be > 0"):
        ShardOptions(max_weight_memory=0)

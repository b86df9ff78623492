"""A GGUF served from its own blocks: the converted folder of a Llama/Qwen
file holds no float32 copy of a block-served matrix (gguf_checkpoint.py),
and the shard attaches the blocks straight from the .gguf, q/k rows
reordered by llama.cpp's permutation undone.

The oracle is the previous way, kept for the other families: the same
folder with every weight in float32 (`dense_twin`, which is what the
transformers conversion wrote: test_converted_folder_matches_transformers),
its blocks attached by matching rows by content. The two must give the
same blocks and bit for bit the same logits, in both arithmetics.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice_server.download import resolve_model
from sluice_server.gguf_checkpoint import BLOCK_TYPES, TENSORS_FILE, GGUFTensors
from sluice_server.gguf_header import read_header
from sluice_server.models import checkpoint_slices
from sluice_server.model_runner import ModelRunner

import test_gguf_families as families
from conftest import make_tiny_model, prefill_then_decodes


@pytest.fixture
def kernels():
    from sluice_kernels import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip(f"GGUF blocks need the CPU kernels: {cpu_kernels.unavailable_reason()}")


def dense_twin(folder: Path, out: Path) -> Path:
    """`folder` as the float32 conversion held it: every tensor in
    model.safetensors, no gguf_tensors.json (the same gguf_source.json)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for p in folder.iterdir():
        if p.is_file() and p.name not in (TENSORS_FILE, "model.safetensors"):
            shutil.copy(p, out / p.name)
    save_file({name: s[:].contiguous() for name, s in checkpoint_slices(folder)}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def tiny_llama_gguf(tmp: Path, types=families.BLOCK_TYPES, arch: str = "llama") -> tuple[Path, Path]:
    """A tiny random Llama GGUF (K-quants and Q8_0, q/k rows in llama.cpp's
    order, an untied head), or Qwen2 (q/k/v biases, rows in order), and its
    converted folder."""
    hf = make_tiny_model(tmp / "hf", arch, **dict(families.SIZES, vocab_size=len(families.vocabulary()[0])))
    gguf = tmp / f"tiny-{arch}.gguf"
    old = families.BLOCK_TYPES, families.random_blocks
    families.BLOCK_TYPES, families.random_blocks = types, random_blocks
    try:
        families.write_gguf(gguf, arch, hf, tmp / "oracle")
    finally:
        families.BLOCK_TYPES, families.random_blocks = old
    return gguf, resolve_model(str(gguf), cache_dir=str(tmp / "cache"))


def random_blocks(rows: int, cols: int, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """test_gguf_families' random blocks, and Q2_K's (d and dmin last) with small scales."""
    raw = RANDOM_BLOCKS(rows, cols, type_name, rng)
    if type_name == "Q2_K":
        scale = np.frombuffer(np.float16(2.0**-12).tobytes(), dtype=np.uint8)
        blocks = raw.reshape(rows, -1, 84)
        blocks[..., -4:-2] = scale
        blocks[..., -2:] = scale
    return raw


RANDOM_BLOCKS = families.random_blocks


def block_layers(runner) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in runner.model.named_modules() if getattr(m, "quantized", None) is not None}


def assert_same_blocks_and_logits(folder: Path, twin: Path, dtype: str, tokens: list[int], **kwargs) -> None:
    direct = ModelRunner(folder, dtype=dtype, block_size=4, **kwargs)
    matched = ModelRunner(twin, dtype=dtype, block_size=4, **kwargs)
    got, want = block_layers(direct), block_layers(matched)
    assert got and set(got) == set(want)
    for name, module in got.items():
        for a, b in zip(module.quantized.tensors(), want[name].quantized.tensors(), strict=True):
            assert torch.equal(a, b), name
    assert direct.weight_bytes == matched.weight_bytes
    assert direct.dense_copy_bytes == matched.dense_copy_bytes
    assert torch.equal(prefill_then_decodes(direct, tokens, 5), prefill_then_decodes(matched, tokens, 5))


def test_bundled_folder_holds_no_float32_copy_of_its_blocks(smollm2_dir, smollm2_gguf):
    """Every matrix of a block type is read from the .gguf; model.safetensors
    holds the norms only (the bundled file's F32 tensors)."""
    from safetensors import safe_open

    tensors = GGUFTensors.of_folder(smollm2_dir)
    header = read_header(smollm2_gguf)
    served = {t.name for t in header.tensors if t.type_name in BLOCK_TYPES}
    assert served and {t.gguf for t in tensors.tensors.values()} == served
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
        assert all(f.get_slice(n).get_shape().__len__() == 1 for n in stored)
    assert not stored & set(tensors.tensors)
    assert (smollm2_dir / "model.safetensors").stat().st_size < 0.02 * smollm2_gguf.stat().st_size


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_bundled_direct_blocks_equal_content_matched(smollm2_dir, tmp_path, kernels, dtype):
    """auto: every step on the blocks (no dense weight allocated on a
    VNNI host); float32: the blocks for few rows, dense float32 made tensor
    by tensor from the blocks above."""
    tokens = [1, 504, 3458, 282, 4649, 314, 2, 17, 8830, 29, 3216, 30, 113, 9]
    assert_same_blocks_and_logits(smollm2_dir, dense_twin(smollm2_dir, tmp_path / "twin"), dtype, tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_tiny_direct_blocks_equal_content_matched(tmp_path, kernels, dtype, arch):
    _, folder = tiny_llama_gguf(tmp_path, arch=arch)
    assert GGUFTensors.of_folder(folder) is not None
    tokens = torch.randint(0, 250, (17,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_same_blocks_and_logits(folder, dense_twin(folder, tmp_path / "twin"), dtype, tokens)


def test_blocks_taking_every_step_are_never_dense(smollm2_dir, kernels):
    """With every step on the blocks, the block-served parameters are
    emptied before loading: none is ever read from the .gguf as float32."""
    from sluice_kernels.cpu_matmuls import ALL_ROWS
    from sluice_server.gguf_checkpoint import DenseSlice
    from sluice_server.options import ShardOptions

    reads = []
    original = DenseSlice.__getitem__
    DenseSlice.__getitem__ = lambda self, key: reads.append(self.name) or original(self, key)
    try:
        runner = ModelRunner(smollm2_dir, dtype="auto", options=ShardOptions(cpu_block_rows=ALL_ROWS))
    finally:
        DenseSlice.__getitem__ = original
    assert reads == []
    assert runner.dense_copy_bytes == 0 and runner.model.model.embed_tokens.weight.numel() == 0


def test_dense_paths_read_the_blocks_tensor_by_tensor(smollm2_dir, tmp_path):
    """Without blocks (bfloat16, or no CPU kernels: what CUDA and tensor
    parallelism do too) every weight comes dense from the .gguf, equal to
    the float32 folder's."""
    twin = dense_twin(smollm2_dir, tmp_path / "twin")
    for kwargs in (dict(dtype="bfloat16"), dict(dtype="float32", pack_weights=False)):
        a, b = ModelRunner(smollm2_dir, **kwargs), ModelRunner(twin, **kwargs)
        assert not block_layers(a)
        for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
            assert torch.equal(p, q), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_converted_folder_matches_transformers(tmp_path, arch):
    """The folder's tensors (model.safetensors and the .gguf's expanded) are
    what transformers' GGUF reader loads, bit for bit, q/k order included."""
    from transformers import AutoModelForCausalLM
    from sluice_server.gguf_convert import _dequantize_option

    gguf, folder = tiny_llama_gguf(tmp_path, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 **_dequantize_option())
    want = model.state_dict()
    got = dict(checkpoint_slices(folder))
    assert set(got) == set(want)
    for name, s in got.items():
        assert torch.equal(s[:], want[name]), name
    assert set(GGUFTensors.of_folder(folder).tensors) == {n for n in want if n.endswith("weight") and want[n].dim() == 2}


def test_a_type_the_kernels_do_not_read_stays_float32(tmp_path, kernels):
    """A Q2_K matrix (dequantized, not read as blocks by the kernels) is
    written to model.safetensors in float32 and computed dense; the others
    still run on their blocks, and the logits equal the float32 twin's."""
    gguf, folder = tiny_llama_gguf(tmp_path, types=("Q2_K", "Q4_K", "Q8_0"))
    types = {t.name: t.type_name for t in read_header(gguf).tensors}
    assert "Q2_K" in types.values()
    tensors = GGUFTensors.of_folder(folder)
    assert {t.type_name for t in tensors.tensors.values()} <= set(BLOCK_TYPES)
    assert all(types[t.gguf] != "Q2_K" for t in tensors.tensors.values())
    tokens = list(range(3, 20))
    for dtype in ("auto", "float32"):
        direct = ModelRunner(folder, dtype=dtype, block_size=4)
        dense = [name for name, m in direct.model.named_modules()
                 if hasattr(m, "pack_for_cpu_") and getattr(m, "quantized", None) is None]
        assert dense  # the layers with a Q2_K piece
        matched = ModelRunner(dense_twin(folder, tmp_path / f"twin-{dtype}"), dtype=dtype, block_size=4)
        assert torch.equal(prefill_then_decodes(direct, tokens, 4), prefill_then_decodes(matched, tokens, 4))


def test_a_folder_whose_gguf_is_gone_says_so(tmp_path):
    gguf, folder = tiny_llama_gguf(tmp_path)
    gguf.unlink()
    with pytest.raises(FileNotFoundError, match="tiny-llama.gguf, which is gone"):
        ModelRunner(folder, dtype="auto")


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "exact"])
def test_a_layer_of_mixed_k_quants_keeps_each_type_compact(kernels, int8):
    """Q4_K_M's attention: q and k in Q4_K, v in Q6_K. Each run of one type
    is its own part in its own compact layout (gguf_blocks.QuantizedParts),
    not all of them 8-bit with a float32 pair per 16 weights; each output is
    the same bits its type's layer alone gives (int8: Q4_K's rows summed per
    32 values now, as a Q4_K layer's are, not per 16)."""
    from sluice_kernels import gguf_blocks
    from sluice_server.layers.gguf_weights import _quantized

    rng, k = np.random.default_rng(5), 512
    types = ["Q4_K", "Q4_K", "Q6_K"]
    pieces = [gguf_blocks.unpack(t, RANDOM_BLOCKS(n, k, t, rng), k) for t, n in zip(types, (48, 16, 16))]
    layer = _quantized(pieces, types, 80, int8=int8, max_rows=64)
    assert isinstance(layer, gguf_blocks.QuantizedParts)
    assert [p.format for p in layer.parts] == [gguf_blocks.U4_K, gguf_blocks.U6_K]
    assert [p.out_features for p in layer.parts] == [64, 16] and layer.out_features == 80
    def alone(records, fmt):
        return gguf_blocks.QuantizedWeight(gguf_blocks.pack(records, fmt), fmt, len(records.wq), int8, 64)

    one = alone(gguf_blocks.Records.concat(pieces), gguf_blocks.U8_HALVES)  # the layout holding every type
    assert sum(t.numel() for t in layer.tensors()) < 0.5 * one.data.numel()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    q4 = alone(gguf_blocks.Records.concat(pieces[:2]), gguf_blocks.U4_F32)
    assert torch.equal(layer.linear(x), torch.cat([q4.linear(x), alone(pieces[2], gguf_blocks.U6_K).linear(x)], 1))
    torch.testing.assert_close(layer.linear(x), one.linear(x), rtol=1e-5, atol=1e-5)

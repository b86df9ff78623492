"""Tiny GGUF files of the architectures the families serve (llama, qwen3,
phi3, gemma3), every weight in K-quant or Q8_0 blocks, as a user would
download them: the conversion maps each architecture to its family, the
converted weights are the model's own weights bit for bit, and the shard's
logits equal transformers' on those weights.

The oracle is independent of the code under test, which reads a GGUF
through transformers' GGUF loader: each file is written here, with the gguf
package, from a tiny random transformers model, the way llama.cpp's
converter lays a checkpoint out (its tensor names and metadata, q/k rows
permuted for llama's rotary layout, Gemma's norms stored as 1 + w). Every
matrix is random but valid blocks (Q4_K, Q5_K and Q6_K, the types of
Q4_K_M/Q5_K_M files, and Q8_0; fp16 scales 2^-12, so weights stay small),
and the model's weight is set to what those blocks stand for (the gguf
package's expansion), so nothing is lost to quantization. The reference is
transformers loading that model from its safetensors, never the GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice_server.download import resolve_model
from sluice_server.gguf_convert import GGUF_ARCHITECTURES
from sluice_server.model_runner import ModelRunner
from sluice_server.testing import add_bpe_vocabulary

from conftest import Driver, make_tiny_model

# K-quant rows are 256 values: every matrix's input width is a multiple.
SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=256)
# arch -> (tiny model kind, its size overrides). Qwen3's GGUF metadata has no
# head_dim, which transformers then takes as 128.
ARCHS = {
    "llama": ("llama", dict()),
    "qwen3": ("qwen3", dict(head_dim=128, use_sliding_window=False)),
    "phi3": ("phi3", dict(partial_rotary_factor=1.0, rope_scaling=None, sliding_window=None)),
    "gemma3": ("gemma3", dict(head_dim=128, final_logit_softcapping=None, rope_parameters=None, layer_types=None,
                              query_pre_attn_scalar=256)),
}
BLOCK_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
VOCAB_BYTES = 256


def vocabulary() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, two merges, and
    an end-of-text token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    return symbols + ["th", "the", "<|endoftext|>"], ["t h", "th e"]


def random_blocks(rows: int, cols: int, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """Random [rows, row bytes] blocks of `type_name` with small fp16 scales."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2.0**-12).tobytes(), dtype=np.uint8)
    if type_name == "Q6_K":  # ql, qh, int8 scales, then d
        raw[..., -2:] = scale
    else:  # d first; Q4_K/Q5_K then dmin
        raw[..., 0:2] = scale
        if type_name in ("Q4_K", "Q5_K"):
            raw[..., 2:4] = scale
    return raw.reshape(rows, -1)


def llama_cpp_rows(rows: int, heads: int) -> np.ndarray:
    """The order llama.cpp's converter writes a llama q or k projection's rows
    in (its rotary layout): within each head, the first half's rows and the
    second half's interleaved. GGUF row i is the checkpoint's row order[i]."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)


def rope_theta(config: dict) -> float:
    """The (global layers') rotary base of a transformers config.json."""
    params = config.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def write_gguf(path: Path, arch: str, hf_folder: Path, oracle_folder: Path) -> dict[str, str]:
    """The GGUF llama.cpp's converter would write for the tiny model in
    `hf_folder`, its matrices random blocks, and in `oracle_folder` that
    model with the weights the file stands for (the reference). Returns the
    block type of each quantized tensor."""
    import gguf
    from safetensors.torch import load_file, save_file

    config = json.loads((hf_folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    tokens, merges = vocabulary()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope_theta(config))
    if arch == "gemma3":
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_sliding_window(config["sliding_window"])
    # A pad token inside the vocabulary: Phi-3's default, 32000, is past it.
    add_bpe_vocabulary(writer, tokens, merges)
    rng = np.random.default_rng(0)
    types: dict[str, str] = {}
    weights = load_file(str(hf_folder / "model.safetensors"))
    for i, (name, tensor) in enumerate(sorted(weights.items())):
        stem, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        if tensor.dim() == 1:
            if arch == "gemma3" and stem.endswith("norm"):
                # llama.cpp stores Gemma's norms as 1 + w; w is chosen so
                # that 1 + w - 1 is w exactly in float32.
                stored = tensor + 1.0
                weights[name] = stored - 1.0
                tensor = stored
            writer.add_tensor(gguf_name, tensor.numpy())
            continue
        type_name = "Q8_0" if stem.endswith("embed_tokens") else BLOCK_TYPES[i % len(BLOCK_TYPES)]
        rows, cols = tensor.shape
        blocks = random_blocks(rows, cols, type_name, rng)
        qtype = gguf.GGMLQuantizationType[type_name]
        weights[name] = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(rows, cols).copy())
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads" if stem.endswith("q_proj") else "num_key_value_heads"]
            blocks = blocks[llama_cpp_rows(rows, heads)]
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        types[gguf_name] = type_name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    oracle_folder.mkdir(parents=True)
    (oracle_folder / "config.json").write_text((hf_folder / "config.json").read_text())
    save_file(weights, str(oracle_folder / "model.safetensors"), metadata={"format": "pt"})
    return types


@pytest.fixture(scope="module", params=sorted(ARCHS))
def converted(request, tmp_path_factory):
    arch = request.param
    kind, overrides = ARCHS[arch]
    tmp = tmp_path_factory.mktemp(arch)
    hf = make_tiny_model(tmp / "hf", kind, **dict(SIZES, vocab_size=len(vocabulary()[0]), **overrides))
    gguf_path = tmp / f"tiny-{arch}.gguf"
    types = write_gguf(gguf_path, arch, hf, tmp / "oracle")
    return arch, tmp / "oracle", types, resolve_model(str(gguf_path), cache_dir=str(tmp / "cache"))


def test_architecture_maps_to_its_family(converted):
    arch, _, _, folder = converted
    assert json.loads((folder / "config.json").read_text())["model_type"] == GGUF_ARCHITECTURES[arch]


def test_converted_weights_are_the_models(converted):
    """Every tensor of the converted folder is the model's own, bit for bit:
    the gguf package's expansion of the blocks, llama's q/k rows back in the
    checkpoint's order, Gemma's norms back from 1 + w (Phi-3's fused tensors
    stay fused)."""
    from safetensors import safe_open

    from sluice_server.models import checkpoint_slices

    _, oracle, types, folder = converted
    got = dict(checkpoint_slices(folder))  # Llama, Qwen3: the block-served matrices from the .gguf
    with safe_open(str(oracle / "model.safetensors"), framework="pt") as want:
        assert set(got) == set(want.keys())
        for key in want.keys():
            assert torch.equal(got[key][:], want.get_tensor(key)), key
    assert set(types.values()) == set(BLOCK_TYPES)


def test_logits_equal_transformers_on_the_models_weights(converted):
    from transformers import AutoModelForCausalLM

    _, oracle, _, folder = converted
    tokens = torch.randint(0, VOCAB_BYTES, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = AutoModelForCausalLM.from_pretrained(str(oracle), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0]
    runner = ModelRunner(folder, dtype="float32", block_size=4)
    d = Driver(runner)
    r = d.request(1, tokens)
    d.step([(r, 13)])
    for _ in range(7):
        d.step([(r, 1)])
    torch.testing.assert_close(d.computed(1, 0, 20), want, atol=1e-4, rtol=0)


def test_decodes_run_on_the_k_quant_blocks(converted):
    """--dtype auto: every layer whose GGUF tensors are all in types the int8
    kernel reads (all here: Q4_K, Q5_K, Q6_K, Q8_0) multiplies on its blocks,
    and the logits stay those of the float32 weights up to the int8 rounding
    of the activations: about 0.5% per matmul, which these random models
    amplify differently (measured: qwen3 0.002, phi3 0.001, gemma3 0.016,
    llama 0.10, whose peaked attention, with no q/k norms and rotary on
    every dimension, magnifies it most). Llama's run on the C++ decoder."""
    from sluice_kernels import gguf_blocks
    from sluice_server.layers.gguf_weights import _pieces

    arch, _, types, folder = converted
    tokens = torch.randint(0, VOCAB_BYTES, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = {}
    for dtype in ("float32", "auto"):
        runner = ModelRunner(folder, dtype=dtype, block_size=4)
        d = Driver(runner)
        r = d.request(1, tokens)
        d.step([(r, 8)])
        for _ in range(4):
            d.step([(r, 1)])
        logits[dtype] = d.computed(1, 8, 12)
    pieces = _pieces(runner.model)
    readable = [m for m, names in pieces if all(types.get(n) in gguf_blocks.FORMATS for n in names)]
    attached = [m for m, _ in pieces if getattr(m, "quantized", None) is not None]
    assert attached == readable
    k_quants = {types[n] for m, names in pieces if m in attached for n in names} - {"Q8_0"}
    assert k_quants, "no K-quant layer ran on its blocks"
    assert (runner.cpu_decoder is not None) == (arch == "llama")
    rel = (logits["auto"] - logits["float32"]).norm() / logits["float32"].norm()
    assert rel < (0.15 if arch == "llama" else 0.05), rel

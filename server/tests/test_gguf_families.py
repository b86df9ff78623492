"""Tiny GGUF files of the architectures the new families serve (qwen3, phi3,
gemma3), every weight in K-quant or Q8_0 blocks, as a user would download
them: the conversion maps each architecture to its family, the converted
weights are the gguf package's expansion of the blocks bit for bit (Q4_K,
Q5_K and Q6_K, the types of Q4_K_M/Q5_K_M files, and Q8_0), and the shard's
logits equal transformers reading the GGUF itself.

The blocks are random but valid (their fp16 scales set to 2^-12, so weights
stay small); names and metadata follow llama.cpp's conventions (the gguf
package's tensor-name map), with a byte-level BPE vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice_server.download import resolve_model
from sluice_server.gguf_convert import GGUF_ARCHITECTURES
from sluice_server.gguf_header import read_header, tensor_bytes
from sluice_server.model_runner import ModelRunner

from conftest import Driver, make_tiny_model

# K-quant rows are 256 values: every matrix's input width is a multiple.
SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=256)
# arch -> (tiny model kind, its size overrides). Qwen3's GGUF metadata has no
# head_dim, which transformers then takes as 128.
ARCHS = {
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


def write_gguf(path: Path, arch: str, hf_folder: Path) -> dict[str, str]:
    """The GGUF twin of the tiny model in `hf_folder` (its names and shapes;
    matrices as random blocks, vectors as they are). Returns the block type
    of each quantized tensor."""
    import gguf
    from safetensors.torch import load_file

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
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_sliding_window(8)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_pad_token_id(len(tokens) - 1)  # else Phi-3's default, 32000, is past this vocabulary
    rng = np.random.default_rng(0)
    types: dict[str, str] = {}
    for i, (name, tensor) in enumerate(sorted(load_file(str(hf_folder / "model.safetensors")).items())):
        stem, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        if tensor.dim() == 1:
            writer.add_tensor(gguf_name, tensor.numpy())
            continue
        type_name = "Q8_0" if stem.endswith("embed_tokens") else BLOCK_TYPES[i % len(BLOCK_TYPES)]
        rows, cols = tensor.shape
        blocks = random_blocks(rows, cols, type_name, rng)
        writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType[type_name])
        types[gguf_name] = type_name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


@pytest.fixture(scope="module", params=sorted(ARCHS))
def converted(request, tmp_path_factory):
    arch = request.param
    kind, overrides = ARCHS[arch]
    tmp = tmp_path_factory.mktemp(arch)
    hf = make_tiny_model(tmp / "hf", kind, **dict(SIZES, vocab_size=len(vocabulary()[0]), **overrides))
    gguf_path = tmp / f"tiny-{arch}.gguf"
    types = write_gguf(gguf_path, arch, hf)
    return arch, gguf_path, types, resolve_model(str(gguf_path), cache_dir=str(tmp / "cache"))


def test_architecture_maps_to_its_family(converted):
    arch, _, _, folder = converted
    assert json.loads((folder / "config.json").read_text())["model_type"] == GGUF_ARCHITECTURES[arch]


def test_blocks_expand_as_the_gguf_package_does(converted):
    """Each quantized tensor of the file is, in the converted folder, exactly
    gguf.quants.dequantize of its blocks (Phi-3's fused tensors stay fused)."""
    import gguf
    from safetensors import safe_open

    arch, gguf_path, types, folder = converted
    by_name = {t.name: t for t in read_header(gguf_path).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], SIZES["num_hidden_layers"])
    seen = set()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            stem, suffix = key.rsplit(".", 1)
            gguf_name = f"{names.get_name(stem)}.{suffix}"
            if gguf_name not in types:
                continue
            tensor = by_name[gguf_name]
            want = gguf.quants.dequantize(np.array(tensor_bytes(gguf_path, tensor)), gguf.GGMLQuantizationType[tensor.type_name])
            assert torch.equal(f.get_tensor(key), torch.from_numpy(want)), key
            seen.add(tensor.type_name)
    assert seen == set(BLOCK_TYPES)


def test_logits_equal_transformers_reading_the_gguf(converted):
    from transformers import AutoModelForCausalLM

    from sluice_server.gguf_convert import _dequantize_option

    _, gguf_path, _, folder = converted
    tokens = torch.randint(0, VOCAB_BYTES, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **_dequantize_option()
    )
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
    of the activations."""
    from sluice_kernels import gguf_blocks
    from sluice_server.layers.gguf_weights import _pieces

    _, _, types, folder = converted
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
    rel = (logits["auto"] - logits["float32"]).norm() / logits["float32"].norm()
    assert rel < 0.05, rel

"""GGUF files: the converted bundled model against an independent reading of
its .gguf; damaged and unsupported files; GGUF blocks that do not match the
float weights.

What `test_converted_folder_is_the_gguf_decoded_independently` proves: every
tensor of the converted folder equals the GGUF's own tensor decoded by this
file's block decoders (numpy, written from GGML's block layouts: neither
transformers nor the gguf package's dequantizer is involved), with the
query/key rows in llama.cpp's rotary order (its converter's permutation,
restated here) and the tied embedding as the output head. So the conversion
neither lost, altered nor reordered a weight, other than undoing that
permutation. That the permutation's direction is right (the q/k rows pair
up as the model's rotary embedding expects) is checked by what the model
says: it answers the capital of France, which with scrambled rotary pairs
it does not. Not checked here: llama.cpp's own logits (llama-cpp-python
compiles llama.cpp for about ten minutes on two cores).
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from sluice_server.download import ModelResolutionError, resolve_model
from sluice_server.gguf_convert import SOURCE_FILE

from conftest import Driver, make_tiny_model, reference_logits

# --- an independent reading of GGML blocks -------------------------------------
#
#   Q8_0, 34 bytes per 32 weights:  d (fp16) | q[0..31] (int8)          w = d * q
#   Q4_1, 20 bytes per 32 weights:  d (fp16) | m (fp16) | 16 bytes      w = d * nibble + m
#       byte j holds weight j in its low nibble and weight j + 16 in its high one


def decode_q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(raw.shape[0], -1)


def decode_q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 4:]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    return (d * nibbles + m).reshape(raw.shape[0], -1)


def decode(tensor) -> np.ndarray:
    kind = tensor.tensor_type.name
    if kind == "F32":
        return np.asarray(tensor.data, dtype=np.float32)
    return {"Q8_0": decode_q8_0, "Q4_1": decode_q4_1}[kind](np.asarray(tensor.data))


def rotary_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of q/k rows: within each head, the rows of the first
    and the second half interleaved (pairs (i, i + D/2) become (2i, 2i + 1))."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def folder_name(gguf_name: str) -> str:
    """transformers' name for a GGUF tensor of a Llama model."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, part, _ = gguf_name.split(".")
    sub = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}[part]
    return f"model.layers.{layer}.{sub}.weight"


def test_converted_folder_is_the_gguf_decoded_independently(smollm2_dir, smollm2_gguf):
    from gguf import GGUFReader

    from sluice_server.models import checkpoint_slices

    config = json.loads((smollm2_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = GGUFReader(str(smollm2_gguf)).tensors
    assert {t.tensor_type.name for t in tensors} == {"F32", "Q4_1", "Q8_0"}
    seen = set()
    folder = {name: s[:].numpy() for name, s in checkpoint_slices(smollm2_dir)}  # model.safetensors and the .gguf's
    names = set(folder)
    for t in tensors:
        name = folder_name(t.name)
        ours = folder[name].astype(np.float32)
        want = decode(t).reshape(ours.shape)
        if ".attn_q." in t.name:
            ours = rotary_order(ours, heads)
        elif ".attn_k." in t.name:
            ours = rotary_order(ours, kv_heads)
        assert np.array_equal(ours, want), t.name
        seen.add(name)
    # Tied: the GGUF has no output.weight; the folder's head (if it
    # stores one) is the embedding.
    assert "output.weight" not in {t.name for t in tensors} and config["tie_word_embeddings"]
    if "lm_head.weight" in names:
        assert np.array_equal(folder["lm_head.weight"], folder["model.embed_tokens.weight"])
        seen.add("lm_head.weight")
    assert seen == names  # nothing in the folder that the GGUF does not hold


def test_converted_model_answers_correctly(smollm2_dir):
    """The rotary pairing of q/k rows is right: scrambled, the model would not
    know the capital of France."""
    import transformers

    from sluice_server.testing import transformers_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers_model(smollm2_dir, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]).startswith(" Paris")


# --- damaged and unsupported files ---------------------------------------------------


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, object]]) -> None:
    """A GGUF file with `tensors` (name -> (array, GGML type or None for
    float32)); for a block type the array holds the raw bytes, one row per row."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for name, (array, raw_dtype) in tensors.items():
        if raw_dtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def small_gguf(path) -> None:
    write_gguf(path, {"token_embd.weight": (np.ones((64, 32), dtype=np.float32), None)})


def assert_refused(gguf, cache, *words) -> None:
    with pytest.raises(ModelResolutionError) as refused:
        resolve_model(str(gguf), cache_dir=str(cache))
    message = str(refused.value)
    for word in (gguf.name, *words):
        assert word in message, message
    leftovers = list((cache / "sluice-gguf").iterdir()) if (cache / "sluice-gguf").exists() else []
    assert leftovers == []


def test_wrong_magic_is_named(tmp_path):
    gguf = tmp_path / "renamed.gguf"
    small_gguf(gguf)
    data = bytearray(gguf.read_bytes())
    data[:4] = b"GGML"  # an older format's magic
    gguf.write_bytes(bytes(data))
    assert_refused(gguf, tmp_path / "cache", "not a GGUF file", "b'GGML'")


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_file_is_named(tmp_path, keep):
    gguf = tmp_path / "partial.gguf"
    small_gguf(gguf)
    data = gguf.read_bytes()
    gguf.write_bytes(data[: int(len(data) * keep)])
    assert_refused(gguf, tmp_path / "cache", "cut short")


def test_tensor_type_that_cannot_be_dequantized_is_named(tmp_path):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType.Q8_K  # llama.cpp's internal activation type: no dequantizer
    block_bytes = GGML_QUANT_SIZES[kind][1]
    gguf = tmp_path / "odd.gguf"
    write_gguf(gguf, {
        "token_embd.weight": (np.ones((64, 32), dtype=np.float32), None),
        "blk.0.ffn_down.weight": (np.zeros((4, block_bytes), dtype=np.uint8), kind),
    })
    assert_refused(gguf, tmp_path / "cache", "blk.0.ffn_down.weight", "Q8_K", "cannot be dequantized")


# --- GGUF blocks beside the float weights ----------------------------------------------


def pieces(runner) -> dict[str, torch.nn.Module]:
    """The linear layers that can carry GGUF blocks, by their GGUF tensor name."""
    out = {"output": runner.model.lm_head}
    for i, layer in enumerate(runner.model.model.layers):
        out.update({f"blk.{i}.attn_qkv": layer.self_attn.qkv_proj, f"blk.{i}.attn_output": layer.self_attn.o_proj,
                    f"blk.{i}.ffn_gate_up": layer.mlp.gate_up_proj, f"blk.{i}.ffn_down": layer.mlp.down_proj})
    return out


def with_blocks(folder, corrupt: str | None = None, embedding: bool = False):
    """Gives the tiny model `folder` a GGUF twin (Q8_0 blocks, q/k rows in
    llama.cpp's order) and makes the folder's float weights exactly what the
    blocks hold. `corrupt`: a GGUF tensor whose blocks get one value changed
    afterwards, so they no longer match the folder. `embedding`: the
    embedding table gets blocks too (token_embd)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from safetensors.numpy import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    names = {"output.weight": "lm_head.weight"}
    if embedding:
        names["token_embd.weight"] = "model.embed_tokens.weight"
    for i in range(config["num_hidden_layers"]):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            names[f"blk.{i}.{part}.weight"] = folder_name(f"blk.{i}.{part}.weight")
    tensors = {}
    for gguf_name, name in names.items():
        blocks = quantize(weights[name].astype(np.float32), GGMLQuantizationType.Q8_0)
        weights[name] = decode_q8_0(blocks)  # the float weight the blocks expand to
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        kind = gguf_name.split(".")[-2]
        if kind in heads:
            blocks = rotary_order(blocks, heads[kind])
        if gguf_name == corrupt:
            blocks = blocks.copy()
            blocks[0, 2] ^= 0x01  # one int8 weight of the first block
        tensors[gguf_name] = (blocks, GGMLQuantizationType.Q8_0)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_gguf(folder / "twin.gguf", tensors)
    (folder / SOURCE_FILE).write_text(json.dumps({"gguf": str(folder / "twin.gguf")}))
    return folder


@pytest.fixture
def kernels():
    from sluice_kernels import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip(f"GGUF blocks need the CPU kernels: {cpu_kernels.unavailable_reason()}")


def decode_logits_match_transformers(folder, runner) -> None:
    """Prefill, then decodes (1 row: on the blocks where attached)."""
    tokens = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    d = Driver(runner)
    r = d.request(1, tokens)
    d.step([(r, 14)])
    for _ in range(6):
        d.step([(r, 1)])
    torch.testing.assert_close(d.computed(1, 0, 20), reference_logits(folder, tokens), atol=1e-4, rtol=0)


def test_matching_blocks_are_attached_everywhere(tmp_path, kernels):
    from sluice_server.model_runner import ModelRunner

    folder = with_blocks(make_tiny_model(tmp_path / "m", "llama", seed=5))
    runner = ModelRunner(folder, dtype="float32", block_size=4)
    assert all(m.quantized is not None for m in pieces(runner).values())
    decode_logits_match_transformers(folder, runner)


def test_blocks_that_do_not_match_fall_back_to_float(tmp_path, kernels, caplog):
    from sluice_server.model_runner import ModelRunner

    folder = with_blocks(make_tiny_model(tmp_path / "m", "llama", seed=5), corrupt="blk.1.ffn_down.weight")
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(folder, dtype="float32", block_size=4)
    attached = {name for name, m in pieces(runner).items() if m.quantized is not None}
    assert attached == set(pieces(runner)) - {"blk.1.ffn_down"}
    assert "blk.1.ffn_down.weight" in caplog.text and "do not match" in caplog.text
    decode_logits_match_transformers(folder, runner)

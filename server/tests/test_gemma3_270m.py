"""Gemma 3 270M from its Q4_K_M GGUF (the second real model): the conversion
keeps the gguf package's dequantized values, the converted tokenizer equals
transformers', and the shard's greedy tokens equal transformers' generate on
the same weights, alone and batched, one prompt past the 512-token window."""

from __future__ import annotations

import json

import pytest
import torch

from sluice_kernels import cpu_kernels
from sluice_server.model_runner import ModelRunner

from test_model_numerics import shard_greedy, transformers_greedy

pytestmark = pytest.mark.gemma3_270m

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Water boils at 100 degrees Celsius at sea level because",
]
# Longer than the local layers' 512-token window, so those layers attend to
# a part of the context only while the global ones see all of it.
LONG_PROMPT = " ".join(
    f"Step {i}: the river carried {i} boats past the mill, and the miller counted them." for i in range(40)
) + " In the end, the miller had counted"
NEW_TOKENS = 32
TEXTS = ["Hello world", " leading space", "Ünïcödé and emoji 🙂", "tabs\tand\nnewlines", "<start_of_turn>user\nhi"]


def test_conversion(gemma3_dir):
    config = json.loads((gemma3_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["layer_types"].count("full_attention") == 3 and config["sliding_window"] == 512
    runner = ModelRunner(gemma3_dir, dtype="float32", block_size=16, pack_weights=False)
    layers = runner.model.model.layers
    assert [layer.self_attn.layer.sliding_window for layer in layers[:6]] == [512] * 5 + [None]
    assert runner.vocab_size == 262144 and runner.eos_token_ids == [1]


def test_config_is_the_gguf_metadata(gemma3_dir, gemma3_gguf):
    """The converted config.json, written by transformers' GGUF reader and
    read by the shard and by transformers (the greedy oracle below), says
    what the file's metadata says, read here with the gguf package alone,
    and follows llama.cpp's Gemma 3 conventions the file does not record:
    local layers rotate with base 10000, every sixth layer is global,
    queries are scaled by head_dim^-0.5. A misread config cannot hide behind
    both sides reading it."""
    import gguf

    fields = gguf.GGUFReader(str(gemma3_gguf)).fields

    def meta(key: str):
        return fields[f"gemma3.{key}"].contents()

    config = json.loads((gemma3_dir / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        meta("embedding_length"), meta("feed_forward_length"), meta("block_count"))
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        meta("attention.head_count"), meta("attention.head_count_kv"), meta("attention.key_length"))
    assert config["rms_norm_eps"] == pytest.approx(meta("attention.layer_norm_rms_epsilon"), rel=1e-6)
    assert (config["sliding_window"], config["max_position_embeddings"]) == (
        meta("attention.sliding_window"), meta("context_length"))
    rope = config["rope_parameters"]
    assert rope["full_attention"]["rope_theta"] == meta("rope.freq_base")
    assert rope["sliding_attention"]["rope_theta"] == 10000.0
    assert config["layer_types"] == [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(config["num_hidden_layers"])
    ]
    assert config["query_pre_attn_scalar"] == config["head_dim"]


def test_dequantized_weights_equal_the_gguf_package(gemma3_dir, gemma3_gguf):
    """Every tensor of the converted folder is the gguf package's expansion of
    the file's blocks (Q4_K, Q6_K, Q5_0 and Q8_0 here), bit for bit; the
    norms are stored as 1 + w in the file (llama.cpp's Gemma convention)."""
    import gguf
    from safetensors import safe_open

    from sluice_server.gguf_header import read_header, tensor_bytes

    header = read_header(gemma3_gguf)
    by_name = {t.name: t for t in header.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 18)
    checked: dict[str, int] = {}
    with safe_open(str(gemma3_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            tensor = by_name[names.get_name(key.removesuffix(".weight")) + ".weight"]
            raw = tensor_bytes(gemma3_gguf, tensor)
            rows = slice(None) if tensor.shape[1:] != (262144,) else slice(0, 4096)  # the embedding: a part
            want = torch.tensor(gguf.quants.dequantize(raw[rows], gguf.GGMLQuantizationType[tensor.type_name]))
            got = f.get_slice(key)[rows]
            if key.endswith("norm.weight"):
                want = want.reshape(-1) - 1
            assert torch.equal(got, want.reshape(got.shape)), key
            checked[tensor.type_name] = checked.get(tensor.type_name, 0) + 1
    assert set(checked) == {"F32", "Q4_K", "Q6_K", "Q5_0", "Q8_0"}, checked


def test_tokenizer_equals_transformers(gemma3_dir, gemma3_gguf):
    """The tokenizer.json the router loads (through the same Rust tokenizers
    library) encodes as transformers' tokenizer read from the GGUF itself,
    BOS included, and decodes back the same."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ours = Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)
    for text in TEXTS + PROMPTS + [LONG_PROMPT]:
        ids = ours.encode(text, add_special_tokens=True).ids
        assert ids == theirs(text).input_ids, text
        assert ids[0] == 2  # <bos>
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_greedy_matches_transformers(gemma3_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(p, add_special_tokens=True).ids for p in PROMPTS + [LONG_PROMPT]]
    assert len(prompts[-1]) > 600
    want = transformers_greedy(gemma3_dir, prompts, NEW_TOKENS)

    # The exact path (--dtype float32); the default one quantizes activations.
    runner = ModelRunner(gemma3_dir, dtype="float32", block_size=16)
    assert runner.dtype == torch.float32
    # The decodes run on the file's own Q4_K / Q6_K / Q5_0 / Q8_0 blocks,
    # expanded to exactly the float32 weights, wherever the CPU kernels build.
    if cpu_kernels.load():
        # 72 projections, the LM head and the embedding (tied: the head's blocks).
        linears = [m for m in runner.model.modules() if hasattr(m, "quantized")]
        assert len(linears) == 74 and all(m.quantized is not None for m in linears)
    batched = shard_greedy(runner, prompts, NEW_TOKENS)
    alone = [shard_greedy(runner, [p], NEW_TOKENS)[0] for p in prompts]
    for i, text in enumerate(PROMPTS + ["<long prompt>"]):
        assert alone[i] == want[i], f"prompt {i} ({text!r}) alone"
        assert batched[i] == want[i], f"prompt {i} ({text!r}) batched"

"""Mixture-of-experts GGUF files, written as llama.cpp writes them: each
layer's experts stacked in one tensor per projection (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`, [E, rows, cols]) beside the router
(`ffn_gate_inp`), and rope scaling in the metadata.

- Mixtral (architecture `llama` with an expert count, which transformers
  cannot read): written from a tiny Mixtral in float32 with q/k permuted for
  llama.cpp's rotary, the conversion restores the checkpoint exactly, so the
  shard equals transformers on the original folder.
- Qwen3-MoE (`qwen3moe`): random K-quant / Q8_0 blocks; the shard equals
  transformers reading the GGUF itself, and the expert blocks are what
  decodes run on with --dtype auto.
- Qwen2-MoE (`qwen2moe`): the routed experts as above, plus the shared
  expert (`ffn_{gate,up,down}_shexp`) and its gate (`ffn_gate_inp_shexp`, a
  vector, as llama.cpp stores it); its widths come from
  `expert_feed_forward_length` and `expert_shared_feed_forward_length`.
  Written in float32, the conversion restores the checkpoint exactly; in
  Q8_0 blocks, the shared expert runs on its blocks like a dense MLP.
- YaRN in the metadata (`rope.scaling.type` yarn, factor, original context)
  becomes the converted config's rope settings and served length.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice_server.download import resolve_model
from sluice_server.model_runner import ModelRunner
from sluice_server.testing import add_bpe_vocabulary

from conftest import make_tiny_model, prefill_then_decodes, reference_logits
from test_gguf_families import VOCAB_BYTES, random_blocks, vocabulary

# Expert projections: GGUF's stacked tensor per checkpoint name, by family.
EXPERT_NAMES = {
    "mixtral": {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"},
    "qwen3_moe": {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"},
    "qwen2_moe": {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"},
}


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows as llama.cpp's converter stores them for its rotary layout:
    within each head, the two halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(hf_folder: Path, arch: str) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors under GGUF names, experts stacked."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    family = config["model_type"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    experts: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in load_file(str(hf_folder / "model.safetensors")).items():
        parts = name.split(".")
        if "experts" in parts:
            at = parts.index("experts")
            layer = parts[2]
            stacked = f"blk.{layer}.{EXPERT_NAMES[family][parts[at + 2]]}.weight"
            experts.setdefault(stacked, {})[int(parts[at + 1])] = tensor
            continue
        stem, suffix = name.rsplit(".", 1)
        if family == "mixtral" and stem.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads" if stem.endswith("q_proj") else "num_key_value_heads"]
            tensor = llama_cpp_permute(tensor, heads)
        if stem.endswith("shared_expert_gate"):  # llama.cpp stores the [1, H] gate as a vector
            tensor = tensor.reshape(-1)
        out[f"{names.get_name(stem)}.{suffix}"] = tensor
    for stacked, by_expert in experts.items():
        out[stacked] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(path: Path, arch: str, hf_folder: Path, block_type: str | None, rope: dict | None = None) -> None:
    """block_type None: every tensor in float32; else matrices as random
    blocks of that type (vectors stay float32)."""
    import gguf

    config = json.loads((hf_folder / "config.json").read_text())
    tokens, merges = vocabulary()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    else:
        writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    if arch == "qwen2moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if rope:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original"])
    add_bpe_vocabulary(writer, tokens, merges)
    rng = np.random.default_rng(0)
    for name, tensor in sorted(gguf_tensors(hf_folder, arch).items()):
        if block_type is None or tensor.dim() == 1:
            writer.add_tensor(name, tensor.float().numpy())
            continue
        kind = "Q8_0" if "token_embd" in name or "gate_inp" in name else block_type
        blocks = random_blocks(tensor[..., 0].numel(), tensor.shape[-1], kind, rng)
        writer.add_tensor(name, blocks.reshape(*tensor.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


SIZES = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def run(folder: Path | ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Logits of every token: a prefill of all but 4, then 4 decode steps."""
    runner = folder if isinstance(folder, ModelRunner) else ModelRunner(folder, dtype="float32", block_size=4)
    return prefill_then_decodes(runner, tokens, 4)


def test_mixtral_gguf_restores_the_checkpoint(tmp_path):
    # GGUF records no sliding window: the tiny Mixtral has none either.
    hf = make_tiny_model(tmp_path / "hf", "mixtral", seed=6, vocab_size=len(vocabulary()[0]), sliding_window=None,
                         **SIZES)
    gguf_path = tmp_path / "tiny-mixtral.gguf"
    write_gguf(gguf_path, "llama", hf, block_type=None)
    folder = resolve_model(str(gguf_path), cache_dir=str(tmp_path / "cache"))
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    tokens = torch.randint(0, VOCAB_BYTES, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    torch.testing.assert_close(run(folder, tokens), reference_logits(hf, tokens), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def qwen3moe_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """A Qwen3-MoE GGUF of random Q4_K / Q8_0 blocks (K-quant rows: 256
    values) with YaRN in its metadata, and its converted folder."""
    tmp = tmp_path_factory.mktemp("qwen3moe")
    hf = make_tiny_model(tmp / "hf", "qwen3_moe", vocab_size=len(vocabulary()[0]), hidden_size=256,
                         moe_intermediate_size=256, head_dim=64, **SIZES)
    gguf_path = tmp / "tiny-qwen3moe.gguf"
    write_gguf(gguf_path, "qwen3moe", hf, block_type="Q4_K", rope={"factor": 4.0, "original": 16})
    return gguf_path, resolve_model(str(gguf_path), cache_dir=str(tmp / "cache"))


def test_qwen3moe_gguf_equals_transformers_reading_it(qwen3moe_gguf):
    """The rope scaling of the metadata is not read by transformers' GGUF
    loader: the reference gets the converted config's (YaRN) settings."""
    import transformers

    from sluice_server.gguf_convert import _dequantize_option

    gguf_path, folder = qwen3moe_gguf
    config = json.loads((folder / "config.json").read_text())
    rope = config["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32,
        config=transformers.AutoConfig.from_pretrained(folder), **_dequantize_option(),
    )
    tokens = torch.randint(0, VOCAB_BYTES, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0]
    runner_logits = run(folder, tokens)
    torch.testing.assert_close(runner_logits, want, atol=1e-4, rtol=0)
    assert ModelRunner(folder, dtype="float32").max_position_embeddings == 64  # 16 x 4


def test_qwen3moe_decodes_run_on_the_expert_blocks(qwen3moe_gguf):
    """Every expert layer gets its experts' Q4_K blocks (prefill and decode
    steps run on them). float32: the blocks expanded exactly, so the steps
    equal the same steps on the dense weights; auto: int8 activations,
    close to float32."""
    from sluice_kernels import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip(f"the C++ CPU kernels are off here: {cpu_kernels.unavailable_reason()}")
    _, folder = qwen3moe_gguf
    tokens = torch.randint(0, VOCAB_BYTES, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = {}
    for dtype in ("float32", "auto"):
        runner = ModelRunner(folder, dtype=dtype, block_size=4)
        assert all(layer.mlp.quantized is not None for layer in runner.model.model.layers), dtype
        assert all(layer.mlp.w13_weight.numel() == 0 for layer in runner.model.model.layers)  # freed
        logits[dtype] = run(runner, tokens)
    dense = ModelRunner(folder, dtype="float32", block_size=4, pack_weights=False)  # no blocks attached
    assert all(layer.mlp.quantized is None for layer in dense.model.model.layers)
    torch.testing.assert_close(logits["float32"], run(dense, tokens), atol=1e-4, rtol=0)
    rel = (logits["auto"] - logits["float32"]).norm() / logits["float32"].norm()
    assert rel < 0.05, rel


# GGUF records neither dense layers among expert ones nor sliding windows
# (llama.cpp's qwen2moe has neither); the widths differ from transformers'
# defaults for Qwen2-MoE, so the converted config must take them from the file.
QWEN2MOE = dict(SIZES, mlp_only_layers=[], use_sliding_window=False)


def test_qwen2moe_gguf_restores_the_checkpoint(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", "qwen2_moe", seed=7, vocab_size=len(vocabulary()[0]), **QWEN2MOE)
    gguf_path = tmp_path / "tiny-qwen2moe.gguf"
    write_gguf(gguf_path, "qwen2moe", hf, block_type=None)
    folder = resolve_model(str(gguf_path), cache_dir=str(tmp_path / "cache"))
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe"
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (32, 48)
    tokens = torch.randint(0, VOCAB_BYTES, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(run(folder, tokens), reference_logits(hf, tokens), atol=1e-4, rtol=0)


def test_qwen2moe_shared_expert_runs_on_its_blocks(tmp_path):
    """Q8_0 blocks (a shared expert of width 64: whole blocks of 32): the
    routed experts and the shared expert get their blocks; with --dtype
    float32 the steps equal transformers reading the GGUF itself."""
    import transformers

    from sluice_kernels import cpu_kernels
    from sluice_server.gguf_convert import _dequantize_option

    if not cpu_kernels.load():
        pytest.skip(f"the C++ CPU kernels are off here: {cpu_kernels.unavailable_reason()}")
    hf = make_tiny_model(tmp_path / "hf", "qwen2_moe", seed=8, vocab_size=len(vocabulary()[0]),
                         shared_expert_intermediate_size=64, **QWEN2MOE)
    gguf_path = tmp_path / "tiny-qwen2moe-q8.gguf"
    write_gguf(gguf_path, "qwen2moe", hf, block_type="Q8_0")
    folder = resolve_model(str(gguf_path), cache_dir=str(tmp_path / "cache"))
    runner = ModelRunner(folder, dtype="float32", block_size=4)
    for layer in runner.model.model.layers:
        shared = layer.mlp.shared_expert
        assert layer.mlp.quantized is not None
        assert shared.gate_up_proj.quantized is not None and shared.down_proj.quantized is not None
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32,
        config=transformers.AutoConfig.from_pretrained(folder), **_dequantize_option(),
    )
    tokens = torch.randint(0, VOCAB_BYTES, (16,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(run(runner, tokens), want, atol=1e-4, rtol=0)


# --- gpt-oss (`gpt-oss`): experts as MXFP4 blocks --------------------------

def write_gpt_oss_gguf(path: Path, mxfp4_folder: Path) -> None:
    """A gpt-oss GGUF as llama.cpp's converter writes one, from a gpt-oss
    MXFP4 checkpoint (testing.to_mxfp4_checkpoint): gate and up split out of
    their interleaved rows, the expert blocks repacked into ggml's MXFP4
    bytes, everything else float32, YaRN in the metadata. The converter
    clamps SwiGLU at 7 (no per-file key)."""
    import gguf
    from safetensors.torch import load_file

    from sluice_server.gguf_gpt_oss import ggml_mxfp4

    config = json.loads((mxfp4_folder / "config.json").read_text())
    rope = config["rope_parameters"]
    tokens, merges = vocabulary()
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    add_bpe_vocabulary(writer, tokens, merges)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config["num_hidden_layers"])
    tensors = load_file(str(mxfp4_folder / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            stem, suffix = name.rsplit(".", 1) if not name.endswith("sinks") else (name, "weight")
            out[f"{names.get_name(stem)}.{suffix}"] = tensor.float().numpy()
            continue
        layer = name.split(".")[2]
        kind = name.rsplit(".", 1)[1]
        if kind == "gate_up_proj_bias":
            out[f"blk.{layer}.ffn_gate_exps.bias"] = tensor[:, 0::2].numpy()
            out[f"blk.{layer}.ffn_up_exps.bias"] = tensor[:, 1::2].numpy()
        elif kind == "down_proj_bias":
            out[f"blk.{layer}.ffn_down_exps.bias"] = tensor.numpy()
        elif kind == "gate_up_proj_blocks":
            scales = tensors[name.replace("_blocks", "_scales")]
            out[f"blk.{layer}.ffn_gate_exps.weight"] = ggml_mxfp4(tensor[:, 0::2], scales[:, 0::2])
            out[f"blk.{layer}.ffn_up_exps.weight"] = ggml_mxfp4(tensor[:, 1::2], scales[:, 1::2])
        elif kind == "down_proj_blocks":
            out[f"blk.{layer}.ffn_down_exps.weight"] = ggml_mxfp4(tensor, tensors[name.replace("_blocks", "_scales")])
    for name, value in sorted(out.items()):
        if value.dtype == np.uint8:
            writer.add_tensor(name, value, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gpt_oss_gguf_serves_its_mxfp4_experts_and_equals_transformers(tmp_path):
    """The converted folder is a gpt-oss MXFP4 checkpoint (experts as blocks,
    YaRN, windows and expert counts from the metadata); the shard's logits
    equal transformers on the MXFP4 checkpoint the file was written from
    (transformers places no gpt-oss GGUF experts), with the experts on their
    MXFP4 blocks on CPU and, without the C++ kernels, on the dense copy."""
    from sluice_kernels import cpu_kernels
    from sluice_server.testing import to_mxfp4_checkpoint

    hf = to_mxfp4_checkpoint(make_tiny_model(tmp_path / "hf", "gpt_oss", seed=9, vocab_size=len(vocabulary()[0]),
                                             swiglu_limit=7.0, max_position_embeddings=64))
    gguf_path = tmp_path / "tiny-gpt-oss.gguf"
    write_gpt_oss_gguf(gguf_path, hf)
    folder = resolve_model(str(gguf_path), cache_dir=str(tmp_path / "cache"))
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["quantization_config"]["quant_method"]) == ("gpt_oss", "mxfp4")
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["sliding_window"]) == (4, 2, 8)
    rope = config["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 16.0, 16)
    tokens = torch.randint(0, VOCAB_BYTES, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    want = reference_logits(hf, tokens)
    runner = ModelRunner(folder, dtype="float32", block_size=4)
    if cpu_kernels.load():
        assert all(layer.mlp.quantized is not None for layer in runner.model.model.layers)
    torch.testing.assert_close(run(runner, tokens), want, atol=1e-4, rtol=0)
    # Greedy: the next token after every prefix is transformers'.
    assert run(folder, tokens).argmax(-1).tolist() == want.argmax(-1).tolist()

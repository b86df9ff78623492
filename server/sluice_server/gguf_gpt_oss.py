"""gpt-oss GGUF files (llama.cpp architecture `gpt-oss`) -> a gpt-oss
checkpoint folder whose experts stay MXFP4 blocks.

transformers' GGUF reader does not place gpt-oss's stacked experts, so this
writes the folder itself, as the released checkpoints are
(models/gpt_oss.py): the experts as `*_blocks` / `*_scales` with
`quantization_config` mxfp4, every other tensor dequantized to float32. The
model then loads its experts as it loads a released checkpoint: expanded
exactly, and kept as block records the CPU kernels run on.

    GGUF (per layer blk.N.)                 checkpoint (model.layers.N.)
    attn_norm, post_attention_norm          input_layernorm, post_attention_layernorm
    attn_{q,k,v,output}.{weight,bias}       self_attn.{q,k,v,o}_proj.{weight,bias}
    attn_sinks.weight                       self_attn.sinks
    ffn_gate_inp.{weight,bias}              mlp.router.{weight,bias}
    ffn_gate_exps, ffn_up_exps [E, I, H]    mlp.experts.gate_up_proj_{blocks,scales}
        (MXFP4) and their .bias [E, I]          [E, 2 I, H/32, ...], gate and up rows
                                                interleaved (2j gate j, 2j + 1 up j); _bias
    ffn_down_exps [E, H, I] (MXFP4), .bias  mlp.experts.down_proj_{blocks,scales,bias}
    token_embd, output_norm, output         model.embed_tokens, model.norm, lm_head

One MXFP4 block of 32 weights, in each layout:

    GGUF (ggml block_mxfp4, 17 bytes)       checkpoint
    byte 0       e (E8M0: 2^(e - 127))       scales[..., g] = e (the same byte)
    bytes 1..16  qs[j]: low nibble weight j, blocks[..., g, m]: low nibble weight 2m,
                 high nibble weight j + 16   high nibble weight 2m + 1

The codes are FP4 (E2M1) in both (ggml's table is the values doubled, its
scale halved). llama.cpp does not permute gpt-oss's q/k (NeoX rotary), and
alternates windows from layer 0 (sliding, full, ...), as the checkpoints do.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sluice_server.gguf_header import GGUFHeader, tensor_bytes
from sluice_server.model_folder import ModelResolutionError, write_weight_index

ARCH = "gpt-oss"

NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}"
       for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
}
# Tensors llama.cpp may add that a checkpoint does not have.
SKIPPED = ("rope_freqs.weight",)


def gpt_oss_config(header: GGUFHeader, vocab_size: int, tokenizer) -> dict:
    """config.json of a gpt-oss GGUF, from its `gpt-oss.*` metadata."""
    meta = header.metadata
    key = lambda name: f"{ARCH}.{name}"  # noqa: E731
    try:
        heads = int(meta[key("attention.head_count")])
        hidden = int(meta[key("embedding_length")])
        layers = int(meta[key("block_count")])
        experts = int(meta[key("expert_count")])
        used = int(meta[key("expert_used_count")])
    except KeyError as missing:
        raise ModelResolutionError(f"gpt-oss GGUF: metadata key {missing.args[0]} is missing") from None
    window = int(meta.get(key("attention.sliding_window"), 128))
    rope = {"rope_type": "default", "rope_theta": float(meta.get(key("rope.freq_base"), 150000.0))}
    # YaRN (rope.scaling.*) is added by the caller, as for every architecture;
    # gpt-oss's own YaRN does not truncate its correction range.
    if meta.get(key("rope.scaling.type")) == "yarn":
        rope["truncate"] = False
    return {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(meta.get(key("expert_feed_forward_length"), meta.get(key("feed_forward_length")))),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(key("attention.head_count_kv"), heads)),
        "head_dim": int(meta.get(key("attention.key_length"), hidden // heads)),
        "max_position_embeddings": int(meta.get(key("context_length"), 131072)),
        "rms_norm_eps": float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
        "rope_parameters": rope,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "swiglu_limit": _swiglu_limit(meta.get(key("swiglu_clamp_exp"))),
        "attention_bias": True,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
        },
    }


def _swiglu_limit(value) -> float:
    """llama.cpp's gpt-oss clamps at 7; a file may say so (a number; the
    header reader leaves arrays, per-layer clamps, unread: refused)."""
    if value is None:
        return 7.0
    if not isinstance(value, (int, float)):
        raise ModelResolutionError("gpt-oss GGUF: per-layer swiglu_clamp_exp is not supported (one clamp for all)")
    return float(value)


def write_gpt_oss_folder(gguf_path: Path, header: GGUFHeader, folder: Path, tokenizer) -> dict:
    """Writes config.json and the weights (one safetensors file per layer) of
    a gpt-oss GGUF into `folder`; returns the config."""
    tensors = {t.name: t for t in header.tensors}
    config = gpt_oss_config(header, tensors["token_embd.weight"].shape[1], tokenizer)
    files = _write_weights(gguf_path, header, folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_weight_index(folder, files)
    return config


def _write_weights(gguf_path: Path, header: GGUFHeader, folder: Path) -> dict[str, list[str]]:
    from safetensors.torch import save_file

    files: dict[str, list[str]] = {}
    for group, members in header.by_layer(SKIPPED):
        out = {}
        if group == "rest":
            for name, t in members.items():
                if name not in NAMES:
                    raise ModelResolutionError(f"gpt-oss GGUF tensor {name} is not one Sluice knows how to place")
                out[NAMES[name]] = _dense(gguf_path, t)
        else:
            out = _layer_tensors(gguf_path, group, members)
        file = f"model-{group}.safetensors"
        save_file(out, str(folder / file), metadata={"format": "pt"})
        files[file] = sorted(out)
    return files


def _layer_tensors(gguf_path: Path, group: str, members: dict) -> dict:
    import torch

    layer = int(group.split("-")[1])
    prefix = f"model.layers.{layer}"
    out = {}
    experts = {}
    for name, t in members.items():
        rest = name.split(".", 2)[2]
        if rest in LAYER_NAMES:
            out[f"{prefix}.{LAYER_NAMES[rest]}"] = _dense(gguf_path, t)
        elif rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
            if t.type_name != "MXFP4":
                raise ModelResolutionError(
                    f"gpt-oss GGUF: expert tensor {name} is {t.type_name}; Sluice serves gpt-oss experts as MXFP4"
                )
            experts[rest.split(".")[0]] = mxfp4_blocks(gguf_path, t)
        elif rest in ("ffn_gate_exps.bias", "ffn_up_exps.bias"):
            experts[rest] = _dense(gguf_path, t)
        else:
            raise ModelResolutionError(f"gpt-oss GGUF tensor {name} is not one Sluice knows how to place")
    want = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_exps.bias", "ffn_up_exps.bias"}
    if set(experts) != want:
        raise ModelResolutionError(f"gpt-oss GGUF layer {layer}: expert tensors missing: "
                                   f"{', '.join(sorted(want - set(experts)))}")
    stem = f"{prefix}.mlp.experts"
    (gate_b, gate_s), (up_b, up_s) = experts["ffn_gate_exps"], experts["ffn_up_exps"]
    out[f"{stem}.gate_up_proj_blocks"] = interleave(gate_b, up_b)
    out[f"{stem}.gate_up_proj_scales"] = interleave(gate_s, up_s)
    out[f"{stem}.gate_up_proj_bias"] = interleave(experts["ffn_gate_exps.bias"], experts["ffn_up_exps.bias"])
    out[f"{stem}.down_proj_blocks"], out[f"{stem}.down_proj_scales"] = experts["ffn_down_exps"]
    return {k: torch.as_tensor(v).contiguous() for k, v in out.items()}


def _dense(gguf_path: Path, t):
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = np.array(tensor_bytes(gguf_path, t))
    values = dequantize(raw, GGMLQuantizationType[t.type_name]).reshape(tuple(reversed(t.shape)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def mxfp4_blocks(gguf_path: Path, t):
    """A stacked MXFP4 tensor [E, rows, K] -> the checkpoint's (blocks [E,
    rows, K/32, 16], scales [E, rows, K/32]) uint8 (module docstring)."""
    import torch

    raw = np.array(tensor_bytes(gguf_path, t)).reshape(*reversed(t.shape[1:]), t.shape[0] // 32, 17)
    scales, qs = raw[..., 0], raw[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # weights 0..31 of each block
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(np.ascontiguousarray(scales))


def ggml_mxfp4(blocks, scales) -> np.ndarray:
    """The inverse of `mxfp4_blocks`: checkpoint blocks [..., G, 16] and
    scales [..., G] -> ggml's bytes [..., G * 17] (for writing test files)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*blocks.shape[:-2], -1).astype(np.uint8)


def interleave(gate, up):
    """[E, I, ...] gate and up -> [E, 2 I, ...], rows gate 0, up 0, gate 1, ..."""
    import torch

    gate, up = torch.as_tensor(gate), torch.as_tensor(up)
    return torch.stack([gate, up], dim=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])

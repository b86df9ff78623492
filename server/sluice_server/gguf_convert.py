"""Turns a .gguf file into a normal model folder, once.

transformers reads the GGUF (metadata, tokenizer, dequantized tensors; it
also undoes llama.cpp's q/k permutation) and writes the standard layout:

    <cache>/<stem>-<key>/
        config.json               model config
        generation_config.json    bos/eos ids
        model.safetensors         float32 weights (faithful to the dequantized file);
                                  for Llama, Qwen2 and Qwen3 files only those the CPU
                                  kernels do not read as blocks (norms, biases, ...)
        gguf_tensors.json         Llama, Qwen2, Qwen3: where each block-served matrix
                                  is in the .gguf, read from there (gguf_checkpoint.py)
        tokenizer.json            fast tokenizer, readable by the Rust router
        tokenizer_config.json     with "chat_template"
        chat_template.jinja       the same template (newer transformers read this)
        gguf_source.json          {"gguf": path of the .gguf}: a CPU shard also runs
                                  its quantized blocks directly (layers.gguf_weights)

key hashes the file's resolved path, size and mtime, so an edited or
replaced file converts again while an unchanged one is reused. The folder
is built under a temporary name (`.tmp-<folder>-<host>-<pid>`) and renamed
into place: a folder that exists is complete. A conversion that is
interrupted removes its temporary folder (the CLI turns SIGTERM into an
exception); one killed outright leaves it, and the next conversion on the
same host removes it once its process is gone.

Before transformers reads it, `check_gguf_file` reads the header
(gguf_header.py: a second or so, where transformers' reader takes minutes
on a large vocabulary) and refuses, in one sentence naming the file, what
Sluice cannot serve or what would otherwise fail deep inside the reader: a
file that is not GGUF (magic), one cut short (a tensor ends past the end of
the file), an architecture no model family serves, a rope scaling type
no rotary implements, and a tensor type the conversion does not dequantize.
Nothing is written then.

Llama, Qwen2 and Qwen3 files (gguf_checkpoint.DIRECT_ARCHITECTURES) are
not read by transformers' model loader: it dequantizes every tensor into a
float32 model (8.9 GB at Llama-3.2-1B's size, 32 GB at 8B), and the shard
serves the matrices on their blocks anyway. transformers reads their
config and tokenizer only; `write_direct_folder` writes the small tensors
and the table of the block-served ones (gguf_checkpoint.py), a tensor at a
time, with the same expansion and q/k permutation transformers applies.

Two additions to what transformers reads:

- Rope scaling. transformers' GGUF reader ignores `<arch>.rope.scaling.*`;
  the converted config.json gets it (`rope_scaling_from_metadata`: linear,
  yarn with its factor, original context and beta bounds), so the model
  rotates as llama.cpp would and serves the extended length.
- Mixtral. llama.cpp files Mixtral under architecture `llama` with an
  `expert_count` and each layer's experts stacked (`ffn_gate_exps`,
  `ffn_up_exps`, `ffn_down_exps`: [E, rows, cols]), which transformers does
  not read; `write_mixtral_folder` dequantizes the tensors with the gguf
  package itself, undoes llama.cpp's q/k row permutation and writes the
  Mixtral checkpoint layout, one safetensors file per layer.
- gpt-oss. transformers does not place its stacked experts either;
  gguf_gpt_oss.py writes the checkpoint layout with the experts kept as
  MXFP4 blocks (as the released checkpoints are), the rest in float32.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from sluice_server.gguf_gpt_oss import ARCH as GPT_OSS_ARCH, write_gpt_oss_folder
from sluice_server.gguf_checkpoint import TENSORS_FILE, checkpoint_name, dequantized, direct_architecture, manifest, \
    rotary_heads, unpermute_rotary_rows
from sluice_server.gguf_header import GGML_QUANT_SIZES, GGUFFormatError, GGUFHeader, read_header, tensor_bytes
from sluice_server.model_folder import (
    SOURCE_FILE,
    ModelResolutionError,
    check_model_folder,
    progress,
    write_weight_index,
)


# Part of the folder key: a change to what a converted folder holds converts again.
# 4: block-served matrices of Llama/Qwen2/Qwen3 files stay in the .gguf.
FORMAT_VERSION = 4

# GGUF `general.architecture` -> the model_type transformers writes for it
# (each one of models.MODEL_FAMILIES). llama.cpp files most Mistral models
# under "llama" (without their sliding window, which GGUF does not record).
GGUF_ARCHITECTURES = {
    "gemma3": "gemma3_text",
    "gpt-oss": "gpt_oss",
    "llama": "llama",
    "mistral": "mistral",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen2moe": "qwen2_moe",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
}
# `llama` files with experts are Mixtral (llama.cpp's convention).
MIXTRAL = "mixtral"
# `<arch>.rope.scaling.type` values the rotary implements ("none": no scaling).
GGUF_ROPE_SCALING = ("none", "linear", "yarn")
# Tensor types the conversion expands to float32, exactly as the gguf
# package's dequantizer does (transformers calls it): the float types, the
# legacy and K-quant blocks of the Q*_K_M/Q*_K_S/Q8_0 files, and the i-quants.
GGUF_TENSOR_TYPES = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "MXFP4",
)


def converted_folder(gguf_path: Path, cache: Path) -> Path:
    """Where `gguf_path` is (or will be) converted to inside `cache`."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = hashlib.sha256(
        f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}\0{FORMAT_VERSION}".encode()
    ).hexdigest()[:16]
    return cache / f"{resolved.stem}-{key}"


def check_gguf_file(path: Path) -> GGUFHeader:
    """The file's header, if Sluice can serve the file; otherwise one
    ModelResolutionError naming the file and, for what Sluice does not
    serve, what it does."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelResolutionError(f"{path.name} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    try:
        header = read_header(path)
    except GGUFFormatError as e:
        raise ModelResolutionError(f"{path.name} is damaged or cut short: its header cannot be read ({e})") from None
    arch = header.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelResolutionError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    scaling = header.metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in GGUF_ROPE_SCALING:
        raise ModelResolutionError(
            f"{path.name}: rope scaling type {scaling!r} is not supported; supported: {', '.join(GGUF_ROPE_SCALING)}"
        )
    for t in header.tensors:
        if t.type_name not in GGUF_TENSOR_TYPES:
            raise ModelResolutionError(
                f"{path.name}: tensor {t.name} is of type {t.type_name}, which cannot be dequantized; "
                f"supported: {', '.join(GGUF_TENSOR_TYPES)}"
            )
        end = t.offset + t.nbytes
        if end > size:
            raise ModelResolutionError(
                f"{path.name} is cut short: tensor {t.name} ends at byte {end}, but the file has {size} bytes"
            )
    return header


def gguf_model_type(header: GGUFHeader) -> str:
    """The model_type a checked file converts to."""
    arch = header.architecture
    if arch == "llama" and header.metadata.get("llama.expert_count", 0) > 0:
        return MIXTRAL
    return GGUF_ARCHITECTURES[arch]


def rope_scaling_from_metadata(header: GGUFHeader) -> dict | None:
    """config.json's rope settings for the file's `rope.scaling.*` keys (None:
    unscaled). llama.cpp's `attn_factor` multiplies YaRN's own cos/sin
    scale (0.1 ln factor + 1), which is transformers' `attention_factor`."""
    meta, arch = header.metadata, header.architecture
    key = lambda name: f"{arch}.rope.scaling.{name}"  # noqa: E731
    kind = meta.get(key("type"), "none")
    factor = meta.get(key("factor")) or meta.get(f"{arch}.rope.scale_linear")
    if kind == "linear" or (kind == "none" and factor and factor != 1.0):
        return {"rope_type": "linear", "factor": float(factor)}
    if kind != "yarn":
        return None
    if not factor:
        raise ModelResolutionError(f"{arch}: rope scaling yarn without {key('factor')}")
    params = {"rope_type": "yarn", "factor": float(factor)}
    if meta.get(key("original_context_length")):
        params["original_max_position_embeddings"] = int(meta[key("original_context_length")])
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if meta.get(key(theirs)):
            params[ours] = float(meta[key(theirs)])
    attn = meta.get(key("attn_factor"))
    if attn and attn != 1.0:
        params["attention_factor"] = float(attn) * (0.1 * math.log(float(factor)) + 1.0 if factor > 1 else 1.0)
    return params


def convert_gguf(gguf_path: Path, cache: Path) -> Path:
    """Returns the converted folder for `gguf_path`, converting on first use."""
    out = converted_folder(gguf_path, cache)
    if out.is_dir():
        progress(f"using converted {gguf_path.name} in {out}")
        return out
    check_gguf_file(gguf_path)
    cache.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(cache)
    tmp = cache / f".tmp-{out.name}-{_host()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converting {gguf_path} into {out} (once; takes a minute)")
    try:
        tmp.mkdir()
        # transformers and tqdm may print; stdout belongs to our caller.
        with contextlib.redirect_stdout(sys.stderr):
            _write_folder(gguf_path.resolve(), tmp)
        check_model_folder(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.is_dir():  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converted {gguf_path.name}")
    return out


def _host() -> str:
    # A cache may be shared between hosts: a pid means something on its own host only.
    return socket.gethostname().replace("-", "_") or "host"


def remove_stale_tmp(cache: Path) -> list[Path]:
    """Removes the temporary folders of conversions on this host whose process
    is gone (killed: a conversion that fails or is interrupted cleans up
    itself). Returns what was removed."""
    removed = []
    suffix = re.compile(rf"-{re.escape(_host())}-(\d+)$")
    for tmp in cache.glob(".tmp-*"):
        found = suffix.search(tmp.name)
        if found and tmp.is_dir() and not _process_alive(int(found.group(1))):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _write_folder(gguf_path: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    header = read_header(gguf_path)
    source = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    try:
        tokenizer = _tokenizer(source, header)
        if gguf_model_type(header) == MIXTRAL:
            config = write_mixtral_folder(gguf_path, header, folder, tokenizer)
        elif header.architecture == GPT_OSS_ARCH:
            config = SimpleNamespace(**write_gpt_oss_folder(gguf_path, header, folder, tokenizer))
        elif direct_architecture(header):
            config = write_direct_folder(gguf_path, header, folder, source)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                **source, dtype=torch.float32, trust_remote_code=False, **_config_option(source, header),
                **_dequantize_option(),
            )
            model.save_pretrained(folder)
            config = model.config
    except ModelResolutionError:
        raise
    except Exception as error:  # a bad or unsupported file fails in many ways inside the reader
        raise ModelResolutionError(
            f"transformers cannot read {gguf_path.name}: {type(error).__name__}: {error}"
        ) from error
    tokenizer.save_pretrained(folder)
    _write_rope_scaling(folder, rope_scaling_from_metadata(header))
    _write_chat_template(folder, tokenizer.chat_template)
    _write_generation_config(folder, config, tokenizer)
    (folder / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_path)}) + "\n")


def _tokenizer(source: dict, header: GGUFHeader):
    """The file's tokenizer. AutoTokenizer reads the file's config first,
    which fails on a gpt-oss file with YaRN keys (transformers 5 parses each
    `gpt-oss.rope.scaling.*` value from the key's bytes); the fast tokenizer
    class reads only the tokenizer's keys."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if header.architecture == GPT_OSS_ARCH:
        return PreTrainedTokenizerFast.from_pretrained(**source)
    return AutoTokenizer.from_pretrained(**source, trust_remote_code=False)


# Config keys transformers' GGUF reader does not map although the weights'
# shapes depend on them: {architecture: {config key: GGUF metadata key}}.
# Without them it assumes Qwen3's head_dim of 128, Qwen3-30B-A3B's expert
# width of 768, and Qwen1.5-MoE-A2.7B's expert and shared expert widths
# (1408, 5632).
CONFIG_GAPS = {
    "qwen3": {"head_dim": "qwen3.attention.key_length"},
    "qwen3moe": {"moe_intermediate_size": "qwen3moe.expert_feed_forward_length"},
    "qwen2moe": {
        "moe_intermediate_size": "qwen2moe.expert_feed_forward_length",
        "shared_expert_intermediate_size": "qwen2moe.expert_shared_feed_forward_length",
    },
}


def _config_option(source: dict, header: GGUFHeader) -> dict:
    """A config for transformers' reader with the CONFIG_GAPS the file fills."""
    gaps = {key: header.metadata[meta] for key, meta in CONFIG_GAPS.get(header.architecture, {}).items()
            if meta in header.metadata}
    if not gaps:
        return {}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(**source, trust_remote_code=False)
    for key, value in gaps.items():
        setattr(config, key, int(value))
    return {"config": config}


def _write_rope_scaling(folder: Path, params: dict | None) -> None:
    if params is None:
        return
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = dict(config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.update(params)
    config["rope_parameters"] = rope
    config.pop("rope_scaling", None)
    path.write_text(json.dumps(config, indent=2) + "\n")


def write_direct_folder(gguf_path: Path, header: GGUFHeader, folder: Path, source: dict):
    """Writes config.json, model.safetensors (the tensors that are not
    block-served, float32) and gguf_tensors.json (where the block-served ones
    are) for a file of a direct architecture (module docstring); returns the
    config. Tensors of block types the kernels do not read (Q2_K, Q3_K,
    i-quants) are among the float32 ones, all held until the file is written:
    a file made mostly of those converts with their float32 size in memory,
    as every file did before."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = _config_option(source, header).get("config") or AutoConfig.from_pretrained(
        **source, trust_remote_code=False
    )
    config.dtype = torch.float32  # what the weights are expanded to, as the old folders said
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    blocks = manifest(header)
    small = {}
    for t in header.tensors:
        name = checkpoint_name(t.name)
        if name is None or name in blocks:
            continue
        small[name] = torch.from_numpy(dequantized(gguf_path, t, rotary_heads(header, t.name)))
    save_file(small, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / TENSORS_FILE).write_text(json.dumps({"tensors": blocks}, indent=1) + "\n")
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    return config


# llama.cpp's Mixtral tensor names -> the checkpoint's, per layer (blk.N.*) or whole.
MIXTRAL_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
}
MIXTRAL_EXPERT_NAMES = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}
MIXTRAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# Tensors llama.cpp adds that a checkpoint does not have.
MIXTRAL_SKIPPED = ("rope_freqs.weight",)


def write_mixtral_folder(gguf_path: Path, header: GGUFHeader, folder: Path, tokenizer):
    """Writes config.json and the weights of a Mixtral GGUF (module
    docstring) into `folder`; returns the config."""
    import transformers

    meta = header.metadata
    heads = int(meta["llama.attention.head_count"])
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    hidden = int(meta["llama.embedding_length"])
    tensors = {t.name: t for t in header.tensors}
    vocab = tensors["token_embd.weight"].shape[1]
    config = transformers.MixtralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(meta.get("llama.context_length", 32768)),
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("llama.rope.freq_base", 1e6)),
        num_local_experts=int(meta["llama.expert_count"]),
        num_experts_per_tok=int(meta["llama.expert_used_count"]),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    files = _write_mixtral_weights(gguf_path, header, folder, {"q": heads, "k": kv_heads})
    config.save_pretrained(folder)
    write_weight_index(folder, files)
    return config


def _write_mixtral_weights(gguf_path: Path, header: GGUFHeader, folder: Path, heads: dict[str, int]):
    """One safetensors file per layer (and one for the rest), so a layer at a
    time is in memory. Returns {file: tensor names}."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    files: dict[str, list[str]] = {}
    for group, members in header.by_layer(MIXTRAL_SKIPPED):
        out: dict[str, torch.Tensor] = {}
        for name, t in members.items():
            raw = np.array(tensor_bytes(gguf_path, t))
            values = dequantize(raw, GGMLQuantizationType[t.type_name]).reshape(tuple(reversed(t.shape)))
            out.update(_mixtral_tensors(name, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)), heads))
        file = f"model-{group}.safetensors"
        save_file(out, str(folder / file), metadata={"format": "pt"})
        files[file] = sorted(out)
    return files


def _mixtral_tensors(name: str, value, heads: dict[str, int]) -> dict:
    """One GGUF tensor -> its checkpoint tensor(s) (experts split one by one)."""
    if name in MIXTRAL_NAMES:
        return {MIXTRAL_NAMES[name]: value}
    _, layer, rest = name.split(".", 2)
    prefix = f"model.layers.{layer}"
    if rest in MIXTRAL_EXPERT_NAMES:
        w = MIXTRAL_EXPERT_NAMES[rest]
        return {f"{prefix}.block_sparse_moe.experts.{e}.{w}.weight": value[e].clone() for e in range(value.shape[0])}
    if rest not in MIXTRAL_LAYER_NAMES:
        raise ModelResolutionError(f"Mixtral GGUF tensor {name} is not one Sluice knows how to place")
    if rest in ("attn_q.weight", "attn_k.weight"):
        value = unpermute_rotary_rows(value, heads["q" if rest == "attn_q.weight" else "k"])
    return {f"{prefix}.{MIXTRAL_LAYER_NAMES[rest]}": value}


def _dequantize_option() -> dict:
    """transformers 5 keeps GGUF weights quantized (and then refuses to save
    them) unless asked to dequantize; 4.x always dequantized and has no
    GgufConfig."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _write_chat_template(folder: Path, template: str | None) -> None:
    # Readers differ: older transformers and most tools look in
    # tokenizer_config.json, newer transformers in chat_template.jinja.
    if not template:
        return
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (folder / "chat_template.jinja").write_text(template)


def _write_generation_config(folder: Path, config, tokenizer) -> None:
    # The router stops on generation_config's eos ids; make sure they exist
    # even when the GGUF metadata gave transformers nothing to write.
    path = folder / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    for key, fallback in (("bos_token_id", tokenizer.bos_token_id), ("eos_token_id", tokenizer.eos_token_id)):
        if generation.get(key) is None:
            value = getattr(config, key, None)
            generation[key] = value if value is not None else fallback
    path.write_text(json.dumps(generation, indent=2) + "\n")

"""Turns a .gguf file into a normal model folder, once.

transformers reads the GGUF (metadata, tokenizer, dequantized tensors; it
also undoes llama.cpp's q/k permutation) and writes the standard layout:

    <cache>/<stem>-<key>/
        config.json               model config
        generation_config.json    bos/eos ids
        model.safetensors         float32 weights (faithful to the dequantized file)
        tokenizer.json            fast tokenizer, readable by the Rust router
        tokenizer_config.json     with "chat_template"
        chat_template.jinja       the same template (newer transformers read this)
        gguf_source.json          {"gguf": path of the .gguf}: a CPU shard also runs
                                  its quantized blocks directly (layers.gguf_weights)

key hashes the file's resolved path, size and mtime, so an edited or
replaced file converts again while an unchanged one is reused. The folder
is built under a temporary name and renamed into place: a folder that
exists is complete.

Before transformers reads it, `check_gguf_file` refuses, in one sentence
naming the file, what would otherwise fail deep inside the reader: a file
that is not GGUF (magic), one cut short (a tensor ends past the end of the
file), and a tensor type that cannot be dequantized.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from sluice_server.model_folder import SOURCE_FILE, ModelResolutionError, check_model_folder, progress


# Part of the folder key: a change to what a converted folder holds converts again.
FORMAT_VERSION = 2


def converted_folder(gguf_path: Path, cache: Path) -> Path:
    """Where `gguf_path` is (or will be) converted to inside `cache`."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = hashlib.sha256(
        f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}\0{FORMAT_VERSION}".encode()
    ).hexdigest()[:16]
    return cache / f"{resolved.stem}-{key}"


def check_gguf_file(path: Path) -> None:
    """Raises ModelResolutionError unless `path` is a whole GGUF file whose
    tensors all have a type the gguf package dequantizes."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUFReader
    from gguf.quants import dequantize

    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelResolutionError(f"{path.name} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    try:
        tensors = GGUFReader(str(path)).tensors
    except Exception as e:  # the reader fails in many ways on a damaged header
        raise ModelResolutionError(
            f"{path.name} is damaged or cut short: its header cannot be read ({type(e).__name__}: {e})"
        ) from e
    checked = set()
    for t in tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelResolutionError(
                f"{path.name} is cut short: tensor {t.name} ends at byte {end}, but the file has {size} bytes"
            )
        if t.tensor_type in checked:
            continue
        block_bytes = GGML_QUANT_SIZES[t.tensor_type][1]
        try:
            dequantize(np.zeros((1, block_bytes), dtype=np.uint8), t.tensor_type)
        except NotImplementedError:
            raise ModelResolutionError(
                f"{path.name}: tensor {t.name} is of type {t.tensor_type.name}, which cannot be dequantized"
            ) from None
        checked.add(t.tensor_type)


def convert_gguf(gguf_path: Path, cache: Path) -> Path:
    """Returns the converted folder for `gguf_path`, converting on first use."""
    out = converted_folder(gguf_path, cache)
    if out.is_dir():
        progress(f"using converted {gguf_path.name} in {out}")
        return out
    check_gguf_file(gguf_path)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converting {gguf_path} into {out} (once; takes a minute)")
    try:
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


def _write_folder(gguf_path: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**source, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            **source, dtype=torch.float32, trust_remote_code=False, **_dequantize_option()
        )
    except Exception as error:  # a bad or unsupported file fails in many ways inside the reader
        raise ModelResolutionError(
            f"transformers cannot read {gguf_path.name}: {type(error).__name__}: {error}"
        ) from error
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _write_chat_template(folder, tokenizer.chat_template)
    _write_generation_config(folder, model.config, tokenizer)
    (folder / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_path)}) + "\n")


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

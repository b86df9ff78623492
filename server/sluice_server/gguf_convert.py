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
the file), an architecture no model family serves, and a tensor type the
conversion does not dequantize. Nothing is written then.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from sluice_server.gguf_header import GGML_QUANT_SIZES, GGUFFormatError, GGUFHeader, read_header
from sluice_server.model_folder import SOURCE_FILE, ModelResolutionError, check_model_folder, progress


# Part of the folder key: a change to what a converted folder holds converts again.
FORMAT_VERSION = 2

# GGUF `general.architecture` -> the model_type transformers writes for it
# (each one of models.MODEL_FAMILIES). llama.cpp files most Mistral models
# under "llama" (without their sliding window, which GGUF does not record).
GGUF_ARCHITECTURES = {
    "gemma3": "gemma3_text",
    "llama": "llama",
    "mistral": "mistral",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
# Tensor types the conversion expands to float32, exactly as the gguf
# package's dequantizer does (transformers calls it): the float types, the
# legacy and K-quant blocks of the Q*_K_M/Q*_K_S/Q8_0 files, and the i-quants.
GGUF_TENSOR_TYPES = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
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

"""What a servable model folder holds, and the checks every way of getting
one (Hub download, local folder, .gguf conversion) applies to it.

A leaf module: the standard library only, so the downloader, the GGUF
converter and the model layers can all import it without importing each
other.

    <folder>/
        config.json              required
        *.safetensors            required (pickled .bin/.pt weights are refused)
        tokenizer.json, generation_config.json, chat_template.jinja, ...
        gguf_source.json         only in a folder converted from a .gguf:
                                 {"gguf": path of the .gguf} (layers.gguf_weights)

A LoRA adapter folder (PEFT's layout; `adapters` reads it on the shard):

    <folder>/
        adapter_config.json         required
        adapter_model.safetensors   required (adapter_model.bin is refused)
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path
from typing import Iterable

# Written into a folder converted from a .gguf, naming the file it came from.
SOURCE_FILE = "gguf_source.json"

PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


class ModelResolutionError(Exception):
    """A model id that cannot be turned into a servable folder; the message
    says why and what to do."""


def check_model_folder(folder: Path) -> Path:
    """Returns `folder` if it holds config.json and safetensors weights."""
    if not folder.is_dir():
        raise ModelResolutionError(f"model folder not found: {folder}")
    files = [p.name for p in folder.iterdir() if p.is_file()]
    ggufs = [f for f in files if f.endswith(".gguf")]
    if "config.json" not in files:
        hint = f"; to serve a .gguf, pass the file itself: {folder / ggufs[0]}" if ggufs else ""
        raise ModelResolutionError(f"{folder} has no config.json{hint}")
    check_weight_format(files, str(folder))
    return folder


def check_weight_format(files: Iterable[str], where: str) -> None:
    """Raises unless `files` (a folder's or a repository's) include safetensors weights."""
    files = list(files)
    if any(f.endswith(".safetensors") for f in files):
        return
    pickled = [f for f in files if any(fnmatch.fnmatch(f, p) for p in PICKLED_WEIGHTS)]
    if pickled:
        raise ModelResolutionError(
            f"{where} has only pickled weights ({', '.join(sorted(pickled)[:3])}); Sluice loads "
            "safetensors only, since unpickling runs arbitrary code. Use a repository with "
            ".safetensors weights, or convert these to safetensors first."
        )
    raise ModelResolutionError(f"{where} has no .safetensors weights")


def progress(message: str) -> None:
    """Download and conversion progress goes to stderr: stdout belongs to the
    caller (the CLI prints the resolved folder there)."""
    print(f"[sluice download] {message}", file=sys.stderr, flush=True)


def write_weight_index(folder: Path, files: dict[str, list[str]]) -> None:
    """model.safetensors.index.json for weights written as {file: tensor names}."""
    weight_map = {name: file for file, names in files.items() for name in names}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n"
    )

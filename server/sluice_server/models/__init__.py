"""Model families and the weight loader.

`build_model(config, ...)` picks the family from config.json's model_type;
`load_weights(model, folder)` copies every safetensors tensor into its
parameter through the parameter's `weight_loader`, which takes only this
rank's tensor-parallel slice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from safetensors import safe_open

from sluice_server.distributed import Distributed
from sluice_server.layers.attention import AttentionBackend
from sluice_server.models.llama import LlamaForCausalLM

MODEL_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def model_class(model_type: str) -> type[nn.Module]:
    try:
        return MODEL_FAMILIES[model_type]
    except KeyError:
        supported = ", ".join(sorted(MODEL_FAMILIES))
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {supported}") from None


def build_model(
    config: dict[str, Any], dist: Distributed, backend: AttentionBackend, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """Allocates the model (uninitialised) directly in `dtype` on `device`."""
    cls = model_class(config.get("model_type", "<missing>"))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config, dist, backend).eval()
    finally:
        torch.set_default_dtype(previous)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return files


def _target(model: nn.Module, name: str) -> tuple[str, int]:
    """Checkpoint tensor name -> (our parameter name, piece index of a fused layer)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in model.packed_modules:
        fused, shard_id = model.packed_modules[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard_id
    return name, 0


def load_weights(model: nn.Module, folder: Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    # A fused parameter (qkv, gate_up) is complete once each of its pieces loaded.
    pieces_needed = {name: getattr(p, "num_pieces", 1) for name, p in params.items()}
    loaded: dict[str, set[int]] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(model.ignored_suffixes) or (tied and name == "lm_head.weight"):
                    continue
                target, shard_id = _target(model, name)
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
                param = params[target]
                param.weight_loader(param, f.get_slice(name), shard_id)
                loaded.setdefault(target, set()).add(shard_id)
    if tied:
        loaded["lm_head.weight"] = {0}
    missing = [n for n, k in pieces_needed.items() if len(loaded.get(n, ())) != k]
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks weights for: {', '.join(sorted(missing)[:8])}")

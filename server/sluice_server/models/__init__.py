"""Model families and the weight loader.

`build_model(config, ...)` picks the family from config.json's model_type;
`load_weights(model, folder)` copies every safetensors tensor into its
parameter through the parameter's `weight_loader`, which takes only this
rank's tensor-parallel slice; in a folder converted from a Llama/Qwen GGUF,
the block-served matrices come from the .gguf, expanded one at a time
(gguf_checkpoint.py), except those of parameters the shard emptied because
their layer serves every step on the blocks (`skip`).

    model_type          file                 what it adds
    llama, mistral,     models/llama.py      (the base: GQA, rotary, SwiGLU;
    qwen2                                     per-layer sliding windows)
    qwen3               models/qwen3.py      per-head q/k RMSNorm
    phi3                models/phi3.py       fused checkpoint tensors, LongRoPE
    gemma3_text         models/gemma3.py     (1 + w) norms, GELU, local/global layers
    qwen3_moe           models/qwen3_moe.py  Qwen3 attention, expert MLPs (layers/moe.py)
    qwen2_moe           models/qwen2_moe.py  Qwen2 attention, expert MLPs and a gated
                                             shared expert
    mixtral             models/mixtral.py    Mistral attention, expert MLPs
    gpt_oss             models/gpt_oss.py    attention sinks, biases, alternating windows,
                                             clamped-SwiGLU experts (MXFP4 checkpoints too)

A fast path lives beside the model it speeds up: models/llama_cpu_decoder.py
runs the Llama model's decode steps on CPU in one C++ call (the model runner
picks the steps). Models import layers and kernels, never the batch or the
servicer above them.

Checkpoint names map to parameters in three steps (`_target`): the family's
`checkpoint_renames` (Mixtral's block_sparse_moe -> mlp), then one expert's
tensor (`...experts.<e>.<projection>`) to its slot in the layer's stacked
expert weights (the family's `expert_projections`), or a fused layer's piece
(`packed_modules`: q/k/v -> qkv_proj). A family with other layouts (gpt-oss's
stacked experts) adds a `checkpoint_target` hook, consulted first.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from safetensors import safe_open

from sluice_server.distributed import Distributed
from sluice_server.gguf_checkpoint import GGUFTensors
from sluice_server.layers.attention import AttentionBackend
from sluice_server.models.gemma3 import Gemma3ForCausalLM
from sluice_server.models.gpt_oss import GptOssForCausalLM
from sluice_server.models.llama import LlamaForCausalLM
from sluice_server.models.mixtral import MixtralForCausalLM
from sluice_server.models.phi3 import Phi3ForCausalLM
from sluice_server.models.qwen2_moe import Qwen2MoeForCausalLM
from sluice_server.models.qwen3 import Qwen3ForCausalLM
from sluice_server.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_FAMILIES: dict[str, type[nn.Module]] = {
    "gemma3_text": Gemma3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}

# One expert's tensor in a checkpoint that stores experts one by one.
EXPERT_TENSOR = re.compile(r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.(?P<kind>weight|bias)$")


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
        return [folder / _confined(n, index) for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return files


def _confined(name: str, index: Path) -> str:
    """A file name from the index, if it names a .safetensors file inside
    the folder. The check is on the name, not the resolved path: in the Hub
    cache every file is a symlink into ../../blobs."""
    if not isinstance(name, str) or not name.endswith(".safetensors") or Path(name).is_absolute() \
            or ".." in Path(name).parts:
        raise ValueError(f"{index.name} lists {name!r}: weight files must be .safetensors files inside the model folder")
    return name


def _target(model: nn.Module, name: str) -> tuple[str, int]:
    """Checkpoint tensor name -> (our parameter name, piece index of a fused
    layer or of stacked experts). The steps are in the module docstring."""
    for old, new in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(old, new)
    hook = getattr(model, "checkpoint_target", None)
    found = hook(name) if hook is not None else None
    if found is not None:
        return found
    expert = EXPERT_TENSOR.match(name)
    projections = getattr(model, "expert_projections", {})
    if expert and expert["proj"] in projections:
        param, piece, per_expert = projections[expert["proj"]]
        return f"{expert['layer']}.{param}_{expert['kind']}", int(expert["expert"]) * per_expert + piece
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in model.packed_modules:
        fused, shard_id = model.packed_modules[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard_id
    return name, 0


class RowRange:
    """Rows [start, end) of a safetensors slice, read like a slice itself:
    what a weight loader gets for one piece of a fused checkpoint tensor."""

    def __init__(self, tensor_slice, start: int, end: int):
        self.tensor_slice, self.start, self.end = tensor_slice, start, end

    def get_shape(self) -> list[int]:
        return [self.end - self.start, *self.tensor_slice.get_shape()[1:]]

    def __getitem__(self, key) -> torch.Tensor:
        rows, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        first, last, step = rows.indices(self.end - self.start)
        if step != 1:
            raise ValueError("a fused checkpoint piece is read in contiguous rows only")
        return self.tensor_slice[(slice(self.start + first, self.start + last), *rest)]


def _pieces(model: nn.Module, target: str, tensor_slice) -> list[tuple[object, int]]:
    """(what to load, piece index) for one checkpoint tensor: itself, or, for a
    tensor the checkpoint stores fused the way our layer is (Phi-3's qkv_proj),
    each piece's rows."""
    parts = target.split(".")
    if len(parts) < 2 or parts[-2] not in getattr(model, "fused_checkpoint_tensors", ()):
        return [(tensor_slice, 0)]
    sizes = model.get_submodule(".".join(parts[:-1])).output_sizes
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    if tensor_slice.get_shape()[0] != starts[-1]:
        raise ValueError(f"checkpoint tensor {target!r} has {tensor_slice.get_shape()[0]} rows, expected {starts[-1]}")
    return [(RowRange(tensor_slice, starts[i], starts[i + 1]), i) for i in range(len(sizes))]


def parameter_counts(folder: Path, config) -> tuple[int, int]:
    """(total, active) parameters of the checkpoint in `folder`, from its
    tensors' shapes (no data is read): every tensor once (a tied LM head is
    not stored), an MXFP4 byte as two values and its block scales as none;
    active: the routed experts' tensors (`.experts.`) count num_experts_per_tok /
    num_experts of theirs (`config.moe`, absent for dense models); a shared
    expert (`.shared_expert.`), which every token runs, counts whole."""
    total = experts = 0
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("_scales") and ".experts." in name:
                    continue
                n = math.prod(f.get_slice(name).get_shape()) * (2 if name.endswith("_blocks") else 1)
                total += n
                experts += n if ".experts." in name else 0
    gguf = GGUFTensors.of_folder(folder)
    total += gguf.parameter_count() if gguf is not None else 0
    moe = getattr(config, "moe", None)
    if moe is None:
        return total, total
    return total, total - experts + experts * moe.top_k // moe.num_experts


def checkpoint_slices(folder: Path):
    """(name, slice) for every checkpoint tensor of `folder`: the safetensors
    files' (each file open while its tensors are read), then the .gguf's
    block-served matrices (gguf_checkpoint.DenseSlice) where the folder has them."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
    gguf = GGUFTensors.of_folder(folder)
    if gguf is not None:
        yield from gguf.slices()


def load_weights(
    model: nn.Module, folder: Path, skip: frozenset[str] = frozenset(), on_loaded: Callable[[str], None] | None = None
) -> None:
    """Loads every parameter of `model` from `folder`, but those named in
    `skip` (emptied by the shard: their layer computes on GGUF blocks only),
    whose tensors are not read. `on_loaded(name)` is called as soon as a
    parameter has all its pieces (the shard packs it then)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    # A fused parameter (qkv, gate_up) is complete once each of its pieces loaded.
    pieces_needed = {name: getattr(p, "num_pieces", 1) for name, p in params.items()}
    loaded: dict[str, set[int]] = {name: set(range(pieces_needed[name])) for name in skip}
    for name, tensor_slice in checkpoint_slices(folder):
        if name.endswith(model.ignored_suffixes) or (tied and name == "lm_head.weight"):
            continue
        target, shard_id = _target(model, name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        if target in skip:
            continue
        param = params[target]
        for piece, piece_id in _pieces(model, target, tensor_slice):
            param.weight_loader(param, piece, shard_id + piece_id)
            loaded.setdefault(target, set()).add(shard_id + piece_id)
        if on_loaded is not None and len(loaded[target]) == pieces_needed[target]:
            on_loaded(target)
    if tied:
        loaded["lm_head.weight"] = {0}
    missing = [n for n, k in pieces_needed.items() if len(loaded.get(n, ())) != k]
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks weights for: {', '.join(sorted(missing)[:8])}")

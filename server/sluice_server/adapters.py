"""LoRA adapters on the shard: PEFT folders read, checked against the model,
and put into adapter slots.

The router decides which adapter sits in which slot (1..max_loras) and when;
this module holds the weights (`AdapterSlots`, owned by the model runner) and
refuses what cannot serve the model, with a message naming the problem:

    AdapterSlots(model, max_loras, max_rank, roots)
        allocate(kernel)       at warmup, before the KV cache is sized: every
                               adapted layer gets its stacks (layers.lora),
                               applied by `kernel` (the grouped matmul)
        read(path)             read and check a PEFT folder, keep nothing
        load(slot, path)       read, check, and write it into the slot
        unload(slot)           zero the slot
        applied(segments)      the step's segments, for the length of a forward

A PEFT LoRA folder is `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules, ...) and `adapter_model.safetensors`, whose tensors are named
after the module they adapt:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [out, r]

q/k/v and gate/up are fused in our layers (qkv_proj, gate_up_proj): each is
a piece there (the model's `packed_modules` says which), so an adapter of q
and v alone leaves the k piece zero. The update is scaled by
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), as PEFT scales it.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from sluice_server.layers.linear import ColumnParallelLinear, RowParallelLinear
from sluice_server.layers.lora import KERNELS, LoraContext, LoraSegments, LoraWeights
from sluice_server.model_folder import ADAPTER_CONFIG_FILE as CONFIG_FILE
from sluice_server.model_folder import ADAPTER_WEIGHTS_FILE as WEIGHTS_FILE
# PEFT's module names that an adapter may target here.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Our layers that hold them (after the model's packed_modules mapping).
ADAPTED_LAYERS = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")
# A LoRA tensor of adapter_model.safetensors: the module, and A or B.
LORA_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
MODULE_PATH = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<name>\w+)$")


class AdapterError(ValueError):
    """An adapter that cannot serve this model (gRPC INVALID_ARGUMENT)."""


@dataclass
class PeftAdapter:
    """An adapter read and checked: per adapted module, (A [r, in], B [out, r])
    at full (unsharded) size, keyed by our module path and piece index."""

    rank: int
    scale: float
    target_modules: list[str]
    # (our layer's module path, piece index) -> (A, B)
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]


def confined(path: str, roots: list[Path]) -> Path:
    """`path` resolved, when it lies inside one of `roots` (resolved too);
    otherwise AdapterError. Symlinks are followed first, so a link cannot
    lead out of a root."""
    if not roots:
        raise AdapterError(
            f"cannot load the adapter at {path}: no adapter folder is allowed "
            "(start the server with --lora-root DIR, or name the adapter with --lora-adapters)"
        )
    resolved = Path(path).resolve()
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        shown = ", ".join(str(r) for r in roots)
        raise AdapterError(f"the adapter path {path} is outside the allowed adapter folders ({shown}; see --lora-root)")
    return resolved


def read_config(folder: Path) -> dict:
    config_path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist")
    if not config_path.is_file():
        raise AdapterError(f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder")
    if not (folder / WEIGHTS_FILE).is_file():
        pickled = " (adapter_model.bin is not read: pickled weights can run code; save with safetensors)" if (
            folder / "adapter_model.bin"
        ).exists() else ""
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE}{pickled}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} is not a JSON object")
    return config


def check_config(config: dict, where: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a LoRA adapter_config.json; AdapterError for what
    this server does not serve."""
    def fail(message: str):
        raise AdapterError(f"{where / CONFIG_FILE}: {message}")

    if config.get("peft_type", "LORA") != "LORA":
        fail(f"peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        fail(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        fail(f"the adapter's rank r={rank} is above this server's --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        fail(f"lora_alpha must be a number, got {alpha!r}")
    unsupported = [
        ("use_dora", config.get("use_dora"), "DoRA adapters are not supported"),
        ("bias", config.get("bias", "none") != "none", "adapters that train biases are not supported (bias must be \"none\")"),
        ("fan_in_fan_out", config.get("fan_in_fan_out"), "fan_in_fan_out (Conv1D models) is not supported"),
        ("modules_to_save", config.get("modules_to_save"), "modules_to_save (fully trained modules) is not supported"),
        ("rank_pattern", config.get("rank_pattern"), "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", config.get("alpha_pattern"), "per-module alphas (alpha_pattern) are not supported"),
    ]
    for _, present, message in unsupported:
        if present:
            fail(message)
    # Named targets are checked here, before the weights: peft saves an
    # adapted lm_head or embedding with extra tensors that say less.
    targets = config.get("target_modules")
    if isinstance(targets, list):
        others = [t for t in targets if str(t).rsplit(".", 1)[-1] not in SUPPORTED_MODULES]
        if others:
            fail(f"the adapter targets {', '.join(map(repr, others))}; only the decoder layers' "
                 f"{', '.join(SUPPORTED_MODULES)} can be adapted")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


class AdapterSlots:
    """The model's adapter slots; see the module comment."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, roots: list[Path | str]):
        if max_loras < 0 or max_rank <= 0:
            raise ValueError(f"--max-loras must be >= 0 and --max-lora-rank > 0, got {max_loras} and {max_rank}")
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.roots = [Path(r).resolve() for r in roots]
        self.layers: dict[str, ColumnParallelLinear | RowParallelLinear] = {
            name: module for name, module in model.named_modules() if ADAPTED_LAYERS.match(name)
        }
        self.num_layers = model.config.num_hidden_layers
        self.context: LoraContext | None = None
        # Per slot (index slot - 1): the folder loaded there, or None.
        self.loaded: list[Path | None] = [None] * max_loras

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    @property
    def allocated(self) -> bool:
        return self.context is not None

    @property
    def nbytes(self) -> int:
        return sum(m.lora.nbytes for m in self.layers.values() if m.lora is not None)

    def allocate(self, kernel: str = "torch", dtype: torch.dtype | None = None) -> int:
        """Stacks of `dtype` (default: the model's) for every adapted layer
        (zeros: every slot empty), applied by `kernel` (layers.lora.KERNELS);
        returns their bytes. Again after a second warmup: the slots start
        empty."""
        if not self.enabled:
            return 0
        if kernel not in KERNELS:
            raise ValueError(f"LoRA kernel {kernel!r} is not one of {', '.join(KERNELS)}")
        param = next(self.model.parameters())
        dtype, device = dtype or param.dtype, param.device
        self.context = LoraContext(scales=torch.zeros(self.max_loras, dtype=torch.float32, device=device), kernel=kernel)
        self.loaded = [None] * self.max_loras
        for module in self.layers.values():
            module.lora = None  # the old stacks go before the new ones are made
        for module in self.layers.values():
            if isinstance(module, ColumnParallelLinear):
                pieces, in_features = _column_pieces(module), module.input_size
            else:
                pieces, in_features = [(0, module.output_size)], module.end - module.start
            out = pieces[-1][1]
            module.lora = LoraWeights.zeros(
                self.max_loras, len(pieces), self.max_rank, in_features, [start for start, _ in pieces] + [out],
                dtype, device, self.context,
            )
        return self.nbytes

    # -- reading ------------------------------------------------------------

    def read(self, path: str) -> PeftAdapter:
        """Reads the PEFT folder at `path` and checks it against the model."""
        folder = confined(path, self.roots)
        rank, scale = check_config(read_config(folder), folder, self.max_rank)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        try:
            with safe_open(str(folder / WEIGHTS_FILE), framework="pt", device="cpu") as f:
                for name in f.keys():
                    match = LORA_TENSOR.match(name)
                    if match is None:
                        raise AdapterError(
                            f"{folder / WEIGHTS_FILE}: tensor {name!r} is not a LoRA A/B weight of a supported module "
                            f"({', '.join(SUPPORTED_MODULES)})"
                        )
                    pairs.setdefault(match["module"], {})[match["which"]] = f.get_tensor(name)
        except AdapterError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged file is the adapter's fault
            raise AdapterError(f"{folder / WEIGHTS_FILE} cannot be read: {e}") from None
        if not pairs:
            raise AdapterError(f"{folder / WEIGHTS_FILE} holds no LoRA weights")
        weights = {}
        targets = set()
        for module, pair in sorted(pairs.items()):
            key, name = self._layer_of(module, folder)
            targets.add(name)
            weights[key] = self._checked_pair(module, name, pair, key, rank, folder)
        return PeftAdapter(rank=rank, scale=scale, target_modules=sorted(targets), weights=weights)

    def _layer_of(self, module: str, folder: Path) -> tuple[tuple[str, int], str]:
        """PEFT's module path -> ((our layer's path, piece), PEFT's short name)."""
        match = MODULE_PATH.match(module)
        name = module.rsplit(".", 1)[-1]
        if match is None or name not in SUPPORTED_MODULES:
            raise AdapterError(
                f"{folder.name}: the adapter targets {module!r}; only the decoder layers' "
                f"{', '.join(SUPPORTED_MODULES)} can be adapted"
            )
        layer = int(match["layer"])
        if layer >= self.num_layers:
            raise AdapterError(
                f"{folder.name}: the adapter adapts layer {layer}, but the model has {self.num_layers} layers "
                "(was it trained for another base model?)"
            )
        ours, piece = self.model.packed_modules.get(name, (name, 0))
        path = module.rsplit(".", 1)[0] + "." + ours
        if path not in self.layers:
            raise AdapterError(f"{folder.name}: the model has no module {module!r} to adapt")
        return (path, piece), name

    def _checked_pair(
        self, module: str, name: str, pair: dict[str, torch.Tensor], key: tuple[str, int], rank: int, folder: Path
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{folder.name}: {module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        layer = self.layers[key[0]]
        in_features = layer.input_size
        out_features = layer.output_sizes[key[1]] if isinstance(layer, ColumnParallelLinear) else layer.output_size
        want_a, want_b = (rank, in_features), (out_features, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(
                f"{folder.name}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; this model's "
                f"{name} needs {list(want_a)} and {list(want_b)} at r={rank} (was the adapter trained for another "
                "base model?)"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{folder.name}: {module} holds non-finite weights")
        return a, b

    # -- slots --------------------------------------------------------------

    def _index(self, slot: int) -> int:
        if self.context is None:
            raise RuntimeError("adapter slots are not allocated: call warmup first")
        if not 1 <= slot <= self.max_loras:
            raise AdapterError(f"adapter slot {slot} is not in [1, {self.max_loras}] (--max-loras)")
        return slot - 1

    def load(self, slot: int, path: str) -> PeftAdapter:
        """Reads the adapter and writes it into `slot` (the slot is empty if
        it fails)."""
        index = self._index(slot)
        self.unload(slot)
        adapter = self.read(path)
        for (layer_path, piece), (a, b) in adapter.weights.items():
            _write(self.layers[layer_path], index, piece, a, b)
        self.context.scales[index] = adapter.scale
        self.loaded[index] = Path(path)
        return adapter

    def unload(self, slot: int) -> None:
        index = self._index(slot)
        for module in self.layers.values():
            module.lora.zero_slot_(index)
        self.context.scales[index] = 0.0
        self.loaded[index] = None

    def held_slots(self) -> frozenset[int]:
        """The slots (1..max_loras) that hold an adapter."""
        return frozenset(i + 1 for i, folder in enumerate(self.loaded) if folder is not None)

    @contextlib.contextmanager
    def at_full_rank(self):
        """Every (empty) slot counts as holding a rank-max_rank adapter of
        every module while inside (its weights stay zero): warmup's dummy step
        then makes the largest LoRA temporaries a step can make, and the
        memory measured holds them."""
        if self.context is None or any(folder is not None for folder in self.loaded):
            yield
            return
        loras = [m.lora for m in self.layers.values()]
        try:
            for lora in loras:
                for index in range(self.max_loras):
                    for piece in range(len(lora.bounds) - 1):
                        lora.set_rank(index, piece, self.max_rank)
            yield
        finally:
            for lora in loras:
                for index in range(self.max_loras):
                    lora.zero_slot_(index)

    @contextlib.contextmanager
    def applied(self, segments: LoraSegments | None):
        """The step's segments (checked here, once per step), seen by every
        adapted layer while inside."""
        if self.context is None or segments is None:
            yield
            return
        segments.check(self.max_loras)
        self.context.segments = segments
        try:
            yield
        finally:
            self.context.segments = None


def _column_pieces(module: ColumnParallelLinear) -> list[tuple[int, int]]:
    """[start, end) output rows of each fused piece on this rank."""
    starts = [sum(module.local_sizes[:i]) for i in range(len(module.local_sizes) + 1)]
    return list(zip(starts[:-1], starts[1:]))


def _write(module: ColumnParallelLinear | RowParallelLinear, index: int, piece: int, a: torch.Tensor, b: torch.Tensor) -> None:
    """This rank's part of one module's A [r, in] and B [out, r] into the
    stacks: a column-parallel layer keeps the B rows of its output range, a
    row-parallel one the A columns of its input range."""
    if isinstance(module, ColumnParallelLinear):
        start, end = module.ranges[piece]
        b = b[start:end]
    else:
        a = a[:, module.start : module.end]
    module.lora.write_(index, piece, a, b)

"""Tensor-parallel linear layers (Megatron style).

A column-parallel layer splits its *output* features over the ranks; a
row-parallel layer splits its *input* features and sums the partial results.
Attention and MLP blocks use one of each, so a block needs a single
all-reduce:

    x ──► ColumnParallel (local heads / local intermediate) ──► ... ──► RowParallel ──► all_reduce

Each parameter carries a `weight_loader(param, checkpoint_slice, shard_id)`
that copies just this rank's part out of a safetensors slice (`get_slice`),
so a rank never reads the whole tensor.

A layer may also carry LoRA adapters (`lora`, a `layers.lora.LoraWeights`,
attached by the shard's adapter slots): their update is added to the
layer's own output, before a row-parallel layer's all-reduce (each rank adds
B (A_local x_local), and the reduction sums those into B A x).
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from sluice_kernels.cpu_matmuls import ALL_ROWS
from sluice_server.distributed import Distributed, shard_range
from sluice_server.layers.lora import LoraWeights

# oneDNN's packed-weight linear (the op torch's own CPU compiler emits for
# frozen weights), in place of F.linear (MKL sgemm on a plain row-major
# weight); benchmarks/packed_linear.py times the two on a model's shapes.
_MKLDNN = getattr(torch.ops, "mkldnn", None)
CPU_PACK_DTYPES = (torch.float32, torch.bfloat16)


def blocks_take_every_step(module: nn.Module) -> bool:
    """Whether every matmul of `module` runs on its GGUF blocks (the plan's
    row limit is ALL_ROWS), so that no dense form of its weight is ever read."""
    quantized = getattr(module, "quantized", None)
    return quantized is not None and quantized.max_rows >= ALL_ROWS


def packs_for_cpu(module: nn.Module) -> bool:
    """Whether `module.pack_for_cpu_()` packs it (a layer or the LM head):
    not packed yet, its GGUF blocks (if any) do not take every step, and its
    weight is a CPU tensor oneDNN packs."""
    return module.packed is None and not blocks_take_every_step(module) and can_pack_for_cpu(module.weight)


def let_blocks_take_every_step(model: nn.Module) -> None:
    """Raises the row limit of every layer's GGUF blocks to ALL_ROWS, so
    that no step reads a dense form of a block-served matrix (those are
    then freed, or never allocated, by `free_unread_weights`). Experts'
    blocks take every step already."""
    for module in model.modules():
        quantized = getattr(module, "quantized", None)
        if hasattr(quantized, "max_rows"):
            quantized.max_rows = ALL_ROWS


def free_dense_weight_(module: nn.Module) -> None:
    """Empties `module.weight` (its [out, in] shape kept as `dense_shape`)."""
    if module.dense_shape is None:
        module.dense_shape = tuple(module.weight.shape)
    module.weight.data = torch.empty(0, dtype=module.weight.dtype)


def _onednn_bf16() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU: torch refuses to
    without AVX-512 BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only host then keeps
    the plain bf16 weight, as F.linear multiplies it)."""
    supported = getattr(_MKLDNN, "_is_mkldnn_bf16_supported", None)
    return supported is None or bool(supported())


def can_pack_for_cpu(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in CPU_PACK_DTYPES
        and (weight.dtype != torch.bfloat16 or _onednn_bf16())
        and torch.backends.mkldnn.is_available()
        and hasattr(_MKLDNN, "_reorder_linear_weight")
        and hasattr(_MKLDNN, "_linear_pointwise")
    )


def pack_for_cpu(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight [out, in] (cast to `dtype`) reordered into oneDNN's blocked
    layout (an opaque tensor only `packed_linear` reads)."""
    weight = weight.detach()
    return _MKLDNN._reorder_linear_weight(weight.to(dtype or weight.dtype).contiguous())


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x @ W^T + bias on a packed weight, returned in `out_dtype` (default:
    x's). A weight packed in another dtype than x (bfloat16 under float32
    activations) is multiplied in its own dtype, accumulated in float32 by
    oneDNN."""
    out_dtype = out_dtype or x.dtype
    if packed.dtype != x.dtype:
        x = x.to(packed.dtype)
        bias = None if bias is None else bias.to(packed.dtype)
    y = _MKLDNN._linear_pointwise(x, packed, bias, "none", [], "")
    return y if y.dtype == out_dtype else y.to(out_dtype)


class PackableLinear(nn.Module):
    """A linear layer whose weight can be repacked for the CPU once loaded.

    `pack_for_cpu_()` replaces the dense weight by oneDNN's layout (the dense
    copy is freed: the weight is never read again); `_linear` then runs the
    packed kernel. Left unpacked (CUDA, other dtypes), it is plain F.linear.
    A layer whose GGUF blocks take every step is not packed, and its dense
    weight is freed (`free_unread_weights`): it holds the blocks only.
    """

    packed: torch.Tensor | None = None
    dense_shape: tuple[int, int] | None = None
    # GGUF blocks of the same weight, for few-row matmuls (layers.gguf_weights).
    quantized = None
    # Stacked LoRA adapters of this layer (layers.lora), when adapters are on.
    lora: LoraWeights | None = None

    def pack_for_cpu_(self, dtype: torch.dtype | None = None) -> bool:
        if not packs_for_cpu(self):
            return False
        self.packed = pack_for_cpu(self.weight, dtype)
        free_dense_weight_(self)  # dense_shape: [out, in] of the packed weight
        return True

    def reads_dense_weight(self) -> bool:
        return self.packed is None and not blocks_take_every_step(self)

    def matmul_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype in which this layer multiplies x: the packed weight's
        (bfloat16 under float32 activations on CPUs with native bf16), else x's."""
        if self.packed is not None and not (self.quantized is not None and self.quantized.handles(x)):
            return self.packed.dtype
        return x.dtype

    def _linear(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x W^T + bias in `out_dtype` (default: x's dtype)."""
        if self.quantized is not None and self.quantized.handles(x):
            y = self.quantized.linear(x)
            y = y if bias is None else y + bias
        elif self.packed is not None:
            return packed_linear(x, self.packed, bias, out_dtype)
        elif self.weight.numel() == 0:
            raise RuntimeError(
                f"this layer holds its GGUF blocks only, which multiply 2-D float32 CPU rows; got "
                f"{tuple(x.shape)} {x.dtype} on {x.device}"
            )
        else:
            y = F.linear(x, self.weight, bias)
        return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus the step's adapter updates for x's rows (y itself, unchanged,
        on a step without adapter rows)."""
        if self.lora is not None:
            self.lora.apply_(x, y)
        return y


def pack_linear_weights(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Packs every layer of `model` that has `pack_for_cpu_` (the linear
    layers and the LM head), in `dtype` (default: the weight's own), except
    those whose GGUF blocks take every step; returns how many were packed."""
    return sum(m.pack_for_cpu_(dtype) for m in model.modules() if hasattr(m, "pack_for_cpu_"))


def _unread_weights(model: nn.Module, once_packed: bool = False) -> list[list[nn.Module]]:
    """The non-empty dense weights that none of the modules holding them
    reads (with `once_packed`: will read, once every layer that packs has
    packed), each as the list of its holders. A weight held by a module
    that cannot say (a norm, a router) is read."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(module)

    def reads(module: nn.Module) -> bool:
        if not hasattr(module, "reads_dense_weight"):
            return True
        packs = once_packed and hasattr(module, "pack_for_cpu_") and packs_for_cpu(module)
        return module.reads_dense_weight() and not packs

    return [modules for modules in holders.values() if modules[0].weight.numel() and not any(map(reads, modules))]


def free_unread_weights(model: nn.Module) -> int:
    """Frees every dense `weight` that none of the modules holding it reads
    any more (`reads_dense_weight()` False: a packed copy or GGUF blocks
    serve them), so that each matrix is held once per kind of step it runs:
    the blocks where they take every step, else the blocks and one packed
    form. A weight held by a module that cannot say (a norm, a router)
    stays. Returns how many were freed."""
    unread = _unread_weights(model)
    for modules in unread:
        shape = tuple(modules[0].weight.shape)
        for module in modules:
            module.dense_shape = module.dense_shape or shape
        free_dense_weight_(modules[0])  # the parameter all of them hold
    return len(unread)


def _held(model: nn.Module, packed_in: torch.dtype | None) -> list[tuple[nn.Module, int, int, bool]]:
    """(module, key, bytes, dense matrix?) for every tensor each module of
    `model` holds: its parameters, its oneDNN-packed copy, its GGUF blocks
    (a tensor two modules hold is listed under both, with one key).

    `packed_in` None: as held now. A dtype: as they will be held once
    `pack_linear_weights(model, packed_in)` and `free_unread_weights` have
    run, found from shapes without allocating anything (the load checks
    --max-weight-memory this way before a dense form exists): a layer that
    will pack holds its packed form, and a weight nothing will read, nothing.
    """
    unread = set()
    if packed_in is not None:
        unread = {id(modules[0].weight) for modules in _unread_weights(model, once_packed=True)}
    held = []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            held.append((module, id(p), 0 if id(p) in unread else p.numel() * p.element_size(), p.dim() >= 2))
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            held.append((module, id(packed), packed.numel() * packed.element_size(), True))
        elif packed_in is not None and hasattr(module, "pack_for_cpu_") and packs_for_cpu(module):
            held.append((module, -id(module), module.weight.numel() * packed_in.itemsize, True))
        quantized = getattr(module, "quantized", None)
        if quantized is not None:
            held += [(module, id(t), t.numel() * t.element_size(), False) for t in quantized.tensors()]
    return held


def weight_bytes(model: nn.Module, packed_in: torch.dtype | None = None) -> int:
    """Bytes of `model`'s weights as it holds them: every parameter (tied
    ones once; a packed layer's emptied dense weight counts nothing), the
    oneDNN-packed copies and the GGUF blocks (`quantized`). With
    `packed_in`: as it will hold them once packed in that dtype (`_held`)."""
    return sum({key: nbytes for _, key, nbytes, _ in _held(model, packed_in)}.values())


def dense_copy_bytes(model: nn.Module, packed_in: torch.dtype | None = None) -> int:
    """Of `weight_bytes`, the dense forms of matrices that also hold GGUF
    blocks (`quantized`): their oneDNN-packed copies and dense weights, what
    the plan keeps for steps larger than the blocks take. With `packed_in`:
    once packed in that dtype (`_held`)."""
    held = _held(model, packed_in)
    others = {key for module, key, _, _ in held if getattr(module, "quantized", None) is None}
    return sum({
        key: nbytes for module, key, nbytes, dense in held
        if dense and key not in others and getattr(module, "quantized", None) is not None
    }.values())


def _check_shape(name: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{name}: checkpoint shape {tuple(got)} != expected {tuple(want)}")


class ColumnParallelLinear(PackableLinear):
    """y = x W^T + b with W's rows split over ranks.

    `output_sizes` lists the (full, unsharded) sizes of the matrices fused into
    this layer, e.g. [q, k, v] or [gate, up]. Each is split separately, so the
    local weight is the concatenation of every piece's local rows:

        local rows: [ q[rank] | k[rank] | v[rank] ]

    `ranges` (optional) gives each piece's [start, end) rows on this rank
    explicitly, for pieces that are not an even split (key/value heads
    replicated when there are fewer of them than ranks); default: the rank's
    equal share of each piece.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dist: Distributed,
        ranges: list[tuple[int, int]] | None = None,
    ):
        super().__init__()
        self.dist = dist
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        # shard_range raises when a piece does not split evenly.
        self.ranges = list(ranges) if ranges is not None else [shard_range(s, dist) for s in output_sizes]
        if len(self.ranges) != len(output_sizes):
            raise ValueError(f"{len(self.ranges)} row ranges for {len(output_sizes)} pieces")
        self.local_sizes = [end - start for start, end in self.ranges]
        local_out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(local_out, input_size), requires_grad=False)
        self.weight.weight_loader = self._load
        self.weight.num_pieces = len(output_sizes)
        if bias:
            self.bias = nn.Parameter(torch.empty(local_out), requires_grad=False)
            self.bias.weight_loader = self._load
            self.bias.num_pieces = len(output_sizes)
        else:
            self.bias = None

    def _load(self, param: nn.Parameter, checkpoint, shard_id: int) -> None:
        full = self.output_sizes[shard_id]
        want = (full, self.input_size) if param.dim() == 2 else (full,)
        _check_shape("column-parallel weight", checkpoint.get_shape(), want)
        start, end = self.ranges[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        param.data[offset : offset + end - start].copy_(checkpoint[start:end])

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._add_lora(x, self._linear(x, self.bias, out_dtype))


class RowParallelLinear(PackableLinear):
    """y = all_reduce(x_local W_local^T) + b with W's columns split over ranks.

    The input is expected already split (the output of a column-parallel
    layer). The bias is added once, after the reduction.

    `reduce=False`: this rank's partial sum (the bias added on rank 0 only),
    for a block that adds more partial sums before its one all-reduce (the
    shared expert beside the routed ones, layers/moe.py).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, dist: Distributed, reduce: bool = True):
        super().__init__()
        self.dist = dist
        self.reduce = reduce
        self.input_size = input_size
        self.output_size = output_size
        self.start, self.end = shard_range(input_size, dist)
        self.weight = nn.Parameter(torch.empty(output_size, self.end - self.start), requires_grad=False)
        self.weight.weight_loader = self._load_weight
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self._load_bias
        else:
            self.bias = None

    def _load_weight(self, param: nn.Parameter, checkpoint, shard_id: int = 0) -> None:
        _check_shape("row-parallel weight", checkpoint.get_shape(), (self.output_size, self.input_size))
        param.data.copy_(checkpoint[:, self.start : self.end])

    def _load_bias(self, param: nn.Parameter, checkpoint, shard_id: int = 0) -> None:
        _check_shape("row-parallel bias", checkpoint.get_shape(), (self.output_size,))
        param.data.copy_(checkpoint[:])

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = self._add_lora(x, self._linear(x, None, out_dtype))
        if self.reduce:
            y = self.dist.all_reduce(y)
        if self.bias is not None and (self.reduce or self.dist.rank == 0):
            y = y + self.bias
        return y

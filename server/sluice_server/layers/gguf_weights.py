"""GGUF's quantized weight blocks, run as they are on CPU for few-row matmuls.

A model served from a .gguf is converted once to a model folder (see
gguf_convert.py): every weight in float32, or, for Llama, Qwen2 and Qwen3
files, the block-served matrices left in the .gguf and expanded to dense
one at a time where a path computes on dense weights (gguf_checkpoint.py:
CUDA, bfloat16, tensor parallelism, the dense steps of a plan). On CPU the
weights of a decode step are read from memory once per step, which is the
whole cost at small batches: Q4_1 blocks are 0.625 bytes per weight against
float32's 4. So, for each linear layer whose GGUF tensors are in a block
format the C++ kernels read, the blocks are attached too, and matmuls of at
most `max_rows` rows run on them; larger ones (prefill, big decode batches)
keep the packed dense weights (layers.linear), except where the blocks take
every step: then the layer holds its blocks only. The kernels read Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, mixed within a layer (every
type of the Q4_K_M / Q5_K_M / Q6_K files), unpacked once into records
(sluice_kernels.gguf_blocks) that both arithmetics read.

Two arithmetics on the blocks (`QuantizedWeight.int8`):

- exact (`--dtype float32`): each record is expanded to float32 in
  registers (`exact_linear`): bit for bit the float32 weight, summed in
  another order, so the results equal the float32 path's up to rounding.
- int8 activations (`--dtype auto`): llama.cpp's arithmetic. Each activation
  row is quantized to int8 per block of 32 and multiplied with the blocks by
  integer dot products (`q8_linear`, AMX / AVX-512 VNNI / AVX-VNNI / AVX2):
  several times faster, at an accuracy cost measured by
  benchmarks/quality.py. A row's result is the same whatever else is in its
  matmul (see cpu_q8_linear.cpp).

Two ways to attach them:

- `attach_gguf_blocks`, for a folder whose block-served matrices stay in the
  .gguf (gguf_checkpoint.py: Llama, Qwen2, Qwen3 files): before any weight
  is loaded, straight from the memory-mapped file, the q/k rows put back in
  the checkpoint's order by llama.cpp's permutation undone
  (`BlockTensor.row_order`). A layer whose blocks take every step then has
  its dense weight emptied before it is ever written, so the shard never
  holds a float32 form of it (model_runner.py skips loading it).
- `attach_gguf_weights`, for a folder holding every weight in float32 (the
  other families): only where the blocks expand to exactly the float32
  weight the layer holds, each tensor's rows matched to the layer's rows by
  content (which also finds the q/k order). It is the oracle the direct
  path is tested against (server/tests/test_gguf_direct.py).

    ours                                  GGUF tensors (piece order)
    layers.i.self_attn.qkv_proj           blk.i.attn_q, attn_k, attn_v
    layers.i.self_attn.o_proj             blk.i.attn_output
    layers.i.mlp.gate_up_proj             blk.i.ffn_gate, ffn_up
    layers.i.mlp.down_proj                blk.i.ffn_down
    lm_head                               output (or token_embd when tied)
    model.embed_tokens                    token_embd (the LM head's blocks when tied)

The embedding's blocks serve its lookup (`QuantizedWeight.rows`: each
record expanded to exactly the float32 table's row, up to the sign of a
zero), so its float32 table can be freed (layers.linear.free_unread_weights)
where the LM head, when tied to it, no longer reads the table either.

The expert layers of mixture-of-experts models (layers/moe.py) get their
experts' blocks the same way, one expert at a time out of llama.cpp's
stacked tensors ([E, rows, cols]), as `QuantizedExperts`:

    layers.i.mlp.w13_weight[e]            blk.i.ffn_gate_exps[e], ffn_up_exps[e]
    layers.i.mlp.w2_weight[e]             blk.i.ffn_down_exps[e]

A shared expert (Qwen2-MoE) is a dense MLP, and gets its blocks as one:

    layers.i.mlp.shared_expert.gate_up_proj   blk.i.ffn_gate_shexp, ffn_up_shexp
    layers.i.mlp.shared_expert.down_proj      blk.i.ffn_down_shexp

and so do gpt-oss's MXFP4 experts, from the records its loader kept
(`attach_block_experts`). Experts run on their blocks at every step size,
whatever the plan's row limit for dense layers: a step's tokens are spread
over the experts, so each expert's matmul has few rows even in a prefill,
and the experts are most of the weights, so their dense copy is freed.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from sluice_kernels import cpu_kernels, gguf_blocks
from sluice_kernels.gguf_blocks import QuantizedWeight
from sluice_kernels.moe import QuantizedExperts, pack_experts
from sluice_server.gguf_checkpoint import GGUFTensors
from sluice_server.model_folder import SOURCE_FILE
from sluice_server.layers.moe import FusedMoE

log = logging.getLogger(__name__)


def gguf_source(folder: Path) -> Path | None:
    path = folder / SOURCE_FILE
    if not path.is_file():
        return None
    gguf = Path(json.loads(path.read_text())["gguf"])
    return gguf if gguf.is_file() else None


def _pieces(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    out = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        out.append((attn.qkv_proj, [f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight", f"blk.{i}.attn_v.weight"]))
        out.append((attn.o_proj, [f"blk.{i}.attn_output.weight"]))
        if isinstance(mlp, FusedMoE):  # the routed experts: attach_experts
            if mlp.shared_expert is not None:
                shared = mlp.shared_expert
                out.append((shared.gate_up_proj, [f"blk.{i}.ffn_gate_shexp.weight", f"blk.{i}.ffn_up_shexp.weight"]))
                out.append((shared.down_proj, [f"blk.{i}.ffn_down_shexp.weight"]))
            continue
        out.append((mlp.gate_up_proj, [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"]))
        out.append((mlp.down_proj, [f"blk.{i}.ffn_down.weight"]))
    tied = getattr(model.config, "tie_word_embeddings", False)
    out.append((model.lm_head, ["token_embd.weight" if tied else "output.weight"]))
    if not tied:
        out.append((model.model.embed_tokens, ["token_embd.weight"]))
    return out


def _match_rows(have: np.ndarray, want: torch.Tensor) -> np.ndarray | None:
    """The order of `have`'s rows [N, K] that equals want [N, K], or None."""
    want = want.numpy()
    if np.array_equal(have, want):
        return np.arange(len(want))
    # Rows are keyed by their bytes, with -0.0 made +0.0 (adding 0.0 does):
    # the two are the same weight, but the gguf package expands a Q6_K zero
    # as d * sc * 0, negative where d * sc is, and the records as +0.0.
    have, want = have + 0.0, want + 0.0
    index = {have[i].tobytes(): i for i in range(len(have))}
    try:
        return np.array([index[want[j].tobytes()] for j in range(len(want))])
    except KeyError:
        return None


def attach_gguf_weights(model: nn.Module, folder: Path, world_size: int, *, int8: bool, max_rows: int) -> int:
    """Attaches the GGUF blocks to every layer they match exactly (before the
    float32 weights are packed), for matmuls of at most `max_rows` rows, with
    int8 activations or exact; returns how many layers got them (the
    embedding, whose lookup reads them, not counted)."""
    gguf = gguf_source(folder)
    if gguf is None or world_size != 1 or max_rows <= 0 or not cpu_kernels.loaded():
        return 0
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    attached = 0
    for module, names in _pieces(model):
        if not all(name in tensors and tensors[name].tensor_type.name in gguf_blocks.FORMATS for name in names):
            continue
        types = {tensors[name].tensor_type.name for name in names}
        weight = module.weight.detach()
        if weight.dtype != torch.float32 or weight.shape[1] % 32:
            continue
        n, k = weight.shape
        if any(k % gguf_blocks.BLOCK_VALUES.get(t, 32) for t in types):
            continue
        pieces, first = [], 0
        for name in names:
            tensor = tensors[name]
            blocks = np.asarray(tensor.data)
            records = gguf_blocks.unpack(tensor.tensor_type.name, blocks, k)
            order = _match_rows(records.expand(), weight[first : first + len(blocks)])
            if order is None:
                break
            pieces.append(records.take(order))
            first += len(blocks)
        if first != n or len(pieces) != len(names):
            log.warning("GGUF blocks of %s do not match the loaded weight; using float32 only", names[0])
            continue
        module.quantized = _quantized(pieces, [tensors[name].tensor_type.name for name in names], n, int8=int8,
                                      max_rows=max_rows)
        attached += module is not model.model.embed_tokens
    _share_tied_blocks(model)
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, FusedMoE):
            attached += attach_experts(layer.mlp, tensors, i, int8=int8)
    return attached


def _quantized(pieces: list, types: list[str], n: int, *, int8: bool, max_rows: int):
    """One layer's blocks: its pieces' records (in the layer's row order)
    stacked and packed, each run of pieces of one type as its own part where
    the types differ (gguf_blocks.QuantizedParts)."""
    parts = []
    for kind, run in itertools.groupby(zip(types, pieces), key=lambda piece: piece[0]):
        records = gguf_blocks.Records.concat([r for _, r in run])
        fmt = gguf_blocks.layout({kind}, records)
        parts.append(QuantizedWeight(gguf_blocks.pack(records, fmt), fmt, len(records.wq), int8, max_rows))
    assert sum(p.out_features for p in parts) == n
    return parts[0] if len(parts) == 1 else gguf_blocks.QuantizedParts(parts)


def _share_tied_blocks(model: nn.Module) -> None:
    embedding, head = model.model.embed_tokens, model.lm_head
    if head.weight is embedding.weight and head.quantized is not None:
        embedding.quantized = head.quantized  # tied: the head's rows are the table's


def attach_gguf_blocks(model: nn.Module, tensors: GGUFTensors, world_size: int, *, int8: bool, max_rows: int) -> int:
    """Attaches the blocks of a folder's block-served matrices (`tensors`,
    read from the .gguf) to every layer whose pieces all are, before its
    weights are loaded; returns how many layers got them (the embedding not
    counted). Their dense weights are left as allocated (never written):
    the caller empties those nothing reads (layers.linear.free_unread_weights)
    before loading the rest."""
    if world_size != 1 or max_rows <= 0 or not cpu_kernels.loaded():
        return 0
    attached = 0
    for module, names in _pieces(model):
        wanted = [tensors.by_gguf_name.get(name) for name in names]
        n, k = module.weight.shape
        if module.weight.dtype != torch.float32 or any(t is None or t.shape[1] != k for t in wanted):
            continue
        pieces = []
        for t in wanted:
            records = gguf_blocks.unpack(t.type_name, tensors.blocks(t), k)
            order = t.row_order()
            pieces.append(records if order is None else records.take(order))
        if sum(len(r.wq) for r in pieces) != n:
            raise ValueError(f"GGUF tensors {names} have {sum(t.shape[0] for t in wanted)} rows; the layer has {n}")
        module.quantized = _quantized(pieces, [t.type_name for t in wanted], n, int8=int8, max_rows=max_rows)
        attached += module is not model.model.embed_tokens
    _share_tied_blocks(model)
    return attached


def _readable(tensors: dict, names: list[str], k: int) -> bool:
    """Every tensor is there, in a block type the kernels read, and its rows
    of k values are whole blocks."""
    return k % 32 == 0 and all(
        name in tensors and tensors[name].tensor_type.name in gguf_blocks.FORMATS
        and k % gguf_blocks.BLOCK_VALUES.get(tensors[name].tensor_type.name, 32) == 0
        for name in names
    )


def _expert_records(tensors: dict, names: list[str], dense: torch.Tensor) -> list[gguf_blocks.Records] | None:
    """Each expert's records for the stacked GGUF tensors `names` (pieces
    stacked along the rows, as gate and up are in w13), matched to the dense
    weight [E, rows, K]; None where a row does not match."""
    k = dense.shape[2]
    stacked = [np.asarray(tensors[name].data) for name in names]
    out = []
    for e in range(dense.shape[0]):
        pieces, first = [], 0
        for name, blocks in zip(names, stacked):
            records = gguf_blocks.unpack(tensors[name].tensor_type.name, blocks[e], k)
            order = _match_rows(records.expand(), dense[e, first : first + len(blocks[e])])
            if order is None:
                return None
            pieces.append(records.take(order))
            first += len(blocks[e])
        if first != dense.shape[1]:
            return None
        out.append(gguf_blocks.Records.concat(pieces))
    return out


def attach_experts(moe: FusedMoE, tensors: dict, index: int, *, int8: bool) -> int:
    """Attaches layer `index`'s expert blocks to its FusedMoE (both
    projections, or neither); returns 1 when attached."""
    if moe.w13_weight.dtype != torch.float32:
        return 0
    gate_up = [f"blk.{index}.ffn_gate_exps.weight", f"blk.{index}.ffn_up_exps.weight"]
    down = [f"blk.{index}.ffn_down_exps.weight"]
    pairs = ((gate_up, moe.w13_weight.detach()), (down, moe.w2_weight.detach()))
    if not all(_readable(tensors, names, dense.shape[2]) for names, dense in pairs):
        return 0
    packed, formats = [], []
    for names, dense in pairs:
        records = _expert_records(tensors, names, dense)
        if records is None:
            log.warning("GGUF expert blocks of %s do not match the loaded weights; using float32 only", names[0])
            return 0
        data, layout = pack_experts(records, {tensors[name].tensor_type.name for name in names})
        packed.append(data)
        formats.append(layout)
    moe.use_blocks_(QuantizedExperts(packed[0], packed[1], (formats[0], formats[1]), moe.w2_weight.shape[2], int8))
    return 1


def attach_block_experts(model: nn.Module, *, int8: bool, max_rows: int) -> int:
    """Attaches the expert block records a checkpoint came with (gpt-oss's
    MXFP4 experts: FusedMoE.block_records) to their layers; returns how many
    layers got them."""
    attached = 0
    for layer in model.model.layers:
        moe = layer.mlp
        records = getattr(moe, "block_records", {})
        if max_rows <= 0 or set(records) != {"w13", "w2"} or not cpu_kernels.loaded():
            continue
        (w13, f13), (w2, f2) = (pack_experts(*records[key]) for key in ("w13", "w2"))
        moe.use_blocks_(QuantizedExperts(w13, w2, (f13, f2), moe.w2_weight.shape[2], int8))
        attached += 1
    return attached

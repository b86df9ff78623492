"""GGUF's quantized weight blocks, run as they are on CPU for few-row matmuls.

A model served from a .gguf is converted once to a float32 folder (see
gguf_convert.py); that folder is what every path computes with. On CPU the
weights of a decode step are read from memory once per step, which is the
whole cost at small batches: Q4_1 blocks are 0.625 bytes per weight against
float32's 4. So, for each linear layer whose GGUF tensors are in a block
format the C++ kernels read, the blocks are attached too, and matmuls of at
most `max_rows` rows run on them; larger ones (prefill, big decode batches)
keep the packed dense weights (layers.linear). The kernels read Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, mixed within a layer (every type of
the Q4_K_M / Q5_K_M / Q6_K files), unpacked once into records
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

The blocks are attached only where they expand to exactly the float32 weight
the layer holds. The GGUF's row order differs for q/k (llama.cpp permutes
them for its rotary layout), so each tensor's rows are matched to the
layer's rows by content rather than by a hard-coded permutation.

    ours                                  GGUF tensors (piece order)
    layers.i.self_attn.qkv_proj           blk.i.attn_q, attn_k, attn_v
    layers.i.self_attn.o_proj             blk.i.attn_output
    layers.i.mlp.gate_up_proj             blk.i.ffn_gate, ffn_up
    layers.i.mlp.down_proj                blk.i.ffn_down
    lm_head                               output (or token_embd when tied)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from sluice_kernels import cpu_kernels, gguf_blocks
from sluice_kernels.gguf_blocks import QuantizedWeight
from sluice_server.model_folder import SOURCE_FILE

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
        out.append((mlp.gate_up_proj, [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"]))
        out.append((mlp.down_proj, [f"blk.{i}.ffn_down.weight"]))
    tied = getattr(model.config, "tie_word_embeddings", False)
    out.append((model.lm_head, ["token_embd.weight" if tied else "output.weight"]))
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
    int8 activations or exact; returns how many layers got them."""
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
        records = gguf_blocks.Records(*(np.concatenate(parts) for parts in zip(*((r.sw, r.cw, r.wq) for r in pieces))))
        fmt = gguf_blocks.layout(types, records)
        module.quantized = QuantizedWeight(gguf_blocks.pack(records, fmt), fmt, n, int8, max_rows)
        attached += 1
    return attached

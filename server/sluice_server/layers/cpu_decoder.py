"""Decode steps of a Llama-family model on CPU in one C++ call.

models/llama.py is the model; this is a faster way to run its decode steps
when every matmul of the step runs on GGUF blocks (layers.gguf_weights):
`csrc/cpu_decoder.cpp` holds references to the same weights and calls the
same kernels in the same order as the Python forward, without ~300 Python
dispatches per step. Its hidden states are bitwise the Python path's
(server/tests/test_cpu_decoder.py); the embedding lookup, the rotary tables
and the LM head stay in Python.

Used for a step when `CpuDecoder.accepts(batch)`: every sequence computes
one token of its own, perhaps followed by draft tokens to verify
(speculative decoding), and there are at most `max_rows` tokens. A draft
token is one more decode row: the step writes every row's key and value to
the cache before any row attends, so row i of a sequence attends over the
cache up to its own position, its earlier drafts included. Anything else
(prefill chunks, mixed steps, larger batches, other model files, tensor
parallelism) runs the model's own forward.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sluice_server.batch import Batch
from sluice_kernels import cpu_kernels
from sluice_kernels.cpu_matmuls import ALL_ROWS
from sluice_kernels.ops import CpuOps

log = logging.getLogger(__name__)


class CpuDecoder:
    def __init__(self, model: nn.Module, engine, max_rows: int):
        self.model = model
        self.engine = engine
        self.max_rows = max_rows

    def accepts(self, batch: Batch) -> bool:
        tokens = batch.input_ids.numel()
        if not 0 < tokens <= self.max_rows:
            return False
        return batch.attn.num_decodes == tokens or all(w.num_new_tokens == 1 for w in batch.work)

    def forward(self, batch: Batch, kv_layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """batch (decode rows only) -> final hidden states [T, hidden], as model(...) returns them."""
        model = self.model
        x = model.model.embed_tokens(batch.input_ids)
        rotary = model.rotary.tables(batch.positions)
        meta = batch.attn
        block_tables, seq_lens = meta.block_tables, meta.seq_lens
        if meta.num_decodes != batch.input_ids.numel():
            # Drafts: every token a decode row of its sequence, seeing the
            # cache up to its own position.
            rows = torch.repeat_interleave(
                torch.arange(len(meta.query_lens_list)), torch.tensor(meta.query_lens_list)
            )
            block_tables, seq_lens = block_tables[rows], batch.positions + 1
        return self.engine.forward(
            x, rotary.cos, rotary.sin, meta.slot_mapping, block_tables, seq_lens,
            [k for k, _ in kv_layers], [v for _, v in kv_layers],
        )


def build_cpu_decoder(model: nn.Module) -> CpuDecoder | None:
    """The C++ decoder for `model`, or None where it does not apply (then the
    model's forward runs every step)."""
    from sluice_server.models.llama import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM or not cpu_kernels.load():
        return None
    layers = model.model.layers
    linears = [(l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj) for l in layers]
    quantized = [m.quantized for group in linears for m in group]
    if any(q is None for q in quantized) or len({q.int8 for q in quantized}) != 1:
        return None
    attn = layers[0].self_attn
    if not isinstance(attn.backend.ops, CpuOps) or not getattr(attn.backend, "cpu_kernels", False):
        return None
    if attn.qkv_proj.dist.is_parallel or model.model.norm.weight.dtype != torch.float32:
        return None
    cfg = model.config
    engine = torch.classes.sluice_cpu.LlamaDecoder(
        attn.num_heads, attn.num_kv_heads, attn.head_dim, cfg.rms_norm_eps, model.model.norm.weight
    )
    for layer, group in zip(layers, linears):
        engine.add_layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            [m.quantized.data for m in group],
            [m.quantized.format for m in group],
            [m.quantized.out_features for m in group],
            quantized[0].int8,
            [m.bias for m in group],
        )
    max_rows = min(q.max_rows for q in quantized)
    sizes = "every decode step runs" if max_rows >= ALL_ROWS else f"decode steps of <= {max_rows} sequences run"
    log.info("%s the C++ decoder (%d layers)", sizes, engine.num_layers())
    return CpuDecoder(model, engine, max_rows)

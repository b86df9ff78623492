"""Decode steps of the Llama model (models/llama.py) on CPU in one C++ call.

models/llama.py is the model: the one definition of its math. This is a
faster way to run its decode steps when every matmul of the step runs on
GGUF blocks (layers.gguf_weights): `LlamaDecoder` (the kernels'
csrc/cpu_decoder.cpp) holds references to the same weights and calls the
same kernels in the same order as `LlamaForCausalLM.forward`, without ~300
Python dispatches per step. The embedding lookup, the rotary tables and the
LM head stay in Python.

The Python forward is what the C++ decoder is checked against, not a second
definition beside it: server/tests/test_cpu_decoder.py runs the same decode
steps through both, on the bundled model with --dtype auto and float32, and
requires bitwise-equal logits and KV cache (and that the steps did run on
the decoder). A change to the model's math that the decoder does not follow
fails there.

Rows: every row is one token of a sequence that attends to that sequence's
cache up to its own position (a decode token, or a draft token being
verified: the step writes every row's key and value before any row
attends). Which steps qualify is the model runner's decision: at most
`max_rows` rows, all of that kind.

LoRA adapters: once the shard's adapter slots exist, `attach_lora` hands
the decoder every adapted linear layer's packed stacks (checked when the
layer made them; held by reference, so adapters loaded later show), and a
step with adapter rows passes their segments, checked here once per step
rather than by each of the step's 120 kernel calls; the decoder adds the
updates with the same kernel, at the same point, as the Python layers
(layers.lora with the C++ grouped matmul), so such steps stay bitwise the
Python forward's.

Models it declines (their forward runs every step): other families (even
subclasses of the Llama model), tensor parallelism, sliding-window layers
(the C++ decoder attends over whole contexts), layers without GGUF blocks
or mixing the two block arithmetics, and attention without the C++ kernels.
"""

from __future__ import annotations

import logging

import torch

from sluice_kernels.cpu_matmuls import ALL_ROWS
from sluice_kernels.lora import check_segments
from sluice_server.layers.lora import LoraSegments
from sluice_server.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class LlamaCpuDecoder:
    def __init__(self, model: LlamaForCausalLM, engine, max_rows: int):
        self.model = model
        self.engine = engine
        # Steps of at most this many rows (the GGUF blocks' row limit).
        self.max_rows = max_rows
        # Steps run here so far: which path a step took, for the tests and logs.
        self.steps = 0
        # The adapter slots' scales, once attach_lora gave it their stacks.
        self.lora_scales: torch.Tensor | None = None

    def linears(self):
        """(layer index, linear index, module) of every linear layer, in the
        engine's order: qkv, o, gate_up, down."""
        for i, layer in enumerate(self.model.model.layers):
            group = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for j, module in enumerate(group):
                yield i, j, module

    def attach_lora(self) -> bool:
        """Gives the engine the LoRA stacks of every adapted linear layer
        (packed for the C++ grouped matmul, float32 or bfloat16); True when
        it can then run steps with adapter rows."""
        loras = [(i, j, m.lora) for i, j, m in self.linears() if m.lora is not None]
        if not loras or not all(lora.packed for _, _, lora in loras):
            self.lora_scales = None
            return False
        for i, j, lora in loras:
            self.engine.set_lora(i, j, lora.a, lora.b, lora.bounds_t, lora.ranks)
        self.lora_scales = loras[0][2].context.scales
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoraSegments | None = None,
    ) -> torch.Tensor:
        """One step of R rows -> final hidden states [R, hidden], as the
        model's forward returns them.

        input_ids, positions, slot_mapping: [R] int64, row r's token, its
        position and the cache slot its key/value go to;
        block_tables [R, max_blocks], seq_lens [R] int64: row r's sequence's
        blocks, and how many of its keys it sees (positions[r] + 1);
        lora: the rows' adapter segments (attach_lora first), if any."""
        segments = (None,) * 4
        if lora is not None:
            if self.lora_scales is None:
                raise RuntimeError("a step with adapter rows, but the decoder has no LoRA stacks (attach_lora)")
            check_segments(lora.starts_t, lora.ends_t, lora.slots_t, input_ids.numel(), self.lora_scales.numel())
            segments = (lora.starts_t, lora.ends_t, lora.slots_t, self.lora_scales)
        model = self.model
        x = model.model.embed_tokens(input_ids)
        rotary = model.rotary.tables(positions)
        hidden = self.engine.forward(
            x, rotary.cos, rotary.sin, slot_mapping, block_tables, seq_lens,
            [k for k, _ in kv_layers], [v for _, v in kv_layers], *segments,
        )
        self.steps += 1
        return hidden


def build_llama_cpu_decoder(model) -> LlamaCpuDecoder | None:
    """The C++ decoder for `model`, or None where it does not apply (module
    docstring)."""
    if type(model) is not LlamaForCausalLM:
        return None
    layers = model.model.layers
    if any(layer.self_attn.layer.sliding_window is not None for layer in layers):
        return None
    linears = [(l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj) for l in layers]
    quantized = [m.quantized for group in linears for m in group]
    if any(q is None for q in quantized) or len({q.int8 for q in quantized}) != 1:
        return None
    attn = layers[0].self_attn
    if not getattr(attn.backend, "cpu_kernels", False):
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
            [p.data for m in group for p in m.quantized.pieces()],
            [p.format for m in group for p in m.quantized.pieces()],
            [p.out_features for m in group for p in m.quantized.pieces()],
            quantized[0].int8,
            [m.bias for m in group],
            [len(m.quantized.pieces()) for m in group],
        )
    max_rows = min(q.max_rows for q in quantized)
    sizes = "every decode step runs" if max_rows >= ALL_ROWS else f"decode steps of <= {max_rows} sequences run"
    log.info("%s the C++ decoder (%d layers)", sizes, engine.num_layers())
    return LlamaCpuDecoder(model, engine, max_rows)

"""Mixtral (8x7B, 8x22B): Mistral's attention, eight SwiGLU experts per layer.

    h = h + o_proj(attention(rope(q), rope(k), v))     on rms_norm(h)
    h = h + moe(h')                                    on rms_norm(h)
        moe: softmax over the router logits, the top num_experts_per_tok
        kept and divided by their sum, each expert w2(silu(w1 x) * w3 x)

Attention, norms and rotary are models/llama.py's (a `sliding_window`, when
set, applies to every layer); the expert layer is layers/moe.py's.

Checkpoint names: `block_sparse_moe.gate` is the router,
`block_sparse_moe.experts.<e>.w1 / w3 / w2` an expert's gate, up and down.
GGUF files (architecture `llama` with an expert count) store each layer's
experts stacked (`ffn_gate_exps` ...); gguf_convert.py writes them out in
these names.
"""

from __future__ import annotations

from typing import Any

from sluice_server.layers.moe import MoESpec
from sluice_server.models.llama import LlamaForCausalLM
from sluice_server.models.qwen3_moe import MoEConfig, MoEDecoderLayer, softmax_topk_spec


class MixtralConfig(MoEConfig):
    @staticmethod
    def moe_spec(c: dict[str, Any]) -> MoESpec:
        return softmax_topk_spec(c, c["intermediate_size"], renormalize=True)

    @staticmethod
    def expert_layers(c: dict[str, Any]) -> tuple[bool, ...]:
        return (True,) * c["num_hidden_layers"]


class MixtralForCausalLM(LlamaForCausalLM):
    config_cls = MixtralConfig
    layer_cls = MoEDecoderLayer
    checkpoint_renames = {".block_sparse_moe.gate.": ".mlp.router.", ".block_sparse_moe.": ".mlp."}
    # One expert's checkpoint projection -> (our stacked weight, piece, pieces per expert).
    expert_projections = {"w1": ("w13", 0, 2), "w3": ("w13", 1, 2), "w2": ("w2", 0, 1)}

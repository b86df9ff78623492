"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention, expert
MLPs beside one shared expert.

    h = h + o_proj(attention(rope(q), rope(k), v))        on rms_norm(h)
        q, k, v with biases (`qkv_bias`), o without
    h = h + moe(h') + sigmoid(h' . g) * shared(h')        on rms_norm(h)
        moe: softmax over num_experts router logits, the top
        num_experts_per_tok kept (divided by their sum when
        norm_topk_prob; the released models do not), each a SwiGLU MLP
        of moe_intermediate_size
        shared: one SwiGLU MLP of shared_expert_intermediate_size that
        every token goes through, scaled by a per-token sigmoid gate
        (g: `shared_expert_gate`, [1, hidden])

The attention is models/llama.py's; the expert layer, shared expert
included, is layers/moe.py's, the shared expert itself Llama's dense MLP
(fused gate/up; tensor parallelism splits its intermediate dimension as
any dense MLP's, and the expert layer's one all-reduce sums it with the
routed experts). As in Qwen3-MoE, a layer listed in `mlp_only_layers`, or
one off the `decoder_sparse_step` stride, keeps a plain dense MLP of
`intermediate_size` (no shared expert). With `use_sliding_window`, the
layers `layer_types` marks "sliding_attention" attend over the window.

Checkpoint names: `mlp.gate` is the router, `mlp.experts.<e>.gate_proj /
up_proj / down_proj` one expert's projections, `mlp.shared_expert.gate_proj
/ up_proj / down_proj` the shared expert, `mlp.shared_expert_gate` its gate.
GGUF files (architecture `qwen2moe`) name them `ffn_gate_inp`,
`ffn_{gate,up,down}_exps`, `ffn_{gate,up,down}_shexp` and
`ffn_gate_inp_shexp`; transformers' GGUF reader converts them
(gguf_convert.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

from sluice_server.layers.moe import FusedMoE, MoESpec
from sluice_server.models.llama import LlamaConfig, LlamaForCausalLM, LlamaMLP
from sluice_server.models.qwen3_moe import MoEConfig, MoEDecoderLayer, softmax_topk_spec


@dataclass(frozen=True)
class Qwen2MoeConfig(MoEConfig):
    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "Qwen2MoeConfig":
        if not c.get("num_experts"):
            raise ValueError("qwen2_moe with num_experts 0 (no expert layers) is not supported")
        # Qwen2's bias rule under its own flag: q, k and v (default on), never o.
        base = dataclasses.replace(LlamaConfig.from_dict(c), qkv_bias=bool(c.get("qkv_bias", True)), o_bias=False)
        return cls(**base.__dict__, moe=cls.moe_spec(c), moe_layers=cls.expert_layers(c))

    @staticmethod
    def moe_spec(c: dict[str, Any]) -> MoESpec:
        routed = softmax_topk_spec(c, c["moe_intermediate_size"], renormalize=bool(c.get("norm_topk_prob", False)))
        shared = int(c.get("shared_expert_intermediate_size") or 0)
        if not shared:
            raise ValueError("qwen2_moe with shared_expert_intermediate_size 0 (no shared expert) is not supported")
        return dataclasses.replace(routed, shared_expert_size=shared, shared_expert_gate=True)


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    """Qwen3-MoE's choice of MLP per layer; the expert layers get the shared expert."""

    def feed_forward(self, cfg: Qwen2MoeConfig, dist, backend, index) -> nn.Module:
        if not cfg.moe_layers[index]:
            return LlamaMLP(cfg, dist, backend)
        shared = LlamaMLP(cfg, dist, backend, size=cfg.moe.shared_expert_size, reduce=False)
        return FusedMoE(cfg.moe, dist, backend.ops, shared_expert=shared)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    config_cls = Qwen2MoeConfig
    layer_cls = Qwen2MoeDecoderLayer
    # `.mlp.gate.` is the router; `.mlp.shared_expert_gate.` keeps its name.
    checkpoint_renames = {".mlp.gate.": ".mlp.router."}
    # One expert's checkpoint projection -> (our stacked weight, piece, pieces per expert).
    expert_projections = {"gate_proj": ("w13", 0, 2), "up_proj": ("w13", 1, 2), "down_proj": ("w2", 0, 1)}

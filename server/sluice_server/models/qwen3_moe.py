"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, expert MLPs.

    h = h + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))    on rms_norm(h)
    h = h + moe(h')                                                   on rms_norm(h)
        moe: softmax over num_experts router logits, the top
        num_experts_per_tok kept (divided by their sum when
        norm_topk_prob), each a SwiGLU MLP of moe_intermediate_size

The attention is models/qwen3.py's; the expert layer is layers/moe.py's. A
layer listed in `mlp_only_layers`, or one off the `decoder_sparse_step`
stride, keeps a dense MLP of `intermediate_size` (the released models have
none). With `use_sliding_window` every layer attends over the window.

Checkpoint names: `mlp.gate` is the router, `mlp.experts.<e>.gate_proj /
up_proj / down_proj` one expert's projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from sluice_server.layers.moe import SOFTMAX_TOPK, FusedMoE, MoESpec
from sluice_server.models.llama import LlamaConfig, LlamaDecoderLayer, LlamaMLP
from sluice_server.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """LlamaConfig's fields, the experts, and which layers have them."""

    moe: MoESpec
    # Per layer: experts (True) or the dense MLP of intermediate_size.
    moe_layers: tuple[bool, ...]

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "MoEConfig":
        base = LlamaConfig.from_dict(c)
        return cls(**base.__dict__, moe=cls.moe_spec(c), moe_layers=cls.expert_layers(c))

    @staticmethod
    def moe_spec(c: dict[str, Any]) -> MoESpec:
        return softmax_topk_spec(c, c["moe_intermediate_size"], renormalize=bool(c.get("norm_topk_prob", False)))

    @staticmethod
    def expert_layers(c: dict[str, Any]) -> tuple[bool, ...]:
        dense = set(c.get("mlp_only_layers") or ())
        step = c.get("decoder_sparse_step", 1) or 1
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(c["num_hidden_layers"]))


def softmax_topk_spec(c: dict[str, Any], width: int, renormalize: bool) -> MoESpec:
    """The experts of a family that routes by softmax, then top k (Qwen3-MoE, Mixtral)."""
    return MoESpec(
        num_experts=num_experts(c),
        top_k=c["num_experts_per_tok"],
        hidden_size=c["hidden_size"],
        intermediate_size=width,
        scoring=SOFTMAX_TOPK,
        renormalize=renormalize,
    )


def num_experts(c: dict[str, Any]) -> int:
    """transformers 5 writes `num_local_experts` where older files say `num_experts`."""
    return int(c.get("num_experts") or c["num_local_experts"])


class MoEDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose MLP is the expert layer, where the config says so."""

    def feed_forward(self, cfg: MoEConfig, dist, backend, index) -> nn.Module:
        return FusedMoE(cfg.moe, dist, backend.ops) if cfg.moe_layers[index] else LlamaMLP(cfg, dist, backend)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    config_cls = MoEConfig
    attention_cls = Qwen3Attention
    layer_cls = MoEDecoderLayer
    checkpoint_renames = {".mlp.gate.": ".mlp.router."}
    # One expert's checkpoint projection -> (our stacked weight, piece, pieces per expert).
    expert_projections = {"gate_proj": ("w13", 0, 2), "up_proj": ("w13", 1, 2), "down_proj": ("w2", 0, 1)}

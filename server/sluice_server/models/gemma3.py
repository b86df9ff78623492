"""Gemma 3 (text): Gemma3ForCausalLM checkpoints (270M, 1B) and their GGUFs.

    h = embed(ids) * sqrt(hidden)
    for each layer (local or global):
        a = attention(rope_l(q_norm(q)), rope_l(k_norm(k)), v)  scale query_pre_attn_scalar^-1/2
        h = h + post_attention_norm(o_proj(a))                  on input_norm(h)
        h = h + post_feedforward_norm(down(gelu_tanh(gate(h')) * up(h')))
                                                                on pre_feedforward_norm(h)
    logits = lm_head(norm(h))                                   (tied to the embedding)

Every norm is Gemma's RMSNorm, scaling by (1 + w) in float32. The layers
alternate: five local layers (sliding window, rope base 10k) then one global
layer (whole context, rope base 1M, optionally `linear`-scaled) by default;
config.json's `layer_types` says which is which. The post-norms fold into the
residual pattern the other families use: norm(x + residual) with the sum
carried along.

Shared rather than rewritten: the attention is Qwen3's (models/qwen3.py,
per-head q/k norms) with Gemma's norm and scale; weight loading, the
tensor-parallel split and the tied head are the Llama model's
(Gemma3ForCausalLM subclasses it and brings its own layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sluice_server.distributed import Distributed
from sluice_server.layers.attention import AttentionBackend, LayerAttention
from sluice_server.layers.embedding import VocabParallelEmbedding
from sluice_server.layers.norm import OnePlusRMSNorm
from sluice_server.layers.rotary import RotaryEmbedding, rope_parameters
from sluice_server.models.llama import LlamaConfig, LlamaForCausalLM, LlamaMLP, model_shape
from sluice_server.models.qwen3 import Qwen3Attention

LOCAL, GLOBAL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    """LlamaConfig's fields (`rope`: the global layers' settings) and Gemma's own."""

    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    # Per layer: LOCAL or GLOBAL (its sliding window is in `sliding_windows`).
    layer_types: tuple[str, ...]
    # The local layers' rope settings (their own base frequency).
    rope_local: dict[str, Any]

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "Gemma3Config":
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
        if c.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping is not supported")
        if c.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (EmbeddingGemma) is not supported: Sluice generates text")
        n = c["num_hidden_layers"]
        pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6
        types = tuple(c.get("layer_types") or (LOCAL if (i + 1) % pattern else GLOBAL for i in range(n)))
        window = c.get("sliding_window") or 4096
        bias = bool(c.get("attention_bias", False))
        rope, rope_local = gemma3_rope(c)
        return cls(
            **model_shape(c, head_dim=256, max_position_embeddings=131072, rope=rope),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=False,
            rope=rope,
            sliding_windows=tuple(int(window) if t == LOCAL else None for t in types),
            query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=c.get("final_logit_softcapping"),
            layer_types=types,
            rope_local=rope_local,
        )


def gemma3_rope(c: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) layers' rope settings, from either config.json layout:
    transformers 5 nests them (`rope_parameters` keyed by layer type); older
    files have rope_theta + rope_scaling for global layers and
    rope_local_base_freq for local ones."""
    nested = c.get("rope_parameters") or {}
    if LOCAL in nested or GLOBAL in nested:
        full, local = dict(nested.get(GLOBAL) or {}), dict(nested.get(LOCAL) or {})
    else:
        full = dict(c.get("rope_scaling") or {})
        local = {"rope_type": "default"}
        if "rope_theta" in c:
            full["rope_theta"] = c["rope_theta"]
        if "rope_local_base_freq" in c:
            local["rope_theta"] = c["rope_local_base_freq"]
    full.setdefault("rope_theta", 1_000_000.0)
    local.setdefault("rope_theta", 10_000.0)
    return rope_parameters(c, full), rope_parameters(c, local)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's per-head q/k norms, Gemma's (1 + w) kind, and its softmax scale."""

    qk_norm = OnePlusRMSNorm

    def __init__(self, cfg: Gemma3Config, dist: Distributed, backend: AttentionBackend, index: int):
        super().__init__(cfg, dist, backend, index)
        self.layer = LayerAttention(
            scale=cfg.query_pre_attn_scalar**-0.5, sliding_window=cfg.sliding_windows[index]
        )


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, dist: Distributed, backend: AttentionBackend, index: int):
        super().__init__()
        norm = lambda: OnePlusRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Gemma3Attention(cfg, dist, backend, index)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = LlamaMLP(cfg, dist, backend, activation="gelu_tanh_mul")
        self.post_feedforward_layernorm = norm()

    def forward(self, x, residual, rotary, k_cache, v_cache, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rotary, k_cache, v_cache, meta)
        h, _ = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h, _ = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: Gemma3Config, dist: Distributed, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dist)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, dist, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm = OnePlusRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Llama model's loading, tensor-parallel split and tied head, with
    Gemma's layers, two rotary tables and the embedding scale."""

    config_cls = Gemma3Config

    def __init__(self, config: dict[str, Any], dist: Distributed, backend: AttentionBackend):
        super().__init__(config, dist, backend)
        cfg = self.config
        # Global layers rotate with self.rotary (cfg.rope), local ones with this.
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.rope_local, torch.get_default_device())
        # float32 rounded to the model dtype, as transformers does.
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(torch.get_default_dtype())

    def decoder(self, cfg: Gemma3Config, dist: Distributed, backend: AttentionBackend) -> nn.Module:
        return Gemma3Model(cfg, dist, backend)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.model.embed_tokens(input_ids) * self.embed_scale
        tables = {GLOBAL: self.rotary.tables(positions), LOCAL: self.rotary_local.tables(positions)}
        residual = None
        for layer, kind, (k_cache, v_cache) in zip(self.model.layers, self.config.layer_types, kv_caches):
            x, residual = layer(x, residual, tables[kind], k_cache, v_cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sluice_server.distributed import Distributed
from sluice_server.layers.attention import AttentionBackend, AttentionMetadata, LayerAttention
from sluice_server.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from sluice_server.layers.norm import OnePlusRMSNorm
from sluice_server.layers.rotary import RotaryEmbedding, rope_parameters
from sluice_server.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, check_tensor_parallel, kv_head_range

LOCAL, GLOBAL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma3Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    # Per layer: LOCAL or GLOBAL, and its sliding window (None when global).
    layer_types: tuple[str, ...]
    sliding_windows: tuple[int | None, ...]
    # Rope settings per layer type.
    rope: dict[str, dict[str, Any]]

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
        heads = c["num_attention_heads"]
        bias = bool(c.get("attention_bias", False))
        return cls(
            model_type=c["model_type"],
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or 256,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            max_position_embeddings=c.get("max_position_embeddings", 131072),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=False,
            query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=c.get("final_logit_softcapping"),
            layer_types=types,
            sliding_windows=tuple(int(window) if t == LOCAL else None for t in types),
            rope=gemma3_rope(c),
        )


def gemma3_rope(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rope settings per layer type, from either config.json layout:
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
    return {GLOBAL: rope_parameters(c, full), LOCAL: rope_parameters(c, local)}


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: Gemma3Config, dist: Distributed, backend: AttentionBackend, index: int):
        super().__init__(cfg, dist, backend, index)
        self.layer = LayerAttention(
            scale=cfg.query_pre_attn_scalar**-0.5, sliding_window=cfg.sliding_windows[index]
        )
        self.q_norm = OnePlusRMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend.ops)
        self.k_norm = OnePlusRMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend.ops)

    def position_encode(self, q, k, rotary):
        t, d = q.shape[0], self.head_dim
        q, _ = self.q_norm(q.reshape(-1, d))
        k, _ = self.k_norm(k.reshape(-1, d))
        return super().position_encode(q.view(t, -1, d), k.view(t, -1, d), rotary)


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


class Gemma3ForCausalLM(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules
    ignored_suffixes = LlamaForCausalLM.ignored_suffixes

    def __init__(self, config: dict[str, Any], dist: Distributed, backend: AttentionBackend):
        super().__init__()
        self.config = cfg = Gemma3Config.from_dict(config)
        check_tensor_parallel(cfg, dist.world_size)
        first_kv, last_kv = kv_head_range(cfg, dist)
        self.num_local_kv_heads = last_kv - first_kv
        self.model = Gemma3Model(cfg, dist, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dist)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        device = torch.get_default_device()
        self.rotary = {kind: RotaryEmbedding(cfg.head_dim, params, device) for kind, params in cfg.rope.items()}
        # float32 rounded to the model dtype, as transformers does.
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(torch.get_default_dtype())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids) * self.embed_scale
        tables = {kind: rotary.tables(positions) for kind, rotary in self.rotary.items()}
        residual = None
        for layer, kind, (k_cache, v_cache) in zip(self.model.layers, self.config.layer_types, kv_caches):
            x, residual = layer(x, residual, tables[kind], k_cache, v_cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

"""The Llama family: Llama 2/3, Mistral, Qwen2 and SmolLM2 share this file.

    h = embed(ids)
    for each layer:
        h = h + o_proj(attention(rope(q), rope(k), v))     on rms_norm(h)
        h = h + down(silu(gate(h')) * up(h'))              on rms_norm(h)
    logits = lm_head(rms_norm(h))

Differences between the members are configuration only: Qwen2 has q/k/v
biases, Llama 3.1 scales rotary frequencies (rope_type llama3), SmolLM2 ties
the LM head to the embedding, and all use grouped-query attention.

Not implemented: sliding-window attention (Mistral v0.1's `sliding_window`,
Qwen2's `use_sliding_window`). Every token attends to its whole context, which
is the same computation while sequences stay within the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
import torch.nn.functional as F

from sluice_server.distributed import Distributed
from sluice_server.layers.attention import AttentionBackend, AttentionMetadata
from sluice_server.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from sluice_server.layers.linear import ColumnParallelLinear, RowParallelLinear
from sluice_server.layers.norm import RMSNorm
from sluice_server.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters


@dataclass(frozen=True)
class LlamaConfig:
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
    rope: dict[str, Any]

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "LlamaConfig":
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (only silu)")
        heads = c["num_attention_heads"]
        # Llama/Mistral: attention_bias covers q, k, v and o; Qwen2: q, k, v only.
        qwen = c["model_type"] == "qwen2"
        attention_bias = bool(c.get("attention_bias", False))
        return cls(
            model_type=c["model_type"],
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=qwen or attention_bias,
            o_bias=attention_bias and not qwen,
            mlp_bias=bool(c.get("mlp_bias", False)),
            rope=rope_parameters(c),
        )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, dist: Distributed, backend: AttentionBackend):
        super().__init__()
        if cfg.num_attention_heads % dist.world_size or cfg.num_key_value_heads % dist.world_size:
            raise ValueError(
                f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} key-value heads "
                f"do not split over {dist.world_size} shards"
            )
        self.num_heads = cfg.num_attention_heads // dist.world_size
        self.num_kv_heads = cfg.num_key_value_heads // dist.world_size
        self.head_dim = d = cfg.head_dim
        self.backend = backend
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d],
            bias=cfg.qkv_bias,
            dist=dist,
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.o_bias, dist=dist)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = apply_rotary(q.view(t, self.num_heads, d), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, d), cos, sin)
        o = self.backend.forward(q, k, v.view(t, self.num_kv_heads, d), k_cache, v_cache, meta)
        return self.o_proj(o.view(t, self.num_heads * d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, dist: Distributed):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [size, size], bias=cfg.mlp_bias, dist=dist)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=cfg.mlp_bias, dist=dist)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, dist: Distributed, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, dist, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, dist)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, k_cache, v_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, dist: Distributed, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dist)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dist, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # Checkpoint names that are fused here: (our parameter's module, piece index).
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Checkpoint tensors with no parameter here (buffers some exporters save).
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, config: dict[str, Any], dist: Distributed, backend: AttentionBackend):
        super().__init__()
        self.config = cfg = LlamaConfig.from_dict(config)
        self.model = LlamaModel(cfg, dist, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dist)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, torch.get_default_device())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden)

"""Qwen3 (dense): the Llama layer with an RMSNorm on each query and key head.

    q, k, v = split(qkv_proj(h))
    q, k = rms_norm(q) per head, rms_norm(k) per head      <- the only change
    h = h + o_proj(attention(rope(q), rope(k), v))

No q/k/v biases (`attention_bias`, default false, covers q, k, v and o as in
Llama), an explicit head_dim (128 for most sizes, not hidden / heads), and the
Qwen2 rules for optional sliding-window layers. Everything else is
models/llama.py.
"""

from __future__ import annotations

import torch

from sluice_server.layers.norm import RMSNorm
from sluice_server.layers.rotary import RotaryTables
from sluice_server.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    qk_norm = RMSNorm  # Gemma 3 (models/gemma3.py): its (1 + w) kind

    def __init__(self, cfg, dist, backend, index):
        super().__init__(cfg, dist, backend, index)
        # Shared by every head, hence whole on every tensor-parallel rank.
        self.q_norm = self.qk_norm(cfg.head_dim, cfg.rms_norm_eps, backend.ops)
        self.k_norm = self.qk_norm(cfg.head_dim, cfg.rms_norm_eps, backend.ops)

    def position_encode(self, q: torch.Tensor, k: torch.Tensor, rotary: RotaryTables):
        t, d = q.shape[0], self.head_dim
        q, _ = self.q_norm(q.reshape(-1, d))
        k, _ = self.k_norm(k.reshape(-1, d))
        return super().position_encode(q.view(t, -1, d), k.view(t, -1, d), rotary)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

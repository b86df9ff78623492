"""Phi-3 / Phi-4-mini: the Llama layer with fused checkpoint tensors and LongRoPE.

What differs from models/llama.py:

- The checkpoint stores q/k/v as one `qkv_proj` tensor and gate/up as one
  `gate_up_proj`, in the same row order as our fused layers:

      qkv_proj.weight      [q rows (Hq*D) | k rows (Hkv*D) | v rows (Hkv*D)]
      gate_up_proj.weight  [gate rows (I) | up rows (I)]

  `fused_checkpoint_tensors` tells the loader (models/__init__.py) to cut
  each into those pieces, so every rank still takes only its own rows.
- Rotary: LongRoPE (`rope_scaling` type "su"/"longrope": per-frequency
  factors and a cos/sin scale, see layers/rotary.py), and a
  partial_rotary_factor < 1 rotates only the first dims of each head.
- A `sliding_window` in config.json applies to every layer
  (Phi-3-mini-4k: 2047).
"""

from __future__ import annotations

import torch

from sluice_server.layers.rotary import RotaryTables, rotary_dim
from sluice_server.models.llama import LlamaAttention, LlamaForCausalLM


class Phi3Attention(LlamaAttention):
    def __init__(self, cfg, dist, backend, index):
        super().__init__(cfg, dist, backend, index)
        self.rotary_dim = rotary_dim(cfg.head_dim, cfg.rope)

    def position_encode(self, q: torch.Tensor, k: torch.Tensor, rotary: RotaryTables):
        r = self.rotary_dim
        self.backend.ops.rotary_(q[..., :r], k[..., :r], rotary)  # the rest of each head passes through
        return q, k


class Phi3ForCausalLM(LlamaForCausalLM):
    attention_cls = Phi3Attention
    # Our fused layers whose checkpoint tensor is fused the same way.
    fused_checkpoint_tensors = ("qkv_proj", "gate_up_proj")

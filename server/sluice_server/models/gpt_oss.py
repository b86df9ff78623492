"""gpt-oss (20b, 120b): attention with sinks, alternating windows, expert MLPs.

    h = h + o_proj(attention(rope(q), rope(k), v; sinks))   on rms_norm(h)
        q, k, v, o with biases; each head's softmax has one more term,
        e^sink (layers/attention.py); layers alternate between a sliding
        window (`layer_types` "sliding_attention", window 128) and the
        whole context; rotary is YaRN (factor 32 over a 4k original context)
    h = h + moe(h')                                         on rms_norm(h)
        moe: the top num_experts_per_tok router logits (with a bias),
        softmaxed over those k; each expert
            gate, up = x W13^T + b13
            down((up + 1) * gate * sigmoid(1.702 gate)) + b2
        with gate clamped above at 7 and up to [-7, 7] (layers/moe.py,
        "swiglu_oai")

The layers are models/llama.py's with two additions: `GptOssAttention`
(the sinks) and the expert layer. Norms, embedding and head are Llama's.

Checkpoints store each layer's experts stacked, transposed and with gate
and up interleaved (column 2j is gate j, 2j + 1 up j):

    mlp.experts.gate_up_proj        [E, H, 2 I]    mlp.experts.gate_up_proj_bias  [E, 2 I]
    mlp.experts.down_proj           [E, I, H]      mlp.experts.down_proj_bias     [E, H]

or, in the released files (`quantization_config.quant_method` "mxfp4"),
the weights as MXFP4 blocks, rows not transposed (row r of gate_up is
output 2j or 2j + 1 as above):

    mlp.experts.gate_up_proj_blocks [E, 2 I, H/32, 16] uint8: 32 4-bit codes per block,
                                                        the low nibble first
    mlp.experts.gate_up_proj_scales [E, 2 I, H/32]     uint8: the block's power of two, + 127
    (down_proj_blocks / _scales likewise, [E, H, I/32, ...])

    w = FP4[code] * 2^(scale - 127),  FP4 = 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives

`ExpertLoader` turns each expert into the expert layer's layout
([gate | up] rows) and hands it over; MXFP4 blocks are expanded to the
model's dtype exactly (as transformers does on CPU), and kept as block
records too (`FusedMoE.block_records`, sluice_kernels.moe.mxfp4_records),
which the CPU shard runs decode steps on (layers.gguf_weights.attach_block_experts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sluice_kernels.moe import dequantize_mxfp4, mxfp4_records
from sluice_server.distributed import shard_range
from sluice_server.layers.attention import LayerAttention
from sluice_server.layers.moe import TOPK_SOFTMAX, FusedMoE, MoESpec
from sluice_server.layers.rotary import rope_parameters
from sluice_server.models.llama import LlamaAttention, LlamaForCausalLM, model_shape
from sluice_server.models.qwen3_moe import MoEConfig, MoEDecoderLayer

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GptOssConfig(MoEConfig):
    # The checkpoint's experts are MXFP4 blocks.
    mxfp4: bool

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "GptOssConfig":
        quant = (c.get("quantization_config") or {}).get("quant_method")
        if quant not in (None, "mxfp4"):
            raise ValueError(f"gpt_oss: quantization {quant!r} is not supported (only mxfp4 checkpoints)")
        n = c["num_hidden_layers"]
        types = c.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
        window = c.get("sliding_window")
        rope = rope_parameters(c)
        bias = bool(c.get("attention_bias", True))
        return cls(
            **model_shape(c, head_dim=64, max_position_embeddings=131072, rope=rope),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=False,
            rope=rope,
            sliding_windows=tuple(int(window) if t == SLIDING and window else None for t in types),
            moe=MoESpec(
                num_experts=int(c["num_local_experts"]),
                top_k=c["num_experts_per_tok"],
                hidden_size=c["hidden_size"],
                intermediate_size=c["intermediate_size"],
                scoring=TOPK_SOFTMAX,
                router_bias=True,
                expert_bias=True,
                activation="swiglu_oai",
                swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(c.get("swiglu_limit", 7.0)),
            ),
            moe_layers=(True,) * n,
            mxfp4=quant == "mxfp4",
        )


class GptOssAttention(LlamaAttention):
    """Llama's attention (with q/k/v/o biases) and one sink logit per head."""

    def __init__(self, cfg: GptOssConfig, dist, backend, index):
        super().__init__(cfg, dist, backend, index)
        if not getattr(backend, "supports_sinks", False):
            raise ValueError(
                f"gpt-oss needs attention sinks, which the {backend.name} attention backend does not support yet"
            )
        self.total_heads = cfg.num_attention_heads
        self.head_first, self.head_last = shard_range(cfg.num_attention_heads, dist)
        self.sinks = nn.Parameter(torch.empty(self.head_last - self.head_first), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        self.layer = LayerAttention(sliding_window=cfg.sliding_windows[index], sinks=self.sinks)

    def _load_sinks(self, param: nn.Parameter, checkpoint, shard_id: int = 0) -> None:
        if tuple(checkpoint.get_shape()) != (self.total_heads,):
            raise ValueError(f"sinks: checkpoint shape {tuple(checkpoint.get_shape())} != ({self.total_heads},)")
        param.data.copy_(checkpoint[self.head_first : self.head_last])


# Stacked expert tensors: (layer prefix, projection, what follows).
STACKED = re.compile(r"^(?P<layer>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)(?P<suffix>_bias|_blocks|_scales)?$")


class GptOssForCausalLM(LlamaForCausalLM):
    config_cls = GptOssConfig
    attention_cls = GptOssAttention
    layer_cls = MoEDecoderLayer

    def __init__(self, config: dict[str, Any], dist, backend):
        super().__init__(config, dist, backend)
        for layer in self.model.layers:
            ExpertLoader(layer.mlp, self.config.mxfp4).install()

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, int] | None:
        """mlp.experts.gate_up_proj[_bias|_blocks|_scales] -> mlp.w13_weight /
        w13_bias (piece 1 for the scales: blocks and scales make one weight)."""
        found = STACKED.match(name)
        if found is None:
            return None
        ours = "w13" if found["proj"] == "gate_up_proj" else "w2"
        suffix = found["suffix"] or ""
        kind = "bias" if suffix == "_bias" else "weight"
        return f"{found['layer']}.{ours}_{kind}", 1 if suffix == "_scales" else 0


class ExpertLoader:
    """Loads one layer's stacked gpt-oss expert tensors into its FusedMoE,
    expert by expert (the module docstring has the layouts)."""

    def __init__(self, moe: FusedMoE, mxfp4: bool):
        self.moe = moe
        self.mxfp4 = mxfp4
        # MXFP4 blocks seen, waiting for their scales (the same weight's other piece).
        self.pending: dict[str, Any] = {}

    def install(self) -> None:
        for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
            param = getattr(self.moe, name)
            param.weight_loader = self.load
            param.num_pieces = 2 if self.mxfp4 and name.endswith("weight") else 1

    def load(self, param: nn.Parameter, checkpoint, shard_id: int) -> None:
        spec = self.moe.spec
        w13 = param is self.moe.w13_weight or param is self.moe.w13_bias
        if param.dim() == 2:  # a bias: [E, 2 I] interleaved, or [E, H]
            for e in range(spec.num_experts):
                row = checkpoint[e : e + 1][0]
                self.moe.load_whole_expert_(param, e, deinterleave(row) if w13 else row)
            return
        if not self.mxfp4:  # [E, H, 2 I] or [E, I, H]: transposed
            for e in range(spec.num_experts):
                weight = checkpoint[e : e + 1][0].t()
                self.moe.load_whole_expert_(param, e, deinterleave(weight) if w13 else weight)
            return
        # MXFP4: blocks (piece 0) and scales (piece 1) make the weight; the
        # first to arrive is read whole, since a sharded checkpoint may keep
        # the other in another file.
        pieces = self.pending.setdefault("w13" if w13 else "w2", {})
        pieces[shard_id] = checkpoint[:]
        if len(pieces) < 2:
            return
        blocks, scales = pieces.pop(0), pieces.pop(1)
        records = []
        for e in range(spec.num_experts):
            if self.moe.local_expert(e) is None:  # another rank's (expert parallelism)
                continue
            weight = dequantize_mxfp4(blocks[e], scales[e], param.dtype)
            self.moe.load_whole_expert_(param, e, deinterleave(weight) if w13 else weight)
            records.append(self.local_records(w13, blocks[e], scales[e]))
        if all(r is not None for r in records):
            self.moe.block_records["w13" if w13 else "w2"] = (records, {"MXFP4"})

    def local_records(self, w13: bool, blocks: torch.Tensor, scales: torch.Tensor):
        """This rank's part of one expert's MXFP4 blocks as block records
        (None where its columns do not start and end on whole blocks)."""
        moe, i = self.moe, self.moe.spec.intermediate_size
        if w13:
            blocks, scales = deinterleave(blocks), deinterleave(scales)
            rows = torch.cat([torch.arange(moe.first, moe.last), torch.arange(i + moe.first, i + moe.last)])
            return mxfp4_records(blocks[rows], scales[rows])
        if moe.first % 32 or moe.last % 32:
            return None
        columns = slice(moe.first // 32, moe.last // 32)
        return mxfp4_records(blocks[:, columns].contiguous(), scales[:, columns].contiguous())


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows (or entries) gate 0, up 0, gate 1, up 1, ... -> [gate | up]."""
    return torch.cat([t[0::2], t[1::2]])

"""The Llama family: Llama 2/3, Mistral, Qwen2 and SmolLM2 share this file.

    h = embed(ids)
    for each layer:
        h = h + o_proj(attention(rope(q), rope(k), v))     on rms_norm(h)
        h = h + down(silu(gate(h')) * up(h'))              on rms_norm(h)
    logits = lm_head(rms_norm(h))

Differences between the members are configuration only: Qwen2 has q/k/v
biases, Llama 3.1 scales rotary frequencies (rope_type llama3), SmolLM2 ties
the LM head to the embedding, and all use grouped-query attention. Mistral
(v0.1) attends over a sliding window in every layer, Qwen2 in the layers its
`use_sliding_window` / `max_window_layers` (or `layer_types`) name; the window
is a property of each layer's attention (`LayerAttention`), applied by the
attention backend.

Variants whose layers differ in a few lines subclass the pieces here:
Qwen3 (models/qwen3.py: per-head q/k norms) and Phi-3 (models/phi3.py: fused
checkpoint tensors, LongRoPE, partial rotary). The mixture-of-experts
families (models/qwen3_moe.py, mixtral.py, gpt_oss.py) replace the MLP of
their layers (`LlamaDecoderLayer.feed_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sluice_server.distributed import Distributed, shard_range
from sluice_server.layers.attention import AttentionBackend, AttentionMetadata, LayerAttention
from sluice_server.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from sluice_server.layers.linear import ColumnParallelLinear, RowParallelLinear
from sluice_server.layers.norm import RMSNorm
from sluice_server.layers.rotary import RotaryEmbedding, RotaryTables, context_length, rope_parameters


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
    # Per layer: its sliding window, or None for global attention.
    sliding_windows: tuple[int | None, ...]

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "LlamaConfig":
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (only silu)")
        rope = rope_parameters(c)
        if rope.get("partial_rotary_factor", 1.0) != 1.0 and c["model_type"] != "phi3":
            raise ValueError(f"partial_rotary_factor is not supported for {c['model_type']}")
        # Llama/Mistral: attention_bias covers q, k, v and o; Qwen2: q, k, v only.
        qwen = c["model_type"] == "qwen2"
        attention_bias = bool(c.get("attention_bias", False))
        return cls(
            **model_shape(c, c["hidden_size"] // c["num_attention_heads"], max_position_embeddings=2048, rope=rope),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=qwen or attention_bias,
            o_bias=attention_bias and not qwen,
            mlp_bias=bool(c.get("mlp_bias", False)),
            rope=rope,
            sliding_windows=sliding_windows(c),
        )


def model_shape(
    c: dict[str, Any], head_dim: int, max_position_embeddings: int, rope: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The config.json sizes every family reads the same way; `head_dim` and
    `max_position_embeddings` are the family's defaults where the file has none.
    With `rope`, the served length follows its scaling (rotary.context_length:
    yarn and dynamic extend it)."""
    heads = c["num_attention_heads"]
    max_len = c.get("max_position_embeddings") or max_position_embeddings
    if rope is not None:
        max_len = context_length(rope, max_len)
    return dict(
        model_type=c["model_type"],
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or head_dim,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        max_position_embeddings=max_len,
    )


# Families whose `sliding_window` applies to every layer.
EVERY_LAYER_WINDOW = ("mistral", "phi3", "mixtral", "qwen3_moe")


def sliding_windows(c: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers reads these configs:

        mistral, phi3,  every layer, when `sliding_window` is set
        mixtral
        qwen3_moe       every layer, with `use_sliding_window`
        qwen2, qwen3    only with `use_sliding_window`: the layers `layer_types`
                        marks "sliding_attention", else those >= max_window_layers
        qwen2_moe       only with `use_sliding_window`: the layers `layer_types`
                        marks, else the even ones < max_window_layers
        gpt_oss         the layers `layer_types` marks "sliding_attention"
        llama           none
    """
    n = c["num_hidden_layers"]
    window = c.get("sliding_window")
    family = c["model_type"]
    if family in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and not c.get("use_sliding_window", False):
        window = None
    if not window or family not in EVERY_LAYER_WINDOW + ("qwen2", "qwen3", "qwen2_moe", "gpt_oss"):
        return (None,) * n
    if family in EVERY_LAYER_WINDOW:
        return (int(window),) * n
    limit = c.get("max_window_layers", 28)
    if family == "qwen2_moe":
        windowed = [i % 2 == 0 and i < limit for i in range(n)]
    else:
        windowed = [i >= limit for i in range(n)]
    types = c.get("layer_types") or ["sliding_attention" if w else "full_attention" for w in windowed]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (sliding_attention, full_attention)")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def check_tensor_parallel(cfg: LlamaConfig, world_size: int, expert_parallel: bool = False) -> None:
    """Raises one clear error, naming the numbers, when the model does not
    split evenly over `world_size` shards: query heads and the MLP width (each
    expert's and the shared expert's, for mixtures of experts; with
    `expert_parallel`, the number of experts instead of each one's width) must divide;
    key/value heads must divide, or divide the shard count (then each is
    replicated on world_size / num_kv_heads shards)."""
    problems = []
    if cfg.num_attention_heads % world_size:
        problems.append(f"num_attention_heads={cfg.num_attention_heads} is not divisible by {world_size}")
    kv = cfg.num_key_value_heads
    if kv % world_size and world_size % kv:
        problems.append(f"num_key_value_heads={kv} neither divides nor is divisible by {world_size}")
    # Mixture-of-experts configs (models/qwen3_moe.py) say which layers keep a dense MLP.
    dense_layers = not all(getattr(cfg, "moe_layers", (False,)))
    if dense_layers and cfg.intermediate_size % world_size:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by {world_size}")
    moe = getattr(cfg, "moe", None)
    if moe is None and expert_parallel:
        problems.append("--expert-parallel: the model has no expert layers")
    if moe is not None and expert_parallel and world_size > 1 and moe.num_experts % world_size:
        problems.append(f"num_experts={moe.num_experts} is not divisible by {world_size} "
                        f"(--expert-parallel gives each shard whole experts)")
    if moe is not None and not expert_parallel and moe.intermediate_size % world_size:
        problems.append(f"the experts' intermediate size {moe.intermediate_size} is not divisible by {world_size}")
    if moe is not None and moe.shared_expert_size % world_size:
        problems.append(
            f"the shared expert's intermediate size {moe.shared_expert_size} is not divisible by {world_size}"
        )
    if problems:
        raise ValueError(f"the model cannot be split over {world_size} shards: " + "; ".join(problems))


def kv_head_range(cfg: LlamaConfig, dist: Distributed) -> tuple[int, int]:
    """This rank's [first, last) key/value heads.

    Enough heads: an equal share. Fewer heads than ranks: R = world / Hkv
    consecutive ranks hold a copy of the same head, which is the head their
    query heads use (query head h reads kv head h // (Hq / Hkv)):

        world 4, Hq 8, Hkv 2:  rank    0     1     2     3
                               q heads 0-1   2-3   4-5   6-7
                               kv head 0     0     1     1
    """
    kv = cfg.num_key_value_heads
    if kv >= dist.world_size:
        return shard_range(kv, dist)
    head = dist.rank // (dist.world_size // kv)
    return head, head + 1


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, dist: Distributed, backend: AttentionBackend, index: int):
        super().__init__()
        check_tensor_parallel(cfg, dist.world_size, dist.expert_parallel)
        self.layer = LayerAttention(sliding_window=cfg.sliding_windows[index])
        self.num_heads = cfg.num_attention_heads // dist.world_size
        first_kv, last_kv = kv_head_range(cfg, dist)
        self.num_kv_heads = last_kv - first_kv
        self.head_dim = d = cfg.head_dim
        self.backend = backend
        kv_rows = (first_kv * d, last_kv * d)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d],
            bias=cfg.qkv_bias,
            dist=dist,
            ranges=[shard_range(cfg.num_attention_heads * d, dist), kv_rows, kv_rows],
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.o_bias, dist=dist)

    def forward(self, x, rotary: RotaryTables, k_cache, v_cache, meta: AttentionMetadata):
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q, k, v = q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        q, k = self.position_encode(q, k, rotary)
        o = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.layer)
        return self.o_proj(o.view(t, self.num_heads * d))

    def position_encode(self, q: torch.Tensor, k: torch.Tensor, rotary: RotaryTables):
        """q [T, Hq, D], k [T, Hkv, D] -> the same, rotated (in place, on views of the qkv output)."""
        self.backend.ops.rotary_(q, k, rotary)
        return q, k


# Rows from which the MLP keeps its intermediate in the packed dtype.
MIN_ROWS_PACKED_DTYPE_MLP = 256


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)); `activation` names the fused op of
    `backend.ops`: silu_mul (SwiGLU), or gelu_tanh_mul (Gemma's GeGLU).

    `size`: the intermediate width (default: the config's). `reduce=False`
    returns this rank's partial sum, not yet all-reduced: a shared expert
    (models/qwen2_moe.py), which the expert layer reduces with its own."""

    def __init__(
        self,
        cfg: LlamaConfig,
        dist: Distributed,
        backend: AttentionBackend,
        activation: str = "silu_mul",
        size: int | None = None,
        reduce: bool = True,
    ):
        super().__init__()
        self.ops = backend.ops
        self.act_mul = getattr(backend.ops, activation)
        size = size or cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [size, size], bias=cfg.mlp_bias, dist=dist)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=cfg.mlp_bias, dist=dist, reduce=reduce)

    def forward(self, x):
        # gate_up's local rows are [gate[rank] | up[rank]], what act_mul expects.
        # Where both matmuls run in another dtype than x (dense bfloat16 under
        # float32 activations on CPU) and the step is prefill-sized, the
        # intermediate stays in that dtype, as they compute it: one conversion
        # in and one out, not four (an 8 x 256-token prefill step: -25%). At
        # decode sizes torch's bf16 activation costs more than the conversions.
        inner = self.gate_up_proj.matmul_dtype(x)
        if x.shape[0] < MIN_ROWS_PACKED_DTYPE_MLP or inner != self.down_proj.matmul_dtype(x):
            inner = x.dtype
        return self.down_proj(self.act_mul(self.gate_up_proj(x, inner)), x.dtype)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, dist: Distributed, backend: AttentionBackend, index: int, attention_cls):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)
        self.self_attn = attention_cls(cfg, dist, backend, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)
        self.mlp = self.feed_forward(cfg, dist, backend, index)

    def feed_forward(self, cfg: LlamaConfig, dist: Distributed, backend: AttentionBackend, index: int) -> nn.Module:
        """This layer's MLP (`self.mlp`): what the mixture-of-experts families change."""
        return LlamaMLP(cfg, dist, backend)

    def forward(self, x, residual, rotary, k_cache, v_cache, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rotary, k_cache, v_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: LlamaConfig, dist: Distributed, backend: AttentionBackend, attention_cls, layer_cls=LlamaDecoderLayer
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dist)
        self.layers = nn.ModuleList(
            layer_cls(cfg, dist, backend, i, attention_cls) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)


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
    # Checkpoint name fragments renamed before anything else (a family whose
    # modules are named otherwise in its checkpoints, e.g. Mixtral's
    # block_sparse_moe): {checkpoint fragment: ours}.
    checkpoint_renames: dict[str, str] = {}
    # What a variant changes (models/qwen3.py, models/phi3.py, models/gemma3.py,
    # the mixture-of-experts families).
    config_cls = LlamaConfig
    attention_cls = LlamaAttention
    layer_cls = LlamaDecoderLayer

    def __init__(self, config: dict[str, Any], dist: Distributed, backend: AttentionBackend):
        super().__init__()
        self.config = cfg = self.config_cls.from_dict(config)
        check_tensor_parallel(cfg, dist.world_size, dist.expert_parallel)
        first_kv, last_kv = kv_head_range(cfg, dist)
        self.num_local_kv_heads = last_kv - first_kv
        self.model = self.decoder(cfg, dist, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dist)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, torch.get_default_device())

    def decoder(self, cfg: LlamaConfig, dist: Distributed, backend: AttentionBackend) -> nn.Module:
        """`self.model`: the embedding, the decoder layers and the final norm."""
        return LlamaModel(cfg, dist, backend, self.attention_cls, self.layer_cls)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        rotary = self.rotary.tables(positions)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rotary, k_cache, v_cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden)

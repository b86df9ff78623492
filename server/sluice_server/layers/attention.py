"""Paged attention: the contract every attention backend implements.

The backends: `torch_attention.TorchAttention` (CPU, and the reference),
`triton_attention.TritonAttention` (CUDA); `backends.get_backend` picks one.

A step's tokens are flattened into one batch, sequences ordered decodes first
(one token each), then prefill chunks:

    tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 p0 | p1 p1 p1 |
    seqs:      0    1    2         3              4
    query_start_loc = [0, 1, 2, 3, 8, 11]           (cu_seqlens of the queries)
    seq_lens        = [c0, c1, c2, 5 + k3, 3 + k4]  (tokens with KV after the step;
                                                      k = cached prefix length)

Token t of sequence s sits at position seq_lens[s] - q_len[s] + (t - query_start_loc[s])
and attends to the keys at positions [0, its own position] of its sequence: the
cached prefix plus the causal part of the new tokens. Keys live in the paged
cache (see kv_cache.py); each layer first writes its new k/v through
`slot_mapping`, then reads whole blocks through the block tables.

A layer with a sliding window W (`LayerAttention.sliding_window`) sees only
the last W of those keys, its own included:

    position p, window W:   keys  0 ... p-W | p-W+1 ........ p
                                   hidden   |  visible (W keys)

The cache still holds every block of the sequence (other layers of the same
model may be global); only the backends' reads change.

A layer with attention sinks (gpt-oss: `LayerAttention.sinks`, one learned
logit per query head) adds one more term to each softmax's denominator, a
key that every query sees and whose value is zero:

    p_j = e^(s_j) / (sum_i e^(s_i) + e^(sink_h))      out = sum_j p_j v_j

so a head can attend to "nothing" and its weights over the real keys may sum
to less than one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from sluice_kernels.ops import TorchOps


@dataclass
class AttentionMetadata:
    """Everything a backend needs about a step's batch. Built once per step by
    `batch.build_batch`, shared by all layers. B sequences, T tokens."""

    # [T] int64: the cache slot each new token's k/v is written to.
    slot_mapping: torch.Tensor
    # [B + 1] int64: tokens of sequence s are [query_start_loc[s], query_start_loc[s+1]).
    query_start_loc: torch.Tensor
    # [B] int64: tokens of each sequence with KV once this step is done.
    seq_lens: torch.Tensor
    # [B, max_blocks] int64: block ids per sequence, padded with 0 (never read
    # past seq_lens).
    block_tables: torch.Tensor
    # The first `num_decodes` sequences have exactly one new token.
    num_decodes: int
    block_size: int
    # Python copies of the per-sequence numbers (host side, for loops over the
    # few prefill sequences without device syncs).
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # Backend-specific tensors derived once per step by `AttentionBackend.prepare`.
    backend_state: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LayerAttention:
    """One layer's own attention settings, fixed when the model is built.

    scale: the softmax scale; None means 1/sqrt(head_dim) (Gemma 3 uses
        query_pre_attn_scalar**-0.5 instead).
    sliding_window: None (global attention), or W: the token at position p
        sees the keys at positions [max(0, p - W + 1), p], W keys counting its
        own (transformers' `sliding_window`; Mistral, Gemma 3's local layers).
    sinks: None, or [Hq] float (this rank's query heads): each head's sink
        logit (module docstring). The layer's parameter itself, so it holds
        the loaded values.
    """

    scale: float | None = None
    sliding_window: int | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def window_for(self, seq_lens: list[int]) -> int | None:
        """The window that matters for a batch: None when no sequence is longer
        than it (then every key is visible anyway and global attention's
        faster paths apply)."""
        w = self.sliding_window
        return w if w is not None and max(seq_lens, default=0) > w else None


GLOBAL_ATTENTION = LayerAttention()


class AttentionBackend(ABC):
    """Computes attention for a flattened batch against a paged KV cache.

    `ops` holds the matching small ops (RMSNorm, rotary, SiLU-and-mul) that
    the layers call, so one choice of backend switches the whole layer.
    """

    name: str
    ops: TorchOps
    # True when the backend compiles a kernel the first time it meets a new
    # specialization (Triton's JIT): steps after warmup may then stall on
    # compilation, and the shard says so in its WarmupResponse.
    compiles_lazily: bool = False
    # Whether `forward` applies LayerAttention.sinks (gpt-oss).
    supports_sinks: bool = False

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the layers run; may fill meta.backend_state."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention = GLOBAL_ATTENTION,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (new tokens, rotary applied);
        k_cache/v_cache [num_blocks, block_size, Hkv, D], updated in place;
        `layer`: this layer's scale and sliding window. Returns [T, Hq, D]."""

"""The Triton attention backend: the same contract as `TorchAttention`, on kernels.

Per layer: the new k/v go into the paged cache through the slot mapping
(`sluice_kernels.triton.reshape_and_cache`), then one kernel launch computes attention for
the decodes (split-KV when few long sequences would leave the GPU idle) and
one for the prefill chunks, both reading keys only from the cache
(`sluice_kernels.triton.paged_attention`). The tile plan depends only on the batch and the
head counts, so it is built once per step, by the first layer, and reused.
"""

from __future__ import annotations

import torch

from sluice_kernels.ops import TritonOps
from sluice_kernels.triton import triton_interpreting
from sluice_kernels.triton.paged_attention import AttentionPlan, paged_attention, plan_attention
from sluice_kernels.triton.reshape_and_cache import reshape_and_cache
from sluice_server.layers.attention import GLOBAL_ATTENTION, AttentionBackend, AttentionMetadata


class TritonAttention(AttentionBackend):
    """`num_splits` forces the decode split-KV count (None: chosen from the
    device's SM count and the batch); tests use it to cover the merge on CPU."""

    name = "triton"
    supports_sinks = True

    def __init__(self, num_splits: int | None = None, prefill_block_m: int = 64):
        self.num_splits = num_splits
        self.prefill_block_m = prefill_block_m
        self.ops = TritonOps()
        # Triton compiles per specialization on first launch; its CPU
        # interpreter (tests) compiles nothing.
        self.compiles_lazily = not triton_interpreting()

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_state["triton_plans"] = {}

    def _plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, device: torch.device) -> AttentionPlan:
        plans = meta.backend_state.setdefault("triton_plans", {})
        key = (num_q_heads, num_kv_heads)
        if key not in plans:
            plans[key] = plan_attention(
                meta.query_lens_list, meta.seq_lens_list, meta.num_decodes, num_q_heads, num_kv_heads, device,
                num_splits=self.num_splits, prefill_block_m=self.prefill_block_m,
            )
        return plans[key]

    def forward(self, q, k, v, k_cache, v_cache, meta, layer=GLOBAL_ATTENTION):
        if k_cache.shape[1] != meta.block_size:
            raise ValueError(f"cache block size {k_cache.shape[1]} != batch block size {meta.block_size}")
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = self._plan(meta, q.shape[1], k.shape[1], q.device)
        return paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, plan,
            scale=layer.scale, window=layer.window_for(meta.seq_lens_list), sinks=layer.sinks,
        )

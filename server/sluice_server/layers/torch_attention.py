"""The plain-torch attention backend: the CPU path and the reference the
kernels are tested against. The batch layout is in attention.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice_server.layers.attention import AttentionBackend, AttentionMetadata
from sluice_server.layers.ops import CpuOps, TorchOps


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Stores the new tokens' k/v at their slots (flat index block * block_size + offset)."""
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[B, nb] block tables -> the first `length` tokens' entries, [B, Hkv, length, D]."""
    b, nb = block_tables.shape
    _, bs, heads, dim = cache.shape
    blocks = cache.index_select(0, block_tables.reshape(-1))
    return blocks.view(b, nb * bs, heads, dim)[:, :length].transpose(1, 2)


class TorchAttention(AttentionBackend):
    """Plain torch (SDPA) attention; the CPU backend and the reference for kernels.

    Decodes: all in one padded SDPA call. The Hq query heads of a token are
    regrouped as [Hkv, G] (G = Hq / Hkv) so each key head serves its G query
    heads as G query rows, with no copy of the keys:

        q [B, Hq, D] -> [B, Hkv, G, D]   k [B, Hkv, S, D]   mask [B, 1, 1, S]

    Prefill chunks: one SDPA call per sequence (a step holds few of them);
    causal over the fresh k/v when nothing is cached, otherwise against the
    gathered cache with an explicit mask (query i sees keys <= cached + i).
    """

    name = "torch"

    def __init__(self, cpu_kernels: bool = False):
        # On CPU, float32 decodes and the small ops go through the C++
        # kernels (layers.cpu_kernels) when they could be built.
        self.cpu_kernels = cpu_kernels and cpu_kernels_module().load()
        self.ops = CpuOps() if self.cpu_kernels else TorchOps()

    def _use_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return self.cpu_kernels and q.device.type == "cpu" and q.dtype == k_cache.dtype == torch.float32

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        state = meta.backend_state
        if nd:
            lens = meta.seq_lens[:nd]
            max_len = max(meta.seq_lens_list[:nd])
            nb = -(-max_len // meta.block_size)
            state["decode_tables"] = meta.block_tables[:nd, :nb]
            state["decode_len"] = max_len
            keys = torch.arange(max_len, device=lens.device)
            state["decode_mask"] = (keys < lens.unsqueeze(1)).view(nd, 1, 1, max_len)
        prefills = []
        start = nd
        for s in range(nd, len(meta.query_lens_list)):
            q_len, seq_len = meta.query_lens_list[s], meta.seq_lens_list[s]
            cached = seq_len - q_len
            if cached == 0:
                prefills.append((start, q_len, seq_len, None, None))
                start += q_len
                continue
            nb = -(-seq_len // meta.block_size)
            rows = torch.arange(q_len, device=meta.seq_lens.device).unsqueeze(1) + cached
            mask = torch.arange(seq_len, device=rows.device).unsqueeze(0) <= rows
            prefills.append((start, q_len, seq_len, meta.block_tables[s : s + 1, :nb], mask))
            start += q_len
        state["prefills"] = prefills

    def forward(self, q, k, v, k_cache, v_cache, meta):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        state = meta.backend_state
        num_q_heads, dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        group = num_q_heads // num_kv_heads
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd and self._use_kernel(q, k_cache):
            cpu_kernels_module().paged_decode_attention(
                out[:nd], q[:nd], k_cache, v_cache, state["decode_tables"], meta.seq_lens[:nd], dim**-0.5
            )
        elif nd:
            tables, length = state["decode_tables"], state["decode_len"]
            keys = gather_kv(k_cache, tables, length).to(q.dtype)
            values = gather_kv(v_cache, tables, length).to(q.dtype)
            queries = q[:nd].view(nd, num_kv_heads, group, dim)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=state["decode_mask"])
            out[:nd] = o.reshape(nd, num_q_heads, dim)
        for start, q_len, seq_len, tables, mask in state["prefills"]:
            end = start + q_len
            queries = q[start:end].transpose(0, 1)
            if tables is None:
                keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
                o = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=group > 1)
            else:
                keys = gather_kv(k_cache, tables, seq_len)[0].to(q.dtype)
                values = gather_kv(v_cache, tables, seq_len)[0].to(q.dtype)
                o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=group > 1)
            out[start:end] = o.transpose(0, 1)
        return out


def cpu_kernels_module():
    from sluice_server.layers import cpu_kernels

    return cpu_kernels

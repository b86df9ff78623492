"""The plain-torch attention backend: the CPU path and the reference the
kernels are tested against. The batch layout is in attention.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice_kernels import cpu_kernels as cpu_kernel_loader
from sluice_kernels.cpu_matmuls import cpu_flags
from sluice_kernels.ops import CpuOps, TorchOps
from sluice_server.layers.attention import GLOBAL_ATTENTION, AttentionBackend, AttentionMetadata

# The C++ kernels are built for the host (-march=native): the prompt kernel
# has AVX-512 and AVX2 forms (its portable loops are slower than SDPA).
_FLAGS = cpu_flags()
_PROMPT_KERNEL_ISA = "avx512f" in _FLAGS or {"avx2", "fma"} <= _FLAGS


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


def attend_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention whose softmax has one more term per head, e^sink (see
    attention.py), computed eagerly as transformers' gpt-oss does (SDPA has
    no such term). q [..., Hkv, G, L, D], k/v [..., Hkv, 1, S, D], visible
    bool broadcastable to [..., Hkv, G, L, S], sinks [Hkv * G]."""
    hkv, g = q.shape[-4], q.shape[-3]
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.to(scores.dtype).view(hkv, g, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def visible_keys(positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """[L] query positions -> [L, num_keys] bool: key j is visible to query i
    when j <= positions[i] (causal) and, with a window W, j > positions[i] - W."""
    keys = torch.arange(num_keys, device=positions.device).unsqueeze(0)
    rows = positions.unsqueeze(1)
    mask = keys <= rows
    if window is not None:
        mask &= keys > rows - window
    return mask


class TorchAttention(AttentionBackend):
    """Plain torch (SDPA) attention; the CPU backend and the reference for kernels.

    Decodes: all in one padded SDPA call. The Hq query heads of a token are
    regrouped as [Hkv, G] (G = Hq / Hkv) so each key head serves its G query
    heads as G query rows, with no copy of the keys:

        q [B, Hq, D] -> [B, Hkv, G, D]   k [B, Hkv, S, D]   mask [B, 1, 1, S]

    Prefill chunks: one SDPA call per sequence (a step holds few of them);
    causal over the fresh k/v when nothing is cached, otherwise against the
    gathered cache with an explicit mask (query i sees keys <= cached + i).

    A cache of another dtype than q's (bfloat16 under float32 compute: see
    model_runner.choose_kv_dtype) is read widened to q's dtype, and fresh
    k/v are rounded to the cache's dtype first, so every query sees the
    keys the cache holds.

    Sliding-window layers use the same calls with the window folded into the
    masks; those masks are built once per step and window, on first use.
    Layers with attention sinks (gpt-oss) take `attend_with_sinks` instead
    of SDPA, over the same keys and masks (decodes: the C++ kernel, which
    adds the sinks to its merge).
    """

    name = "torch"
    supports_sinks = True

    def __init__(self, cpu_kernels: bool = False):
        # On CPU, float32 decodes and the small ops go through the C++
        # kernels (sluice_kernels.cpu_kernels) when they could be built.
        self.cpu_kernels = cpu_kernels and cpu_kernel_loader.load()
        self.ops = CpuOps() if self.cpu_kernels else TorchOps()

    def _use_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (
            self.cpu_kernels
            and q.device.type == "cpu"
            and q.dtype == torch.float32
            and k_cache.dtype in (torch.float32, torch.bfloat16)
        )

    def _use_prefill_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Prompt chunks (fresh, later chunks, prefix-cache hits) on the int8
        path's bfloat16 cache go through the C++ causal kernel where it has
        its AVX-512 or AVX2 form (AVX-512 on Zen 4: about 2x torch's SDPA
        at 256 tokens, 1.5x at 1,024; AVX2 on Zen 3: 1.7x, 1.5x), unless a
        sliding window hides keys; float32 caches keep SDPA, the same
        attention transformers runs."""
        return self._use_kernel(q, k_cache) and k_cache.dtype == torch.bfloat16 and _PROMPT_KERNEL_ISA

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_state["torch"] = {None: self._plan(meta, None)}

    def _state(self, meta: AttentionMetadata, window: int | None) -> dict:
        plans = meta.backend_state["torch"]
        if window not in plans:
            plans[window] = self._plan(meta, window)
        return plans[window]

    def _plan(self, meta: AttentionMetadata, window: int | None) -> dict:
        """The step's decode tables/mask and per-prefill (start, q_len,
        seq_len, block tables or None for fresh k/v, mask or None for causal)."""
        nd = meta.num_decodes
        state: dict = {}
        if nd:
            lens = meta.seq_lens[:nd]
            max_len = max(meta.seq_lens_list[:nd])
            nb = -(-max_len // meta.block_size)
            state["decode_tables"] = meta.block_tables[:nd, :nb]
            state["decode_len"] = max_len
            state["decode_mask"] = visible_keys(lens - 1, max_len, window).view(nd, 1, 1, max_len)
        prefills = []
        start = nd
        for s in range(nd, len(meta.query_lens_list)):
            q_len, seq_len = meta.query_lens_list[s], meta.seq_lens_list[s]
            cached = seq_len - q_len
            device = meta.seq_lens.device
            if cached == 0:
                # Fresh k/v: plain causal unless the window hides some of them.
                mask = None
                if window is not None and q_len > window:
                    mask = visible_keys(torch.arange(q_len, device=device), q_len, window)
                prefills.append((start, q_len, seq_len, None, mask))
            else:
                nb = -(-seq_len // meta.block_size)
                mask = visible_keys(torch.arange(cached, seq_len, device=device), seq_len, window)
                prefills.append((start, q_len, seq_len, meta.block_tables[s : s + 1, :nb], mask))
            start += q_len
        state["prefills"] = prefills
        return state

    def forward(self, q, k, v, k_cache, v_cache, meta, layer=GLOBAL_ATTENTION):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        window = layer.window_for(meta.seq_lens_list)
        state = self._state(meta, window)
        num_q_heads, dim = q.shape[1], q.shape[2]
        scale = layer.scale  # None: SDPA's default 1/sqrt(D)
        num_kv_heads = k.shape[1]
        group = num_q_heads // num_kv_heads
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if layer.sinks is not None:
            return self._forward_with_sinks(q, k, v, k_cache, v_cache, state, meta, layer, out)
        if nd and self._use_kernel(q, k_cache):
            cpu_kernel_loader.paged_decode_attention(
                out[:nd], q[:nd], k_cache, v_cache, state["decode_tables"], meta.seq_lens[:nd],
                dim**-0.5 if scale is None else scale, window,
            )
        elif nd:
            tables, length = state["decode_tables"], state["decode_len"]
            keys = gather_kv(k_cache, tables, length).to(q.dtype)
            values = gather_kv(v_cache, tables, length).to(q.dtype)
            queries = q[:nd].view(nd, num_kv_heads, group, dim)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=state["decode_mask"], scale=scale)
            out[:nd] = o.reshape(nd, num_q_heads, dim)
        prompt_kernel = state["prefills"] and self._use_prefill_kernel(q, k_cache)
        for start, q_len, seq_len, tables, mask in state["prefills"]:
            end = start + q_len
            if tables is None:
                # The fresh k/v as the cache holds them, so a prompt's later
                # chunks, decodes and prefix-cache hits see the same keys.
                keys = k[start:end].to(k_cache.dtype).to(q.dtype)
                values = v[start:end].to(v_cache.dtype).to(q.dtype)
            else:  # [seq_len, Hkv, D] views of the rows gathered from the cache
                keys = gather_kv(k_cache, tables, seq_len)[0].to(q.dtype).transpose(0, 1)
                values = gather_kv(v_cache, tables, seq_len)[0].to(q.dtype).transpose(0, 1)
            if prompt_kernel and (window is None or seq_len <= window):  # plain causal
                cpu_kernel_loader.prefill_attention(
                    out[start:end], q[start:end], keys, values, dim**-0.5 if scale is None else scale
                )
                continue
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1,
            )
            out[start:end] = o.transpose(0, 1)
        return out

    def _forward_with_sinks(self, q, k, v, k_cache, v_cache, state, meta, layer, out):
        """The same reads as `forward`: decodes on the C++ kernel (which takes
        the sinks) where it runs, the rest through attend_with_sinks."""
        nd = meta.num_decodes
        num_q_heads, dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        group = num_q_heads // num_kv_heads
        scale = dim**-0.5 if layer.scale is None else layer.scale
        if nd and self._use_kernel(q, k_cache):
            cpu_kernel_loader.paged_decode_attention(
                out[:nd], q[:nd], k_cache, v_cache, state["decode_tables"], meta.seq_lens[:nd], scale,
                layer.window_for(meta.seq_lens_list), layer.sinks,
            )
        elif nd:
            tables, length = state["decode_tables"], state["decode_len"]
            keys = gather_kv(k_cache, tables, length).to(q.dtype).unsqueeze(2)
            values = gather_kv(v_cache, tables, length).to(q.dtype).unsqueeze(2)
            queries = q[:nd].view(nd, num_kv_heads, group, 1, dim)
            visible = state["decode_mask"].view(nd, 1, 1, 1, length)
            o = attend_with_sinks(queries, keys, values, visible, layer.sinks, scale)
            out[:nd] = o.reshape(nd, num_q_heads, dim)
        for start, q_len, seq_len, tables, mask in state["prefills"]:
            end = start + q_len
            queries = q[start:end].view(q_len, num_kv_heads, group, dim).permute(1, 2, 0, 3)
            if tables is None:
                keys = k[start:end].to(k_cache.dtype).to(q.dtype).transpose(0, 1)
                values = v[start:end].to(v_cache.dtype).to(q.dtype).transpose(0, 1)
                if mask is None:
                    mask = visible_keys(torch.arange(q_len, device=q.device), q_len, None)
            else:
                keys = gather_kv(k_cache, tables, seq_len)[0].to(q.dtype)
                values = gather_kv(v_cache, tables, seq_len)[0].to(q.dtype)
            o = attend_with_sinks(queries, keys.unsqueeze(1), values.unsqueeze(1), mask, layer.sinks, scale)
            out[start:end] = o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, dim)
        return out


"""Shared builders for the kernel tests: a device, tolerances, a mixed
paged batch with its dense ground truth, and random GGUF blocks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sluice_kernels.triton import triton_interpreting


def device() -> torch.device:
    """CPU tensors under the interpreter, the GPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() and not triton_interpreting() else "cpu")


# Tolerances against a float32/float64 reference. 16-bit: the output is
# rounded once to the dtype (relative step 2^-8 for bf16, 2^-11 for fp16), and
# attention also rounds its probabilities to the dtype before P @ V.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}


@dataclass
class PagedBatch:
    """A batch ordered decodes first, its KV cache and its dense ground truth.

    Sequence s has `cached[s]` keys already in the cache and `q_lens[s]` new
    tokens; keys[s]/values[s] are its full [seq_len, Hkv, D] k/v.
    """

    q: torch.Tensor  # [T, Hq, D]
    k_new: torch.Tensor  # [T, Hkv, D] the new tokens' k/v (not yet in the cache)
    v_new: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]; unwritten slots are NaN
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    q_lens: list[int]
    seq_lens_list: list[int]
    num_decodes: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def make_batch(
    seqs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    dev: torch.device | None = None,
) -> PagedBatch:
    """seqs: (cached prefix length, new tokens) per sequence; decodes
    (1 new token) must come first. Block ids are shuffled, never contiguous."""
    dev = dev or device()
    g = torch.Generator().manual_seed(seed)
    q_lens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    assert all(n != 1 for n in q_lens[num_decodes:]), "decodes first"
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq)
    tables, slots = [], []
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    keys, values, qs, k_new, v_new = [], [], [], [], []
    for (cached, new), seq_len, nb in zip(seqs, seq_lens, blocks_per_seq):
        table = [ids.pop() for _ in range(nb)]
        tables.append(table + [0] * (max_blocks - nb))
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        keys.append(k)
        values.append(v)
        pos = torch.arange(seq_len)
        seq_slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:cached]] = k[:cached]
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:cached]] = v[:cached]
        slots.extend(seq_slots[cached:].tolist())
        k_new.append(k[cached:])
        v_new.append(v[cached:])
        qs.append(torch.randn(new, num_q_heads, head_dim, generator=g).to(dtype))
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    as_long = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
    return PagedBatch(
        q=torch.cat(qs).to(dev),
        k_new=torch.cat(k_new).to(dev),
        v_new=torch.cat(v_new).to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        slot_mapping=as_long(slots),
        query_start_loc=as_long(starts),
        seq_lens=as_long(seq_lens),
        block_tables=as_long(tables),
        q_lens=q_lens,
        seq_lens_list=seq_lens,
        num_decodes=num_decodes,
        keys=[k.to(dev) for k in keys],
        values=[v.to(dev) for v in values],
    )


def dense_attention(batch: PagedBatch, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(D)) V per sequence in float64 from the un-paged
    k/v, new token i of a sequence seeing keys [0, cached + i] (with a sliding
    window W, only the last W of them; with `sinks` [Hq], each head's softmax
    over one more logit, its sink, whose value is zero). [T, Hq, D] float64."""
    num_q_heads, head_dim = batch.q.shape[1:]
    outs = []
    start = 0
    for s, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens_list)):
        q = batch.q[start : start + q_len].double().transpose(0, 1)  # [Hq, L, D]
        group = num_q_heads // batch.keys[s].shape[1]
        k = batch.keys[s].double().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, S, D]
        v = batch.values[s].double().repeat_interleave(group, 1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) / head_dim**0.5
        pos = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
        keys_at = torch.arange(seq_len, device=q.device)[None, :]
        hidden = keys_at > pos
        if window is not None:
            hidden |= keys_at <= pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            column = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append((probs @ v).transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row bytes] uint8 rows of random valid GGUF blocks of type `fmt`
    (a 32-weight type or a K-quant from Q4_K): random quants, fp16 scale in
    [-0.05, 0.05] (K-quants: a 32nd of that, their sub-scales multiply it)
    and fp16 min in [-0.3, 0] where the type has one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    scale = 0.05 if values == 32 else 0.05 / 32
    at = size - 2 if fmt == "Q6_K" else 0  # Q6_K's d comes last
    blocks[..., at : at + 2] = rng.uniform(-scale, scale, (n, k // values, 1)).astype(np.float16).view(np.uint8)
    if fmt in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        blocks[..., 2:4] = rng.uniform(-0.3, 0.0, (n, k // values, 1)).astype(np.float16).view(np.uint8)
    return np.ascontiguousarray(blocks.reshape(n, -1))

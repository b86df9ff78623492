"""Attention over the paged KV cache for a mixed batch: one kernel for decodes,
prefill chunks and prefill over cached prefixes, plus a merge for split-KV.

The batch (see layers/attention.py): B sequences, T tokens, decodes first.
Sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]) and
seq_lens[s] keys (its cached prefix plus this step's tokens, already written
to the cache). Its new token i sits at position context + i, where
context = seq_len - q_len, and sees keys [0, context + i]:

    keys:    0 .......... context-1 | context ........ seq_len-1
             cached prefix: all     | new tokens: causal
    query i:  sees ───────────────────────────────► context + i

Sliding window W (`window` > 0): query i sees only keys (context + i - W,
context + i]. A tile then starts at its first row's first visible key, and
every step is masked (the unmasked fast loop below is for global layers).

Work split. A program handles one *tile* of one sequence for one KV head:
BLOCK_Q consecutive new tokens times the G = Hq / Hkv query heads that share
the KV head, laid out as BLOCK_M = BLOCK_Q * G_PAD rows (G_PAD = G rounded up
to a power of two; padded rows are masked):

    row m  ->  token  q_first + m // G_PAD,  query head  kv_head * G + m % G_PAD

so every K/V tile is loaded once and serves the whole group (GQA) and all the
tile's tokens. Keys are visited BLOCK_N at a time, gathered through the block
table (key n lives in block block_tables[s, n // block_size] at offset
n % block_size), with an online softmax (running max m, sum l, output acc).

Split-KV (flash-decoding). A decode batch of few long sequences has too few
(tile, KV head) programs to fill the GPU, so grid axis 2 cuts each tile's
key range [0, kv_end) into NUM_SPLITS segments of `seg` keys (a multiple of
BLOCK_N); every segment writes its normalized partial output and its
log2-sum-exp, and `_merge_kernel` combines them:

    out = sum_s 2^(lse_s - M) * o_s / sum_s 2^(lse_s - M),   M = max_s lse_s

A segment with no visible key has lse = -inf and weight 0.

Attention sinks (gpt-oss; `sinks` [Hq], natural-log units): one more term
e^sink in each row's softmax denominator, with no value. Unsplit, the row's
final (m, l) absorb it; split, the merge adds 2^(sink * log2 e - M) to its
denominator (M then the max over the splits' lse and the sink).

Tiles are planned on the host from the batch's Python lists (`plan_attention`)
once per step and shared by every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sluice_kernels.triton import triton_interpreting

LOG2E = 1.4426950408889634
# Decode launch settings (see TileLaunch).
DECODE_CONFIG = dict(block_n=64, num_warps=4, num_stages=3)
PREFILL_CONFIG = dict(block_n=64, num_warps=4, num_stages=3)


@triton.jit
def _attend_keys(
    q, m_i, l_i, acc, start, hi, q_pos, window, table, k_cache_ptr, v_cache_ptr, kv_head, dims, dim_ok, scale_log2,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """One online-softmax step over keys [start, start + BLOCK_N), gathered
    through the block table. MASKED: some keys are >= hi, after some row's
    position or (SLIDING) before some row's window; otherwise every key is
    visible to every row."""
    keys = start + tl.arange(0, BLOCK_N)
    offset = keys % BLOCK_SIZE
    if MASKED:
        key_ok = keys < hi
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
    else:
        block = tl.load(table + keys // BLOCK_SIZE).to(tl.int64)
        kv_mask = dim_ok[None, :]
    k = tl.load(
        k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
        mask=kv_mask, other=0.0,
    )
    if DOT_UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead so
        # exp2 gives 0, not NaN.
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.exp2(s - m_new_safe[:, None])
    alpha = tl.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
        mask=kv_mask, other=0.0,
    )
    # P is rounded to the cache dtype as the tensor-core dot on a GPU takes it.
    p = p.to(v_cache_ptr.dtype.element_ty)
    if DOT_UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    tiles_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    head_dim,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SKIP_FULL_MASKS: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tiles_ptr + 2 * tile).to(tl.int64)
    q_first = tl.load(tiles_ptr + 2 * tile + 1)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_first + rows // GROUP_PAD  # new-token index within the sequence
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (rows // GROUP_PAD < BLOCK_Q) & (tok < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = context + tok
    q_row = (q_begin + tok).to(tl.int64)

    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_ok[None, :], other=0.0,
    )
    if DOT_UPCAST:
        q = q.to(tl.float32)

    # The tile's rows see keys [kv_begin, kv_end) together: its last token
    # sees up to kv_end, its first (with a window) from kv_begin. This split
    # takes [lo, hi).
    kv_end = context + tl.minimum(q_first + BLOCK_Q, q_len)
    kv_begin = 0
    if SLIDING:
        kv_begin = tl.maximum(context + q_first - window + 1, 0)
    seg = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_begin + split * seg
    hi = tl.minimum(lo + seg, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    # Prefill tiles: keys [0, context + q_first] are visible to every row of
    # the tile, so the whole BLOCK_N steps among them skip the causal and
    # bounds masks; the rest of [lo, hi) (the tile's diagonal and the ragged
    # end) is masked.
    #
    #   lo ......... full_end ......... hi
    #   | unmasked steps | masked steps  |
    #
    # Decodes keep the single masked loop: on an H200 the second loop made
    # the 32-split long-context decode 40% slower (kernels/README.md).
    full_end = lo
    if SKIP_FULL_MASKS:
        full_hi = tl.minimum(hi, context + q_first + 1)
        full_end = lo + tl.maximum(full_hi - lo, 0) // BLOCK_N * BLOCK_N
        for start in tl.range(lo, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_keys(
                q, m_i, l_i, acc, start, hi, q_pos, window, table, k_cache_ptr, v_cache_ptr, kv_head, dims, dim_ok,
                scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                BLOCK_N, BLOCK_SIZE, False, False, DOT_PRECISION, DOT_UPCAST,
            )
    for start in tl.range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend_keys(
            q, m_i, l_i, acc, start, hi, q_pos, window, table, k_cache_ptr, v_cache_ptr, kv_head, dims, dim_ok,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_N, BLOCK_SIZE, True, SLIDING, DOT_PRECISION, DOT_UPCAST,
        )

    if HAS_SINKS and NUM_SPLITS == 1:
        # Every row saw its own key, so m_i is finite.
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        m_sink = tl.maximum(m_i, sink)
        shrink = tl.exp2(m_i - m_sink)
        l_i = l_i * shrink + tl.exp2(sink - m_sink)
        acc = acc * shrink[:, None]
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    store_mask = row_valid[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=store_mask,
        )
    else:
        tl.store(
            part_out_ptr + split * stride_ps + q_row[:, None] * stride_pt + head[:, None] * stride_ph + dims[None, :],
            out, mask=store_mask,
        )
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + split * stride_ls + q_row * stride_lt + head, lse, mask=row_valid)


@triton.jit
def _merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    head_dim,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < NUM_SPLITS
    lse = tl.load(part_lse_ptr + splits * stride_ls + row * stride_lt + head, mask=split_ok, other=float("-inf"))
    # Split 0 always holds the decode's first visible key (key 0, or its
    # window's first): the max is finite.
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weight = tl.exp2(lse - top)
    parts = tl.load(
        part_out_ptr + splits[:, None] * stride_ps + row * stride_pt + head * stride_ph + dims[None, :],
        mask=split_ok[:, None] & (dims < head_dim)[None, :], other=0.0,
    )
    total = tl.sum(weight, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(parts * weight[:, None], axis=0) / total
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


@dataclass
class TileLaunch:
    """One launch of the attention kernel: tiles [N, 2] int32 rows of
    (sequence, first new token of the tile), their BLOCK_Q, and the split count."""

    tiles: torch.Tensor
    block_q: int
    block_m: int
    num_splits: int
    # Query rows covered by this launch are [0, num_rows) when split (decodes
    # come first in the batch), which sizes the partial buffers.
    num_rows: int
    # Keys per loop iteration and the compiler's launch settings (tuned on an
    # H200 with benchmarks/kernel_bench.py --sweep).
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclass
class AttentionPlan:
    """A step's attention work for one head configuration; built on the host."""

    launches: list[TileLaunch]
    group: int
    group_pad: int


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-KV only when (sequences x KV heads) programs leave the GPU idle
    and contexts are long: aim at ~2 programs per SM, at least 256 keys per
    segment, a power of two (each value is a separate compilation), at most 32."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms or max_seq_len < 512:
        return 1
    want = min(-(-2 * num_sms // programs), max_seq_len // 256, 32)
    return 1 << max(0, int(math.log2(max(want, 1))))


def plan_attention(
    query_lens: list[int],
    seq_lens: list[int],
    num_decodes: int,
    num_q_heads: int,
    num_kv_heads: int,
    device: torch.device,
    num_splits: int | None = None,
    prefill_block_m: int = 64,
    decode_config: dict | None = None,
    prefill_config: dict | None = None,
) -> AttentionPlan:
    """Tiles for a batch ordered decodes first. Decodes get one tile each and
    split-KV (`num_splits`, or chosen from the device when None); prefill
    chunks are cut into tiles of BLOCK_Q = prefill_block_m // G_PAD tokens.
    `decode_config`/`prefill_config` override the launches' block_n/num_warps/num_stages."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if len(query_lens) != len(seq_lens) or not 0 <= num_decodes <= len(query_lens):
        raise ValueError("query_lens/seq_lens/num_decodes disagree")
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    launches = []
    if num_decodes:
        if num_splits is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            num_splits = choose_num_splits(num_decodes, num_kv_heads, max(seq_lens[:num_decodes]), num_sms)
        tiles = [(s, 0) for s in range(num_decodes)]
        # tl.dot needs at least 16 rows on GPUs.
        launch = TileLaunch(_tile_tensor(tiles, device), 1, max(16, group_pad), num_splits, num_decodes,
                            **DECODE_CONFIG)
        launches.append(replace(launch, **(decode_config or {})))
    if num_decodes < len(query_lens):
        block_m = max(prefill_block_m, 16, group_pad)
        block_q = block_m // group_pad
        tiles = [(s, first) for s in range(num_decodes, len(query_lens)) for first in range(0, query_lens[s], block_q)]
        launch = TileLaunch(_tile_tensor(tiles, device), block_q, block_m, 1, 0, **PREFILL_CONFIG)
        launches.append(replace(launch, **(prefill_config or {})))
    return AttentionPlan(launches, group, group_pad)


def _tile_tensor(tiles: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(tiles, dtype=torch.int32).view(-1, 2).to(device, non_blocking=True)


def _check(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("q must be [T, Hq, D] and k/v caches [num_blocks, block_size, Hkv, D]")
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache's heads/dim {tuple(k_cache.shape[2:])}")
    if query_start_loc.shape != (seq_lens.shape[0] + 1,) or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError("query_start_loc [B+1], seq_lens [B] and block_tables [B, max_blocks] disagree")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    plan: AttentionPlan,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] (last dim contiguous), caches [num_blocks, block_size, Hkv, D]
    (last dim contiguous) already holding this step's k/v, query_start_loc [B+1],
    seq_lens [B], block_tables [B, max_blocks] -> out [T, Hq, D] in q's dtype.
    `scale` defaults to 1/sqrt(D); `window` (None: global) is the sliding window;
    `sinks` (None, or [Hq]) each head's sink logit."""
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks {tuple(sinks.shape)} must hold one logit per query head ({q.shape[1]})")
    _check(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head dim must be contiguous"
    assert block_tables.stride(1) == 1, "block table rows must be contiguous"
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) must share a dtype")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_q_heads // num_kv_heads != plan.group:
        raise ValueError(f"plan was made for group size {plan.group}, q/cache give {num_q_heads // num_kv_heads}")
    if out is None:
        out = torch.empty_like(q)
    scale = head_dim**-0.5 if scale is None else scale
    block_d = triton.next_power_of_2(head_dim)
    # Triton's CPU interpreter multiplies 16-bit floats in tl.dot wrongly
    # (triton 3.x), so there the operands go in as float32: the same numbers,
    # since products of 16-bit floats are exact in float32 accumulation.
    upcast = triton_interpreting() and q.dtype != torch.float32
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    for launch in plan.launches:
        splits = launch.num_splits
        if splits > 1:
            part_out = torch.empty(splits, launch.num_rows, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(splits, launch.num_rows, num_q_heads, dtype=torch.float32, device=q.device)
        else:  # unused by the kernel, but it needs real tensors for the pointers
            part_out = part_lse = out
        grid = (launch.tiles.shape[0], num_kv_heads, splits)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, part_out, part_lse,
            launch.tiles, query_start_loc, seq_lens, block_tables, out if sinks is None else sinks,
            scale * LOG2E, window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            head_dim,
            GROUP=plan.group, GROUP_PAD=plan.group_pad, BLOCK_Q=launch.block_q, BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n, BLOCK_D=block_d, BLOCK_SIZE=block_size,
            NUM_SPLITS=splits, DOT_PRECISION=precision, DOT_UPCAST=upcast,
            SKIP_FULL_MASKS=launch.block_q > 1 and window is None, SLIDING=window is not None,
            HAS_SINKS=sinks is not None, num_warps=launch.num_warps, num_stages=launch.num_stages,
        )
        if splits > 1:
            _merge_kernel[(launch.num_rows, num_q_heads)](
                out, part_out, part_lse, out if sinks is None else sinks,
                out.stride(0), out.stride(1),
                part_out.stride(0), part_out.stride(1), part_out.stride(2),
                part_lse.stride(0), part_lse.stride(1),
                head_dim,
                NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), BLOCK_D=block_d,
                HAS_SINKS=sinks is not None,
            )
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    plan: AttentionPlan | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention, one sequence at a time, in float32 (`plan` is ignored)."""
    _check(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[s], starts[s + 1])
        q_len = starts[s + 1] - starts[s]
        blocks = block_tables[s, : -(-seq_len // block_size)].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        queries = q[rows].float().transpose(0, 1)  # [Hq, L, D]
        scores = queries @ keys.transpose(1, 2) * scale
        positions = torch.arange(q_len, device=q.device) + (seq_len - q_len)
        keys_at = torch.arange(seq_len, device=q.device)[None, :]
        hidden = keys_at > positions[:, None]
        if window is not None:
            hidden |= keys_at <= positions[:, None] - window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:  # a column of each head's sink logit, dropped after the softmax
            sink = sinks.float().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out[rows] = (probs @ values).transpose(0, 1).to(out.dtype)
    return out

"""Paged attention kernel against its torch reference and a dense float64
softmax(QK^T)V over the un-paged sequences (see kernel_cases.make_batch)."""

from __future__ import annotations

import pytest
import torch

from sluice_kernels.triton.paged_attention import (
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
    plan_attention,
)
from sluice_kernels.triton.reshape_and_cache import reshape_and_cache

from .kernel_cases import TOLERANCES, dense_attention, make_batch

# (cached prefix, new tokens) per sequence, decodes first. Lengths avoid
# block multiples: a decode at position 0, decodes ending mid-block and one
# block past a boundary; a fresh prompt, a chunk over a mid-block cached
# prefix, a chunk longer than a prefill tile, and a 2-token chunk.
MIXED = [(0, 1), (16, 1), (40, 1), (70, 1), (0, 7), (21, 13), (33, 40), (5, 2)]

# Every head_dim, GQA ratio, block size and dtype appears; the interpreter is
# slow, so the cases spread the combinations instead of taking their product.
CASES = [
    # head_dim, Hq, Hkv, block_size, dtype
    (64, 2, 2, 16, torch.float32),
    (128, 3, 1, 32, torch.float32),
    (64, 4, 1, 32, torch.bfloat16),
    (128, 8, 1, 16, torch.float16),
    (64, 6, 2, 16, torch.bfloat16),
    (128, 8, 2, 32, torch.float32),
]


def run_kernel(batch, num_splits, window=None, sinks=None):
    reshape_and_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    num_q_heads, num_kv_heads = batch.q.shape[1], batch.k_cache.shape[2]
    plan = plan_attention(
        batch.q_lens, batch.seq_lens_list, batch.num_decodes, num_q_heads, num_kv_heads, batch.q.device,
        num_splits=num_splits,
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, plan)
    return (paged_attention(*args, window=window, sinks=sinks),
            paged_attention_reference(*args, window=window, sinks=sinks))


def check(batch, out, ref, window=None, sinks=None):
    dense = dense_attention(batch, window, sinks)
    tol = TOLERANCES[batch.q.dtype]
    assert out.dtype == batch.q.dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(out.double(), dense, **tol)
    # The reference itself matches the dense truth (it is the CPU path's twin).
    torch.testing.assert_close(ref.double(), dense, **tol)


@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads,block_size,dtype", CASES)
def test_mixed_batch(head_dim, num_q_heads, num_kv_heads, block_size, dtype):
    batch = make_batch(MIXED, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=head_dim + num_q_heads)
    check(batch, *run_kernel(batch, 1))


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=str)
def test_mixed_batch_split_kv(case):
    """The decodes' keys cut into 3 segments and merged (the prefill launch never splits)."""
    head_dim, num_q_heads, num_kv_heads, block_size, dtype = case
    batch = make_batch(MIXED, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=5)
    check(batch, *run_kernel(batch, 3))


@pytest.mark.parametrize("seqs", [[(0, 1)], [(0, 37)], [(5, 1), (9, 1)], [(31, 3)]], ids=str)
def test_small_batches(seqs):
    """One token alone; prefill only; decodes only; one chunk over a cached prefix."""
    batch = make_batch(seqs, 4, 2, 64, 16, torch.float32, seed=len(seqs))
    check(batch, *run_kernel(batch, None))


@pytest.mark.parametrize("window,num_splits,case", [
    (1, 1, CASES[0]),  # each token sees only itself
    (10, 1, CASES[1]),  # windows that start mid-block, shorter than a prefill tile
    (24, 3, CASES[2]),  # split-KV over the window of each decode
    (70, 2, CASES[4]),  # one decode (71 keys) just past the window, the rest inside it
], ids=str)
def test_sliding_window(window, num_splits, case):
    """Every query sees only its last `window` keys: decodes and prefill
    chunks, fresh and over cached prefixes, against the dense truth."""
    head_dim, num_q_heads, num_kv_heads, block_size, dtype = case
    batch = make_batch(MIXED, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=window)
    check(batch, *run_kernel(batch, num_splits, window), window)


@pytest.mark.parametrize("window,num_splits,case", [
    (None, 1, CASES[5]),  # unsplit: the sink enters each row's final sum
    (None, 3, CASES[1]),  # split decodes: the merge adds it
    (10, 2, CASES[2]),  # with a window (gpt-oss's sliding layers)
], ids=str)
def test_attention_sinks(window, num_splits, case):
    """gpt-oss's sinks: one more logit per query head in every softmax,
    some large enough to take most of the weight."""
    head_dim, num_q_heads, num_kv_heads, block_size, dtype = case
    batch = make_batch(MIXED, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=11)
    sinks = torch.linspace(-3.0, 4.0, num_q_heads, device=batch.q.device)
    check(batch, *run_kernel(batch, num_splits, window, sinks), window, sinks)


def test_long_context():
    """Several thousand keys: a decode split 8 ways, a second short decode
    whose later segments are empty, and a chunk over a long cached prefix."""
    seqs = [(3001, 1), (10, 1), (2050, 45)]
    batch = make_batch(seqs, 4, 1, 64, 16, torch.bfloat16, seed=7)
    check(batch, *run_kernel(batch, 8))


def test_padded_head_dim():
    """A head_dim that is not a power of two (80) is padded and masked."""
    batch = make_batch([(3, 1), (17, 9)], 2, 1, 80, 16, torch.float32, seed=3)
    check(batch, *run_kernel(batch, 2))


def test_split_choice():
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=4096, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=300, num_sms=132) == 1
    splits = choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768, num_sms=132)
    assert splits == 32
    assert choose_num_splits(num_seqs=2, num_kv_heads=2, max_seq_len=1024, num_sms=132) == 4


def test_bad_layouts_are_rejected():
    batch = make_batch([(3, 1)], 4, 2, 64, 16, torch.float32)
    plan = plan_attention(batch.q_lens, batch.seq_lens_list, 1, 4, 2, batch.q.device, num_splits=1)
    with pytest.raises(ValueError, match="group size"):
        paged_attention(batch.q[:, :2], batch.k_cache, batch.v_cache,
                        batch.query_start_loc, batch.seq_lens, batch.block_tables, plan)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(batch.q.half(), batch.k_cache, batch.v_cache,
                        batch.query_start_loc, batch.seq_lens, batch.block_tables, plan)
    with pytest.raises(ValueError, match="multiple"):
        plan_attention([1], [3], 1, 6, 4, batch.q.device)


# Larger set, compiled on a GPU only (skipped without CUDA; see conftest.py).
# Every head_dim x GQA x block size, the dtype rotating through the three (each
# combination is a separate compilation, and compiling dominates the run).
GPU_CASES = [
    (head_dim, heads, block_size, [torch.bfloat16, torch.float16, torch.float32][i % 3])
    for i, (head_dim, heads, block_size) in enumerate(
        (d, h, b) for d in (64, 128) for h in ((32, 32), (24, 8), (32, 8), (64, 8)) for b in (16, 32)
    )
]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,heads,block_size,dtype", GPU_CASES, ids=str)
def test_gpu_large(head_dim, heads, block_size, dtype):
    seqs = [(c, 1) for c in (0, 15, 100, 1000, 8191)] + [(0, 300), (777, 129), (5000, 2)]
    for splits in (None, 16):
        batch = make_batch(seqs, *heads, head_dim, block_size, dtype, seed=head_dim)
        check(batch, *run_kernel(batch, splits))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [512, 4096])
def test_gpu_sliding_window(window):
    """Gemma 3 / Mistral-sized windows over long contexts, split and not."""
    seqs = [(c, 1) for c in (0, 100, 511, 512, 5000, 8191)] + [(0, 700), (4000, 129), (600, 2)]
    for splits in (None, 8):
        batch = make_batch(seqs, 8, 1, 256 if window == 512 else 128, 16, torch.bfloat16, seed=window)
        check(batch, *run_kernel(batch, splits, window), window)


@pytest.mark.gpu
def test_gpu_long_decodes_few_sequences():
    """The flash-decoding case: 2 sequences of 32K keys, splits chosen from the device."""
    batch = make_batch([(32767, 1), (20000, 1)], 32, 8, 128, 16, torch.bfloat16, seed=1)
    plan = plan_attention(batch.q_lens, batch.seq_lens_list, 2, 32, 8, batch.q.device)
    assert plan.launches[0].num_splits > 1
    check(batch, *run_kernel(batch, None))

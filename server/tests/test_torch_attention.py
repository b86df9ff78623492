"""The CPU attention backend (`layers.torch_attention.TorchAttention`) with
its C++ decode kernel against the same backend on plain torch (gather +
SDPA): the backend hands the kernel the step's block tables, lengths,
sliding window and scale as its own torch path uses them. (The kernel alone
against a dense reference: kernels/tests/test_cpu_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

from sluice_kernels import cpu_kernels
from sluice_server.layers.attention import AttentionMetadata, LayerAttention
from sluice_server.layers import torch_attention
from sluice_server.layers.torch_attention import TorchAttention

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def decode_meta(seq_lens: list[int], block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """Decode-only metadata with each sequence's blocks scattered over the cache."""
    need = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(need) + 2  # wider than needed: the kernel must stop at seq_len
    tables, used = [], 0
    for n in need:
        tables.append(perm[used : used + n] + [0] * (width - n))
        used += n
    lens = torch.tensor(seq_lens)
    # Each new token's k/v goes to the last position of its sequence.
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, seq_lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(len(seq_lens) + 1),
        seq_lens=lens,
        block_tables=torch.tensor(tables),
        num_decodes=len(seq_lens),
        block_size=block_size,
        query_lens_list=[1] * len(seq_lens),
        seq_lens_list=seq_lens,
    )


def assert_kernel_matches_plain_torch(meta, q, k, v, k_cache, v_cache, window) -> None:
    """The backend on the C++ kernels against plain torch, each on its own
    copy of the caches, within float32's tolerance."""
    reference, kernel = TorchAttention(cpu_kernels=False), TorchAttention(cpu_kernels=True)
    assert kernel.cpu_kernels and not reference.cpu_kernels
    outs = []
    for backend in (reference, kernel):
        meta.backend_state = {}
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, LayerAttention(sliding_window=window)))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-6, rtol=1e-5)


# The shapes' corner cases are the kernel tests'; here, the backend's own
# inputs: several sequences, windows, both cache dtypes.
@pytest.mark.parametrize("hq,hkv,dim", [(9, 3, 64), (4, 1, 40)])  # SmolLM2; D not a multiple of 16
@pytest.mark.parametrize("seq_lens", [[5, 17, 16, 33], [300, 2, 129]])
@pytest.mark.parametrize("window", [None, 1, 16, 100])  # sliding windows: from a block boundary and mid-block
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_on_the_kernel_matches_plain_torch(hq, hkv, dim, seq_lens, window, cache_dtype):
    """Against gather + SDPA in float32. A bfloat16 cache holds the same
    values for both (the reference widens what it gathers, the kernel each
    row it reads), so the tolerance is float32's either way."""
    block_size = 16
    meta = decode_meta(seq_lens, block_size, num_blocks=64, seed=len(seq_lens))
    k_cache = randn(64, block_size, hkv, dim, seed=1).to(cache_dtype)
    v_cache = randn(64, block_size, hkv, dim, seed=2).to(cache_dtype)
    # q as a strided view of a fused qkv output, the way the model passes it.
    qkv = randn(len(seq_lens), (hq + 2 * hkv) * dim, seed=3)
    q = qkv[:, : hq * dim].view(len(seq_lens), hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(len(seq_lens), hkv, dim)
    v = qkv[:, (hq + hkv) * dim :].view(len(seq_lens), hkv, dim)
    assert_kernel_matches_plain_torch(meta, q, k, v, k_cache, v_cache, window)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 16, 64])  # a window that hides keys of every prompt, and one that hides none
def test_prompts_beside_decodes_match_plain_torch(cache_dtype, window, monkeypatch):
    """A step of two decodes, two prompts with nothing cached and a prompt's
    second chunk after 32 cached tokens, against the plain-torch backend. On
    an AVX-512 or AVX2 host with a bfloat16 cache the three prompts go
    through the C++ causal kernel, unless the window hides some of their
    keys."""
    hq, hkv, dim, block_size = 8, 2, 64, 16
    # (cached, new) tokens per sequence: decodes first, as the batch orders them.
    seqs = [(40, 1), (7, 1), (0, 20), (0, 37), (32, 9)]
    tables, slots, used = [], [], 0
    for cached, new in seqs:
        n = -(-(cached + new) // block_size)
        tables.append(list(range(used, used + n)) + [0] * (4 - n))
        slots += [tables[-1][t // block_size] * block_size + t % block_size for t in range(cached, cached + new)]
        used += n
    tokens = sum(new for _, new in seqs)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0] + [sum(new for _, new in seqs[: i + 1]) for i in range(len(seqs))]),
        seq_lens=torch.tensor([c + n for c, n in seqs]),
        block_tables=torch.tensor(tables),
        num_decodes=2,
        block_size=block_size,
        query_lens_list=[n for _, n in seqs],
        seq_lens_list=[c + n for c, n in seqs],
    )
    k_cache = randn(used, block_size, hkv, dim, seed=1).to(cache_dtype)
    v_cache = randn(used, block_size, hkv, dim, seed=2).to(cache_dtype)
    qkv = randn(tokens, (hq + 2 * hkv) * dim, seed=3)
    q = qkv[:, : hq * dim].view(tokens, hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(tokens, hkv, dim)
    v = qkv[:, (hq + hkv) * dim :].view(tokens, hkv, dim)
    calls = []
    kernel_op = cpu_kernels.prefill_attention
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *a: calls.append(a[1].shape[0]) or kernel_op(*a))
    assert_kernel_matches_plain_torch(meta, q, k, v, k_cache, v_cache, window)
    on_kernel = cache_dtype == torch.bfloat16 and torch_attention._PROMPT_KERNEL_ISA and window != 16
    assert calls == ([20, 37, 9] if on_kernel else [])

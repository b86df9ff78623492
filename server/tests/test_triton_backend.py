"""TritonAttention as a whole against TorchAttention on batches built by the
shard's own `batch.build_batch`, and the backend's selection. (Whole models on
the Triton backend: test_triton_families.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from sluice_server.batch import RequestState, Work, build_batch
from sluice_server.layers.backends import get_backend
from sluice_server.layers.torch_attention import TorchAttention
from sluice_server.layers.triton_attention import TritonAttention
from sluice_server.pb import shard_pb2

from conftest import triton_device as device

# The kernel tests' tolerances against a float32 reference (kernels/tests/kernel_cases.py).
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}


def state(rid: int, length: int, computed: int, block_ids: list[int]) -> RequestState:
    return RequestState(
        id=rid, token_ids=list(range(3, 3 + length)), num_prompt_tokens=length, num_computed_tokens=computed,
        block_ids=block_ids, params=shard_pb2.SamplingParams(),
    )


def mixed_work(block_size: int, num_blocks: int, seed: int) -> list[Work]:
    """Decodes, a fresh prompt, a chunk after earlier chunks, and a prompt over
    a cached prefix that ends mid-block; listed out of order on purpose
    (build_batch puts the decodes first)."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    items = []
    # (total tokens, already computed, new this step)
    for rid, (length, computed, new) in enumerate([(13, 0, 13), (30, 29, 1), (40, 20, 11), (17, 16, 1), (14, 9, 5), (1, 0, 1)]):
        blocks = [free.pop() for _ in range(-(-(computed + new) // block_size))]
        items.append(Work(state(rid, length, computed, blocks), computed, new, blocks))
    return items


@pytest.mark.parametrize("dtype,block_size,num_splits", [
    (torch.float32, 16, None), (torch.float32, 32, 2), (torch.bfloat16, 16, 3), (torch.float16, 32, None),
])
def test_triton_equals_torch_backend(dtype, block_size, num_splits):
    num_blocks, num_q_heads, num_kv_heads, head_dim = 24, 4, 2, 64
    batch = build_batch(mixed_work(block_size, num_blocks, seed=block_size), block_size, device())
    meta = batch.attn
    assert meta.num_decodes == 3
    tokens = batch.input_ids.numel()
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device())  # noqa: E731
    # Caches start random: the cached prefixes' keys are whatever the blocks hold.
    k_cache, v_cache = rand(num_blocks, block_size, num_kv_heads, head_dim), rand(num_blocks, block_size, num_kv_heads, head_dim)
    q, k, v = rand(tokens, num_q_heads, head_dim), rand(tokens, num_kv_heads, head_dim), rand(tokens, num_kv_heads, head_dim)

    outs, caches = [], []
    for backend in (TorchAttention(), TritonAttention(num_splits=num_splits)):
        kc, vc = k_cache.clone(), v_cache.clone()
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, kc, vc, meta))
        caches.append((kc, vc))
        meta.backend_state = {}
    torch.testing.assert_close(outs[1], outs[0], **TOLERANCES[dtype])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_plan_is_built_once_per_step():
    backend = TritonAttention()
    batch = build_batch(mixed_work(16, 24, seed=1), 16, device())
    backend.prepare(batch.attn)
    first = backend._plan(batch.attn, 4, 2, device())
    assert backend._plan(batch.attn, 4, 2, device()) is first
    backend.prepare(batch.attn)
    assert backend._plan(batch.attn, 4, 2, device()) is not first


def test_block_size_mismatch_is_rejected():
    batch = build_batch(mixed_work(16, 24, seed=1), 16, device())
    cache = torch.zeros(24, 32, 2, 64, device=device())
    t = batch.input_ids.numel()
    with pytest.raises(ValueError, match="block size"):
        TritonAttention().forward(torch.zeros(t, 4, 64), torch.zeros(t, 2, 64), torch.zeros(t, 2, 64), cache, cache, batch.attn)


def test_backend_selection(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert get_backend(cpu, "auto").name == "torch"
    assert get_backend(cpu, "torch").name == "torch"
    assert get_backend(cpu, "triton").name == "triton"  # TRITON_INTERPRET=1 here
    from sluice_server.layers.backends import resolve_backend_name

    assert resolve_backend_name("auto", cuda) == "triton"
    assert resolve_backend_name("torch", cuda) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device.*TRITON_INTERPRET=1"):
        get_backend(cpu, "triton")
    with pytest.raises(ValueError, match="'flash' is not one of auto, torch, triton"):
        get_backend(cpu, "flash")

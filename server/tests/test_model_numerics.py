"""The shard's model against transformers, fp32, on tiny random models: the
same logits however a sequence is split into steps and batched."""

from __future__ import annotations

import pytest
import torch

from sluice_server.model_runner import ModelRunner
from sluice_server.models import model_class

from conftest import Driver, make_tiny_model, reference_logits

ATOL = 1e-4
KINDS = ["llama", "qwen2", "tied", "mha", "llama3"]


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (length,), generator=g).tolist()


@pytest.fixture(scope="module", params=KINDS)
def model(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=KINDS.index(request.param))
    return folder, ModelRunner(folder, dtype="float32", block_size=4)


def check(driver: Driver, folder, rid: int, tokens: list[int], start: int = 0) -> None:
    want = reference_logits(folder, tokens)[start:]
    got = driver.computed(rid, start, len(tokens))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_whole_sequence_at_once(model):
    folder, runner = model
    d = Driver(runner)
    tokens = prompt(37, 1)
    d.step([(d.request(1, tokens), 37)])
    check(d, folder, 1, tokens)


def test_prefill_then_decodes(model):
    folder, runner = model
    d = Driver(runner)
    tokens = prompt(30, 2)
    r = d.request(1, tokens)
    d.step([(r, 25)])
    for _ in range(5):
        d.step([(r, 1)])
    check(d, folder, 1, tokens)


def test_chunked_prefill(model):
    folder, runner = model
    d = Driver(runner)
    tokens = prompt(41, 3)
    r = d.request(1, tokens)
    for n in (5, 7, 1, 16, 12):  # chunk edges inside and on block boundaries
        d.step([(r, n)])
    check(d, folder, 1, tokens)


@pytest.mark.parametrize("cached", [8, 11])
def test_cached_prefix(model, cached):
    """A second request reuses the blocks filled by the first for its first
    `cached` tokens (block-aligned, and mid-block as after a chunk)."""
    folder, runner = model
    d = Driver(runner)
    tokens = prompt(29, 4)
    first = d.request(1, tokens)
    d.step([(first, 29)])
    second = d.request(2, tokens, num_computed=cached, block_ids=first.block_ids)
    d.step([(second, 29 - cached)])
    check(d, folder, 2, tokens, start=cached)


def test_mixed_batch(model):
    """Requests at different stages share steps: decodes, prefill chunks, a
    cached-prefix request and a fresh prompt."""
    folder, runner = model
    d = Driver(runner)
    seqs = {i: prompt(n, 10 + i) for i, n in enumerate([23, 31, 18, 27, 9], start=1)}
    a = d.request(1, seqs[1])
    b = d.request(2, seqs[2])
    d.step([(a, 20), (b, 6)])
    prefix_owner = d.request(3, seqs[3])
    d.step([(a, 1), (b, 10), (prefix_owner, 18)])
    # Shares request 3's first 3 blocks (12 tokens), then its own 4 blocks.
    own_blocks = [d.free.pop() for _ in range(4)]
    c = d.request(4, seqs[3][:12] + seqs[4][12:], num_computed=12, block_ids=prefix_owner.block_ids[:3] + own_blocks)
    e = d.request(5, seqs[5])
    d.step([(a, 1), (b, 15), (c, 5), (e, 9)])
    d.step([(a, 1), (c, 9)])
    d.step([(c, 1)])
    check(d, folder, 1, seqs[1])
    check(d, folder, 2, seqs[2])
    check(d, folder, 3, seqs[3])
    check(d, folder, 4, c.token_ids, start=12)
    check(d, folder, 5, seqs[5])


def test_unsupported_model_type_names_supported():
    with pytest.raises(ValueError, match="supported: llama, mistral, qwen2"):
        model_class("gpt2")

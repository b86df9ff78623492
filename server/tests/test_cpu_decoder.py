"""The C++ decode path (layers.cpu_decoder) against the model's own forward,
on the bundled SmolLM2 (the model with GGUF blocks): the same kernels in the
same order, so logits and the KV written must be bitwise equal, with int8
activations (--dtype auto) and with the exact block expansion (float32), for
decode steps of one and of several sequences."""

from __future__ import annotations

import pytest
import torch

from conftest import Driver
from sluice_server.layers import cpu_kernels
from sluice_server.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")


@pytest.fixture(scope="module", params=["auto", "float32"])
def runner(request, smollm2_dir):
    return ModelRunner(smollm2_dir, dtype=request.param)


def decode_twice(runner: ModelRunner, use_decoder: bool, prompts: list[list[int]]):
    """Prefills the prompts (Python path), then runs two decode steps of all
    of them with or without the C++ decoder; returns the decode logits and
    the KV cache."""
    decoder = runner.cpu_decoder
    driver = Driver(runner, num_blocks=64, seed=3)
    states = [driver.request(i, p + [7, 9]) for i, p in enumerate(prompts)]
    for s, p in zip(states, prompts):
        driver.step([(s, len(p))])
    runner.cpu_decoder = decoder if use_decoder else None
    try:
        driver.step([(s, 1) for s in states])
        driver.step([(s, 1) for s in states])
    finally:
        runner.cpu_decoder = decoder
    logits = [driver.computed(s.id, len(p), len(p) + 2) for s, p in zip(states, prompts)]
    return logits, runner.kv_cache


@pytest.mark.parametrize("batch", [1, 5])
def test_the_cpu_decoder_equals_the_python_forward(runner, batch):
    assert runner.cpu_decoder is not None, "the bundled model's layers all have GGUF blocks"
    prompts = [[1 + i, 200 + 3 * i, 4000 - i, 17] + list(range(30, 30 + 9 * i)) for i in range(batch)]
    want, want_cache = decode_twice(runner, False, prompts)
    want_kv = [(k.clone(), v.clone()) for k, v in want_cache.layers]
    got, got_cache = decode_twice(runner, True, prompts)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for (k, v), (wk, wv) in zip(got_cache.layers, want_kv):
        assert torch.equal(k, wk) and torch.equal(v, wv)


def test_steps_it_does_not_take(runner):
    from sluice_server.batch import RequestState, Work
    from sluice_server.pb import shard_pb2

    runner.allocate_kv_cache(8)

    def state(n):
        return RequestState(id=n, token_ids=list(range(1, n + 2)), num_prompt_tokens=n + 1,
                            num_computed_tokens=0, block_ids=[n], params=shard_pb2.SamplingParams())

    prefill = runner.build_batch([Work(state(3), 0, 4, [3])])
    assert not runner.cpu_decoder.accepts(prefill)
    big = runner.cpu_decoder.max_rows + 1
    decodes = runner.build_batch([Work(state(1), 1, 1, [0]) for _ in range(big)])
    assert not runner.cpu_decoder.accepts(decodes)

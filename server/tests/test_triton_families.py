"""Each model family on the Triton backend (the interpreter on CPU) against
transformers' logits, through one schedule that holds each batch shape of the
shard's numerics tests: a prompt prefilled in two chunks, then decoding; a
second request over its cached prefix (from mid-block) beside those decodes;
a third prefilled at once in a mixed step. Prompts are longer than the tiny
models' sliding windows (8 tokens; Phi-3: 16), so the windowed kernel paths
run, split-KV included."""

from __future__ import annotations

import random

import pytest
import torch

from sluice_server.batch import RequestState, Work
from sluice_kernels.ops import TritonOps
from sluice_server.model_runner import ModelRunner
from sluice_server.pb import shard_pb2

from conftest import make_tiny_model, reference_logits
from conftest import triton_device as device

KINDS = ["llama", "mistral", "qwen3", "gemma3", "phi3", "qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe"]


@pytest.mark.parametrize("kind", KINDS)
def test_family_on_triton_matches_transformers(tmp_path, kind):
    folder = make_tiny_model(tmp_path, kind, seed=KINDS.index(kind))
    # Through the shard's own selection: on CPU "triton" is allowed because
    # these tests run under TRITON_INTERPRET=1 (conftest.py).
    runner = ModelRunner(folder, dtype="float32", device=str(device()), block_size=4, attention_backend="triton")
    assert runner.backend.name == "triton" and isinstance(runner.backend.ops, TritonOps)
    # Every layer dispatches to the fused kernels, not to torch.
    layer = runner.model.model.layers[0]
    assert layer.input_layernorm.ops is runner.backend.ops and layer.mlp.ops is runner.backend.ops
    runner.backend.num_splits = 2  # the split-KV merge, over windows too
    runner.allocate_kv_cache(32)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 128, (30,), generator=g).tolist()
    third = torch.randint(3, 128, (19,), generator=g).tolist()

    free = list(range(32))
    random.Random(0).shuffle(free)
    params = shard_pb2.SamplingParams()
    first = RequestState(1, tokens, 30, 0, [free.pop() for _ in range(8)], params)
    # Shares first's 3 full blocks (12 tokens) as a cached prefix; computes from token 10.
    second = RequestState(2, tokens[:26], 26, 10, first.block_ids[:3] + [free.pop() for _ in range(4)], params)
    fresh = RequestState(3, third, 19, 0, [free.pop() for _ in range(5)], params)
    got: dict[tuple[int, int], torch.Tensor] = {}

    def step(items):
        batch = runner.build_batch([Work(s, s.num_computed_tokens, n, s.block_ids) for s, n in items])
        batch.logits_indices = torch.arange(batch.input_ids.numel(), device=batch.input_ids.device)
        logits = runner.execute(batch)
        row = 0
        for w in batch.work:
            for i in range(w.num_new_tokens):
                got[(w.state.id, w.start + i)] = logits[row]
                row += 1
            w.state.num_computed_tokens = w.end

    step([(first, 14)])
    step([(first, 13)])
    step([(first, 1), (second, 15)])  # a decode beside a chunk over a cached prefix
    step([(first, 1), (second, 1), (fresh, 19)])  # decodes and a whole prompt
    step([(first, 1)])
    for rid, seq, start in ((1, tokens, 0), (2, tokens[:26], 10), (3, third, 0)):
        want = reference_logits(folder, seq)[start:]
        rows = torch.stack([got[(rid, p)] for p in range(start, len(seq))]).cpu()
        torch.testing.assert_close(rows, want, atol=1e-4, rtol=0, msg=lambda m: f"request {rid}: {m}")

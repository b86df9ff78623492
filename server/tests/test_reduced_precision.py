"""The shard's model in bfloat16 and float16 against transformers, on tiny
random models, through prefill, decodes and a cached prefix.

Tolerances. Both implementations round weights, activations and the KV cache
to the reduced type, but in different places (fused projections, another
summation order, the KV cache's rounding before attention), so they do not
agree bit for bit. Two checks, against transformers' float32 logits `ref`:

- our error is at most ERROR_RATIO x transformers' own error in the same
  dtype, plus ERROR_FLOOR: we lose no more precision than the reference
  implementation does;
- our logits are within ATOL of transformers' in the same dtype (bf16 keeps
  8 significant bits, ~0.4% relative; these models' logits are below ~1.5).

bfloat16 runs on every x86 host: natively with AVX-512 BF16 / AMX, through
float32 conversions elsewhere (slower, the same rounding). float16 runs where
torch's CPU build computes it; a host whose torch cannot is skipped with the
reason printed.
"""

from __future__ import annotations

import pytest
import torch

from sluice_server.model_runner import ModelRunner

from conftest import Driver, make_tiny_model

ERROR_RATIO = 2.0
ERROR_FLOOR = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
ATOL = {torch.bfloat16: 6e-2, torch.float16: 8e-3}
KINDS = ["llama", "qwen2", "tied"]


def half_support(dtype: torch.dtype) -> str | None:
    """Why torch on this host cannot run the model's ops in `dtype`, or None."""
    try:
        x = torch.randn(2, 4, 8, 16).to(dtype)
        torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        torch.nn.functional.linear(x, torch.randn(16, 16).to(dtype))
        torch.nn.functional.silu(x) * x
    except (RuntimeError, NotImplementedError) as e:
        return f"torch cannot compute {dtype} on this CPU: {e}"
    return None


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (length,), generator=g).tolist()


def transformers_logits(folder, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=KINDS)
def folder(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(f"{request.param}-half"), request.param, seed=7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reduced_precision_logits_match_transformers(folder, dtype):
    reason = half_support(dtype)
    if reason:
        pytest.skip(reason)
    runner = ModelRunner(folder, dtype=str(dtype).removeprefix("torch."), block_size=4)
    assert runner.dtype == dtype
    d = Driver(runner)
    # One request prefilled then decoded, a second reusing the first's first
    # three blocks (12 tokens), batched with the first one's decodes.
    first = prompt(30, 1)
    second = first[:12] + prompt(14, 2)
    a = d.request(1, first)
    d.step([(a, 24)])
    b = d.request(2, second, num_computed=12, block_ids=a.block_ids[:3] + [d.free.pop() for _ in range(4)])
    d.step([(a, 1), (b, 14)])
    for _ in range(5):
        d.step([(a, 1)])
    for rid, tokens, start in ((1, first, 0), (2, second, 12)):
        got = d.computed(rid, start, len(tokens)).float()
        assert torch.isfinite(got).all()
        ref = transformers_logits(folder, tokens, torch.float32)[start:]
        theirs = transformers_logits(folder, tokens, dtype)[start:]
        our_error = (got - ref).abs().max().item()
        their_error = (theirs - ref).abs().max().item()
        assert our_error <= ERROR_RATIO * their_error + ERROR_FLOOR[dtype], (rid, our_error, their_error)
        torch.testing.assert_close(got, theirs, atol=ATOL[dtype], rtol=0)

"""The default path (`--dtype auto` on a GGUF: int8 activations on the
blocks, a bfloat16 KV cache) against float32, on the bundled SmolLM2 and the
text benchmarks/quality.py scores: teacher forcing over its first TOKENS
tokens, every position once as a decode step on the C++ decoder and once in
prefill chunks.

`auto` is not float32 bit for bit; these bounds are what "close to float32"
means here, derived from benchmarks/quality.py's measured figures
(benchmarks/README.md: 512-693 positions, two hosts) and this test's own:

                     quality.py             this test (256 positions,        bound
                                            decode / prefill)
    top-1 agreement  95.5% to 97.5%         95.7% / 96.9%                    >= 92%
                     (llama.cpp's own
                     int8 path: 96.8%)
    perplexity       -0.11% to +0.78%       +1.06% / -0.46%                  within 2%
    logit error,     -                      0.031 / 0.029                    <= 0.06
      mean per row
    logit error,     -                      0.116 / 0.126                    <= 0.25
      worst row

(this test's figures: a Sapphire Rapids VM without AMX, int8 blocks at every
step size). Over 256 positions a 3.5% flip rate has a standard deviation of
1.1%, so the top-1 bound sits three of them under the worst measured figure;
perplexity, over fewer positions than quality.py's, may move twice the
issue's 1%; the logit errors (||auto - fp32|| / ||fp32|| per position) may
double. A path that broke its arithmetic (a wrong block layout, a stale
cache row, the wrong rotary) lands far outside all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_kernels import cpu_kernels
from sluice_server.model_runner import ModelRunner
from sluice_server.testing import fidelity, teacher_forced_logits

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")

TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_text.txt"
TOKENS = 256
MIN_TOP1 = 0.92
MAX_PERPLEXITY_CHANGE = 0.02
MAX_MEAN_LOGIT_ERROR = 0.06
MAX_ROW_LOGIT_ERROR = 0.25


@pytest.fixture(scope="module")
def tokens(smollm2_dir) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).encode(TEXT.read_text()).ids[:TOKENS]
    assert len(ids) == TOKENS
    return ids


@pytest.fixture(scope="module")
def reference(smollm2_dir, tokens):
    runner = ModelRunner(smollm2_dir, dtype="float32")
    return teacher_forced_logits(runner, tokens, 128)


@pytest.fixture(scope="module")
def auto(smollm2_dir):
    runner = ModelRunner(smollm2_dir, dtype="auto")
    assert runner.cpu_matmuls.int8 and runner.cpu_matmuls.block_rows > 0, runner.cpu_matmuls
    assert runner.cpu_decoder is not None and str(runner.kv_dtype) == "torch.bfloat16"
    return runner


@pytest.mark.parametrize("chunk", [1, 128], ids=["decode", "prefill"])
def test_auto_stays_close_to_float32(auto, reference, tokens, chunk):
    steps = auto.cpu_decoder.steps
    logits = teacher_forced_logits(auto, tokens, chunk)
    if chunk == 1:
        assert auto.cpu_decoder.steps - steps == TOKENS, "every decode position ran on the C++ decoder"
    got = fidelity(logits, reference, tokens)
    ref = fidelity(reference, reference, tokens)
    change = got["ppl"] / ref["ppl"] - 1
    summary = (
        f"top-1 {got['top1']:.2%}, perplexity {change:+.2%}, logit error mean {got['logit_error']:.3f}, "
        f"worst {got['worst_logit_error']:.3f} at position {got['worst_row']}"
    )
    print(f"auto, {'decode' if chunk == 1 else 'prefill'}: {summary}")
    assert got["top1"] >= MIN_TOP1, summary
    assert abs(change) <= MAX_PERPLEXITY_CHANGE, summary
    assert got["logit_error"] <= MAX_MEAN_LOGIT_ERROR, summary
    assert got["worst_logit_error"] <= MAX_ROW_LOGIT_ERROR, summary

"""How far each CPU arithmetic path is from float32, on a fixed text.

For every path the shard can take on this host, the text (benchmarks/
quality_text.txt, written for this purpose) is scored under teacher forcing:
the model sees the true tokens and its logits at every position are compared
with float32's at the same position.

    top-1 agreement   share of positions where the path's most likely next
                      token is float32's
    perplexity        exp(mean negative log-likelihood of the true next token),
                      and its change against float32's

Paths (rows), as `--dtype` selects them (kernels/sluice_kernels/cpu_matmuls.py):

    float32          the reference: exact GGUF blocks / dense float32
    auto, decode     int8 activations on the GGUF blocks and a bfloat16
                     KV cache: every position computed as a one-token decode
                     step (the C++ decoder)
    auto, prefill    the same --dtype auto model scoring the text in prefill
                     chunks: on the blocks too where the plan runs them at
                     every size (VNNI without AMX), else dense bfloat16
                     where the CPU has native bf16 (else float32); the
                     bfloat16 KV cache
    bfloat16         every weight and activation in bf16 (dense)

The issue's bound for a fast path: top-1 agreement >= 99% and perplexity
within 1% of float32.

    python benchmarks/quality.py                  # bundled SmolLM2
    python benchmarks/quality.py --model DIR --tokens 512
    python benchmarks/quality.py --auto-kv-cache float32  # auto with a float32 cache
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("server", "kernels")]

from sluice_server.batch import RequestState, Work  # noqa: E402
from sluice_server.model_runner import KV_DTYPE_ENV, ModelRunner  # noqa: E402
from sluice_server.pb import shard_pb2  # noqa: E402

TEXT = Path(__file__).with_name("quality_text.txt")


def resolve(model: str | None) -> Path:
    from sluice_server.download import bundled_model_path, resolve_model

    return resolve_model(model or str(bundled_model_path()))


def tokenize(folder: Path, text: str, limit: int) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids[:limit]


def score(runner: ModelRunner, tokens: list[int], chunk: int) -> torch.Tensor:
    """Logits [len(tokens), vocab] under teacher forcing, computed in steps
    of `chunk` tokens (1: one decode step per position)."""
    bs = runner.block_size
    blocks = list(range(-(-len(tokens) // bs)))
    runner.allocate_kv_cache(len(blocks))
    state = RequestState(id=0, token_ids=list(tokens), num_prompt_tokens=len(tokens), num_computed_tokens=0,
                         block_ids=blocks, params=shard_pb2.SamplingParams())
    out = []
    start = 0
    while start < len(tokens):
        n = min(chunk, len(tokens) - start)
        batch = runner.build_batch([Work(state, start, n, blocks)])
        batch.logits_indices = torch.arange(n)
        out.append(runner.execute(batch))
        start += n
    return torch.cat(out)


def compare(logits: torch.Tensor, reference: torch.Tensor, tokens: list[int]) -> dict[str, float]:
    targets = torch.tensor(tokens[1:])
    logprobs = torch.log_softmax(logits[:-1].double(), -1)
    nll = -logprobs.gather(1, targets.view(-1, 1)).mean().item()
    agree = (logits[:-1].argmax(-1) == reference[:-1].argmax(-1)).double().mean().item()
    return {"top1": agree, "ppl": math.exp(nll)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id/folder/.gguf (default: bundled SmolLM2)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the text scored")
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk for the prefill rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--auto-kv-cache", choices=["float32", "bfloat16"], default=None,
                        help="the auto rows' KV cache dtype (default: the one auto picks)")
    args = parser.parse_args()
    # Only the auto rows take another cache; float32 and bfloat16 keep theirs.
    os.environ.pop(KV_DTYPE_ENV, None)
    torch.set_num_threads(args.threads)
    folder = resolve(args.model)
    tokens = tokenize(folder, TEXT.read_text(), args.tokens)

    rows: list[tuple[str, torch.Tensor]] = []
    reference_runner = ModelRunner(folder, dtype="float32")
    reference = score(reference_runner, tokens, args.chunk)
    del reference_runner
    rows.append(("float32", reference))
    if args.auto_kv_cache:
        os.environ[KV_DTYPE_ENV] = args.auto_kv_cache
    auto = ModelRunner(folder, dtype="auto")
    os.environ.pop(KV_DTYPE_ENV, None)
    plan = auto.cpu_matmuls.describe() if auto.cpu_matmuls else "dense"
    plan += f"; KV cache {str(auto.kv_dtype).removeprefix('torch.')}"
    if auto.cpu_matmuls and auto.cpu_matmuls.block_rows > 0:
        rows.append(("auto, decode", score(auto, tokens, 1)))
    rows.append(("auto, prefill", score(auto, tokens, args.chunk)))
    del auto
    rows.append(("bfloat16", score(ModelRunner(folder, dtype="bfloat16"), tokens, args.chunk)))

    ref = compare(reference, reference, tokens)
    print(f"model {folder.name}, {len(tokens)} tokens of {TEXT.name}; --dtype auto here: {plan}")
    print(f"{'path':<16} {'top-1 vs fp32':>14} {'perplexity':>11} {'vs fp32':>9}")
    for name, logits in rows:
        r = compare(logits, reference, tokens)
        print(f"{name:<16} {r['top1']:>13.2%} {r['ppl']:>11.3f} {r['ppl'] / ref['ppl'] - 1:>+9.2%}")


if __name__ == "__main__":
    main()

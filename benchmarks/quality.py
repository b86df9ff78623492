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
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("server", "kernels")]

from sluice_server.model_runner import ModelRunner  # noqa: E402
from sluice_server.options import ShardOptions  # noqa: E402
from sluice_server.testing import fidelity as compare  # noqa: E402
from sluice_server.testing import teacher_forced_logits as score  # noqa: E402

TEXT = Path(__file__).with_name("quality_text.txt")


def resolve(model: str | None) -> Path:
    from sluice_server.download import bundled_model_path, resolve_model

    return resolve_model(model or str(bundled_model_path()))


def tokenize(folder: Path, text: str, limit: int) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids[:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id/folder/.gguf (default: bundled SmolLM2)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the text scored")
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk for the prefill rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--auto-kv-cache", choices=["float32", "bfloat16"], default=None,
                        help="the auto rows' KV cache dtype (default: the one auto picks)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve(args.model)
    tokens = tokenize(folder, TEXT.read_text(), args.tokens)

    rows: list[tuple[str, torch.Tensor]] = []
    reference_runner = ModelRunner(folder, dtype="float32")
    reference = score(reference_runner, tokens, args.chunk)
    del reference_runner
    rows.append(("float32", reference))
    # Only the auto rows take another cache; float32 and bfloat16 keep theirs.
    auto = ModelRunner(folder, dtype="auto", options=ShardOptions(kv_cache_dtype=args.auto_kv_cache or "auto"))
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

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
    python benchmarks/quality.py --model F.gguf --llama-cpp-ctx 256

--llama-cpp-ctx N scores the positions that `llama-perplexity -c N` scores
(benchmarks/llama_cpp_quality.sh, llama.cpp's figures on the same text): the
whole text cut into chunks of N tokens, each starting with BOS where the
tokenizer adds one, and only the second half of each chunk (rows N/2 .. N-2).
Perplexity is then over those positions; top-1 agreement their share.
"""

from __future__ import annotations

import argparse
import math
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


def llama_cpp_chunks(folder: Path, tokens: list[int], n: int) -> list[list[int]]:
    """llama-perplexity's chunks of n tokens: its first token replaced by the
    BOS where the tokenizer adds one (tokens[0] is then that BOS)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = len(tokenizer.encode("a").ids) > len(tokenizer.encode("a", add_special_tokens=False).ids)
    chunks = [tokens[i * n:(i + 1) * n] for i in range(len(tokens) // n)]
    return [tokens[:1] + c[1:] if bos else c for c in chunks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id/folder/.gguf (default: bundled SmolLM2)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the text scored")
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk for the prefill rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--auto-kv-cache", choices=["float32", "bfloat16"], default=None,
                        help="the auto rows' KV cache dtype (default: the one auto picks)")
    parser.add_argument("--llama-cpp-ctx", type=int, default=None, metavar="N",
                        help="score llama-perplexity -c N's positions (the whole text; --tokens is ignored)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve(args.model)
    if args.llama_cpp_ctx:
        n = args.llama_cpp_ctx
        sequences = llama_cpp_chunks(folder, tokenize(folder, TEXT.read_text(), 1 << 30), n)
        skip = n // 2
        scope = f"llama-perplexity -c {n}'s {len(sequences) * (n - 1 - skip)} positions ({len(sequences)} chunks)"
    else:
        sequences, skip = [tokenize(folder, TEXT.read_text(), args.tokens)], 0
        scope = f"{len(sequences[0])} tokens"

    def score_all(runner, chunk: int) -> list[torch.Tensor]:
        return [score(runner, tokens, chunk) for tokens in sequences]

    def fidelity(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> tuple[float, float]:
        """Top-1 agreement and perplexity over rows skip.. of every sequence
        (each scores as many positions)."""
        rs = [compare(l[skip:], r[skip:], t[skip:]) for l, r, t in zip(logits, reference, sequences)]
        return sum(r["top1"] for r in rs) / len(rs), math.exp(sum(math.log(r["ppl"]) for r in rs) / len(rs))

    rows: list[tuple[str, list[torch.Tensor]]] = []
    reference_runner = ModelRunner(folder, dtype="float32")
    reference = score_all(reference_runner, args.chunk)
    del reference_runner
    rows.append(("float32", reference))
    # Only the auto rows take another cache; float32 and bfloat16 keep theirs.
    auto = ModelRunner(folder, dtype="auto", options=ShardOptions(kv_cache_dtype=args.auto_kv_cache or "auto"))
    plan = auto.cpu_matmuls.describe() if auto.cpu_matmuls else "dense"
    plan += f"; KV cache {str(auto.kv_dtype).removeprefix('torch.')}"
    if auto.cpu_matmuls and auto.cpu_matmuls.block_rows > 0:
        rows.append(("auto, decode", score_all(auto, 1)))
    rows.append(("auto, prefill", score_all(auto, args.chunk)))
    del auto
    rows.append(("bfloat16", score_all(ModelRunner(folder, dtype="bfloat16"), args.chunk)))

    _, ref_ppl = fidelity(reference, reference)
    print(f"model {folder.name}, {scope} of {TEXT.name}; --dtype auto here: {plan}")
    print(f"{'path':<16} {'top-1 vs fp32':>14} {'perplexity':>11} {'vs fp32':>9}")
    for name, logits in rows:
        top1, ppl = fidelity(logits, reference)
        print(f"{name:<16} {top1:>13.2%} {ppl:>11.3f} {ppl / ref_ppl - 1:>+9.2%}")


if __name__ == "__main__":
    main()

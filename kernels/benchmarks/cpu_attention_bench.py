"""Times the CPU decode-attention kernel (csrc/cpu_attention.cpp) over a
float32 and a bfloat16 KV cache, taking turns, with SmolLM2-135M's heads
(9 query heads, 3 KV heads, head_dim 64) through its 30 layers (not a test).

Each case is B sequences of `context` keys, their blocks scattered over the
cache as a long-running server leaves them; "shared" cases give every
sequence the same first blocks (a 1,024-token system prompt, as the
shared-prefix workload has). A row prints each dtype's time for one decode
step through all layers and the K/V bytes it reads over that time.

    python kernels/benchmarks/cpu_attention_bench.py
    python kernels/benchmarks/cpu_attention_bench.py --cases 32x300,8x1088 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kernels/: this checkout's sluice_kernels

from sluice_kernels import cpu_kernels  # noqa: E402

HQ, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30
SHARED = 1024


def tables_for(batch: int, context: int, shared: bool, num_blocks: int, seed: int) -> torch.Tensor:
    """[batch, blocks] block tables over a shuffled cache; with `shared`, the
    first SHARED // BS blocks are the same for every sequence."""
    need = -(-context // BS)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    common = perm[: SHARED // BS] if shared else []
    used = len(common)
    rows = []
    for _ in range(batch):
        own = need - len(common)
        rows.append(common + perm[used : used + own])
        used += own
    return torch.tensor(rows)


def step_ms(caches, q, out, tables, lens, repeats: int) -> list[float]:
    op = torch.ops.sluice_cpu.paged_decode_attention
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for k, v in caches:
            op(out, q, k, v, tables, lens, D**-0.5)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1x300,32x300,8x1088,8x1088shared,64x500",
                        help="BATCHxCONTEXT[shared], comma-separated")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        sys.exit(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    print(f"{'case':<16} {'float32 ms':>11} {'GB/s':>6} {'bfloat16 ms':>12} {'GB/s':>6} {'speedup':>8}")
    for case in args.cases.split(","):
        shared = case.endswith("shared")
        batch, context = (int(x) for x in case.removesuffix("shared").split("x"))
        num_blocks = batch * -(-context // BS) + 8
        tables = tables_for(batch, context, shared, num_blocks, seed=batch)
        lens = torch.full((batch,), context, dtype=torch.int64)
        q = torch.randn(batch, HQ, D)
        out = torch.empty_like(q)
        shape = (num_blocks, BS, HKV, D)
        fp32 = [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)]
        bf16 = [(k.bfloat16(), v.bfloat16()) for k, v in fp32]
        times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
        for _ in range(args.repeats):  # turns, so drift in the host's speed hits both
            times["float32"] += step_ms(fp32, q, out, tables, lens, 1)
            times["bfloat16"] += step_ms(bf16, q, out, tables, lens, 1)
        # Distinct K/V rows read per layer (shared blocks once per step at best).
        rows = len(set(tables.flatten().tolist())) * BS if shared else batch * context
        cols = []
        for name, element in (("float32", 4), ("bfloat16", 2)):
            ms = statistics.median(times[name])
            gbs = 2 * rows * HKV * D * element * LAYERS / ms / 1e6
            cols.append((ms, gbs))
        print(f"{case:<16} {cols[0][0]:>11.1f} {cols[0][1]:>6.1f} {cols[1][0]:>12.1f} {cols[1][1]:>6.1f} "
              f"{cols[0][0] / cols[1][0]:>7.2f}x")


if __name__ == "__main__":
    main()

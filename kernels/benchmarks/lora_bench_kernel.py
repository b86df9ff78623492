"""Times the CPU LoRA grouped matmul (csrc/cpu_lora.cpp, `lora_apply_`) at
SmolLM2-135M's four adapted linear layers (not a test):

    qkv      576 -> [576, 192, 192]     three pieces
    o        576 -> 576
    gate_up  576 -> [1536, 1536]        two pieces
    down    1536 -> 576

with every slot holding a rank-R adapter of every piece (the stacks packed
as the shard packs them, `lora_pack_cpu`, in `--stacks` float32 or
bfloat16). A case is T rows
split into G equal segments on G different slots (the rows of a decode step
of T sequences on G adapters). A row prints ms per call of each layer (the
same stacks call after call: they stay in cache) and per 30-layer step:
the four calls on each of 30 layers' own stacks, as a real step reads
them from memory; the median of the repeats.
The op is called as the C++ decoder calls it, without the Python-side
argument check (lora_apply_cpu adds that). `--clock cpu` counts the
process's CPU time instead of wall time: steadier on a shared host, and
the same as wall time times the threads when they are all busy.

    python kernels/benchmarks/lora_bench_kernel.py
    python kernels/benchmarks/lora_bench_kernel.py --rows 8 --segments 4 --repeats 50
    python kernels/benchmarks/lora_bench_kernel.py --stacks bfloat16
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

try:
    from sluice_kernels.lora import lora_pack_cpu  # noqa: E402
except ImportError:  # a checkout from before the packed layout: the stacks as they are
    def lora_pack_cpu(a, b, dtype=torch.float32):
        return a, b

LAYERS = 30
SHAPES = {  # name: (in, piece outputs)
    "qkv": (576, [576, 192, 192]),
    "o": (576, [576]),
    "gate_up": (576, [1536, 1536]),
    "down": (1536, [576]),
}


def stacks(in_features: int, pieces: list[int], slots: int, rank: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, len(pieces), rank, in_features, generator=g) / in_features**0.5
    b = torch.randn(slots, sum(pieces), rank, generator=g) * 0.02
    bounds = torch.tensor([sum(pieces[:i]) for i in range(len(pieces) + 1)], dtype=torch.int32)
    ranks = torch.full((slots, len(pieces)), rank, dtype=torch.int32)
    packed = lora_pack_cpu(a, b) if dtype == torch.float32 else lora_pack_cpu(a, b, dtype)
    return *packed, bounds, ranks


def segments(rows: int, count: int):
    """`count` segments of (nearly) equal length covering the rows, on slots 0..count-1."""
    edges = [rows * i // count for i in range(count + 1)]
    starts = torch.tensor(edges[:-1], dtype=torch.int32)
    ends = torch.tensor(edges[1:], dtype=torch.int32)
    return starts, ends, torch.arange(count, dtype=torch.int32)


def time_calls(fn, repeats: int, inner: int, clock) -> float:
    """Median ms of one call of `fn` over `repeats` timings of `inner` calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        for _ in range(inner):
            fn()
        times.append((clock() - start) * 1e3 / inner)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32], help="rows per call (T)")
    parser.add_argument("--segments", type=int, nargs="+", default=[1, 4, 16], help="adapters in the rows (G)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=16, help="adapter slots in the stacks")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--inner", type=int, default=30, help="calls per timing")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="wall time, or the process's CPU time")
    parser.add_argument("--stacks", choices=["float32", "bfloat16"], default="float32",
                        help="the stacks' element type (--lora-dtype)")
    args = parser.parse_args()
    if not cpu_kernels.load():
        sys.exit(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    op = torch.ops.sluice_cpu.lora_apply_
    dtype = getattr(torch, args.stacks)
    print(f"lora_apply_ (C++), rank {args.rank}, {args.slots} slots, {args.stacks} stacks, "
          f"{torch.get_num_threads()} threads; {args.clock} ms per call (median of {args.repeats})")
    print(f"{'T':>4}{'G':>4}" + "".join(f"{name:>10}" for name in SHAPES) + f"{'30 layers':>12}")
    # Every layer's own stacks: [layer][name].
    model = [{name: stacks(i, p, args.slots, args.rank, 100 * layer + seed, dtype)
              for seed, (name, (i, p)) in enumerate(SHAPES.items())} for layer in range(LAYERS)]
    layers = model[0]
    for rows in args.rows:
        for count in args.segments:
            if count > min(rows, args.slots):
                continue
            seg = segments(rows, count)
            per_layer = {}
            xs = {name: torch.randn(rows, i) for name, (i, _) in SHAPES.items()}
            ys = {name: torch.zeros(rows, sum(p)) for name, (_, p) in SHAPES.items()}
            scales = torch.full((args.slots,), 2.0)
            for name in SHAPES:
                a, b, bounds, ranks = layers[name]
                x, y = xs[name], ys[name]
                per_layer[name] = time_calls(
                    lambda: op(y, x, a, b, bounds, *seg, ranks, scales), args.repeats, args.inner, clock
                )

            def step_call():
                for layer in model:
                    for name, (a, b, bounds, ranks) in layer.items():
                        op(ys[name], xs[name], a, b, bounds, *seg, ranks, scales)

            step = time_calls(step_call, args.repeats, 1, clock)
            print(f"{rows:>4}{count:>4}" + "".join(f"{ms:>10.3f}" for ms in per_layer.values()) + f"{step:>12.2f}",
                  flush=True)


if __name__ == "__main__":
    main()

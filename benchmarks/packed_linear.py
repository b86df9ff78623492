"""Packed (oneDNN blocked layout) against plain linear weights on the CPU (not a test).

The shard packs every linear weight once at load (layers.linear.pack_for_cpu)
and multiplies with oneDNN's packed kernel instead of F.linear (MKL sgemm on
the row-major weight). This times both on the matrices of one model (default:
the bundled SmolLM2: q/k/v fused, o, gate/up fused, down, LM head) for a few
row counts, and prints each layout's time per full pass over the model's
linear layers and the ratio plain / packed. Before timing, each shape's two
results are compared (they must agree up to summation order).

    python benchmarks/packed_linear.py                       # bundled model, float32
    python benchmarks/packed_linear.py --rows 1,8,32 --threads 2 --dtype bfloat16
    python benchmarks/packed_linear.py --out benchmarks/results/packed.json

Name the host (lscpu's model name and flags) beside any figure taken from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("server", "kernels")]

from sluice_server.layers.linear import can_pack_for_cpu, pack_for_cpu, packed_linear  # noqa: E402


def model_shapes(config) -> list[tuple[str, int, int, int]]:
    """(name, out_features, in_features, count per forward) of each linear layer."""
    d, hd = config.hidden_size, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    n = config.num_hidden_layers
    return [
        ("qkv_proj", q + 2 * kv, d, n),
        ("o_proj", d, q, n),
        ("gate_up_proj", 2 * config.intermediate_size, d, n),
        ("down_proj", d, config.intermediate_size, n),
        ("lm_head", config.vocab_size, d, 1),
    ]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def compare(shapes, rows: list[int], dtype: torch.dtype, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(out, inp, generator=g).to(dtype) / inp**0.5 for name, out, inp, _ in shapes}
    packed = {name: pack_for_cpu(w) for name, w in weights.items()}
    results = []
    for m in rows:
        plain_ms = packed_ms = 0.0
        for name, _, inp, count in shapes:
            x = torch.randn(m, inp, generator=g).to(dtype)
            w, p = weights[name], packed[name]
            torch.testing.assert_close(packed_linear(x, p, None), F.linear(x, w), rtol=2e-2, atol=2e-2)
            plain_ms += count * median_ms(lambda: F.linear(x, w), repeats)
            packed_ms += count * median_ms(lambda: packed_linear(x, p, None), repeats)
        results.append({"rows": m, "plain_ms": plain_ms, "packed_ms": packed_ms, "plain_over_packed": plain_ms / packed_ms})
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id/folder/.gguf (default: bundled SmolLM2)")
    parser.add_argument("--rows", default="1,4,8,16,32,64", help="rows of the activation (batch tokens)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per shape and layout (median)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    from sluice_server.download import bundled_model_path, resolve_model

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not can_pack_for_cpu(torch.empty(1, 1, dtype=dtype)):
        sys.exit(f"this torch build cannot pack {args.dtype} weights for the CPU (no oneDNN linear ops)")
    folder = resolve_model(args.model or str(bundled_model_path()))
    shapes = model_shapes(AutoConfig.from_pretrained(folder))
    results = compare(shapes, [int(r) for r in args.rows.split(",")], dtype, args.repeats)
    print(f"model {folder.name}  dtype {args.dtype}  threads {torch.get_num_threads()}  "
          f"one pass over {sum(c for *_, c in shapes)} linear layers, median of {args.repeats}")
    print(f"{'rows':>5} {'plain ms':>9} {'packed ms':>10} {'plain/packed':>13}")
    for r in results:
        print(f"{r['rows']:>5} {r['plain_ms']:>9.2f} {r['packed_ms']:>10.2f} {r['plain_over_packed']:>12.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": folder.name, "dtype": args.dtype, "threads": args.threads,
                                        "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()

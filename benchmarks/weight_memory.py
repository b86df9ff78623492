"""Resident memory of a CPU shard's weights against the GGUF file they come from.

For each --dtype, in a fresh process: the model is loaded as the shard loads
it (`ModelRunner`: conversion, GGUF blocks, the plan's dense forms), warmed
up with a small fixed KV cache (--kv-cache-bytes) so the cache does not
dominate, and the process's resident memory read from /proc/self/status.
Each row gives the file's size, the runner's own count of its weights
(`weight_bytes`, and the dense copies of block-served matrices among them),
VmRSS after warmup, less VmRSS before loading (the interpreter, torch and
the C++ kernels: the same in every row), so that what is left is the
weights, the KV cache and warmup's leftovers; and VmHWM (the peak, loading
included).

    python benchmarks/weight_memory.py                              # bundled SmolLM2-135M Q4_1
    python benchmarks/weight_memory.py --shape llama-1b --quant Q4_1 # random weights, Llama-3.2-1B's shape
    python benchmarks/weight_memory.py --shape llama-8b --quant Q4_0 --write-only --out /tmp/wm  # Llama-3-8B's

--shape writes (once, into --out) a random-weight GGUF of that shape with
the bundled model's tokenizer (its 49,152-token vocabulary, merges and chat
template, copied from the bundled .gguf's metadata, so the bundled tokenizer
serves it); its blocks are valid but meaningless, which does not change what
is held in memory. The file is written a tensor at a time (the 8B shape is
4.4 GB in Q4_0): every tensor's header entry first, then each tensor's
random blocks made and written in turn. --write-only stops there (the 8B
shape is served through the real launcher instead, benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / d) for d in ("server", "kernels", "benchmarks")]

# (hidden, layers, heads, kv heads, FFN width, vocabulary, tied output)
SHAPES = {
    "llama-1b": (2048, 16, 32, 8, 8192, 49152, True),  # Llama-3.2-1B, the bundled vocabulary
    "llama-8b": (4096, 32, 32, 8, 14336, 49152, False),  # Llama-3-8B (untied output), the bundled vocabulary
}


def random_blocks(shape: tuple[int, int], quant: str, rng: np.random.Generator) -> np.ndarray:
    """moe_bench's random blocks, with the minimum of Q4_1 / Q5_1 blocks
    (random fp16 bits there, NaN in one block of 32) set to -8 d: a NaN
    makes the records' layout the widest one (scales per 16, 8-bit), so the
    blocks would take 1.5 bytes a weight instead of the file's 0.625."""
    import gguf

    import moe_bench

    blocks = moe_bench.random_blocks(shape, quant, rng)
    if quant in ("Q4_1", "Q5_1"):
        size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant]][1]
        raw = blocks.reshape(shape[0], -1, size)
        d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)
        raw[..., 2:4] = (d * np.float16(-8)).view(np.uint8)
    return blocks


def copy_bundled_tokenizer(writer) -> None:
    """The bundled model's tokenizer.* metadata (vocabulary, merges, special
    ids, chat template) into `writer`."""
    import gguf

    from sluice_server.download import bundled_model_path

    reader = gguf.GGUFReader(str(bundled_model_path()))
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), kind, sub)


def more_bits(layer: int, layers: int) -> bool:
    """The layers whose attn_v and ffn_down a Q4_K_M file keeps in Q6_K:
    the first and last eighth, and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, quant: str, layers: int, tied: bool) -> str:
    """The block type of matrix `name` in a file of `quant`: one type for
    every matrix, or for Q4_K_M llama-quantize's mix (Q4_K, with the output
    matrix, or the embedding tied to it, and attn_v / ffn_down of the
    more_bits layers in Q6_K)."""
    if quant != "Q4_K_M":
        return quant
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    if name.endswith((".attn_v.weight", ".ffn_down.weight")) and more_bits(int(name.split(".")[1]), layers):
        return "Q6_K"
    return "Q4_K"


def write_llama_gguf(path: Path, shape: str, quant: str) -> None:
    """A Llama GGUF of `shape`, every matrix random `quant` blocks, the
    bundled tokenizer; written a tensor at a time (module docstring)."""
    import gguf

    h, layers, heads, kv, ffn, vocab, tied = SHAPES[shape]
    d = h // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(d)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(5e5)
    copy_bundled_tokenizer(writer)
    # (name, rows, cols or None for a norm of `rows` ones), in file order.
    tensors = [("token_embd.weight", vocab, h), ("output_norm.weight", h, None)]
    if not tied:
        tensors.append(("output.weight", vocab, h))
    for i in range(layers):
        b = f"blk.{i}"
        tensors += [(f"{b}.attn_norm.weight", h, None), (f"{b}.ffn_norm.weight", h, None),
                    (f"{b}.attn_q.weight", heads * d, h), (f"{b}.attn_k.weight", kv * d, h),
                    (f"{b}.attn_v.weight", kv * d, h), (f"{b}.attn_output.weight", h, heads * d),
                    (f"{b}.ffn_gate.weight", ffn, h), (f"{b}.ffn_up.weight", ffn, h),
                    (f"{b}.ffn_down.weight", h, ffn)]
    types = {name: tensor_type(name, quant, layers, tied) for name, _, cols in tensors if cols is not None}
    for name, rows, cols in tensors:
        if cols is None:
            writer.add_tensor_info(name, (rows,), np.dtype(np.float32), rows * 4)
        else:
            qtype = gguf.GGMLQuantizationType[types[name]]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = rows * cols // block * size
            writer.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, rows, cols in tensors:
        if cols is None:
            writer.write_tensor_data(np.ones(rows, dtype=np.float32))
        else:
            writer.write_tensor_data(random_blocks((rows, cols), types[name], rng))
    writer.close()


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(gguf: Path, folder: str, dtype: str, kv_cache_bytes: int) -> dict:
    """One row, in this process (run it in a fresh one)."""
    import torch

    from sluice_kernels import cpu_kernels
    from sluice_server.layers.linear import dense_copy_bytes
    from sluice_server.model_runner import ModelRunner

    cpu_kernels.load()
    base = status_bytes("VmRSS")  # the interpreter, torch and the kernels
    runner = ModelRunner(folder, dtype=dtype)
    runner.warmup(256, 8, 512, kv_cache_bytes)
    return {
        "dtype": dtype,
        "file": gguf.stat().st_size,
        "weight_bytes": runner.weight_bytes,
        "dense_copies": dense_copy_bytes(runner.model),
        "kv_cache": runner.kv_cache.nbytes,
        "base": base,
        "rss": status_bytes("VmRSS"),
        "hwm": status_bytes("VmHWM"),
        "plan": runner.cpu_matmuls.describe() if runner.cpu_matmuls else "",
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a .gguf (default: the bundled model, or --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="write a random-weight GGUF of this shape")
    p.add_argument("--quant", default="Q4_1",
                   help="block type of --shape's matrices, or Q4_K_M (llama-quantize's mix of Q4_K and Q6_K)")
    p.add_argument("--out", help="folder for --shape's file and conversions (default: a temporary one)")
    p.add_argument("--dtypes", default="auto,float32")
    p.add_argument("--kv-cache-bytes", type=int, default=32 * 2**20)
    p.add_argument("--write-only", action="store_true", help="write --shape's file, measure nothing")
    p.add_argument("--one", nargs=2, metavar=("GGUF", "FOLDER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        for dtype in args.dtypes.split(","):
            print(json.dumps(measure(Path(args.one[0]), args.one[1], dtype, args.kv_cache_bytes)))
        return

    from sluice_server.download import bundled_model_path, resolve_model

    out = Path(args.out or tempfile.mkdtemp(prefix="weight_memory-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.shape:
        gguf = out / f"{args.shape}-{args.quant}.gguf"
        if not gguf.exists():
            print(f"writing {gguf}", flush=True)
            write_llama_gguf(gguf, args.shape, args.quant)
    else:
        gguf = Path(args.model or bundled_model_path())
    if args.write_only:
        print(f"{gguf}: {gguf.stat().st_size / 2**20:.1f} MiB")
        return
    folder = resolve_model(str(gguf), cache_dir=str(out / "converted"))
    print(f"{gguf.name}: {gguf.stat().st_size / 2**20:.1f} MiB; KV cache {args.kv_cache_bytes / 2**20:.0f} MiB")
    print("| --dtype | plan | weight_bytes | of it dense copies | VmRSS after warmup (less before loading) "
          "| VmHWM | weight_bytes / file |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        done = subprocess.run(
            [sys.executable, __file__, "--one", str(gguf), str(folder), "--dtypes", dtype,
             "--kv-cache-bytes", str(args.kv_cache_bytes)],
            check=True, capture_output=True, text=True,
        )
        r = json.loads(done.stdout.strip().splitlines()[-1])
        mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
        print(f"| {dtype} | {r['plan']} | {mib(r['weight_bytes'])} | {mib(r['dense_copies'])} "
              f"| {mib(r['rss'])} ({mib(r['rss'] - r['base'])}) | {mib(r['hwm'])} "
              f"| {r['weight_bytes'] / r['file']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

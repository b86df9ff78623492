"""Decode step time and tokens/s of the shard, in-process (no gRPC), for
each CPU arithmetic path, beside the host's limits measured in the same run.

For each path (--dtype auto, float32, bfloat16; kernels/sluice_kernels/cpu_matmuls.py says
what each runs) and batch size B: B requests with a `--prompt-len` prompt
are prefilled, then `--steps` decode steps run through `Shard.step` (batch
building, forward, greedy sampling) and are timed. Each row gives:

    matmul GFLOP/s   the model's linear-layer FLOPs per token x B / step time,
                     and its share of the dense matmul rate of the path's
                     dtype (2048^3 products, same threads)
    weights GB/s     the bytes of weights the step reads (GGUF blocks or
                     dense, whichever its matmuls use at B rows) / step time,
                     and its share of the memory bandwidth (a large copy)

A step can be no faster than max(FLOPs / dense rate, bytes / bandwidth).

    python benchmarks/step_bench.py                     # bundled SmolLM2, CPU
    python benchmarks/step_bench.py --paths auto --batch-sizes 1,16 --threads 2
    python benchmarks/step_bench.py --paths auto --batch-sizes 32,64 --block-rows 16,64

--block-rows compares where the blocks stop paying (kernels/sluice_kernels/cpu_matmuls.py's
row limits): the same steps with blocks up to each limit, taking turns.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("server", "kernels")]

from sluice_server.layers.moe import FusedMoE  # noqa: E402
from sluice_server.model_runner import ModelRunner  # noqa: E402
from sluice_server.pb import shard_pb2  # noqa: E402
from sluice_server.servicer import Shard  # noqa: E402


def resolve(model: str | None) -> Path:
    from sluice_server.download import bundled_model_path, resolve_model

    return resolve_model(model or str(bundled_model_path()))


def flops_per_token(cfg) -> float:
    """Matrix-multiply FLOPs of one token through the model (2 per weight of
    every linear layer and of the LM head; attention over the context is left
    out, so the figure is a lower bound of the work done)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd + cfg.num_attention_heads * hd * d
    mlp = 3 * d * cfg.intermediate_size
    return 2.0 * (cfg.num_hidden_layers * (attn + mlp) + d * cfg.vocab_size)


def dense_matmul_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """The machine's dense matrix-multiply rate in GFLOP/s: n x n x n products
    in `dtype` with torch (same threads), best of `repeats`."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """GB/s of a large copy (bytes read + bytes written), best of `repeats`."""
    src = torch.ones(mib * 2**18)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def int8_dot_peak() -> float:
    """The host's int8 dot-product rate in GOP/s (multiply and add of each
    u8 x s8 pair; the instruction the block matmuls are made of: VPDPBUSD, or
    AVX2's PMADDUBSW), all threads, nothing loaded from memory; best
    of 3. 0 where the kernels did not load."""
    from sluice_kernels import cpu_kernels

    if not cpu_kernels.load():
        return 0.0
    torch.ops.sluice_cpu.q8_dot_peak(100_000)
    return max(torch.ops.sluice_cpu.q8_dot_peak(2_000_000) for _ in range(3)) / 1e9


def block_matmul_rate(runner: ModelRunner, rows: int, repeats: int = 5) -> tuple[str, float] | None:
    """GOP/s of the largest block-served linear layer of the model's first
    decoder layer (a prefill's bulk; the LM head sees one row a sequence) on
    `rows` rows, as a prefill runs it (int8 activations), best of `repeats`;
    None where no such layer has int8 blocks for that many rows."""
    layers = [m for m in runner.model.model.layers[0].modules() if getattr(m, "quantized", None) is not None
              and hasattr(m, "pack_for_cpu_") and m.quantized.int8 and rows <= m.quantized.max_rows]
    if not layers:
        return None
    layer = max(layers, key=lambda m: m.quantized.out_features)
    in_features = (layer.weight.shape if layer.weight.numel() else layer.dense_shape)[1]
    x = torch.randn(rows, in_features)
    layer.quantized.linear(x)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        layer.quantized.linear(x)
        best = min(best, time.perf_counter() - t)
    name = next(n for n, m in runner.model.named_modules() if m is layer)
    return name, 2 * rows * layer.quantized.out_features * in_features / best / 1e9


def weight_bytes(runner: ModelRunner, rows: int) -> int:
    """Bytes of linear weights a step of `rows` rows reads: each layer's GGUF
    blocks where they serve that many rows, else its dense weight. Expert
    layers are left out: which experts a step reads depends on its tokens
    (moe_bench.py counts them); so is the embedding, whose lookup reads a
    step's rows only."""
    total = 0
    for module in runner.model.modules():
        quantized = getattr(module, "quantized", None)
        if isinstance(module, FusedMoE) or not hasattr(module, "pack_for_cpu_"):
            continue
        if quantized is not None and rows <= quantized.max_rows:
            total += sum(t.nbytes for t in quantized.tensors())
        elif getattr(module, "packed", None) is not None:
            out_features, in_features = module.weight.shape if module.weight.numel() else module.dense_shape
            total += out_features * in_features * module.packed.element_size()
        elif hasattr(module, "pack_for_cpu_"):
            total += module.weight.nbytes
    return total


def prefill(shard: Shard, batch: int, prompt_len: int, steps: int, max_prefill: int) -> shard_pb2.StepRequest:
    """Prefills `batch` requests of `prompt_len` random tokens, with cache
    blocks for `steps` decode steps after one untimed one; returns the
    decode step request."""
    runner = shard.runner
    shard.clear()
    blocks_each = -(-(prompt_len + steps + 1) // runner.block_size)
    runner.allocate_kv_cache(blocks_each * batch)
    g = torch.Generator().manual_seed(batch)
    ids = list(range(batch))
    pending = {
        i: shard_pb2.NewRequest(
            id=i, token_ids=torch.randint(3, runner.vocab_size, (prompt_len,), generator=g).tolist(),
            num_prompt_tokens=prompt_len, num_new_tokens=prompt_len,
            block_ids=range(i * blocks_each, (i + 1) * blocks_each), params=shard_pb2.SamplingParams(),
        )
        for i in ids
    }
    # Prefill, whole prompts, as many per step as the budget allows.
    while pending:
        step, budget = shard_pb2.StepRequest(), max_prefill
        for i in list(pending):
            if budget < prompt_len and step.new_requests:
                break
            step.new_requests.append(pending.pop(i))
            budget -= prompt_len
        shard.step(step)
    decode = shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=i, num_new_tokens=1) for i in ids])
    shard.step(decode)  # one untimed decode step
    return decode


def run(shard: Shard, batch: int, prompt_len: int, steps: int, max_prefill: int) -> dict[str, float]:
    decode = prefill(shard, batch, prompt_len, steps, max_prefill)
    times, fwd, prep, samp = [], [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        r = shard.step(decode)
        times.append(time.perf_counter() - t)
        fwd.append(r.timings.forward_ms)
        prep.append(r.timings.prepare_ms)
        samp.append(r.timings.sampling_ms)
        assert len(r.generations) == batch and not r.errors
    step_ms = statistics.median(times) * 1e3
    return {
        "step_ms": step_ms,
        "tokens_per_s": batch / (step_ms / 1e3),
        "prepare_ms": statistics.median(prep),
        "forward_ms": statistics.median(fwd),
        "sampling_ms": statistics.median(samp),
    }


def set_block_rows(runner: ModelRunner, rows: int) -> None:
    """Matmuls (and C++ decode steps) of at most `rows` rows run on the GGUF
    blocks from now on, larger ones on the dense weights: the shard's
    --cpu-block-rows without reloading the model."""
    for module in runner.model.modules():
        if getattr(module, "quantized", None) is not None:
            module.quantized.max_rows = rows
    if runner.cpu_decoder is not None:
        runner.cpu_decoder.max_rows = rows


def compare_block_rows(shard: Shard, batch: int, prompt_len: int, steps: int, max_prefill: int,
                       limits: list[int]) -> dict[int, float]:
    """Median decode step ms of `batch` sequences under each block-row limit,
    the limits taking turns step by step (one untimed step after each
    switch), so a host whose speed drifts during the run slows them alike."""
    decode = prefill(shard, batch, prompt_len, 2 * steps * len(limits), max_prefill)
    times: dict[int, list[float]] = {n: [] for n in limits}
    for _ in range(steps):
        for n in limits:
            set_block_rows(shard.runner, n)
            shard.step(decode)
            t = time.perf_counter()
            shard.step(decode)
            times[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def print_block_rows(shard: Shard, path: str, args) -> None:
    runner = shard.runner
    if not runner.cpu_matmuls or runner.cpu_matmuls.block_rows <= 0:
        print(f"{path:<9} runs no GGUF blocks; nothing to compare")
        return
    limits = [int(x) for x in args.block_rows.split(",")]
    for b in (int(x) for x in args.batch_sizes.split(",")):
        r = compare_block_rows(shard, b, args.prompt_len, args.steps, args.max_prefill, limits)
        print(f"{path:<9} {b:>5} " + "  ".join(f"blocks <= {n} rows: {ms:.1f} ms" for n, ms in r.items()), flush=True)


def print_rows(shard: Shard, path: str, args, per_token: float, dense: dict, bandwidth: float) -> None:
    runner = shard.runner
    big = runner.cpu_matmuls.dense_dtype if runner.cpu_matmuls and runner.cpu_matmuls.dense_dtype else runner.dtype
    for b in (int(x) for x in args.batch_sizes.split(",")):
        r = run(shard, b, args.prompt_len, args.steps, args.max_prefill)
        rate = per_token * b / (r["step_ms"] / 1e3) / 1e9
        rows_dtype = runner.dtype if (runner.cpu_matmuls and b <= runner.cpu_matmuls.block_rows) else big
        reference = dense[torch.bfloat16 if rows_dtype == torch.bfloat16 else torch.float32]
        gbs = weight_bytes(runner, b) / (r["step_ms"] / 1e3) / 1e9
        print(f"{path:<9} {b:>5} {r['step_ms']:>8.1f} {r['tokens_per_s']:>7.1f} {r['prepare_ms']:>7.2f} "
              f"{r['forward_ms']:>7.1f} {r['sampling_ms']:>7.2f} {rate:>8.1f} {rate / reference:>7.0%} "
              f"{gbs:>6.1f} {gbs / bandwidth:>5.0%}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id/folder/.gguf (default: bundled SmolLM2)")
    parser.add_argument("--paths", default="auto,float32,bfloat16", help="--dtype values to measure")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--max-prefill", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-rows", type=int, default=512,
                        help="rows of the prefill-sized block matmul timed after each path's steps")
    parser.add_argument("--block-rows", default=None,
                        help="e.g. 16,64: instead of the table, each path's step time with GGUF blocks for at "
                             "most that many rows (dense above), the limits alternating step by step")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    folder = resolve(args.model)
    bandwidth = memory_bandwidth()
    dense = {dtype: dense_matmul_rate(dtype) for dtype in (torch.float32, torch.bfloat16)}
    print(f"model {folder.name}, {torch.get_num_threads()} threads, prompt {args.prompt_len} tokens, "
          f"{args.steps} timed decode steps")
    peak = int8_dot_peak()
    print(f"host limits: memory bandwidth {bandwidth:.1f} GB/s (copy); dense matmul "
          f"float32 {dense[torch.float32]:.0f} GFLOP/s, bfloat16 {dense[torch.bfloat16]:.0f} GFLOP/s; "
          f"int8 dot products {peak:.0f} GOP/s")
    if not args.block_rows:
        header = (f"{'path':<9} {'batch':>5} {'step ms':>8} {'tok/s':>7} {'prep ms':>7} {'fwd ms':>7} {'samp ms':>7}"
                  f" {'GFLOP/s':>8} {'of dense':>8} {'GB/s':>6} {'of bw':>6}")
        print(header)
        print("-" * len(header))
    for path in args.paths.split(","):
        runner = ModelRunner(folder, dtype=path, device="cpu")
        shard = Shard(runner, urls=[])
        gc.collect()
        gc.freeze()  # as the server does after loading
        per_token = flops_per_token(runner.model.config)
        if args.block_rows:
            print_block_rows(shard, path, args)
        else:
            print_rows(shard, path, args, per_token, dense, bandwidth)
        rate = block_matmul_rate(runner, args.prefill_rows) if peak else None
        if rate is not None:
            print(f"{path}: {rate[0]} on {args.prefill_rows} rows (a prefill's matmul): {rate[1]:.0f} GOP/s, "
                  f"{rate[1] / peak:.0%} of the int8 dot-product rate")
        del shard, runner
        gc.unfreeze()
        gc.collect()
    print(f"a decode step does {per_token * 1e-6:.0f} MFLOP of matmul per token; 'of dense' compares with the "
          "rate of the dtype the step's matmuls ran in (int8 steps against float32)")


if __name__ == "__main__":
    main()

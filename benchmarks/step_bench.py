"""Decode step time and tokens/s of the shard, in-process (no gRPC).

For each batch size B: B requests with a `--prompt-len` prompt are prefilled
(in chunks of at most `--max-prefill` tokens), then `--steps` decode steps run
through `Shard.step` (batch building, forward, greedy sampling) and are timed.

Each row also gives the step's matrix-multiply rate (the model's linear-layer
FLOPs per token x B / step time) as a share of the machine's dense matmul rate
in the same dtype, measured in the same run (2048^3 products, before and after).

    python benchmarks/step_bench.py                     # bundled SmolLM2, CPU
    python benchmarks/step_bench.py --model DIR --batch-sizes 1,16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

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


def run(shard: Shard, batch: int, prompt_len: int, steps: int, max_prefill: int) -> dict[str, float]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id/folder/.gguf (default: bundled SmolLM2)")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--max-prefill", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    folder = resolve(args.model)
    runner = ModelRunner(folder, dtype=args.dtype, device="cpu")
    shard = Shard(runner, urls=[])
    print(f"model {folder.name}  dtype {runner.dtype}  threads {torch.get_num_threads()}  "
          f"prompt {args.prompt_len} tokens  {args.steps} timed decode steps")
    header = f"{'batch':>5} {'step ms':>9} {'tokens/s':>9} {'prepare ms':>10} {'forward ms':>10} {'sampling ms':>11}"
    header += f" {'GFLOP/s':>8} {'of dense':>8}"
    per_token = flops_per_token(runner.model.config)
    dense = dense_matmul_rate(runner.dtype)
    print(header)
    print("-" * len(header))
    for b in (int(x) for x in args.batch_sizes.split(",")):
        r = run(shard, b, args.prompt_len, args.steps, args.max_prefill)
        rate = per_token * b / (r["step_ms"] / 1e3) / 1e9
        print(f"{b:>5} {r['step_ms']:>9.1f} {r['tokens_per_s']:>9.1f} {r['prepare_ms']:>10.2f} "
              f"{r['forward_ms']:>10.1f} {r['sampling_ms']:>11.2f} {rate:>8.1f} {rate / dense:>7.0%}", flush=True)
    dense_after = dense_matmul_rate(runner.dtype)
    print(f"dense {runner.dtype} matmul (2048^3, torch, {torch.get_num_threads()} threads): "
          f"{dense:.1f} GFLOP/s before the steps, {dense_after:.1f} after; "
          f"a decode step does {per_token * 1e-6:.0f} MFLOP of matmul per token")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Multi-LoRA throughput: the base model alone vs batches mixing 1, 4 and 16
adapters (issue 37).

The script makes 16 rank-R adapters of every target module (q/k/v/o,
gate/up/down) with peft over the served model (random A and B, so the
grouped matmul does real work), starts one Sluice server with all of them
resident (`--max-loras 16`, so no run waits on a load), and at each
concurrency runs a random workload of the same shape with each request's
`model` taken in turn from: the base model only, 1 adapter, 4 adapters, 16
adapters. It reports output tokens/s per run and each mixed run's loss
against the base run at the same concurrency; the goal is a loss of at most
15% with 4 adapters. Every run sends prompts of its own (the same lengths,
words drawn with a seed of its own), and its warm-up batch others again:
with one set of prompts for every run, the prefix cache would hand a later
run the KV an earlier one computed for the same prompt and adapter (the base
run of a round, or the adapters a smaller mix shares with a larger one), so
runs would differ in how much they prefill, not in their LoRA work. With
`--rounds N` (default 3) every concurrency runs its adapter counts N times,
interleaved (base, 1, 4, 16, base, 1, ...), and the table reads the median
of each: a busy neighbour on a shared host then slows some runs of every
kind, not all runs of one.

    python benchmarks/lora_bench.py                        # the bundled model, c=8 and c=32
    python benchmarks/lora_bench.py --num-prompts 4 --output-len 8 --concurrency 2 --adapters 0 4 --rounds 1   # smoke run
    python benchmarks/lora_bench.py --launcher-arg=--lora-dtype=float32   # the float32 stacks
    python benchmarks/lora_bench.py --launcher-arg=--dtype=bfloat16 --rank 16

Measure on a quiet machine and name the host (lscpu or nvidia-smi) with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sluice_bench.launch import default_launcher, launched
from sluice_bench.report import versions

GOAL_LOSS_AT_4 = 0.15
WORDS = ("river stone garden lamp window quiet harbor letter paper morning bread silver market winter candle "
         "forest bridge music orange cloud").split()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launcher", default=default_launcher(), help="launcher executable")
    p.add_argument("--launcher-arg", action="append", default=[], help="extra launcher argument")
    p.add_argument("--model", help="model folder to serve and adapt (default: the bundled model)")
    p.add_argument("--port", type=int, help="port for the launched server (default: a free one)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--rank", type=int, default=16, help="rank of every adapter")
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16],
                   help="adapters mixed in a run's batch (0: the base model alone)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    p.add_argument("--input-words", type=int, default=128, help="words per prompt")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs of each adapter count (median reported)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--out", help="write the runs as JSON here")
    return p.parse_args(argv)


def model_folder(args) -> Path:
    from sluice_server.download import bundled_model_path, resolve_model

    return resolve_model(args.model or str(bundled_model_path()))


def make_adapters(base: Path, root: Path, count: int, rank: int) -> dict[str, Path]:
    from sluice_server.testing import make_lora_adapter

    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {f"bench{i}": make_lora_adapter(base, root / f"bench{i}", 100 + i, r=rank, alpha=2.0 * rank,
                                           target_modules=modules, b_std=0.02)
            for i in range(count)}


@contextlib.contextmanager
def server(args, base: Path, adapters: dict[str, Path]):
    flags = ["--model-id", str(base), "--max-loras", str(max(1, len(adapters))), "--max-lora-rank", str(args.rank),
             "--max-concurrent-requests", str(max(args.concurrency) * 2), *args.launcher_arg]
    if adapters:
        flags += ["--lora-adapters", *(f"{name}={path}" for name, path in adapters.items())]
    with launched(args.launcher, flags, args.ready_timeout, port=args.port, shown=12) as url:
        yield url


def prompts(args, *run: int) -> list[str]:
    """The prompts of the run named by `run` (concurrency, round, adapters):
    --num-prompts of --input-words random words, drawn with a seed of that
    run's own, so that no two runs share a prompt (module docstring)."""
    rng = random.Random(repr((args.seed, *run)))
    return [" ".join(rng.choice(WORDS) for _ in range(args.input_words)) for _ in range(args.num_prompts)]


async def run(args, url: str, models: list[str], texts: list[str], warm_texts: list[str], concurrency: int) -> dict:
    """The prompts through /v1/completions, `concurrency` in flight, request
    i naming models[i % len(models)]; output tokens/s over the whole run,
    after a short warm-up batch on other prompts (`warm_texts`)."""
    queue = list(enumerate(texts))
    tokens, failed = [], []

    async def worker(client: httpx.AsyncClient):
        while queue:
            i, text = queue.pop(0)
            body = {"model": models[i % len(models)], "prompt": text, "max_tokens": args.output_len,
                    "temperature": 0, "ignore_eos": True}
            resp = await client.post("/v1/completions", json=body)
            if resp.status_code == 200:
                tokens.append(resp.json()["usage"]["completion_tokens"])
            else:
                failed.append(f"{resp.status_code} {resp.text[:200]}")

    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as client:
        # A short batch of the same shape first: no run pays for a first use.
        warm = [client.post("/v1/completions", json={"model": models[i % len(models)], "prompt": warm_texts[i % len(warm_texts)],
                                                     "max_tokens": 8, "ignore_eos": True})
                for i in range(max(concurrency, len(models)))]
        for resp in await asyncio.gather(*warm):
            resp.raise_for_status()
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return {"concurrency": concurrency, "completed": len(tokens), "failed": len(failed), "errors": failed[:3], "seconds": seconds,
            "output_tokens_per_s": sum(tokens) / seconds}


def medians(runs: list[dict]) -> list[dict]:
    """One row per (concurrency, adapters), in first-run order: the median
    output tok/s of its rounds, with every round's figure."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["concurrency"], r["adapters"]), []).append(r)
    return [{"concurrency": c, "adapters": n, "rounds": [r["output_tokens_per_s"] for r in group],
             "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in group)}
            for (c, n), group in groups.items()]


def table(rows: list[dict]) -> str:
    lines = [f"{'c':>4}{'adapters':>10}{'tok/s':>10}{'vs base':>9}  rounds"]
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["adapters"] == 0}
    for r in rows:
        ref = base.get(r["concurrency"])
        loss = f"{r['output_tokens_per_s'] / ref - 1:+.1%}" if ref and r["adapters"] else "-"
        rounds = " ".join(f"{v:.1f}" for v in r.get("rounds", []))
        lines.append(f"{r['concurrency']:>4}{r['adapters'] or 'base':>10}{r['output_tokens_per_s']:>10.1f}{loss:>9}  {rounds}")
    at4 = [r["output_tokens_per_s"] / base[r["concurrency"]] for r in rows if r["adapters"] == 4 and base.get(r["concurrency"])]
    if at4:
        worst = 1 - min(at4)
        lines.append(f"loss at 4 adapters: {worst:.1%} (goal <= {GOAL_LOSS_AT_4:.0%}: "
                     f"{'met' if worst <= GOAL_LOSS_AT_4 else 'NOT met'})")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    base = model_folder(args)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
            adapters = make_adapters(base, Path(tmp), max(args.adapters), args.rank)
            with server(args, base, adapters) as url:
                served = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
                for c in args.concurrency:
                    for round_ in range(args.rounds):
                        for n in args.adapters:
                            models = list(adapters)[:n] or [served]
                            texts, warm = prompts(args, c, round_, n), prompts(args, c, round_, n, -1)
                            row = {"adapters": n, "round": round_, **asyncio.run(run(args, url, models, texts, warm, c))}
                            print(f"c={c} adapters={n} round {round_ + 1}/{args.rounds}: "
                                  f"{row['output_tokens_per_s']:.1f} tok/s, {row['completed']} done, "
                                  f"{row['failed']} failed", flush=True)
                            rows.append(row)
    except (RuntimeError, ValueError, FileNotFoundError, httpx.HTTPError) as e:
        print(f"lora_bench.py: error: {e}", file=sys.stderr)
        return 2
    print(table(medians(rows)))
    if args.out:
        doc = {"benchmark": "lora", "versions": versions(), "args": vars(args), "runs": rows,
               "medians": medians(rows)}
        Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(r["completed"] and not r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What a running Batch API job costs interactive traffic (issue 38).

Interactive load: 4 concurrent streaming /v1/completions requests (random
prompts, fixed output length, sluice-bench's client). The script measures:

1. interactive alone: TTFT and TPOT p50/p99, output tokens/s (I1);
2. a 2,000-line batch alone, for --window seconds: batch output tokens/s,
   from /metrics (C: what the server can do with nothing else running);
3. the same interactive load while the batch runs: TTFT/TPOT p50/p99 (I2),
   and the batch's output tokens/s meanwhile (B2).

It prints both runs side by side, the p99 TPOT ratio (goal: within 10%),
and the batch's share of the capacity the interactive load left,
B2 / (C - I2) (goal: at least 70%). The batch is cancelled at the end.

    python benchmarks/batch_interference.py                 # starts sluice-launcher (bundled model)
    python benchmarks/batch_interference.py --url http://localhost:8080
    python benchmarks/batch_interference.py --launcher-arg=--model-id=/tiny --lines 40 --requests 8 --window 5

Numbers depend on the host: give its CPU (lscpu) or GPU with any figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sluice_bench import BenchConfig, WorkloadSpec, run_benchmark_sync
from sluice_bench.launch import default_launcher, launched

GOAL_TPOT_RATIO = 1.10
GOAL_SHARE = 0.70
TERMINAL = ("completed", "failed", "expired", "cancelled")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running server (skips launching)")
    p.add_argument("--launcher", default=default_launcher())
    p.add_argument("--launcher-arg", action="append", default=[], help="extra launcher argument (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--concurrency", type=int, default=4, help="interactive requests in flight")
    p.add_argument("--requests", type=int, default=64, help="interactive requests per run")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--lines", type=int, default=2000, help="request lines of the batch")
    p.add_argument("--line-output-len", type=int, default=64)
    p.add_argument("--window", type=float, default=30.0, help="seconds the batch runs alone (step 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


@contextlib.contextmanager
def server(args):
    if args.url:
        yield args.url.rstrip("/")
        return
    with tempfile.TemporaryDirectory(prefix="sluice-batch-bench-") as data_dir:
        with launched(args.launcher, ["--data-dir", data_dir, *args.launcher_arg], args.ready_timeout) as url:
            yield url


def batch_tokens(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sluice_batch_api_generated_tokens_total "):
            return float(line.split()[1])
    raise RuntimeError("the server does not report sluice_batch_api_generated_tokens_total")


def interactive(args, url: str, label: str) -> dict:
    spec = WorkloadSpec(kind="random", num_prompts=args.requests, input_len=args.input_len, output_len=args.output_len)
    cfg = BenchConfig(base_url=url, spec=spec, concurrency=args.concurrency, seed=args.seed, warmup=2,
                      progress=False, label=label)
    started = time.monotonic()
    result = run_benchmark_sync(cfg)
    s = result.summary
    return {
        "label": label,
        "seconds": time.monotonic() - started,
        "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_p50_ms": s["tpot_ms"]["median"], "tpot_p99_ms": s["tpot_ms"]["p99"],
        "output_tokens_per_s": s["output_throughput"],
        "completed": s.get("completed"), "failed": s.get("failed"),
    }


def start_batch(args, url: str) -> str:
    lines = "".join(
        json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": f"Summarise item {i} of the catalogue in plain words:",
                             "max_tokens": args.line_output_len, "temperature": 0, "ignore_eos": True}}) + "\n"
        for i in range(args.lines))
    uploaded = httpx.post(f"{url}/v1/files", data={"purpose": "batch"},
                          files={"file": ("interference.jsonl", lines.encode())}, timeout=120)
    uploaded.raise_for_status()
    batch = httpx.post(f"{url}/v1/batches", timeout=120, json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    batch.raise_for_status()
    batch_id = batch.json()["id"]
    deadline = time.monotonic() + 120
    while batch_tokens(url) == 0 or httpx.get(f"{url}/v1/batches/{batch_id}").json()["status"] == "validating":
        if time.monotonic() > deadline:
            raise RuntimeError("the batch did not start within 120 s")
        time.sleep(0.2)
    return batch_id


def batch_rate(url: str, seconds: float) -> float:
    before, started = batch_tokens(url), time.monotonic()
    time.sleep(seconds)
    return (batch_tokens(url) - before) / (time.monotonic() - started)


def main(argv=None) -> int:
    args = parse_args(argv)
    with server(args) as url:
        alone = interactive(args, url, "interactive alone")
        batch_id = start_batch(args, url)
        capacity = batch_rate(url, args.window)
        before, started = batch_tokens(url), time.monotonic()
        shared = interactive(args, url, "with the batch")
        batch_during = (batch_tokens(url) - before) / (time.monotonic() - started)
        state = httpx.get(f"{url}/v1/batches/{batch_id}").json()
        if state["status"] not in TERMINAL:
            httpx.post(f"{url}/v1/batches/{batch_id}/cancel")
        if state["status"] in TERMINAL:
            print(f"warning: the batch ended ({state['status']}) before the measurement did: "
                  "give more --lines for a fair share", file=sys.stderr)
        info = httpx.get(f"{url}/info").json()
    left = capacity - shared["output_tokens_per_s"]
    share = batch_during / left if left > 0 else float("nan")
    tpot_ratio = shared["tpot_p99_ms"] / alone["tpot_p99_ms"] if alone["tpot_p99_ms"] else float("nan")
    print(f"\n{'run':<18} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'tok/s':>8}  (ms)")
    for row in (alone, shared):
        print(f"{row['label']:<18} {row['ttft_p50_ms']:>9.1f} {row['ttft_p99_ms']:>9.1f} "
              f"{row['tpot_p50_ms']:>9.1f} {row['tpot_p99_ms']:>9.1f} {row['output_tokens_per_s']:>8.1f}")
    print(f"batch alone: {capacity:.1f} output tok/s; during the interactive run: {batch_during:.1f} tok/s")
    print(f"interactive p99 TPOT with / without the batch: {tpot_ratio:.3f} (goal <= {GOAL_TPOT_RATIO})")
    print(f"batch share of the capacity left by interactive traffic: {share:.1%} (goal >= {GOAL_SHARE:.0%})")
    print(f"server: model {info.get('model_id')}, device {info.get('model_device_type')}, "
          f"batch_min_share {info.get('batch_min_share')}, batch_step_slack {info.get('batch_step_slack')}")
    if args.out:
        doc = {"benchmark": "batch_interference", "args": vars(args), "info": info, "alone": alone, "shared": shared,
               "batch_alone_tokens_per_s": capacity, "batch_during_tokens_per_s": batch_during,
               "tpot_p99_ratio": tpot_ratio, "batch_share_of_left_capacity": share}
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if not alone["failed"] and not shared["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())

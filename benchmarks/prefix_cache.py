#!/usr/bin/env python3
"""Prefix caching on vs off, on the same shared-prefix traffic (issue 5).

32 requests share one 1,024-token system prompt, each with its own 32-token
question, 64 output tokens, 8 in flight. The script starts Sluice with prefix
caching on, runs the workload, stops it, starts it again with
--no-prefix-caching and runs the identical workload (same seed: same prompts,
same order). It reports output tokens/s and median/p99 time to first token for
both, and the ratios the issue sets as goals (>= 2x throughput, >= 4x lower
median TTFT with caching on).

    python benchmarks/prefix_cache.py                      # starts sluice-launcher itself
    python benchmarks/prefix_cache.py --launcher-arg=--max-batch-prefill-tokens=512
    python benchmarks/prefix_cache.py --on-url http://localhost:8080 --off-url http://localhost:8081

Each server starts cold; the two warm-up requests use a different system prompt,
so they warm the engine without putting the measured prefix in the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from sluice_bench import BenchConfig, RunResult, WorkloadSpec, run_benchmark_sync
from sluice_bench.launch import default_launcher, launched
from sluice_bench.report import result_table, versions

GOAL_THROUGHPUT = 2.0
GOAL_TTFT = 4.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launcher", default=default_launcher(),
                   help="launcher executable (default: $SLUICE_LAUNCHER_BIN, the one beside this Python, or PATH's)")
    p.add_argument("--launcher-arg", action="append", default=[], help="extra launcher argument (repeatable)")
    p.add_argument("--port", type=int, help="port for the launched server (default: a free one)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for GET /ready")
    p.add_argument("--on-url", help="an already running server with prefix caching on (skips launching)")
    p.add_argument("--off-url", help="an already running server with prefix caching off")
    p.add_argument("--tokenizer", help="tokenizer.json or folder (default: the server's /tokenize)")
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--out", help="write both runs as JSON here")
    args = p.parse_args(argv)
    if bool(args.on_url) != bool(args.off_url):
        p.error("give both --on-url and --off-url, or neither")
    return args


@contextlib.contextmanager
def server(args, prefix_caching: bool):
    """A Sluice server for the duration of the block; its base URL."""
    flags = [*args.launcher_arg] + ([] if prefix_caching else ["--no-prefix-caching"])
    with launched(args.launcher, flags, args.ready_timeout, port=args.port) as url:
        yield url


def bench(args, url: str, label: str) -> RunResult:
    spec = WorkloadSpec(kind="shared-prefix", num_groups=1, prompts_per_group=args.num_prompts,
                        system_prompt_len=args.system_prompt_len, question_len=args.question_len,
                        output_len=args.output_len)
    cfg = BenchConfig(base_url=url, spec=spec, concurrency=args.concurrency, seed=args.seed, warmup=args.warmup,
                      tokenizer=args.tokenizer, timeout=args.timeout, label=label)
    result = run_benchmark_sync(cfg)
    print(result_table(result), flush=True)
    return result


def verdict(on: RunResult, off: RunResult) -> str:
    son, soff = on.summary, off.summary
    rows = [("output tokens/s", son["output_throughput"], soff["output_throughput"]),
            ("median TTFT (ms)", son["ttft_ms"]["median"], soff["ttft_ms"]["median"]),
            ("p99 TTFT (ms)", son["ttft_ms"]["p99"], soff["ttft_ms"]["p99"]),
            ("prompt tokens from cache", son["cached_prompt_tokens"], soff["cached_prompt_tokens"]),
            ("failed requests", son["failed"], soff["failed"])]
    lines = [f"{'':<28}{'caching on':>14}{'caching off':>14}"]
    for name, a, b in rows:
        fmt = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
        lines.append(f"{name:<28}{fmt(a):>14}{fmt(b):>14}")
    if son["completed"] and soff["completed"]:
        tput = son["output_throughput"] / soff["output_throughput"]
        ttft = soff["ttft_ms"]["median"] / son["ttft_ms"]["median"]
        lines.append(f"throughput on/off: x{tput:.2f} (goal >= {GOAL_THROUGHPUT}: {'met' if tput >= GOAL_THROUGHPUT else 'NOT met'})")
        lines.append(f"median TTFT off/on: x{ttft:.2f} (goal >= {GOAL_TTFT}: {'met' if ttft >= GOAL_TTFT else 'NOT met'})")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = {}
    try:
        for label, caching, url in (("caching on", True, args.on_url), ("caching off", False, args.off_url)):
            if url:
                results[label] = bench(args, url, label)
            else:
                with server(args, caching) as launched_url:
                    results[label] = bench(args, launched_url, label)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"prefix_cache.py: error: {e}", file=sys.stderr)
        return 2
    on, off = results["caching on"], results["caching off"]
    print(verdict(on, off))
    if args.out:
        doc = {"benchmark": "prefix_cache", "versions": versions(), "args": vars(args),
               "runs": [on.to_json(), off.to_json()]}
        Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0 if on.summary["completed"] and off.summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Speculative decoding on vs off, on the same traffic (issue 19).

Two workloads, each run against a server with `--speculate ngram` and one
without, in the same invocation:

- grounded: the shipped passage (speculative_passage.txt, ~430 tokens) and
  the instruction to repeat it with one change, as a chat request, greedy,
  at concurrency 1 and 8. Output that copies its input is where n-gram
  proposals are accepted. Goals: >= 1.6x output tok/s at c=1, >= 1.3x at c=8.
- random: the benchmark's random workload at concurrency 1, 8 and 32, where
  proposals rarely match. Goal: >= 0.95x (speculation backs off).

For each run: output tokens/s, and from the speculating server's /metrics
the acceptance rate (accepted / proposed draft tokens) and the mean tokens
emitted per step that carried a draft (accepted + 1).

    python benchmarks/speculative.py                         # starts sluice-launcher twice
    python benchmarks/speculative.py --num-prompts 2 --concurrency 1 --random-concurrency 1   # smoke run
    python benchmarks/speculative.py --on-url http://localhost:8080 --off-url http://localhost:8081

Measure on a quiet machine and name the host (lscpu) with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path

import httpx

from sluice_bench import BenchConfig, RunResult, WorkloadSpec, run_benchmark_sync
from sluice_bench.launch import default_launcher, launched
from sluice_bench.report import versions
from sluice_bench.workloads import Plan, Session, Turn

PASSAGE = Path(__file__).resolve().parent / "speculative_passage.txt"
INSTRUCTION = (
    "Repeat the following text exactly, word for word, with one change: the town is called Mirre "
    "instead of Vell. Output only the text.\n\n"
)
GOALS = {("grounded", 1): 1.6, ("grounded", 8): 1.3}
RANDOM_GOAL = 0.95


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launcher", default=default_launcher(), help="launcher executable")
    p.add_argument("--launcher-arg", action="append", default=[], help="extra launcher argument for both servers")
    p.add_argument("--speculate-arg", action="append", default=[],
                   help="extra launcher argument for the speculating server (e.g. --speculate-tokens=6)")
    p.add_argument("--port", type=int, help="port for the launched servers (default: a free one)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--on-url", help="an already running server with --speculate ngram (skips launching)")
    p.add_argument("--off-url", help="an already running server without speculation")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per run")
    p.add_argument("--concurrency", type=int, action="append", help="grounded concurrencies (default 1 and 8)")
    p.add_argument("--random-concurrency", type=int, action="append", help="random concurrencies (default 1, 8, 32)")
    p.add_argument("--grounded-output-len", type=int, default=512)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--out", help="write every run as JSON here")
    args = p.parse_args(argv)
    if bool(args.on_url) != bool(args.off_url):
        p.error("give both --on-url and --off-url, or neither")
    args.concurrency = args.concurrency or [1, 8]
    args.random_concurrency = args.random_concurrency or [1, 8, 32]
    return args


@contextlib.contextmanager
def started(args, speculate: bool):
    flags = [*args.launcher_arg] + (["--speculate", "ngram", *args.speculate_arg] if speculate else [])
    with launched(args.launcher, flags, args.ready_timeout, port=args.port) as url:
        yield url


def grounded_plan(num_prompts: int, output_len: int, seed: int) -> Plan:
    """The same passage-copying chat request, num_prompts times."""
    user = INSTRUCTION + PASSAGE.read_text().strip()
    spec = WorkloadSpec(kind="random", num_prompts=num_prompts, input_len=1, output_len=output_len)
    plan = Plan(spec=spec, seed=seed, tokenizer="(server)")
    for i in range(num_prompts):
        turn = Turn(prompt=user, system=None, user=user, max_tokens=output_len, expected_prompt_tokens=None)
        plan.sessions.append(Session(i, [turn]))
    return plan


SPEC_COUNTERS = {
    "proposed": "sluice_speculative_proposed_tokens_total",
    "accepted": "sluice_speculative_accepted_tokens_total",
    "draft_steps": "sluice_speculative_emitted_tokens_count",
    "emitted": "sluice_speculative_emitted_tokens_sum",
}


def speculation_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10.0).text
    values = {}
    for key, name in SPEC_COUNTERS.items():
        m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        values[key] = float(m.group(1)) if m else 0.0
    return values


def run(args, url: str, label: str, workload: str, concurrency: int) -> dict:
    before = speculation_counters(url)
    if workload == "grounded":
        cfg = BenchConfig(base_url=url, concurrency=concurrency, seed=args.seed, endpoint="chat",
                          timeout=args.timeout, label=label, ignore_eos=False, progress=False)
        result: RunResult = run_benchmark_sync(cfg, grounded_plan(args.num_prompts, args.grounded_output_len, args.seed))
    else:
        spec = WorkloadSpec(kind="random", num_prompts=args.num_prompts, input_len=args.random_input_len,
                            output_len=args.random_output_len)
        cfg = BenchConfig(base_url=url, spec=spec, concurrency=concurrency, seed=args.seed,
                          timeout=args.timeout, label=label, progress=False)
        result = run_benchmark_sync(cfg)
    after = speculation_counters(url)
    delta = {k: after[k] - before[k] for k in after}
    s = result.summary
    return {
        "label": label,
        "workload": workload,
        "concurrency": concurrency,
        "completed": s["completed"],
        "failed": s["failed"],
        "output_tokens_per_s": s["output_throughput"],
        "acceptance_rate": delta["accepted"] / delta["proposed"] if delta["proposed"] else None,
        "mean_emitted_per_draft_step": delta["emitted"] / delta["draft_steps"] if delta["draft_steps"] else None,
        "speculation": delta,
        "result": result.to_json(),
    }


def table(rows: list[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"{'workload':<10}{'c':>4}{'off tok/s':>12}{'on tok/s':>12}{'on/off':>8}{'goal':>7}"
             f"{'accept':>8}{'tok/step':>9}"]
    by = {(r["workload"], r["concurrency"], r["label"]): r for r in rows}
    for (workload, c, label), on in by.items():
        if label != "on":
            continue
        off = by[(workload, c, "off")]
        ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"] if off["output_tokens_per_s"] else None
        goal = GOALS.get((workload, c), RANDOM_GOAL if workload == "random" else None)
        lines.append(f"{workload:<10}{c:>4}{fmt(off['output_tokens_per_s'], '12.1f')}{fmt(on['output_tokens_per_s'], '12.1f')}"
                     f"{fmt(ratio, '8.2f')}{fmt(goal, '7.2f')}{fmt(on['acceptance_rate'], '8.2f')}"
                     f"{fmt(on['mean_emitted_per_draft_step'], '9.2f')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = [("grounded", c) for c in args.concurrency] + [("random", c) for c in args.random_concurrency]
    rows: list[dict] = []
    try:
        for label, speculate, url in (("on", True, args.on_url), ("off", False, args.off_url)):
            server = contextlib.nullcontext(url) if url else started(args, speculate)
            with server as base:
                for workload, c in runs:
                    row = run(args, base, label, workload, c)
                    print(f"{label:>3} {workload} c={c}: {row['output_tokens_per_s']:.1f} tok/s, "
                          f"{row['completed']} done, {row['failed']} failed", flush=True)
                    rows.append(row)
    except (RuntimeError, ValueError, FileNotFoundError, httpx.HTTPError) as e:
        print(f"speculative.py: error: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.out:
        doc = {"benchmark": "speculative", "versions": versions(), "args": vars(args), "runs": rows}
        Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(r["completed"] and not r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`sluice-bench`: the command line.

    sluice-bench --base-url http://localhost:8080 --workload random \\
        --input-len 256 --output-len 128 --num-prompts 64 --concurrency 1,8,32 \\
        --out results.json --plot charts/

    sluice-bench --compare http://localhost:8080 http://localhost:8081 \\
        --labels sluice llama.cpp --workload shared-prefix --concurrency 8

With --compare the plan (prompts, order, arrival times) is built once, with the
first server's tokenizer or --tokenizer, and sent unchanged to every server.
Each level of a --concurrency sweep has its own prompts, so a prefix cache
cannot serve a level from the one before it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys

from .metrics import RequestRecord, parse_goodput, summarize
from .plot import PlotUnavailable, check_plotting, plot_results
from .report import compare_table, result_table, write_json
from .runner import (
    ENDPOINTS,
    BenchConfig,
    RunResult,
    auth_headers,
    discover_model,
    make_client,
    prepare,
    root_url,
    run_plan,
    server_info,
)
from .workloads import KINDS, WorkloadSpec


SWEEP_SEED_STRIDE = 7919


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sluice-bench",
        description="Benchmark any OpenAI-compatible server: TTFT, TPOT, ITL, E2E latency, throughput, goodput, cost.",
    )
    g = p.add_argument_group("servers")
    g.add_argument("--base-url", default="http://localhost:8080", help="server root (a trailing /v1 is accepted)")
    g.add_argument("--compare", nargs="+", metavar="URL", help="run the same workload against each URL in turn")
    g.add_argument("--labels", nargs="+", help="names for the --compare URLs, in order")
    g.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--endpoint", choices=ENDPOINTS, default="completions", help="/v1/completions or /v1/chat/completions")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--tokenizer", help="tokenizer.json or model folder (default: the server's POST /tokenize)")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=list(KINDS), default="random")
    w.add_argument("--num-prompts", type=int, default=100, help="random: number of requests")
    w.add_argument("--input-len", type=int, default=256, help="random: prompt tokens; multi-turn: tokens per user turn")
    w.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    w.add_argument("--num-groups", type=int, default=1, help="shared-prefix: groups (G)")
    w.add_argument("--prompts-per-group", type=int, default=32, help="shared-prefix: prompts per group (P)")
    w.add_argument("--system-prompt-len", type=int, default=1024, help="shared-prefix: shared system prompt tokens (S)")
    w.add_argument("--question-len", type=int, default=32, help="shared-prefix: question tokens (Q)")
    w.add_argument("--num-conversations", type=int, default=8, help="multi-turn: conversations (C)")
    w.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation (T)")
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos/min_tokens (for servers that reject unknown fields)")
    w.add_argument("--temperature", type=float, default=0.0)

    l = p.add_argument_group("load")
    l.add_argument("--concurrency", default="1", help="requests in flight; a comma list runs a sweep, e.g. 1,8,32")
    l.add_argument("--request-rate", help="Poisson arrivals per second instead of fixed concurrency (comma list: sweep)")
    l.add_argument("--max-concurrency", type=int, help="with --request-rate: cap on requests in flight")
    l.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted")
    l.add_argument("--seed", type=int, default=0, help="same seed, same requests, order and arrival times")

    o = p.add_argument_group("metrics and output")
    o.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="targets, e.g. ttft:500 tpot:50 e2el:10000")
    o.add_argument("--hourly-cost", type=float, help="machine price in $/hour: report $ per million output tokens")
    o.add_argument("--out", help="write a JSON report here")
    o.add_argument("--save-requests", action="store_true", help="include per-request records in the JSON")
    o.add_argument("--plot", metavar="DIR", help="write PNG charts (needs matplotlib)")
    o.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _levels(text: str, cast, name: str) -> list:
    try:
        values = [cast(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name}: {text!r} is not a comma-separated list of numbers") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--{name}: values must be positive, got {text!r}")
    return values


def configs_from_args(args) -> tuple[list[BenchConfig], list[str], list[str]]:
    """One config per load level (for the first URL), the URLs and their labels."""
    spec = WorkloadSpec(
        kind=args.workload, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        num_groups=args.num_groups, prompts_per_group=args.prompts_per_group,
        system_prompt_len=args.system_prompt_len, question_len=args.question_len,
        num_conversations=args.num_conversations, num_turns=args.num_turns,
    )
    urls = args.compare or [args.base_url]
    for u in urls:
        root_url(u)  # validates
    labels = args.labels or urls
    if len(labels) != len(urls):
        raise ValueError(f"--labels gives {len(labels)} names for {len(urls)} URLs")
    base = BenchConfig(
        base_url=urls[0], spec=spec, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
        tokenizer=args.tokenizer, timeout=args.timeout, seed=args.seed, warmup=args.warmup,
        ignore_eos=args.ignore_eos, temperature=args.temperature, goodput_ms=parse_goodput(args.goodput),
        hourly_cost=args.hourly_cost, progress=args.progress, max_concurrency=args.max_concurrency,
    )
    if args.request_rate:
        loads = [dict(request_rate=r, concurrency=None) for r in _levels(args.request_rate, float, "request-rate")]
    else:
        loads = [dict(concurrency=c) for c in _levels(args.concurrency, int, "concurrency")]
    # Each level of a sweep gets its own prompts (seed + i * stride): a server's
    # prefix cache must not serve one level's prompts from the level before.
    configs = [dataclasses.replace(base, seed=args.seed + i * SWEEP_SEED_STRIDE, **load) for i, load in enumerate(loads)]
    for c in configs:
        c.validate()
    return configs, urls, labels


async def run_all(configs: list[BenchConfig], urls: list[str], labels: list[str], echo=print) -> list[RunResult]:
    """Every load level against every URL, one after the other. Each level's
    plan is built once, with the first server's tokenizer, so all servers get
    identical requests."""
    results: list[RunResult] = []
    plans: list[tuple] = []
    for url, label in zip(urls, labels):
        first = dataclasses.replace(configs[0], base_url=url, label=label)
        async with make_client(first) as client:
            root, headers = root_url(url), auth_headers(first.api_key)
            try:
                model = first.model or await discover_model(client, root, headers)
            except ValueError as e:
                if not plans and url == urls[0] and len(urls) == 1:
                    raise
                # One server of a comparison being down spoils only its column.
                echo(f"sluice-bench: skipping {label}: {e}")
                results.extend(_skipped(cfg, url, label, str(e)) for cfg in configs)
                continue
            if not plans:
                plans = [await prepare(dataclasses.replace(c, base_url=url), client, model) for c in configs]
            info = await server_info(client, root, headers)
            for cfg, (plan, warm) in zip(configs, plans):
                cfg = dataclasses.replace(cfg, base_url=url, label=label)
                result = await run_plan(cfg, client, model, plan, warm)
                result.server_info = info
                results.append(result)
                echo(result_table(result))
    return results


def _skipped(cfg: BenchConfig, url: str, label: str, error: str) -> RunResult:
    """The result of a server that could not be benchmarked at all: every
    request failed with `error`."""
    n = cfg.spec.num_requests()
    records = [RequestRecord(index=i, error=error) for i in range(n)]
    return RunResult(label=label, base_url=url, model=cfg.model or "?", load=cfg.load(), workload=cfg.spec.describe(),
                     summary=summarize(records, 0.0, cfg.goodput_ms, cfg.hourly_cost), records=records,
                     warmup={"requests": 0, "failed": 0})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configs, urls, labels = configs_from_args(args)
        if args.plot:
            check_plotting()  # fail before a long run, not after it
        results = asyncio.run(run_all(configs, urls, labels))
    except (ValueError, PlotUnavailable) as e:
        print(f"sluice-bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sluice-bench: interrupted", file=sys.stderr)
        return 130
    if len(urls) > 1:
        print(compare_table(results))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "api_key"}
        write_json(args.out, config, results, args.save_requests)
        print(f"wrote {args.out}")
    if args.plot:
        try:
            for path in plot_results(results, args.plot):
                print(f"wrote {path}")
        except PlotUnavailable as e:
            print(f"sluice-bench: {e}", file=sys.stderr)
            return 2
    # A run in which nothing completed is a failed benchmark, not a result.
    return 1 if any(r.summary["completed"] == 0 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What structured output costs (issue 17): the same traffic unconstrained
and with every request under a JSON schema, at concurrency 1 and 32.

Every request asks for --output-len tokens of /v1/completions:

    free   no constraint, `ignore_eos` (exactly --output-len tokens)
    json   `response_format: json_schema` with a schema the output cannot
           finish before --output-len tokens (an array of at least 1,000
           records with a string, an integer, an enum and a boolean), so
           both modes produce the same number of tokens and the mask is
           computed on realistic JSON: forced keys, numbers, enums, strings.

Reported per mode and concurrency: output tokens/s (all output tokens over
the wall time of the run) and TPOT (per request, (last token - first token) /
(tokens - 1); mean, median and p99 over requests), plus TTFT. The goal:
`free` within noise of the build without constraints, and `json` TPOT at
most 10% above `free` TPOT at concurrency 32.

    python benchmarks/structured_output.py --url http://127.0.0.1:8080
    python benchmarks/structured_output.py --launch              # starts sluice-launcher (bundled model)
    python benchmarks/structured_output.py --launch --launcher-arg=--device=cuda --out results.json

Name the host (CPU model, lscpu flags) with every figure you report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

# The launcher helpers of the prefix-cache benchmark, beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_cache import default_launcher, launched  # noqa: E402

GOAL_TPOT_OVERHEAD = 0.10

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 1000}

TOPICS = ["users of a library", "staff of a hospital", "players of a chess club", "members of a choir",
          "pilots of an airline", "guests of a hotel", "students of a school", "clients of a bank"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running Sluice server")
    p.add_argument("--launch", action="store_true", help="start sluice-launcher for the run (bundled model by default)")
    p.add_argument("--launcher", default=default_launcher())
    p.add_argument("--launcher-arg", action="append", default=[], help="extra launcher argument (repeatable)")
    p.add_argument("--port", type=int, help="port for the launched server (default: a free one)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--concurrency", type=int, action="append", help="default: 1 and 32")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests-per-client", type=int, default=4,
                   help="requests per concurrent client (at least 8 requests per run)")
    p.add_argument("--warmup", type=int, default=2, help="requests per mode before measuring")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--out", help="write every run as JSON here")
    args = p.parse_args(argv)
    if bool(args.url) == args.launch:
        p.error("give --url or --launch")
    args.concurrency = args.concurrency or [1, 32]
    return args


@dataclass
class Sample:
    tokens: int
    ttft_s: float
    tpot_s: float | None


@dataclass
class Run:
    mode: str
    concurrency: int
    requests: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    tpot_ms_mean: float
    tpot_ms_median: float
    tpot_ms_p99: float
    ttft_ms_median: float
    samples: list = field(default_factory=list, repr=False)


def body(mode: str, i: int, output_len: int) -> dict:
    topic = TOPICS[i % len(TOPICS)]
    request = {"prompt": f"A JSON list of the {topic}, request {i}:\n", "max_tokens": output_len,
               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if mode == "free":
        request["ignore_eos"] = True
    else:
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA}}
    return request


async def one(client: httpx.AsyncClient, url: str, request: dict) -> Sample:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=request) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            now = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif any(c.get("text") for c in chunk.get("choices", [])):
                first = first or now
                last = now
    if first is None:
        raise RuntimeError("no token arrived")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Sample(tokens=tokens, ttft_s=first - start, tpot_s=tpot)


async def run(url: str, mode: str, concurrency: int, count: int, output_len: int, timeout: float) -> Run:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker():
            while not queue.empty():
                i = queue.get_nowait()
                samples.append(await one(client, url, body(mode, i, output_len)))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tpots = sorted(s.tpot_s * 1e3 for s in samples if s.tpot_s is not None)
    total = sum(s.tokens for s in samples)
    return Run(
        mode=mode, concurrency=concurrency, requests=len(samples), wall_s=wall, output_tokens=total,
        output_tok_s=total / wall, tpot_ms_mean=statistics.fmean(tpots), tpot_ms_median=statistics.median(tpots),
        tpot_ms_p99=tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))],
        ttft_ms_median=statistics.median(s.ttft_s * 1e3 for s in samples), samples=[asdict(s) for s in samples],
    )


def report(runs: list[Run], info: dict) -> str:
    lines = [f"model {info.get('model_id')} on {info.get('model_device_type')} ({platform.processor() or platform.machine()})",
             "", "| mode | concurrency | requests | output tok/s | TPOT mean ms | TPOT median ms | TPOT p99 ms | TTFT median ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.mode} | {r.concurrency} | {r.requests} | {r.output_tok_s:.1f} | {r.tpot_ms_mean:.2f} | "
                     f"{r.tpot_ms_median:.2f} | {r.tpot_ms_p99:.2f} | {r.ttft_ms_median:.1f} |")
    lines.append("")
    for c in sorted({r.concurrency for r in runs}):
        by_mode = {r.mode: r for r in runs if r.concurrency == c}
        if {"free", "json"} <= by_mode.keys():
            overhead = by_mode["json"].tpot_ms_mean / by_mode["free"].tpot_ms_mean - 1
            goal = f" (goal at 32: <= {GOAL_TPOT_OVERHEAD:.0%})" if c == 32 else ""
            lines.append(f"concurrency {c}: JSON schema TPOT {overhead:+.1%} vs free{goal}; "
                         f"throughput x{by_mode['json'].output_tok_s / by_mode['free'].output_tok_s:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.launch:
        args.launcher_arg = ["--max-concurrent-requests", "128", *args.launcher_arg]
    with (launched(args, prefix_caching=True) if args.launch else contextlib.nullcontext(args.url)) as url:
        info = httpx.get(f"{url}/info", timeout=30).json()
        for mode in ("free", "json"):
            asyncio.run(run(url, mode, 1, args.warmup, args.output_len, args.timeout))
        runs = []
        for c in args.concurrency:
            count = max(8, c * args.requests_per_client)
            for mode in ("free", "json"):
                r = asyncio.run(run(url, mode, c, count, args.output_len, args.timeout))
                print(f"{mode:4} c={c:<3} {r.output_tok_s:8.1f} tok/s  TPOT {r.tpot_ms_mean:7.2f} ms", file=sys.stderr)
                runs.append(r)
    print(report(runs, info))
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "runs": [asdict(r) for r in runs]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

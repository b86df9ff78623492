#!/usr/bin/env python3
"""Soak (issue 16): a few minutes of mixed traffic at concurrency 64, then
the checks an operator cares about after a night of it.

Each of --concurrency clients loops until --duration is over, picking at
random one of:

    complete     /v1/completions, 1-32 tokens, sometimes n=2 or two prompts
    chat_stream  /v1/chat/completions streamed, read to the end
    generate     TGI /generate
    invalid      a body the server must refuse with a 4xx (bad JSON, wrong
                 types, unknown model, too long, a bad logit_bias, junk keys)
    cancel       a stream closed after its first events
    disconnect   a request whose client hangs up before the answer

Afterwards, with the traffic stopped:

    no request hung       every request ended within --request-timeout
    no 5xx                invalid input got 4xx, valid input 200 or 429
    KV blocks back        sluice_kv_blocks_used returns to its idle value
    router RSS flat       the router's resident memory at the end is within
                          --rss-slack of what it was after the first third

The script exits 1 when a check fails. It is a script, not a test: it needs
minutes, and reports numbers.

    python benchmarks/soak.py                                  # starts sluice-launcher (bundled model)
    python benchmarks/soak.py --duration 600 --out soak.json
    python benchmarks/soak.py --url http://127.0.0.1:8080 --router-pid 1234

Name the host (CPU model, lscpu flags) with every figure you report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_cache import default_launcher, launched  # noqa: E402

KINDS = ["complete", "chat_stream", "generate", "invalid", "cancel", "disconnect"]
WEIGHTS = [3, 3, 1, 2, 2, 1]
WORDS = "the sea a cat river stone light morning north window paper quiet city garden".split()

INVALID_BODIES: list[tuple[str, bytes]] = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", json.dumps({"prompt": "x", "temperature": "hot"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2**64 - 1}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "logit_bias": {"5": 1, "05": 2}}).encode()),
    ("/v1/completions", json.dumps({"prompt": ["x"] * 1000}).encode()),
    ("/v1/completions", json.dumps({f"k{i}": i for i in range(5000)}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
    ("/v1/chat/completions", json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 10_000}).encode()),
    ("/generate", json.dumps({"inputs": "x", "parameters": {"top_p": 7}}).encode()),
    ("/generate", json.dumps({"inputs": "word " * 20_000}).encode()),
]


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    hung: int = 0
    server_errors: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def status(self, kind: str, code: int, text: str, expect: tuple[int, ...]) -> None:
        self.statuses[f"{kind} {code}"] += 1
        if code >= 500:
            self.server_errors.append(f"{kind} {code}: {text[:200]}")
        elif code not in expect:
            self.unexpected.append(f"{kind} {code}: {text[:200]}")


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))


async def one_request(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random, tally: Tally,
                      request_timeout: float) -> None:
    ok = (200, 429)
    if kind == "complete":
        body: dict = {"prompt": prompt(rng), "max_tokens": rng.randint(1, 32), "temperature": 0.8, "seed": rng.randint(0, 1000)}
        if rng.random() < 0.2:
            body["n"] = 2
        if rng.random() < 0.2:
            body["prompt"] = [prompt(rng), prompt(rng)]
        r = await client.post(f"{url}/v1/completions", json=body, timeout=request_timeout)
        tally.status(kind, r.status_code, r.text, ok)
    elif kind == "generate":
        body = {"inputs": prompt(rng), "parameters": {"max_new_tokens": rng.randint(1, 32)}}
        r = await client.post(f"{url}/generate", json=body, timeout=request_timeout)
        tally.status(kind, r.status_code, r.text, ok)
    elif kind == "invalid":
        path, content = rng.choice(INVALID_BODIES)
        r = await client.post(f"{url}{path}", content=content, headers={"content-type": "application/json"},
                              timeout=request_timeout)
        tally.status(kind, r.status_code, r.text, (400, 404, 413, 422))
    elif kind in ("chat_stream", "cancel"):
        body = {"messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": rng.randint(4, 48), "stream": True}
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=request_timeout) as r:
            if r.status_code != 200:
                tally.status(kind, r.status_code, (await r.aread()).decode(errors="replace"), ok)
                return
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data:")
                if kind == "cancel" and events >= 2:
                    break  # leaving the block closes the connection mid-stream
            tally.status(kind, 200, "", ok)
    elif kind == "disconnect":
        body = {"prompt": prompt(rng), "max_tokens": 64}
        try:
            r = await client.post(f"{url}/v1/completions", json=body, timeout=rng.uniform(0.01, 0.3))
            tally.status(kind, r.status_code, r.text, ok)
        except httpx.TimeoutException:
            tally.statuses[f"{kind} hung up"] += 1


async def client_loop(url: str, seed: int, stop_at: float, tally: Tally, request_timeout: float) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient() as client:
        while time.monotonic() < stop_at:
            kind = rng.choices(KINDS, WEIGHTS)[0]
            tally.outcomes[kind] += 1
            try:
                # The server bounds every request; twice its timeout means a hang.
                await asyncio.wait_for(one_request(client, url, kind, rng, tally, request_timeout), 2 * request_timeout)
            except asyncio.TimeoutError:
                tally.hung += 1
            except httpx.TimeoutException:
                tally.hung += 1
            except httpx.HTTPError as e:
                tally.unexpected.append(f"{kind}: {type(e).__name__}: {e}")


def gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} not in /metrics")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def find_router_pid(port: int) -> int:
    """The router process serving `port` (its command line has the shard socket and the port)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"--master-shard-uds-path" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
                return int(entry.name)
    raise RuntimeError(f"no router process serves port {port}")


async def sampler(url: str, pid: int, stop_at: float, every: float, samples: list[dict]) -> None:
    start = time.monotonic()
    async with httpx.AsyncClient() as client:
        while time.monotonic() < stop_at:
            metrics = (await client.get(f"{url}/metrics", timeout=30)).text
            samples.append({"t": round(time.monotonic() - start, 1), "rss_kib": rss_kib(pid),
                            "kv_blocks_used": gauge(metrics, "sluice_kv_blocks_used")})
            await asyncio.sleep(every)


async def wait_idle(url: str, baseline: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while True:
            used = gauge((await client.get(f"{url}/metrics", timeout=30)).text, "sluice_kv_blocks_used")
            if used <= baseline or time.monotonic() > deadline:
                return used
            await asyncio.sleep(0.5)


async def soak(url: str, pid: int, args) -> dict:
    async with httpx.AsyncClient() as client:
        baseline = gauge((await client.get(f"{url}/metrics", timeout=30)).text, "sluice_kv_blocks_used")
    tally = Tally()
    samples: list[dict] = []
    started = time.monotonic()
    stop_at = started + args.duration
    await asyncio.gather(
        sampler(url, pid, stop_at, args.sample_every, samples),
        *(client_loop(url, args.seed + i, stop_at, tally, args.request_timeout) for i in range(args.concurrency)),
    )
    wall = time.monotonic() - started
    used_after = await wait_idle(url, baseline, args.idle_timeout)
    rss_end = rss_kib(pid)
    third = [s for s in samples if s["t"] >= args.duration / 3] or samples
    rss_ref = third[0]["rss_kib"]
    checks = {
        "no request hung": tally.hung == 0,
        "no 5xx": not tally.server_errors,
        "only expected statuses": not tally.unexpected,
        "KV blocks back to idle": used_after <= baseline,
        "router RSS flat": rss_end <= rss_ref * (1 + args.rss_slack),
    }
    return {
        "host": platform.processor() or platform.machine(),
        "duration_s": round(wall, 1),
        "concurrency": args.concurrency,
        "requests": dict(tally.outcomes),
        "statuses": dict(sorted(tally.statuses.items())),
        "hung": tally.hung,
        "server_errors": tally.server_errors[:20],
        "unexpected": tally.unexpected[:20],
        "kv_blocks_used": {"idle_before": baseline, "after": used_after},
        "router_rss_kib": {"after_first_third": rss_ref, "end": rss_end, "max": max(s["rss_kib"] for s in samples)},
        "samples": samples,
        "checks": checks,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running server (then give --router-pid)")
    p.add_argument("--router-pid", type=int, help="the router of --url, for its RSS")
    p.add_argument("--launcher", default=default_launcher())
    p.add_argument("--launcher-arg", action="append", default=[], help="extra launcher argument (repeatable)")
    p.add_argument("--port", type=int, help="port for the launched server (default: a free one)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds; twice this counts as a hang")
    p.add_argument("--idle-timeout", type=float, default=60.0, help="seconds for KV blocks to come back")
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--rss-slack", type=float, default=0.10, help="allowed RSS growth after the first third")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report as JSON here")
    args = p.parse_args(argv)
    if args.url and not args.router_pid:
        p.error("--url needs --router-pid (the router's RSS is one of the checks)")
    return args


def report(result: dict) -> None:
    print(f"soak: {result['duration_s']} s at concurrency {result['concurrency']} on {result['host']}")
    print(f"  requests: {result['requests']}")
    print(f"  statuses: {result['statuses']}")
    print(f"  KV blocks used: idle {result['kv_blocks_used']['idle_before']:.0f}, after {result['kv_blocks_used']['after']:.0f}")
    rss = result["router_rss_kib"]
    print(f"  router RSS KiB: after first third {rss['after_first_third']}, end {rss['end']}, max {rss['max']}")
    for line in result["server_errors"] + result["unexpected"]:
        print(f"  ! {line}")
    for name, ok in result["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.url:
        result = asyncio.run(soak(args.url, args.router_pid, args))
    else:
        with launched(args, prefix_caching=True) as url:
            pid = find_router_pid(int(url.rsplit(":", 1)[1]))
            result = asyncio.run(soak(url, pid, args))
    report(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

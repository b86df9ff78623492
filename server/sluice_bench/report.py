"""Terminal tables and the JSON report."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

from .runner import RunResult

LATENCIES = (("ttft_ms", "Time to first token (ms)"), ("tpot_ms", "Time per output token, excl. 1st (ms)"),
             ("itl_ms", "Inter-token latency (ms)"), ("e2el_ms", "End-to-end latency (ms)"))
# (the TPOT title is the longest and sets the column width of 40)


def load_text(load: dict) -> str:
    if "request_rate" in load:
        cap = load.get("max_concurrency")
        return f"Poisson {load['request_rate']} req/s" + (f", at most {cap} in flight" if cap else "")
    return f"concurrency {load['concurrency']}"


def _num(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def result_table(r: RunResult) -> str:
    s = r.summary
    w = 44
    lines = [
        f"{' sluice-bench: ' + r.label + ' ':=^64}",
        f"{'Workload:':<{w}}{r.workload}",
        f"{'Load:':<{w}}{load_text(r.load)}",
        f"{'Model:':<{w}}{r.model}",
        f"{'Successful / failed requests:':<{w}}{s['completed']} / {s['failed']}",
        f"{'Warm-up requests (not counted):':<{w}}{r.warmup['requests']} ({r.warmup['failed']} failed)",
        f"{'Benchmark duration (s):':<{w}}{_num(s['duration_s'])}",
        f"{'Total input tokens:':<{w}}{s['total_input_tokens']}",
        f"{'Total generated tokens:':<{w}}{s['total_output_tokens']}"
        + ("" if s["output_tokens_from_usage"] == s["completed"] else
           f"  (usage reported for {s['output_tokens_from_usage']} of {s['completed']}; others counted by chunks)"),
        f"{'Request throughput (req/s):':<{w}}{_num(s['request_throughput'], 3)}",
        f"{'Output token throughput (tok/s):':<{w}}{_num(s['output_throughput'])}",
        f"{'Total token throughput (tok/s):':<{w}}{_num(s['total_token_throughput'])}",
    ]
    if "goodput" in s:
        g = s["goodput"]
        targets = ", ".join(f"{k}<={v:g}ms" for k, v in g["targets_ms"].items())
        lines.append(f"{'Goodput (req/s) [' + targets + ']:':<{w}}{_num(g['requests_per_s'], 3)}"
                     f"  ({g['good_requests']} good)")
    if "hourly_cost" in s:
        lines.append(f"{'$ per million output tokens (at $' + format(s['hourly_cost'], 'g') + '/h):':<{w}}"
                     f"{_num(s['dollars_per_million_output_tokens'], 4)}")
    if s["cached_prompt_tokens"]:
        lines.append(f"{'Prompt tokens served from cache:':<{w}}{s['cached_prompt_tokens']}")
    m = s["prompt_length_mismatches"]
    if m["checked"]:
        verdict = "all as planned" if not m["mismatched"] else f"{m['mismatched']} MISMATCHED, e.g. {m['examples'][:2]}"
        lines.append(f"{'Prompt lengths (usage.prompt_tokens):':<{w}}{m['checked']} checked, {verdict}")
    lines.append(f"{'':<40}{'mean':>9}{'median':>9}{'p90':>9}{'p99':>9}")
    for key, title in LATENCIES:
        st = s[key]
        lines.append(f"{title:<40}" + "".join(f"{_num(st[p]):>9}" for p in ("mean", "median", "p90", "p99")))
    for err, n in s["errors"].items():
        lines.append(f"  failed x{n}: {err}")
    lines.append("=" * 64)
    return "\n".join(lines)


# (title, value getter, whether a ratio means anything)
COMPARE_ROWS = [
    ("Completed / failed", lambda s: f"{s['completed']} / {s['failed']}", None),
    ("Output tok/s", lambda s: s["output_throughput"], True),
    ("Total tok/s", lambda s: s["total_token_throughput"], True),
    ("Requests/s", lambda s: s["request_throughput"], True),
    ("TTFT median (ms)", lambda s: s["ttft_ms"]["median"], True),
    ("TTFT p99 (ms)", lambda s: s["ttft_ms"]["p99"], True),
    ("TPOT median (ms)", lambda s: s["tpot_ms"]["median"], True),
    ("TPOT p99 (ms)", lambda s: s["tpot_ms"]["p99"], True),
    ("ITL median (ms)", lambda s: s["itl_ms"]["median"], True),
    ("ITL p99 (ms)", lambda s: s["itl_ms"]["p99"], True),
    ("E2E median (ms)", lambda s: s["e2el_ms"]["median"], True),
    ("E2E p99 (ms)", lambda s: s["e2el_ms"]["p99"], True),
    ("Goodput (req/s)", lambda s: s["goodput"]["requests_per_s"] if "goodput" in s else None, True),
    ("$ / M output tokens", lambda s: s.get("dollars_per_million_output_tokens"), True),
    ("Prompt tokens from cache", lambda s: s["cached_prompt_tokens"] or None, True),
    ("Prompt length mismatches", lambda s: s["prompt_length_mismatches"]["mismatched"] or None, None),
]


def ratio(value, base) -> float | None:
    if not isinstance(value, (int, float)) or not isinstance(base, (int, float)) or base == 0:
        return None
    return value / base


def compare_table(results: list[RunResult]) -> str:
    """Side by side, one block per load level; each column after the first
    also shows its ratio to the first (value / first's value)."""
    blocks = []
    for load_key in dict.fromkeys(json.dumps(r.load, sort_keys=True) for r in results):
        group = [r for r in results if json.dumps(r.load, sort_keys=True) == load_key]
        col = max(22, *(len(r.label) + 2 for r in group))
        head = f"{load_text(group[0].load) + ' | ' + group[0].workload:<28}"
        lines = [f"{'':<28}" + "".join(f"{r.label:>{col}}" for r in group), head]
        for title, get, has_ratio in COMPARE_ROWS:
            values = [get(r.summary) for r in group]
            if all(v is None for v in values):
                continue
            cells = []
            for i, v in enumerate(values):
                text = v if isinstance(v, str) else _num(v)
                q = ratio(v, values[0]) if (has_ratio and i) else None
                cells.append(f"{text + (f' (x{q:.2f})' if q is not None else ''):>{col}}")
            lines.append(f"{title:<28}" + "".join(cells))
        blocks.append("\n".join(lines))
    return ("\n\n".join(blocks) + "\n(xN = value / first column's value)")


def versions() -> dict:
    import httpx

    return {
        "sluice_bench": _installed_version("sluice"),
        "python": sys.version.split()[0],
        "httpx": httpx.__version__,
        "platform": platform.platform(),
    }


def write_json(path: str | Path, config: dict, results: list[RunResult], with_requests: bool) -> None:
    doc = {
        "tool": "sluice-bench",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "config": config,
        "runs": [r.to_json(with_requests) for r in results],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def _installed_version(distribution: str) -> str:
    """The installed distribution's version (sluice-bench ships in the `sluice` wheel)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:  # a source checkout never installed
        return "unknown"

"""Metric definitions, the same as `vllm bench serve` uses, so numbers compare.

One streamed request, on the client's clock:

    send        chunk 1       chunk 2        chunk 3 (last)
     |------------|-------------|--------------|
     |<-- TTFT -->|<-- ITL 1 -->|<-- ITL 2 --->|
     |<------------------- E2E latency ------->|

- TTFT: first chunk that carries generated text, minus send time.
- ITL: the gaps between consecutive token-carrying chunks (a chunk with several
  tokens gives one gap, as in vLLM).
- E2E latency: last token-carrying chunk minus send time.
- TPOT: (E2E - TTFT) / (output_tokens - 1), time per output token after the
  first; defined only for requests with more than one output token (for goodput
  a one-token request counts as TPOT 0).
- output_tokens: `usage.completion_tokens` when the server reports it, else the
  number of token-carrying chunks.

Over a run of duration D (first send to last completion):
  requests/s = completed / D; output tok/s = sum(output_tokens) / D;
  total tok/s = (sum(prompt_tokens) + sum(output_tokens)) / D;
  goodput = completed requests meeting every given target (value <= target) / D.
Percentiles interpolate linearly (numpy's default); statistics of an empty set
are reported as None, not 0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
# Goodput targets are given in milliseconds for these per-request metrics.
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; `start` is from the run's start."""

    index: int
    session: int = 0
    turn: int = 0
    start: float = 0.0
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    prompt_tokens: int | None = None
    expected_prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens <= 1 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_json(self, with_text: bool = False) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        if not with_text:
            d.pop("text")
        return d


def timings_from_chunks(send: float, chunk_times: list[float]) -> tuple[float, list[float], float]:
    """(ttft, itl, e2el) from the send time and the arrival times of the
    token-carrying chunks (at least one)."""
    if not chunk_times:
        raise ValueError("a request without any token has no timings")
    ttft = chunk_times[0] - send
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return ttft, itl, chunk_times[-1] - send


def stats(values: list[float], scale: float = 1.0) -> dict:
    """mean, median, p90, p99 (and min/max) of `values` times `scale`."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None, "min": None, "max": None, "n": 0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "min": float(a.min()),
        "max": float(a.max()),
        "n": int(a.size),
    }


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput target {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput target {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"goodput target {item!r}: must be positive")
        slo[name] = ms
    return slo


def is_good(r: RequestRecord, slo_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    return r.ok and all(values[k] is not None and values[k] * 1000.0 <= v for k, v in slo_ms.items())


def cost_per_million(hourly_cost: float, output_tps: float) -> float | None:
    """Dollars per million output tokens for a machine rented at `hourly_cost`
    producing `output_tps` output tokens/s: hourly / (tps * 3600) * 1e6."""
    if output_tps <= 0:
        return None
    return hourly_cost / (output_tps * 3600.0) * 1e6


def summarize(
    records: list[RequestRecord],
    duration: float,
    slo_ms: dict[str, float] | None = None,
    hourly_cost: float | None = None,
) -> dict:
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or r.expected_prompt_tokens or 0 for r in done)
    # A run that never got going (duration 0) has throughput 0, not NaN.
    d = duration if duration > 0 else float("inf")
    summary = {
        "requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "errors": dict(Counter(_short(r.error) for r in failed).most_common(10)),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / d,
        "output_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "ttft_ms": stats([r.ttft for r in done], 1000.0),
        "tpot_ms": stats([t for t in (r.tpot for r in done) if t is not None], 1000.0),
        "itl_ms": stats([g for r in done for g in r.itl], 1000.0),
        "e2el_ms": stats([r.e2el for r in done], 1000.0),
        "output_tokens_from_usage": sum(r.output_tokens_from_usage for r in done),
        "cached_prompt_tokens": sum(r.cached_tokens or 0 for r in done),
        "prompt_length_mismatches": _mismatches(done),
    }
    if slo_ms:
        good = sum(is_good(r, slo_ms) for r in done)
        summary["goodput"] = {"targets_ms": slo_ms, "good_requests": good, "requests_per_s": good / d}
    if hourly_cost is not None:
        summary["hourly_cost"] = hourly_cost
        summary["dollars_per_million_output_tokens"] = cost_per_million(hourly_cost, summary["output_throughput"])
    return summary


def _mismatches(done: list[RequestRecord]) -> dict:
    """Requests whose usage.prompt_tokens differs from the planned length."""
    checked = [r for r in done if r.expected_prompt_tokens is not None and r.prompt_tokens is not None]
    bad = [r for r in checked if r.prompt_tokens != r.expected_prompt_tokens]
    return {
        "checked": len(checked),
        "mismatched": len(bad),
        "examples": [{"index": r.index, "expected": r.expected_prompt_tokens, "got": r.prompt_tokens} for r in bad[:5]],
    }


def _short(error: str | None) -> str:
    return (error or "unknown error").splitlines()[0][:160]

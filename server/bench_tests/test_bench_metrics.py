"""sluice-bench metric definitions on synthetic event timelines (vLLM's
`bench serve` definitions), computed by hand here and compared exactly."""

from __future__ import annotations

import pytest

from sluice_bench.metrics import (
    RequestRecord,
    cost_per_million,
    is_good,
    parse_goodput,
    stats,
    summarize,
    timings_from_chunks,
)


def record(index, send, chunks, output_tokens=None, ok=True, prompt_tokens=10, expected=None):
    """A finished request: sent at `send`, token-carrying chunks at `chunks`."""
    r = RequestRecord(index=index, start=send, ok=ok, prompt_tokens=prompt_tokens, expected_prompt_tokens=expected)
    if ok:
        r.ttft, r.itl, r.e2el = timings_from_chunks(send, chunks)
        r.output_tokens = len(chunks) if output_tokens is None else output_tokens
    else:
        r.error = "HTTP 500: boom"
    return r


def test_ttft_itl_e2e_from_a_timeline():
    # send at 10.0; tokens at 10.5, 10.6, 10.8, 11.1
    ttft, itl, e2el = timings_from_chunks(10.0, [10.5, 10.6, 10.8, 11.1])
    assert ttft == pytest.approx(0.5)
    assert itl == pytest.approx([0.1, 0.2, 0.3])
    assert e2el == pytest.approx(1.1)


def test_tpot_excludes_the_first_token():
    r = record(0, 0.0, [0.5, 0.6, 0.8, 1.1])
    # (1.1 - 0.5) / (4 - 1)
    assert r.tpot == pytest.approx(0.2)
    # usage says 7 tokens arrived in those 4 chunks: TPOT counts tokens, not chunks
    r = record(1, 0.0, [0.5, 0.6, 0.8, 1.1], output_tokens=7)
    assert r.tpot == pytest.approx(0.6 / 6)
    # one token: no TPOT (and no ITL)
    r = record(2, 0.0, [0.3])
    assert r.tpot is None and r.itl == []


def test_timings_need_a_token():
    with pytest.raises(ValueError):
        timings_from_chunks(0.0, [])


def test_percentiles_interpolate_linearly():
    s = stats([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], scale=1000.0)
    assert s["mean"] == pytest.approx(5500.0)
    assert s["median"] == pytest.approx(5500.0)
    # numpy linear: position 0.9 * 9 = 8.1 -> 9 + 0.1 * (10 - 9)
    assert s["p90"] == pytest.approx(9100.0)
    assert s["p99"] == pytest.approx(9910.0)
    assert stats([])["median"] is None


def test_summary_throughput_and_latency_stats():
    recs = [
        record(0, 0.0, [0.5, 0.6, 0.7], prompt_tokens=100),        # 3 tokens, ttft .5, tpot .1, e2e .7
        record(1, 0.0, [1.0, 1.2, 1.4, 1.6, 1.8], prompt_tokens=50),  # 5 tokens, ttft 1, tpot .2, e2e 1.8
        record(2, 0.5, [], ok=False),
    ]
    s = summarize(recs, duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["total_output_tokens"] == 8
    assert s["total_input_tokens"] == 150
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(79.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(750.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["e2el_ms"]["median"] == pytest.approx(1250.0)
    # ITL pools the gaps of all requests: .1 .1 .2 .2 .2 .2
    assert s["itl_ms"]["mean"] == pytest.approx(1000.0 * 1.0 / 6)
    assert s["itl_ms"]["n"] == 6


def test_goodput_counts_requests_meeting_every_target():
    fast = record(0, 0.0, [0.1, 0.15, 0.2])            # ttft 100 ms, tpot 50 ms, e2e 200 ms
    slow_start = record(1, 0.0, [0.9, 0.95, 1.0])      # ttft 900 ms, tpot 50 ms
    slow_decode = record(2, 0.0, [0.1, 0.6, 1.1])      # ttft 100 ms, tpot 500 ms
    one_token = record(3, 0.0, [0.2])                  # tpot counts as 0 for goodput
    failed = record(4, 0.0, [], ok=False)
    slo = parse_goodput(["ttft:500", "tpot:100"])
    assert slo == {"ttft": 500.0, "tpot": 100.0}
    assert [is_good(r, slo) for r in (fast, slow_start, slow_decode, one_token, failed)] == [True, False, False, True, False]
    s = summarize([fast, slow_start, slow_decode, one_token, failed], duration=4.0, slo_ms=slo)
    assert s["goodput"]["good_requests"] == 2
    assert s["goodput"]["requests_per_s"] == pytest.approx(0.5)
    # the boundary is inclusive, as in vLLM (value <= target)
    assert is_good(fast, {"e2el": 200.0}) and not is_good(fast, {"e2el": 199.0})


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "foo:10", "ttft:abc", "tpot:-5"])
def test_bad_goodput_targets_are_rejected_clearly(bad):
    with pytest.raises(ValueError, match="goodput target"):
        parse_goodput([bad])


def test_cost_per_million_output_tokens():
    # $3.60/h at 100 tok/s = 360,000 tok/h -> $10 per million
    assert cost_per_million(3.6, 100.0) == pytest.approx(10.0)
    assert cost_per_million(3.6, 0.0) is None
    s = summarize([record(0, 0.0, [0.5, 1.0])], duration=0.02, hourly_cost=3.6)  # 100 tok/s
    assert s["dollars_per_million_output_tokens"] == pytest.approx(10.0)


def test_prompt_length_mismatches_are_reported():
    recs = [record(0, 0, [1.0], prompt_tokens=256, expected=256),
            record(1, 0, [1.0], prompt_tokens=257, expected=256),
            record(2, 0, [1.0], prompt_tokens=300, expected=None)]
    m = summarize(recs, 1.0)["prompt_length_mismatches"]
    assert (m["checked"], m["mismatched"]) == (2, 1)
    assert m["examples"] == [{"index": 1, "expected": 256, "got": 257}]

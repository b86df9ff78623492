"""sluice-bench against a real Sluice (launcher, router, shard; tiny model):
the tokens it counts are the server's, and its timings obey their
definitions and bracket the server's own.

Timing checks are inequalities that causality guarantees on one machine,
however busy: the client sends before the server receives and receives after
the server sends, so each client-side duration contains the server's.
"""

from __future__ import annotations

import re

import httpx
import pytest

from conftest import start_launcher

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 24, 8


def samples(base_url: str) -> dict[str, float]:
    """Every unlabelled or labelled sample line of /metrics, by its full name."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(sluice_[^ ]+) (\S+)$", text, re.M)}


def test_bench_counts_what_the_server_counts(tiny_model_dir, tmp_path):
    from sluice_bench import BenchConfig, WorkloadSpec, run_benchmark_sync

    server = start_launcher("--model-id", str(tiny_model_dir), tmp=tmp_path)
    try:
        before = samples(server.base_url)
        config = BenchConfig(
            base_url=server.base_url,
            spec=WorkloadSpec(kind="random", num_prompts=NUM_PROMPTS, input_len=INPUT_LEN, output_len=OUTPUT_LEN),
            concurrency=2,
            tokenizer=None,  # prompts sized by the server's /tokenize
            progress=False,
        )
        result = run_benchmark_sync(config)
        after = samples(server.base_url)
    finally:
        server.stop()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    s = result.summary
    assert (s["completed"], s["failed"]) == (NUM_PROMPTS, 0), s["errors"]
    # Tokens: the prompts have the planned length as the server counts them,
    # and the output counts come from the server's usage.
    assert s["prompt_length_mismatches"] == {"checked": NUM_PROMPTS, "mismatched": 0, "examples": []}
    assert s["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert s["output_tokens_from_usage"] == NUM_PROMPTS
    assert s["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos + min_tokens
    assert delta("sluice_prompt_tokens_total") == s["total_input_tokens"]
    assert delta("sluice_generated_tokens_total") == s["total_output_tokens"]
    assert delta('sluice_requests_total{endpoint="completions",outcome="success"}') == NUM_PROMPTS

    # Definitions, per request.
    for rec in result.records:
        assert rec.ok and rec.output_tokens == OUTPUT_LEN
        assert len(rec.itl) == OUTPUT_LEN - 1
        assert rec.ttft + sum(rec.itl) == pytest.approx(rec.e2el, abs=1e-9)
        assert rec.tpot == pytest.approx((rec.e2el - rec.ttft) / (OUTPUT_LEN - 1))
        assert 0 < rec.ttft <= rec.e2el
        assert rec.start >= 0 and rec.start + rec.e2el <= s["duration_s"] + 1e-6
    assert s["itl_ms"]["n"] == NUM_PROMPTS * (OUTPUT_LEN - 1)
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(NUM_PROMPTS / s["duration_s"])

    # The client's clocks contain the server's. Its TTFT (send -> first token
    # received) holds the server's (arrival -> first token generated), and its
    # e2el (send -> last token received) the server's arrival -> last token,
    # which is the server's TTFT plus its inter-token gaps.
    client_ttft = sum(rec.ttft for rec in result.records)
    client_e2el = sum(rec.e2el for rec in result.records)
    server_ttft = delta("sluice_time_to_first_token_seconds_sum")
    server_gaps = delta("sluice_inter_token_latency_seconds_sum")
    assert delta("sluice_time_to_first_token_seconds_count") == NUM_PROMPTS
    assert delta("sluice_inter_token_latency_seconds_count") == NUM_PROMPTS * (OUTPUT_LEN - 1)
    assert 0 < server_ttft <= client_ttft
    assert server_ttft + server_gaps <= client_e2el

"""Observability end to end: OTLP traces from router and shard, Prometheus
/metrics, JSON logs.

The trace test runs a real OTLP/gRPC receiver (opentelemetry-proto's
TraceService on a grpcio server, loopback port) and points the launcher at it.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from conftest import free_port, start_launcher

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The converted bundled model (its tokenizer and chat template), without
    starting the session's full-size launcher."""
    from sluice_server.download import bundled_model_path, resolve_model

    return resolve_model(str(bundled_model_path()))


# --- OTLP receiver -----------------------------------------------------------------


def attribute_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [attribute_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def attributes(kvs) -> dict:
    return {kv.key: attribute_value(kv.value) for kv in kvs}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span as a flat dict."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "service": resource.get("service.name"),
                            "resource": resource,
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                            "attributes": attributes(span.attributes),
                        })
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


@pytest.fixture
def collector():
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


def chat(server, model: str, max_tokens: int = 6, headers: dict | None = None, **extra) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Name three colours of the rainbow, please."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers or {}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def served_model(server) -> str:
    return httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


# --- traces ------------------------------------------------------------------------------


def test_one_trace_from_router_and_shard(collector, tiny_model_dir, tmp_path):
    receiver, endpoint = collector
    server = start_launcher("--model-id", str(tiny_model_dir), "--otlp-endpoint", endpoint, tmp=tmp_path)
    try:
        model = served_model(server)
        answer = chat(server, model, max_tokens=6, temperature=0.7, seed=3, headers={"traceparent": TRACEPARENT})
        usage = answer["usage"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            spans = receiver.trace(TRACE_ID)
            services = {s["service"] for s in spans}
            names = {s["name"] for s in spans}
            if {"sluice-router", "sluice-shard"} <= services and f"chat {model}" in names:
                break
            time.sleep(0.2)
    finally:
        server.stop()
    # The router flushes on exit: everything of the request is in now.
    spans = receiver.trace(TRACE_ID)
    by_id = {s["span_id"]: s for s in spans}
    services = {s["service"] for s in spans}
    assert {"sluice-router", "sluice-shard"} <= services, (services, [s["name"] for s in spans])

    # One tree hanging off the caller's span.
    for span in spans:
        assert span["parent"] in by_id or span["parent"] == CALLER_SPAN_ID, span
    roots = [s for s in spans if s["parent"] == CALLER_SPAN_ID]
    assert [r["name"] for r in roots] == ["POST /v1/chat/completions"], roots
    root = roots[0]
    assert root["attributes"]["http.response.status_code"] == 200

    def ancestors(span):
        chain = []
        while span["parent"] in by_id:
            span = by_id[span["parent"]]
            chain.append(span["name"])
        return chain

    generation = next(s for s in spans if s["name"] == f"chat {model}")
    assert generation["parent"] == root["span_id"]
    a = generation["attributes"]
    assert a["gen_ai.request.model"] == model
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7, abs=1e-6)
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == [answer["choices"][0]["finish_reason"]] == ["length"]
    assert a["gen_ai.usage.cached_input_tokens"] == usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert 0 < a["sluice.time_to_first_token_s"] < 120

    # Queue and steps hang off the generation span; validation off the root.
    names = {s["name"] for s in spans}
    assert {"tokenize", "validate", "queue", "step"} <= names, names
    router_steps = [s for s in spans if s["service"] == "sluice-router" and s["name"] == "step"]
    # One prefill step, then the 5 later tokens, several per step with
    # multi-step decode (how many per step depends on the host's step time).
    # Each step asked for its draws (1 for the prefill), 6 in all.
    assert 2 <= len(router_steps) <= 6
    assert sum(s["attributes"]["sluice.step.decode_steps"] for s in router_steps) == 6
    for step in router_steps:
        assert step["parent"] == generation["span_id"]
        assert (TRACE_ID, generation["span_id"]) in step["links"]

    shard_steps = [s for s in spans if s["service"] == "sluice-shard"]
    assert len(shard_steps) == len(router_steps)
    for step in shard_steps:
        assert step["name"] == "shard step"
        assert by_id[step["parent"]]["name"] == "step"
        assert ancestors(step)[-1] == "POST /v1/chat/completions"
        assert step["resource"]["sluice.rank"] == 0
        assert (TRACE_ID, generation["span_id"]) in step["links"]
        assert step["attributes"]["sluice.step.batch_size"] == 1
        assert step["attributes"]["sluice.step.forward_ms"] > 0
    assert sum(s["attributes"]["sluice.step.generated"] for s in shard_steps) == 6
    prefill = [s for s in shard_steps if s["attributes"]["sluice.step.prefill_tokens"] > 0]
    assert len(prefill) == 1
    assert prefill[0]["attributes"]["sluice.step.new_tokens"] == usage["prompt_tokens"]


def mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def wait_for_output(server, needle: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while needle not in server.output():
        if time.monotonic() > deadline:
            pytest.fail(f"no {needle!r} in the launcher's output after {timeout}s:\n{server.output()}")
        time.sleep(0.2)


def test_collector_down_is_logged_once_and_serving_goes_on(tiny_model_dir, tmp_path):
    """With nothing listening at the OTLP endpoint every request is served,
    and each process says so exactly once however many exports fail. (What
    a dead collector costs in latency is measured, not asserted:
    benchmarks/tracing_overhead.sh.)"""
    closed = free_port()  # nothing listens there
    down = start_launcher("--model-id", str(tiny_model_dir), "--otlp-endpoint", f"http://127.0.0.1:{closed}",
                          tmp=mkdir(tmp_path / "down"))
    try:
        model = served_model(down)
        for _ in range(3):
            assert chat(down, model, max_tokens=8)["usage"]["completion_tokens"] == 8
        # The router's and the shard's exporters fail (3 s timeout) and say so.
        wait_for_output(down, "cannot export traces")
        wait_for_output(down, "trace export problem")
        # More spans, more failed exports (and one more at shutdown's flush).
        for _ in range(3):
            assert chat(down, model, max_tokens=8)["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{down.base_url}/ready", timeout=30).status_code == 200
    finally:
        down.stop()
    output = down.output()
    assert down.proc.returncode == 0, output
    assert output.count("cannot export traces") == 1, output
    assert output.count("trace export problem") == 1, output


# --- metrics -------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value, for every sample line."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.fail("promtool is missing: `apt-get install -y prometheus` (scripts/test.sh does it)")
    return found


def test_metrics_lint_and_move_by_the_right_amounts(tiny_model_dir, tmp_path):
    launched = time.monotonic()
    # An hour's window: all of this test's tokens fall in it however slow the machine.
    server = start_launcher("--model-id", str(tiny_model_dir), "--hourly-cost", "2.5", "--cost-window-secs", "3600",
                            tmp=tmp_path)
    try:
        model = served_model(server)
        traffic_started = time.monotonic()
        chat(server, model, max_tokens=2)  # every series exists from here on
        before = parse_metrics(httpx.get(f"{server.base_url}/metrics", timeout=10).text)
        usages = [chat(server, model, max_tokens=n)["usage"] for n in (3, 5, 7)]
        # A refused request counts under its own outcome.
        bad = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": model, "messages": []}, timeout=30)
        assert bad.status_code in (400, 422), bad.text
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        scraped = time.monotonic()
        info = httpx.get(f"{server.base_url}/info", timeout=10).json()
    finally:
        server.stop()
    check = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr + text

    after = parse_metrics(text)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    completion = sum(u["completion_tokens"] for u in usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    assert completion == 15
    assert delta('sluice_requests_total{endpoint="chat_completions",outcome="success"}') == 3
    assert delta('sluice_requests_total{endpoint="chat_completions",outcome="invalid"}') == 1
    assert delta('sluice_request_duration_seconds_count{endpoint="chat_completions"}') == 4
    assert delta("sluice_generated_tokens_total") == completion
    assert delta("sluice_prompt_tokens_total") == prompt
    assert delta("sluice_request_generated_tokens_sum") == completion
    assert delta("sluice_request_generated_tokens_count") == 3
    assert delta("sluice_time_to_first_token_seconds_count") == 3
    assert delta("sluice_request_queue_duration_seconds_count") == 3
    assert delta("sluice_inter_token_latency_seconds_count") == completion - 3
    # The same prompt each time: its full blocks come from the prefix cache.
    assert cached > 0
    assert delta("sluice_prefix_cache_hit_tokens_total") == cached
    # Requests ran one at a time: one prefill step, then the later tokens,
    # several per step when multi-step decode took them together (how many
    # depends on the host's step time), never more steps than tokens.
    steps = delta("sluice_scheduler_steps_total")
    assert 3 <= steps <= completion
    assert delta("sluice_step_duration_seconds_count") == steps
    assert after["sluice_kv_blocks_capacity"] > 0
    assert after["sluice_kv_blocks_used"] == 0  # nothing running
    assert after["sluice_queue_size"] == 0
    assert after["sluice_preemptions_total"] == 0
    # Buckets fit LLM latencies: sub-10 ms to minutes.
    buckets = [k for k in after if k.startswith("sluice_time_to_first_token_seconds_bucket")]
    assert any('le="0.005"' in k for k in buckets) and any('le="60"' in k for k in buckets), buckets

    # The price, and the window gauges (promtool checked them above).
    assert info["hourly_cost"] == 2.5
    assert after["sluice_hourly_cost_dollars"] == 2.5
    assert 0 < after["sluice_prefix_cache_hit_ratio"] < 1
    # All 2 + 15 tokens fall in the hour's window, which covers at most the
    # time since the launcher started: that bounds dollars per million tokens.
    assert scraped - traffic_started < 3600, "the requests outlasted the cost window"
    most = 2.5 * (scraped - launched) / 3600 / (2 + completion) * 1e6
    assert 0 < after["sluice_cost_dollars_per_million_output_tokens"] <= most


# --- logs ----------------------------------------------------------------------------------------


def test_json_output_every_line_is_json(tiny_model_dir, tmp_path):
    server = start_launcher("--model-id", str(tiny_model_dir), "--json-output", tmp=tmp_path)
    try:
        chat(server, served_model(server), max_tokens=3, headers={"traceparent": TRACEPARENT})
        wait_for_output(server, "generation finished")
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=120)
    assert server.output_ended.wait(60), "the launcher's output never ended"
    lines = list(server.lines)
    assert server.proc.returncode == 0, "\n".join(lines)
    assert len(lines) > 5
    objects = []
    for line in lines:
        value = json.loads(line)  # raises on a line that is not JSON
        assert isinstance(value, dict), line
        objects.append(value)
    text = "\n".join(lines)
    assert "Listening on" in text and "shut down cleanly" in text
    # The request's log line carries the caller's trace id.
    finished = [o for o in objects if o.get("message") == "generation finished"
                or o.get("fields", {}).get("message") == "generation finished"]
    assert finished, text
    assert TRACE_ID in json.dumps(finished[0]), finished[0]

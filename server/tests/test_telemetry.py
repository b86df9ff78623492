"""The shard's Step span: parent from `traceparent`, links from
`sluice-link-traceparent`, step attributes (see sluice_server/telemetry.py)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice_server import telemetry
from sluice_server.pb import shard_pb2

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
STEP_SPAN = "00f067aa0ba902b7"
LINK_A = "1111111111111111"
OTHER_TRACE = "0af7651916cd43dd8448eb211c80319c"
LINK_B = "2222222222222222"


@pytest.fixture
def exported(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def step_request() -> shard_pb2.StepRequest:
    request = shard_pb2.StepRequest(finished_ids=[7])
    request.new_requests.add(id=1, token_ids=list(range(10)), num_prompt_tokens=10, num_new_tokens=10)
    request.scheduled.add(id=2, num_new_tokens=1)
    request.scheduled.add(id=3, num_new_tokens=4)  # a prefill chunk
    return request


def test_step_span_joins_the_routers_trace(exported):
    metadata = [
        ("traceparent", f"00-{TRACE}-{STEP_SPAN}-01"),
        (telemetry.LINK_KEY, f"00-{TRACE}-{LINK_A}-01"),
        (telemetry.LINK_KEY, f"00-{OTHER_TRACE}-{LINK_B}-01"),
        (telemetry.LINK_KEY, "garbage"),
        ("user-agent", "grpc-rust"),
    ]
    response = shard_pb2.StepResponse()
    response.timings.forward_ms = 12.5
    response.timings.sampling_ms = 0.5
    with telemetry.step_span(metadata, step_request()) as span:
        assert telemetry.current_trace_id() == TRACE
        telemetry.record_step(span, response)
    (span,) = exported.get_finished_spans()
    assert span.name == "shard step"
    assert format(span.context.trace_id, "032x") == TRACE
    assert format(span.parent.span_id, "016x") == STEP_SPAN
    links = [(format(l.context.trace_id, "032x"), format(l.context.span_id, "016x")) for l in span.links]
    assert links == [(TRACE, LINK_A), (OTHER_TRACE, LINK_B)]
    a = span.attributes
    assert a["sluice.step.batch_size"] == 3
    assert a["sluice.step.new_tokens"] == 15
    assert a["sluice.step.prefill_tokens"] == 14
    assert a["sluice.step.new_requests"] == 1
    assert a["sluice.step.finished"] == 1
    assert a["sluice.step.forward_ms"] == pytest.approx(12.5)
    assert a["sluice.step.sampling_ms"] == pytest.approx(0.5)


def test_without_router_context_the_span_is_a_root(exported):
    with telemetry.step_span([], step_request()):
        pass
    (span,) = exported.get_finished_spans()
    assert span.parent is None and list(span.links) == []


def test_tracing_off_costs_no_span():
    assert not telemetry.enabled()
    with telemetry.step_span([("traceparent", f"00-{TRACE}-{STEP_SPAN}-01")], step_request()) as span:
        assert span is None
        assert telemetry.current_trace_id() is None
    telemetry.record_step(span, shard_pb2.StepResponse())  # a no-op

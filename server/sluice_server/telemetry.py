"""OpenTelemetry traces of the shard (off unless `--otlp-endpoint` is set).

One span per Step RPC, named `shard step`. The router sends the step's own
span as the `traceparent` gRPC metadata entry (the shard span's parent) and
the spans of the requests the step serves as repeated
`sluice-link-traceparent` entries (the shard span's links). Attributes:
batch size, new and prefill tokens, and the prepare/forward/sampling
durations the shard measured.

Export never blocks a step: spans go to the SDK's bounded batch queue,
exported by its own thread; with the collector down a batch is dropped and
the first failure is logged, later ones are not.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Sequence

LINK_KEY = "sluice-link-traceparent"

log = logging.getLogger("sluice_server.telemetry")

_tracer = None
_provider = None


def enabled() -> bool:
    return _tracer is not None


class _FirstOnly(logging.Filter):
    """Lets through the first record of the OpenTelemetry SDK/exporter
    loggers (an export failure, typically) and drops the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("opentelemetry"):
            return True
        if self.seen:
            return False
        self.seen = True
        record.msg = f"trace export problem (logged once; later spans may be dropped silently): {record.msg}"
        record.exc_info = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def setup(endpoint: str | None, service_name: str, rank: int) -> None:
    """Starts exporting spans to the OTLP/gRPC collector at `endpoint`."""
    global _tracer, _provider
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    once = _FirstOnly()
    for handler in logging.getLogger().handlers:
        handler.addFilter(once)
    resource = Resource.create({"service.name": service_name, "sluice.rank": rank})
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=3)
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=8192, schedule_delay_millis=500))
    _provider = provider
    _tracer = provider.get_tracer("sluice_server")
    log.info("exporting traces to %s as %s (rank %d)", endpoint, service_name, rank)


def shutdown() -> None:
    """Flushes pending spans (bounded by the exporter's timeout)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def _context(traceparent: str):
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def parent_and_links(metadata: Sequence[tuple[str, str]] | None):
    """(parent context, links) from the Step call's gRPC metadata."""
    from opentelemetry import trace
    from opentelemetry.context import Context

    parent = Context()
    links = []
    for key, value in metadata or ():
        if not isinstance(value, str):
            continue
        if key == "traceparent":
            parent = _context(value)
        elif key == LINK_KEY:
            span_context = trace.get_current_span(_context(value)).get_span_context()
            if span_context.is_valid:
                links.append(trace.Link(span_context))
    return parent, links


@contextlib.contextmanager
def step_span(metadata, request) -> Iterator[object | None]:
    """The span of one Step call (None when tracing is off); current while
    the step runs, so log lines written inside it carry its trace id."""
    if _tracer is None:
        yield None
        return
    parent, links = parent_and_links(metadata)
    scheduled = [(r.num_new_tokens, False) for r in request.scheduled]
    new = [(r.num_new_tokens, True) for r in request.new_requests]
    attributes = {
        "sluice.step.batch_size": len(scheduled) + len(new),
        "sluice.step.new_tokens": sum(n for n, _ in scheduled + new),
        "sluice.step.prefill_tokens": sum(n for n, is_new in scheduled + new if is_new or n > 1),
        "sluice.step.new_requests": len(new),
        "sluice.step.finished": len(request.finished_ids),
    }
    with _tracer.start_as_current_span("shard step", context=parent, links=links, attributes=attributes) as span:
        yield span


def record_step(span, response) -> None:
    """Adds the shard's measured durations to a step span."""
    if span is None or response is None:
        return
    timings = response.timings
    span.set_attribute("sluice.step.prepare_ms", timings.prepare_ms)
    span.set_attribute("sluice.step.forward_ms", timings.forward_ms)
    span.set_attribute("sluice.step.sampling_ms", timings.sampling_ms)
    span.set_attribute("sluice.step.errors", len(response.errors))
    # Tokens drawn: one per sampling request, more with drafts or multi-step decode.
    span.set_attribute("sluice.step.generated", len(response.generations))


def current_trace_id() -> str | None:
    """The current span's trace id (32 hex digits), for log lines."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else None

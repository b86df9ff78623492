//! Logs and traces.
//!
//! Logs: human-readable lines by default, one JSON object per line with
//! `--json-output`. Every line written inside an HTTP request carries the
//! request span's `trace_id` field.
//!
//! Traces (off unless `--otlp-endpoint` is set): one trace per HTTP request,
//! continuing the caller's W3C `traceparent`. Span tree:
//!
//! ```text
//!  http_request (POST /v1/chat/completions)   <- parent: the caller's span
//!  ├── tokenize / validate                    (validation.rs)
//!  └── generation (gen_ai.* attributes)       one per choice (http/generation.rs)
//!      ├── queue                              submit -> first scheduled
//!      └── step                               only when it is the step's
//!          └── shard step (Python)            first request; other requests
//!                                             of the step are LINKED
//! ```
//!
//! A Step serves many requests: its span is parented on the first request of
//! the batch and links to every request span in it (at most
//! [`MAX_STEP_LINKS`]); the shards get the step span as the `traceparent`
//! gRPC metadata entry and the request spans as `sluice-link-traceparent`
//! entries, so their step spans join the same traces.
//!
//! Export never blocks serving: spans go to a bounded queue drained by the
//! SDK's batch thread; when the collector is unreachable the batch is dropped
//! and one warning is logged (the first time only).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::trace::{SpanContext, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Request spans a step links to (and sends to the shards): gRPC metadata is
/// capped at 8 KiB by default and one entry is about 70 bytes.
pub const MAX_STEP_LINKS: usize = 32;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// True when spans are exported (`--otlp-endpoint` was given).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Flushes pending spans when dropped (bounded by the exporter's timeout).
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            let _ = provider.shutdown();
        }
    }
}

/// Installs the global logger, plus the OTLP trace pipeline when `endpoint`
/// is set. Must run inside a tokio runtime (the gRPC channel lives on it).
pub fn init(json: bool, endpoint: Option<&str>, service_name: &str) -> Telemetry {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // The SDK reports each failed export itself; `WarnOnce` says it once.
    for quiet in ["opentelemetry=off", "opentelemetry_sdk=off", "opentelemetry_otlp=off"] {
        filter = filter.add_directive(quiet.parse().expect("static directive"));
    }
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if json { fmt.json().flatten_event(true).boxed() } else { fmt.boxed() };

    let provider = endpoint.filter(|e| !e.is_empty()).and_then(|endpoint| match provider(endpoint, service_name) {
        Ok(provider) => Some(provider),
        Err(e) => {
            eprintln!("cannot set up trace export to {endpoint}: {e}; tracing stays off");
            None
        }
    });
    let otel = provider.as_ref().map(|provider| {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        // Only the router's own spans: tonic/hyper spans (the exporter's
        // own calls among them) would make noise and feedback.
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("sluice-router"))
            .with_filter(Targets::new().with_target("sluice_router", LevelFilter::DEBUG))
    });
    let _ = tracing_subscriber::registry().with(fmt.with_filter(filter)).with(otel).try_init();
    ENABLED.store(provider.is_some(), Ordering::Relaxed);
    if let (Some(endpoint), true) = (endpoint, provider.is_some()) {
        tracing::info!(endpoint, service_name, "exporting traces over OTLP/gRPC");
    }
    Telemetry { provider }
}

fn provider(endpoint: &str, service_name: &str) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(3))
        .build()
        .map_err(|e| e.to_string())?;
    let exporter = WarnOnce { inner: exporter, endpoint: endpoint.to_string(), warned: AtomicBool::new(false) };
    let batch = BatchConfigBuilder::default()
        .with_scheduled_delay(Duration::from_millis(500))
        .with_max_queue_size(8192)
        .build();
    let processor = BatchSpanProcessor::builder(exporter).with_batch_config(batch).build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(
            Resource::builder()
                .with_service_name(service_name.to_string())
                .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                .build(),
        )
        .build())
}

/// Logs the first failed export (collector down, wrong address), then stays
/// quiet: the spans of later failures are dropped silently.
#[derive(Debug)]
struct WarnOnce<E> {
    inner: E,
    endpoint: String,
    warned: AtomicBool,
}

impl<E: SpanExporter> SpanExporter for WarnOnce<E> {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let export = self.inner.export(batch);
        async move {
            let result = export.await;
            if let Err(e) = &result {
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        endpoint = %self.endpoint,
                        "cannot export traces ({e}); spans are dropped while the collector is unreachable (logged once)"
                    );
                }
            }
            result
        }
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Parses a W3C `traceparent` value: `VERSION-TRACEID-SPANID-FLAGS`, lower
/// case hex, 2-32-16-2 digits; version ff and all-zero ids are invalid.
pub fn parse_traceparent(value: &str) -> Option<SpanContext> {
    use opentelemetry::trace::{SpanId, TraceFlags, TraceState};
    let parts: Vec<&str> = value.trim().split('-').collect();
    let [version, trace_id, span_id, flags, ..] = parts[..] else { return None };
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !hex(version, 2) || version == "ff" || !hex(trace_id, 32) || !hex(span_id, 16) || !hex(flags, 2) {
        return None;
    }
    // Version 00 has exactly four fields; later versions may append more.
    if version == "00" && parts.len() != 4 {
        return None;
    }
    let cx = SpanContext::new(
        TraceId::from_hex(trace_id).ok()?,
        SpanId::from_hex(span_id).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()? & 1),
        true,
        TraceState::default(),
    );
    cx.is_valid().then_some(cx)
}

/// The `traceparent` value naming `cx` (None for an invalid context).
pub fn format_traceparent(cx: &SpanContext) -> Option<String> {
    cx.is_valid()
        .then(|| format!("00-{}-{}-{:02x}", cx.trace_id(), cx.span_id(), cx.trace_flags().to_u8()))
}

/// The span context of a tracing span (invalid when tracing is off).
pub fn span_context(span: &tracing::Span) -> SpanContext {
    span.context().span().span_context().clone()
}

/// The root span of one HTTP request: continues the caller's `traceparent`
/// and records the trace id (the caller's, the exported one, or a fresh one
/// when neither exists) for the log lines written inside it.
pub fn request_span(method: &str, path: &str, traceparent: Option<&str>) -> tracing::Span {
    let span = tracing::info_span!(
        "http_request",
        otel.name = %format!("{method} {path}"),
        otel.kind = "server",
        http.request.method = %method,
        url.path = %path,
        trace_id = tracing::field::Empty,
    );
    let parent = traceparent.and_then(parse_traceparent);
    if let Some(parent) = &parent {
        span.set_parent(Context::new().with_remote_span_context(parent.clone()));
    }
    let trace_id = log_trace_id(span_context(&span).trace_id(), parent.as_ref());
    span.record("trace_id", tracing::field::display(trace_id));
    span
}

/// The trace id logged for a request: the exported span's (tracing on), else
/// the caller's, else a fresh random one (so a request's lines still group).
fn log_trace_id(exported: TraceId, parent: Option<&SpanContext>) -> TraceId {
    if exported != TraceId::INVALID {
        exported
    } else if let Some(parent) = parent {
        parent.trace_id()
    } else {
        TraceId::from_bytes(*uuid::Uuid::new_v4().as_bytes())
    }
}

/// axum middleware: runs the rest of the request inside [`request_span`].
pub async fn trace_http(request: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    use tracing::Instrument;
    let traceparent = request.headers().get("traceparent").and_then(|v| v.to_str().ok());
    let span = request_span(request.method().as_str(), request.uri().path(), traceparent);
    let response = next.run(request).instrument(span.clone()).await;
    span.set_attribute("http.response.status_code", i64::from(response.status().as_u16()));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trip() {
        let value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = parse_traceparent(value).expect("valid");
        assert_eq!(cx.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(cx.span_id().to_string(), "00f067aa0ba902b7");
        assert!(cx.is_sampled() && cx.is_remote());
        assert_eq!(format_traceparent(&cx).as_deref(), Some(value));
    }

    #[test]
    fn traceparent_rejects_malformed_values() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad:?} was accepted");
        }
        // A later version may carry more fields.
        assert!(parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-x").is_some());
    }

    #[test]
    fn unsampled_flag_survives() {
        let cx = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert!(!cx.is_sampled());
        assert!(format_traceparent(&cx).unwrap().ends_with("-00"));
    }

    #[test]
    fn logged_trace_id_prefers_export_then_caller_then_fresh() {
        let caller = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let exported = TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap();
        assert_eq!(log_trace_id(exported, Some(&caller)), exported);
        assert_eq!(log_trace_id(TraceId::INVALID, Some(&caller)), caller.trace_id());
        let a = log_trace_id(TraceId::INVALID, None);
        let b = log_trace_id(TraceId::INVALID, None);
        assert!(a != TraceId::INVALID && a != b);
    }
}

//! Prometheus metrics. The recorder is process-global (the `metrics` crate's
//! model), installed once; `/metrics` renders it. HTTP-level series are
//! recorded here; the scheduler records its own series (queue, batch, KV
//! blocks, prefix cache) with the `metrics` macros, all named `sluice_*`.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_histogram, histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the global recorder (first call) and returns its handle.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let seconds = [
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
            ];
            let tokens = [1.0, 8.0, 32.0, 128.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 32768.0];
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)
                .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_tokens".into()), &tokens))
                .expect("bucket lists are non-empty")
                .build_recorder();
            let handle = recorder.handle();
            // Fails only if another recorder was installed first (a test
            // harness); the handle then renders nothing, which is harmless.
            let _ = metrics::set_global_recorder(recorder);
            describe();
            handle
        })
        .clone()
}

/// HELP lines (Prometheus' linter wants one per series).
fn describe() {
    describe_counter!("sluice_requests_total", "Generation requests finished, by endpoint and outcome");
    describe_histogram!("sluice_request_duration_seconds", Unit::Seconds, "Time from arrival to the last byte's generation");
    describe_histogram!("sluice_request_queue_duration_seconds", Unit::Seconds, "Time a request waited before its first step");
    describe_histogram!("sluice_time_to_first_token_seconds", Unit::Seconds, "Time from arrival to the first generated token");
    describe_histogram!("sluice_inter_token_latency_seconds", Unit::Seconds, "Time between consecutive tokens of one request");
    describe_histogram!("sluice_request_prompt_tokens", "Prompt tokens per successful request");
    describe_histogram!("sluice_request_generated_tokens", "Generated tokens per successful request");
    describe_counter!("sluice_prompt_tokens_total", "Prompt tokens of successful requests");
    describe_counter!("sluice_generated_tokens_total", "Tokens generated for successful requests");
    counter!("sluice_prompt_tokens_total").increment(0);
    counter!("sluice_generated_tokens_total").increment(0);
}

/// One finished HTTP request. `outcome` is "success" or an error class.
pub fn request_finished(endpoint: &'static str, outcome: &'static str, duration: Duration) {
    counter!("sluice_requests_total", "endpoint" => endpoint, "outcome" => outcome).increment(1);
    histogram!("sluice_request_duration_seconds", "endpoint" => endpoint).record(duration.as_secs_f64());
}

pub fn queue_wait(wait: Duration) {
    histogram!("sluice_request_queue_duration_seconds").record(wait.as_secs_f64());
}

pub fn time_to_first_token(ttft: Duration) {
    histogram!("sluice_time_to_first_token_seconds").record(ttft.as_secs_f64());
}

pub fn inter_token_latency(gap: Duration) {
    histogram!("sluice_inter_token_latency_seconds").record(gap.as_secs_f64());
}

pub fn tokens(prompt: usize, generated: u32) {
    histogram!("sluice_request_prompt_tokens").record(prompt as f64);
    histogram!("sluice_request_generated_tokens").record(f64::from(generated));
    counter!("sluice_prompt_tokens_total").increment(prompt as u64);
    counter!("sluice_generated_tokens_total").increment(u64::from(generated));
}

//! Prometheus metrics: every series the router publishes is named, described
//! and recorded here, all named `sluice_*`. The recorder is process-global
//! (the `metrics` crate's model), installed once; `/metrics` renders it. The
//! HTTP side and the scheduler report events as plain numbers through the
//! functions below (requests, tokens and latencies; queue, batch, KV blocks,
//! prefix cache, steps); without a recorder they are no-ops.
//!
//! The window gauges (price, cost per token, prefix-cache hit ratio over
//! recent traffic) are not in the recorder: /metrics computes them from the
//! app's configuration and a scheduler snapshot and appends them with
//! [`render_window`], because a series must be able to vanish (a recorder
//! gauge, once set, stays) and each app has its own price and window.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit};
use metrics_exporter_prometheus::formatting::{write_help_line, write_metric_line, write_type_line};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::infer::WindowTotals;

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
    describe_gauge!("sluice_queue_size", "Requests waiting for admission");
    describe_gauge!("sluice_batch_current_size", "Requests in the running batch");
    describe_gauge!("sluice_kv_blocks_capacity", "KV cache blocks the scheduler may hand out (capacity)");
    describe_gauge!(
        "sluice_kv_cache_usage_ratio",
        "KV blocks held by running requests / capacity, in [0, 1] (what an endpoint picker reads)"
    );
    describe_gauge!("sluice_kv_blocks_used", "KV blocks referenced by running requests");
    describe_gauge!("sluice_kv_blocks_cached", "KV blocks held only by the prefix cache (evictable)");
    describe_gauge!("sluice_kv_blocks_free", "KV blocks on the free list");
    describe_gauge!("sluice_prefix_cache_tree_blocks", "Blocks in the prefix tree");
    describe_counter!("sluice_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache");
    describe_counter!("sluice_prefix_cache_lookup_tokens_total", "Prompt tokens looked up in the prefix cache");
    describe_counter!("sluice_prefix_cache_evicted_blocks_total", "Cached blocks evicted to make room");
    describe_counter!("sluice_preemptions_total", "Running requests preempted for lack of KV blocks");
    describe_counter!("sluice_scheduler_steps_total", "Steps sent to the shards");
    describe_counter!("sluice_step_failures_total", "Steps whose RPC failed");
    describe_histogram!("sluice_step_duration_seconds", Unit::Seconds, "Time of one Step RPC");
    describe_histogram!("sluice_batch_tokens", "Tokens computed per step");
    describe_histogram!("sluice_batch_size", "Requests per step");
    describe_counter!("sluice_speculative_proposed_tokens_total", "Draft tokens sent to the shards for verification");
    describe_counter!("sluice_speculative_accepted_tokens_total", "Draft tokens the shards accepted");
    describe_histogram!(
        "sluice_speculative_emitted_tokens",
        "Tokens emitted per request and step that carried a draft (accepted drafts + 1)"
    );
    describe_counter!("sluice_batch_api_lines_total", "Batch API request lines finished, by outcome (success: a 200 answer)");
    describe_counter!("sluice_batch_api_prompt_tokens_total", "Prompt tokens of finished Batch API lines (not in sluice_prompt_tokens_total)");
    describe_counter!(
        "sluice_batch_api_generated_tokens_total",
        "Tokens generated for finished Batch API lines (not in sluice_generated_tokens_total)"
    );
    describe_gauge!("sluice_lora_slots_capacity", "LoRA adapter slots of the shards (--max-loras)");
    describe_gauge!("sluice_lora_slots_loaded", "Adapter slots holding an adapter");
    describe_gauge!("sluice_lora_slots_active", "Adapter slots in use by running requests (never reloaded while so)");
    describe_gauge!("sluice_lora_adapters", "LoRA adapters requests may name");
    describe_gauge!(
        "sluice_lora_adapters_held",
        "LoRA adapters the router keeps: those requests may name, and unloaded ones requests still use"
    );
    describe_counter!("sluice_lora_loads_total", "Adapters loaded into a slot (at a load command or on demand)");
    describe_counter!("sluice_lora_evictions_total", "Adapters taken out of a slot to make room for another");
    describe_counter!(
        "sluice_lora_requests_total",
        "Successful generation requests by LoRA adapter (adapter=\"\": the base model)"
    );
    describe_counter!("sluice_lora_prompt_tokens_total", "Prompt tokens of successful requests by LoRA adapter");
    describe_counter!("sluice_lora_generated_tokens_total", "Tokens generated for successful requests by LoRA adapter");
    describe_gauge!(
        "sluice_lora_spent_dollars",
        "Dollars spent so far by LoRA adapter (--hourly-cost): each step's time, shared out by the tokens each request computed in it (only grows)"
    );
    // Counters exist (at 0) before their first event, so rates and alerts
    // see them from the start.
    for name in [
        "sluice_prompt_tokens_total",
        "sluice_generated_tokens_total",
        "sluice_prefix_cache_hit_tokens_total",
        "sluice_prefix_cache_lookup_tokens_total",
        "sluice_prefix_cache_evicted_blocks_total",
        "sluice_preemptions_total",
        "sluice_scheduler_steps_total",
        "sluice_step_failures_total",
        "sluice_speculative_proposed_tokens_total",
        "sluice_speculative_accepted_tokens_total",
        "sluice_batch_api_prompt_tokens_total",
        "sluice_batch_api_generated_tokens_total",
    ] {
        counter!(name).increment(0);
    }
}

// -- HTTP side ------------------------------------------------------------

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

/// One finished Batch API line (batch/runner.rs): its tokens count apart
/// from interactive traffic's.
pub fn batch_line(succeeded: bool, prompt_tokens: u64, generated_tokens: u64) {
    let outcome = if succeeded { "success" } else { "error" };
    counter!("sluice_batch_api_lines_total", "outcome" => outcome).increment(1);
    counter!("sluice_batch_api_prompt_tokens_total").increment(prompt_tokens);
    counter!("sluice_batch_api_generated_tokens_total").increment(generated_tokens);
}

/// A successful request's usage, by its adapter (`""`: the base model).
/// Recorded only when adapters are on.
pub fn adapter_usage(adapter: &str, prompt: usize, generated: u32) {
    let adapter = adapter.to_string();
    counter!("sluice_lora_requests_total", "adapter" => adapter.clone()).increment(1);
    counter!("sluice_lora_prompt_tokens_total", "adapter" => adapter.clone()).increment(prompt as u64);
    counter!("sluice_lora_generated_tokens_total", "adapter" => adapter).increment(u64::from(generated));
}

// -- scheduler --------------------------------------------------------------

/// The adapter slots after a change; `active`: slots running requests use.
pub fn adapter_occupancy(stats: &crate::infer::AdapterStats, active: usize) {
    gauge!("sluice_lora_slots_capacity").set(f64::from(stats.slots));
    gauge!("sluice_lora_slots_loaded").set(f64::from(stats.loaded));
    gauge!("sluice_lora_slots_active").set(active as f64);
    gauge!("sluice_lora_adapters").set(stats.registered as f64);
    gauge!("sluice_lora_adapters_held").set(stats.held as f64);
}

pub fn adapter_loaded() {
    counter!("sluice_lora_loads_total").increment(1);
}

pub fn adapter_evicted() {
    counter!("sluice_lora_evictions_total").increment(1);
}

/// `dollars` of a step spent on `adapter`'s requests (`""`: the base model).
/// A gauge that only grows: the recorder's counters count integers.
pub fn adapter_cost(adapter: &str, dollars: f64) {
    gauge!("sluice_lora_spent_dollars", "adapter" => adapter.to_string()).increment(dollars);
}

/// What the scheduler holds after a change.
#[derive(Debug, Clone, Copy)]
pub struct Occupancy {
    pub waiting: usize,
    pub running: usize,
    pub blocks_total: u32,
    pub blocks_free: u32,
    /// Held only by the prefix tree (evictable).
    pub blocks_cached: u32,
    pub tree_blocks: usize,
}

pub fn occupancy(o: Occupancy) {
    gauge!("sluice_queue_size").set(o.waiting as f64);
    gauge!("sluice_batch_current_size").set(o.running as f64);
    gauge!("sluice_kv_blocks_capacity").set(f64::from(o.blocks_total));
    gauge!("sluice_kv_blocks_free").set(f64::from(o.blocks_free));
    gauge!("sluice_kv_blocks_cached").set(f64::from(o.blocks_cached));
    let used = o.blocks_total.saturating_sub(o.blocks_free + o.blocks_cached);
    gauge!("sluice_kv_blocks_used").set(f64::from(used));
    // Cached-only blocks are evictable on demand, so they count as free (as
    // vLLM's kv_cache_usage_perc counts them).
    let ratio = if o.blocks_total == 0 { 0.0 } else { f64::from(used) / f64::from(o.blocks_total) };
    gauge!("sluice_kv_cache_usage_ratio").set(ratio);
    gauge!("sluice_prefix_cache_tree_blocks").set(o.tree_blocks as f64);
}

/// A Step RPC returned (successfully or not) after `elapsed`.
pub fn step_finished(elapsed: Duration, batch_size: usize, tokens: usize) {
    counter!("sluice_scheduler_steps_total").increment(1);
    histogram!("sluice_step_duration_seconds").record(elapsed.as_secs_f64());
    histogram!("sluice_batch_tokens").record(tokens as f64);
    histogram!("sluice_batch_size").record(batch_size as f64);
}

pub fn step_failed() {
    counter!("sluice_step_failures_total").increment(1);
}

/// A prompt of `tokens` tokens was looked up in the prefix cache, `hit` of
/// them served from it.
pub fn prefix_lookup(tokens: u64, hit: u64) {
    counter!("sluice_prefix_cache_lookup_tokens_total").increment(tokens);
    counter!("sluice_prefix_cache_hit_tokens_total").increment(hit);
}

pub fn blocks_evicted(blocks: u64) {
    counter!("sluice_prefix_cache_evicted_blocks_total").increment(blocks);
}

pub fn preempted() {
    counter!("sluice_preemptions_total").increment(1);
}

/// A request's draft of `proposed` tokens came back with `accepted` of them.
pub fn draft_verified(proposed: usize, accepted: usize) {
    counter!("sluice_speculative_proposed_tokens_total").increment(proposed as u64);
    counter!("sluice_speculative_accepted_tokens_total").increment(accepted as u64);
    histogram!("sluice_speculative_emitted_tokens").record((accepted + 1) as f64);
}

// -- /metrics ---------------------------------------------------------------

/// Appends the window gauges to a rendered exposition, in the recorder's
/// format. A gauge whose value is undefined is left out rather than given a
/// made-up number:
///
/// | gauge | present when |
/// |---|---|
/// | `sluice_hourly_cost_dollars` | `--hourly-cost` is set |
/// | `sluice_cost_dollars_per_million_output_tokens` | `--hourly-cost` is set and the window has output tokens |
/// | `sluice_prefix_cache_hit_ratio` | the window has prompt tokens looked up in the prefix cache |
pub fn render_window(out: &mut String, hourly_cost: Option<f64>, window: Option<&WindowTotals>) {
    if let Some(dollars) = hourly_cost {
        write_gauge(out, "sluice_hourly_cost_dollars", "Configured cost of the deployment per hour (--hourly-cost)", dollars);
    }
    let Some(window) = window else { return };
    let span = window.span.as_secs();
    if let Some(cost) = hourly_cost.and_then(|dollars| window.dollars_per_million_output_tokens(dollars)) {
        let help = format!(
            "Dollars per million output tokens over the last {span} s: hourly cost / (output tokens/s * 3600) * 1e6; absent while no token was generated in the window"
        );
        write_gauge(out, "sluice_cost_dollars_per_million_output_tokens", &help, cost);
    }
    if let Some(ratio) = window.prefix_cache_hit_ratio() {
        let help = format!(
            "Share of the prompt tokens looked up in the prefix cache over the last {span} s that it served; absent while none were looked up"
        );
        write_gauge(out, "sluice_prefix_cache_hit_ratio", &help, ratio);
    }
}

fn write_gauge(out: &mut String, name: &str, help: &str, value: f64) {
    write_help_line(out, name, help);
    write_type_line(out, name, "gauge");
    write_metric_line::<&str, f64>(out, name, None, &[], None, value, None);
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::infer::TokenCounts;

    fn window(output: u64, prompt: u64, cached_prompt: u64) -> WindowTotals {
        WindowTotals {
            span: Duration::from_secs(60),
            covered: Duration::from_secs(60),
            counts: TokenCounts { output, prompt, cached_prompt },
        }
    }

    fn render(hourly_cost: Option<f64>, window: Option<&WindowTotals>) -> String {
        let mut out = String::new();
        render_window(&mut out, hourly_cost, window);
        out
    }

    #[test]
    fn window_gauges_in_exposition_format() {
        // 3600 tokens in 60 s = 60 tokens/s; $2.16/h / (60 * 3600) * 1e6 = $10.
        let text = render(Some(2.16), Some(&window(3600, 100, 25)));
        let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).collect();
        assert_eq!(lines[0], "sluice_hourly_cost_dollars 2.16");
        let (name, cost) = lines[1].split_once(' ').unwrap();
        assert_eq!(name, "sluice_cost_dollars_per_million_output_tokens");
        assert!((cost.parse::<f64>().unwrap() - 10.0).abs() < 1e-9, "{cost}");
        assert_eq!(lines[2], "sluice_prefix_cache_hit_ratio 0.25");
        assert!(text.contains("# TYPE sluice_cost_dollars_per_million_output_tokens gauge\n"));
        assert!(text.contains("over the last 60 s"));
    }

    #[test]
    fn undefined_gauges_are_left_out() {
        // No price: neither price nor cost, the ratio still.
        let text = render(None, Some(&window(3600, 100, 25)));
        assert!(!text.contains("dollars") && text.contains("sluice_prefix_cache_hit_ratio 0.25"), "{text}");
        // An idle window: the price only.
        let text = render(Some(1.0), Some(&window(0, 0, 0)));
        assert!(text.contains("sluice_hourly_cost_dollars 1\n"), "{text}");
        assert!(!text.contains("per_million") && !text.contains("hit_ratio"), "{text}");
        // No scheduler snapshot: the price only.
        assert_eq!(render(Some(1.0), None).matches("# TYPE").count(), 1);
        assert_eq!(render(None, None), "");
    }
}

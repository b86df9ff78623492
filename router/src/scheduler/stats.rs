//! Scheduler series for Prometheus (the recorder is installed by the
//! router's `metrics` module; without one these calls are no-ops).

use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit};

use super::step::StepPlan;
use super::Scheduler;

pub(crate) fn describe() {
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
    // Counters exist (at 0) before their first event, so rates and alerts
    // see them from the start.
    for name in [
        "sluice_prefix_cache_hit_tokens_total",
        "sluice_prefix_cache_lookup_tokens_total",
        "sluice_prefix_cache_evicted_blocks_total",
        "sluice_preemptions_total",
        "sluice_scheduler_steps_total",
        "sluice_step_failures_total",
    ] {
        counter!(name).increment(0);
    }
}

pub(crate) fn queue(s: &Scheduler) {
    let total = s.config.num_blocks;
    let free = s.kv.num_free();
    let cached = s.kv.num_cached();
    gauge!("sluice_queue_size").set(s.waiting.len() as f64);
    gauge!("sluice_batch_current_size").set(s.running.len() as f64);
    gauge!("sluice_kv_blocks_capacity").set(total as f64);
    gauge!("sluice_kv_blocks_free").set(free as f64);
    gauge!("sluice_kv_blocks_cached").set(cached as f64);
    let used = total.saturating_sub(free + cached);
    gauge!("sluice_kv_blocks_used").set(used as f64);
    // Cached-only blocks are evictable on demand, so they count as free (as
    // vLLM's kv_cache_usage_perc counts them).
    gauge!("sluice_kv_cache_usage_ratio").set(if total == 0 { 0.0 } else { used as f64 / total as f64 });
    gauge!("sluice_prefix_cache_tree_blocks").set(s.kv.tree_blocks() as f64);
}

pub(crate) fn step(s: &mut Scheduler, plan: &StepPlan, elapsed: Duration) {
    s.stats.evicted_blocks = s.kv.evicted;
    counter!("sluice_scheduler_steps_total").increment(1);
    histogram!("sluice_step_duration_seconds").record(elapsed.as_secs_f64());
    histogram!("sluice_batch_tokens").record(plan.tokens() as f64);
    histogram!("sluice_batch_size").record(plan.entries.len() as f64);
}

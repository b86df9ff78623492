//! The trace of a step (see telemetry.rs for the span tree): the step span
//! is a child of the first request's span and links to every request span
//! of the batch; each request's span gets a `step` event.

use opentelemetry::trace::TraceContextExt as _;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::client::StepTrace;
use crate::telemetry::{self, format_traceparent, span_context, MAX_STEP_LINKS};

use super::step::StepPlan;
use super::Scheduler;

impl Scheduler {
    /// Ends the queue span of every request computed in `plan` and, when
    /// tracing is on, opens the step span. The returned span must live
    /// until the step's result is applied.
    pub(crate) fn trace_step(&mut self, plan: &StepPlan) -> (tracing::Span, StepTrace) {
        for entry in &plan.entries {
            if let Some(index) = self.position(entry.id) {
                self.running[index].queue_span = None;
            }
        }
        if !telemetry::enabled() {
            return (tracing::Span::none(), StepTrace::default());
        }
        let requests: Vec<(&super::Request, usize)> = plan
            .entries
            .iter()
            .filter_map(|e| self.position(e.id).map(|i| (&self.running[i], e.query_len())))
            .collect();
        let prefill_tokens: usize = plan.entries.iter().filter(|e| e.is_new || e.num_new_tokens > 1).map(|e| e.num_new_tokens).sum();
        let parent = requests.first().and_then(|(r, _)| r.span.id());
        let span = tracing::debug_span!(
            parent: parent,
            "step",
            sluice.step.batch_size = plan.entries.len(),
            sluice.step.new_tokens = plan.tokens(),
            sluice.step.prefill_tokens = prefill_tokens,
            sluice.step.finished = plan.finished_ids.len(),
            // As i64: the exporter writes unsigned integers as strings.
            sluice.step.decode_steps = plan.entries.iter().map(|e| e.decode_steps).max().unwrap_or(1) as i64,
        );
        let mut links = Vec::new();
        for (r, num_new_tokens) in &requests {
            tracing::debug!(parent: &r.span, new_tokens = num_new_tokens, computed = r.num_computed_tokens, "step");
            if links.len() < MAX_STEP_LINKS {
                let cx = span_context(&r.span);
                if let Some(value) = format_traceparent(&cx) {
                    span.add_link(cx);
                    links.push(value);
                }
            }
        }
        let traceparent = format_traceparent(&span.context().span().span_context().clone());
        (span, StepTrace { traceparent, links })
    }
}

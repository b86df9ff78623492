//! Applying a step's result: advance computed tokens, stream events, stop
//! requests (EOS, max_new_tokens, a shard error).
//!
//! Every block a step fills enters the prefix tree at once (a full block is
//! never written again), so requests sharing a prefix with a running one
//! reuse it without waiting for it to finish. A finished request's computed
//! KV (prompt + generated, except the token sampled last, which has no KV
//! yet) is then already cached, so a follow-up turn of the same conversation
//! starts from cache.

use std::collections::HashMap;
use std::time::Instant;

use crate::client::ClientError;
use crate::infer::{FinishReason, GeneratedToken, InferError, InferEvent, TokenCounts, TokenLogprob};
use crate::pb;

use super::step::StepPlan;
use super::Scheduler;

impl Scheduler {
    pub(crate) fn apply(&mut self, plan: StepPlan, result: Result<pb::StepResponse, ClientError>, started: Instant) {
        let elapsed = started.elapsed();
        self.stats.steps += 1;
        self.stats.step_in_flight_since = None;
        self.stats.last_step_finished = Some(Instant::now());
        self.stats.evicted_blocks = self.kv.evicted;
        crate::metrics::step_finished(elapsed, plan.entries.len(), plan.tokens());
        match result {
            Ok(response) => self.apply_response(plan, response),
            Err(error) => self.fail_step(plan, error),
        }
        self.publish_occupancy();
        self.notify_drained();
    }

    /// The whole step failed: every request in it fails (the client reads
    /// the error), the others keep running, and the tree is emptied because
    /// the shard's KV can no longer be trusted.
    fn fail_step(&mut self, plan: StepPlan, error: ClientError) {
        tracing::error!(%error, requests = plan.entries.len(), "step failed");
        crate::metrics::step_failed();
        let message = error.to_string();
        // The shard may not have dropped them: say it again next step (a
        // shard ignores finished ids it does not hold).
        self.finished.extend(&plan.finished_ids);
        for entry in &plan.entries {
            let Some(index) = self.position(entry.id) else { continue };
            let mut r = self.running.remove(index);
            r.send(Err(InferError::Generation(message.clone())));
            // The shard may or may not hold state for it: drop it to be sure
            // (a shard ignores finished ids it does not know).
            r.on_shard = true;
            self.retire(r, false);
        }
        self.kv.clear_cache();
    }

    fn apply_response(&mut self, plan: StepPlan, response: pb::StepResponse) {
        let mut generations: HashMap<u64, pb::Generation> =
            response.generations.into_iter().map(|g| (g.id, g)).collect();
        let errors: HashMap<u64, String> = response.errors.into_iter().map(|e| (e.id, e.message)).collect();
        let mut sampled = 0;
        for entry in plan.entries {
            let Some(index) = self.position(entry.id) else { continue };
            if let Some(message) = errors.get(&entry.id) {
                // The shard dropped its state; the KV it wrote is suspect, so
                // nothing is cached and the blocks go back with the request.
                let r = self.running.remove(index);
                tracing::warn!(id = r.id, %message, "request failed on the shard");
                r.send(Err(InferError::Generation(message.clone())));
                continue;
            }
            let r = &mut self.running[index];
            r.on_shard = true;
            let bs = self.config.block_size as usize;
            let filled_before = r.num_computed_tokens / bs;
            r.num_computed_tokens += entry.num_new_tokens;
            if r.num_computed_tokens / bs > filled_before {
                // Blocks this step filled are final: cache them now, not at
                // the end, so requests admitted while this one still runs
                // (concurrent users of one system prompt) reuse them.
                self.kv.cache_full_blocks(&r.blocks, r.computed_tokens());
            }
            if r.num_computed_tokens < r.tokens.len() {
                continue; // a prefill chunk
            }
            let Some(generation) = generations.remove(&entry.id) else {
                let r = self.running.remove(index);
                r.send(Err(InferError::Generation("the shard returned no token".into())));
                self.retire(r, false);
                continue;
            };
            sampled += 1;
            self.on_token(index, generation);
        }
        if sampled > 0 {
            self.window.record(Instant::now(), TokenCounts { output: sampled, ..Default::default() });
        }
        if !generations.is_empty() {
            tracing::warn!(ids = ?generations.keys().collect::<Vec<_>>(), "tokens for requests that did not sample");
        }
    }

    /// Streams one sampled token and stops the request when it is done.
    fn on_token(&mut self, index: usize, g: pb::Generation) {
        let eos = &self.config.eos_token_ids;
        let r = &mut self.running[index];
        let mut alive = true;
        if !r.prefill_sent {
            r.prefill_sent = true;
            alive &= r.send(Ok(InferEvent::Prefill {
                cached_tokens: r.cached_tokens,
                prompt_logprobs: g.prompt_logprobs.iter().map(token_logprob).collect(),
                queued: r.queued,
                started: r.started.unwrap_or(r.queued),
            }));
        }
        let is_eos = eos.contains(&g.token_id);
        r.tokens.push(g.token_id);
        alive &= r.send(Ok(InferEvent::Token(GeneratedToken {
            token_id: g.token_id,
            logprob: if r.request.logprobs || r.request.top_n_tokens > 0 { g.logprob } else { f32::NAN },
            top_tokens: g.top_tokens.iter().map(token_logprob).collect(),
            is_eos,
        })));
        let reason = if is_eos && !r.request.ignore_eos {
            Some(FinishReason::Eos)
        } else if r.generated() >= r.request.max_new_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        if let Some(reason) = reason {
            r.send(Ok(InferEvent::End { reason, generated_tokens: r.generated() }));
        }
        if reason.is_some() || !alive {
            let r = self.running.remove(index);
            self.retire(r, true);
        }
    }
}

fn token_logprob(t: &pb::TokenLogprob) -> TokenLogprob {
    TokenLogprob { token_id: t.token_id, logprob: t.logprob }
}

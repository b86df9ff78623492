//! Applying a step's result: advance computed tokens, stream events, stop
//! requests (EOS, max_new_tokens, a shard error).
//!
//! A request that sent a draft gets its accepted drafts and one more token
//! (1..=1 + draft tokens, streamed one event each, stopping at EOS or
//! max_new_tokens). Its KV then covers every emitted token but the last, and
//! its table is cut to the blocks holding that KV; the slots of rejected
//! drafts go back with the blocks cut off, and only computed tokens are ever
//! offered to the prefix tree.
//!
//! ```text
//!  before   tokens [0, L)  computed L-1   blocks for L + K slots (K drafts)
//!  emitted  a accepted drafts + 1
//!  after    tokens [0, L+a+1)  computed L+a   blocks ceil((L+a) / bs)
//! ```
//!
//! A multi-step decode (multistep.rs) emits 1..=decode_steps tokens the
//! same way: each draw's input token got its KV, the last one's did not.
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
use crate::infer::{FinishReason, GeneratedToken, InferEvent, TokenCounts, TokenLogprob};
use crate::pb;

use super::step::{Planned, StepPlan};
use super::Scheduler;

impl Scheduler {
    pub(crate) fn apply(&mut self, plan: StepPlan, result: Result<pb::StepResponse, ClientError>, started: Instant) {
        let elapsed = started.elapsed();
        self.stats.steps += 1;
        self.stats.step_in_flight_since = None;
        self.stats.step_deadline = None;
        self.stats.last_step_finished = Some(Instant::now());
        self.stats.evicted_blocks = self.kv.evicted;
        crate::metrics::step_finished(elapsed, plan.entries.len(), plan.tokens());
        self.share_step_cost(&plan, elapsed);
        match result {
            Ok(response) => self.apply_response(plan, response, elapsed),
            Err(error) => self.fail_step(plan, error),
        }
        self.publish_occupancy();
        self.notify_drained();
    }

    /// With adapters on and `--hourly-cost` set: the step's cost, shared out
    /// to the adapters of its requests by the tokens each computed.
    fn share_step_cost(&self, plan: &StepPlan, elapsed: std::time::Duration) {
        let Some(hourly) = self.config.hourly_cost.filter(|_| self.adapters.enabled()) else { return };
        let tokens = plan.tokens();
        if tokens == 0 {
            return;
        }
        let per_token = hourly / 3600.0 * elapsed.as_secs_f64() / tokens as f64;
        let mut by_adapter: HashMap<&str, usize> = HashMap::new();
        for entry in &plan.entries {
            let Some(index) = self.position(entry.id) else { continue };
            let name = self.running[index].adapter.map_or("", |a| self.adapters.name(a));
            *by_adapter.entry(name).or_default() += entry.query_len();
        }
        for (name, tokens) in by_adapter {
            crate::metrics::adapter_cost(name, per_token * tokens as f64);
        }
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
            r.send(Err(r.shard_failure(&message)));
            // The shard may or may not hold state for it: drop it to be sure
            // (a shard ignores finished ids it does not know).
            r.on_shard = true;
            self.retire(r, false);
        }
        self.kv.clear_cache();
    }

    fn apply_response(&mut self, plan: StepPlan, response: pb::StepResponse, elapsed: std::time::Duration) {
        let step_tokens = plan.tokens().max(1) as f64;
        let mut generations: HashMap<u64, Vec<pb::Generation>> = HashMap::new();
        for g in response.generations {
            generations.entry(g.id).or_default().push(g);
        }
        let errors: HashMap<u64, String> = response.errors.into_iter().map(|e| (e.id, e.message)).collect();
        let mut sampled = 0;
        for entry in plan.entries {
            let Some(index) = self.position(entry.id) else { continue };
            if let Some(message) = errors.get(&entry.id) {
                // The shard dropped its state; the KV it wrote is suspect, so
                // nothing is cached and the blocks go back with the request.
                let r = self.running.remove(index);
                r.send(Err(r.shard_failure(message)));
                continue;
            }
            let r = &mut self.running[index];
            r.on_shard = true;
            // The step's time, split by the tokens each request computed.
            r.compute += elapsed.mul_f64(entry.query_len() as f64 / step_tokens);
            let filled_before = r.num_computed_tokens / self.config.block_size as usize;
            r.num_computed_tokens += entry.num_new_tokens;
            if r.num_computed_tokens < r.tokens.len() {
                self.cache_filled(index, filled_before);
                continue; // a prefill chunk
            }
            let emitted = generations.remove(&entry.id).unwrap_or_default();
            if let Err(message) = check_emitted(&entry, &emitted) {
                self.cache_filled(index, filled_before);
                let r = self.running.remove(index);
                r.send(Err(r.shard_failure(&message)));
                self.retire(r, false);
                continue;
            }
            sampled += emitted.len() as u64;
            if !entry.draft.is_empty() {
                self.record_draft(index, entry.draft.len(), emitted.len() - 1);
            }
            self.on_tokens(index, emitted, filled_before);
        }
        if sampled > 0 {
            self.window.record(Instant::now(), TokenCounts { output: sampled, ..Default::default() });
        }
        if !generations.is_empty() {
            tracing::warn!(ids = ?generations.keys().collect::<Vec<_>>(), "tokens for requests that did not sample");
        }
    }

    /// Blocks this step filled are final: cache them now, not at the end, so
    /// requests admitted while this one still runs (concurrent users of one
    /// system prompt) reuse them.
    fn cache_filled(&mut self, index: usize, filled_before: usize) {
        let r = &self.running[index];
        if r.num_computed_tokens / self.config.block_size as usize > filled_before {
            self.kv.cache_full_blocks(&r.blocks, r.namespace(), r.computed_tokens());
        }
    }

    /// Streams the tokens a step emitted for a request (one, accepted
    /// drafts + one, or several draws of a multi-step decode), stops it when
    /// it is done, and cuts its table to its computed KV.
    fn on_tokens(&mut self, index: usize, emitted: Vec<pb::Generation>, filled_before: usize) {
        let mut done = false;
        for g in emitted {
            if self.on_token(index, g) {
                done = true;
                break;
            }
        }
        let r = &mut self.running[index];
        // Every emitted token but the last has its KV (a draft, or the
        // input of the next draw).
        r.num_computed_tokens = r.tokens.len() - 1;
        let keep = r.num_computed_tokens.div_ceil(self.config.block_size as usize);
        r.blocks.truncate(keep);
        self.cache_filled(index, filled_before);
        if done {
            let r = self.running.remove(index);
            self.retire(r, true);
        }
    }

    /// Streams one sampled token; true when the request is done (finished,
    /// or its client is gone).
    fn on_token(&mut self, index: usize, g: pb::Generation) -> bool {
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
            r.send(Ok(InferEvent::End { reason, generated_tokens: r.generated(), compute: r.compute }));
        }
        reason.is_some() || !alive
    }
}

/// What a request's tokens from the shard must look like: at least one,
/// at most its multi-step draws, and with a draft, its accepted prefix
/// followed by one token.
fn check_emitted(entry: &Planned, emitted: &[pb::Generation]) -> Result<(), String> {
    if emitted.is_empty() {
        return Err("the shard returned no token".into());
    }
    if entry.decode_steps > 1 {
        if emitted.len() > entry.decode_steps {
            return Err(format!("the shard returned {} tokens for {} decode steps", emitted.len(), entry.decode_steps));
        }
        return Ok(());
    }
    let draft = &entry.draft;
    let accepted = emitted.len() - 1;
    if accepted > draft.len() || emitted[..accepted].iter().zip(draft).any(|(g, &d)| g.token_id != d) {
        return Err(format!("the shard returned {} tokens that do not extend a draft of {}", emitted.len(), draft.len()));
    }
    Ok(())
}

fn token_logprob(t: &pb::TokenLogprob) -> TokenLogprob {
    TokenLogprob { token_id: t.token_id, logprob: t.logprob }
}

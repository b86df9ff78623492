//! Multi-step decode: while every running request is decoding and nobody
//! waits, the router has nothing to decide between two steps, so one Step
//! asks the shard for several tokens per request and the round trip (the
//! RPC, the hand-off to the shard's model thread, applying the result) is
//! paid once for all of them. On a 135M model on 2 CPU cores that round
//! trip is about a third of a decode step.
//!
//! ```text
//!  one token per Step    ──Step──►[draw]──►apply ──Step──►[draw]──►apply …
//!  decode_steps = 4      ──Step──►[draw][draw][draw][draw]──►apply …
//! ```
//!
//! Each request draws at most what it still may (`max_new_tokens`), and the
//! shard stops it after an EOS token (unless it ignores EOS); stop strings
//! are the router's, so a request may draw a few tokens past one, which are
//! dropped with it. Its table gets blocks for every slot the draws write
//! (L + n - 1 for n draws after L tokens), from free blocks only: multi-step
//! never preempts a request or evicts a cached block, it draws fewer. After
//! the step the table is cut to the blocks of its computed KV, as after a
//! speculative step (apply.rs).
//!
//! The steps of one Step take at most about [`WINDOW`] together (predicted
//! from the steps run, cost.rs): a request that arrives meanwhile waits for
//! them, and streams receive their tokens in bursts of that length.

use std::time::Duration;

use super::step::StepPlan;
use super::Scheduler;

/// The longest the draws of one Step should take together.
pub(crate) const WINDOW: Duration = Duration::from_millis(100);

impl Scheduler {
    /// Gives every decode of `plan` several draws when nothing else needs
    /// the router between them (see the module comment).
    pub(crate) fn plan_decode_steps(&mut self, plan: &mut StepPlan) {
        let most = self.config.decode_steps as usize;
        if most <= 1 || !self.waiting.is_empty() || plan.entries.len() != self.running.len() {
            return;
        }
        let plain = |e: &super::step::Planned| !e.is_new && e.num_new_tokens == 1 && e.draft.is_empty();
        if !plan.entries.iter().all(plain) {
            return;
        }
        if self.running.iter().any(|r| r.remaining() != 1 || r.request.grammar.is_some() || r.wants_prompt_logprobs()) {
            return;
        }
        // Before the first step there is no cost to go by: one draw.
        let Some(step) = self.costs.predict(plan.tokens()) else { return };
        let steps = if step > 0.0 { (WINDOW.as_secs_f64() / step) as usize } else { most };
        let steps = steps.clamp(1, most);
        if steps == 1 {
            return;
        }
        let bs = self.config.block_size as usize;
        for entry in &mut plan.entries {
            let index = self.position(entry.id).expect("planned requests are running");
            let r = &mut self.running[index];
            let allowed = r.request.max_new_tokens.saturating_sub(r.generated()) as usize;
            let draws = steps.min(allowed);
            if draws <= 1 {
                continue;
            }
            // n draws after L tokens write the KV of positions L-1 .. L+n-2.
            let slots = r.tokens.len() + draws - 1;
            let wanted = slots.div_ceil(bs).saturating_sub(r.blocks.len());
            self.kv.allocate_free(&mut r.blocks, wanted);
            entry.decode_steps = draws.min(r.blocks.len() * bs + 1 - r.tokens.len());
        }
    }
}

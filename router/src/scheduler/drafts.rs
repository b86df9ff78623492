//! The scheduler's side of speculation (speculation.rs has the proposer and
//! the adaptive length): a decoding request's draft for this step, with
//! free blocks for its slots, and what the shard made of it.

use super::speculation::propose;
use super::Scheduler;

impl Scheduler {
    /// The draft of decoding request `id` for this step, with blocks for its
    /// slots already in the request's table: at most `spare` tokens, and
    /// no more than fill a step of `step_tokens` tokens (without the draft)
    /// to `--speculate-max-step-tokens`.
    pub(crate) fn draft(&mut self, id: u64, spare: usize, step_tokens: usize) -> Vec<u32> {
        let Some(spec) = self.config.speculation.as_ref() else { return Vec::new() };
        let spare = spare.min(spec.max_step_tokens.saturating_sub(step_tokens));
        if self.running.len() > spec.max_batch_size || spare == 0 {
            return Vec::new();
        }
        let (max_tokens, ngram_min, ngram_max) = (spec.max_tokens, spec.ngram_min, spec.ngram_max);
        let bs = self.config.block_size as usize;
        let index = self.position(id).expect("drafting for a running request");
        let r = &mut self.running[index];
        // A constrained request samples under its grammar's mask, which the
        // shard computes for the generated tokens only: no drafts for it.
        if r.request.grammar.is_some() {
            return Vec::new();
        }
        // A step emits at most 1 + draft tokens: never past max_new_tokens.
        let left = r.request.max_new_tokens.saturating_sub(r.generated() + 1) as usize;
        let k = r.speculation.k(max_tokens).min(left).min(spare);
        let mut draft = propose(&r.tokens, k, ngram_min, ngram_max);
        if draft.is_empty() {
            return draft;
        }
        let slots = r.tokens.len() + draft.len();
        let needed = slots.div_ceil(bs).saturating_sub(r.blocks.len());
        self.kv.allocate_free(&mut r.blocks, needed);
        draft.truncate((r.blocks.len() * bs).saturating_sub(r.tokens.len()));
        draft
    }

    /// Running request `index` had `accepted` of its `proposed` draft tokens
    /// accepted.
    pub(crate) fn record_draft(&mut self, index: usize, proposed: usize, accepted: usize) {
        let max_tokens = self.config.speculation.as_ref().map_or(0, |s| s.max_tokens);
        self.running[index].speculation.record(proposed, accepted, max_tokens);
        self.stats.speculative_proposed_tokens += proposed as u64;
        self.stats.speculative_accepted_tokens += accepted as u64;
        crate::metrics::draft_verified(proposed, accepted);
    }
}

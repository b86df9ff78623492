//! Blocks on demand, and preemption when there are none.
//!
//! A running request gets a block when its next slot crosses into one it
//! does not have:
//!
//! ```text
//!  block_size 4, num_computed_tokens 8, computing 1 token (slot 8):
//!  blocks [b0 b1] cover slots [0, 8) -> slot 8 needs a third block b2
//! ```
//!
//! When the allocator is dry even after evicting cached blocks, the most
//! recently admitted running request is preempted: its blocks go back (full
//! ones into the tree, so its resumption is mostly a cache hit) and it
//! returns to the front of the queue with prompt + generated tokens. The
//! client sees only a pause: tokens already sent are not sent again.

use super::step::StepPlan;
use super::Scheduler;

impl Scheduler {
    /// Blocks needed to hold `tokens` slots.
    pub(crate) fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size as usize)
    }

    /// Gives running request `id` blocks for up to `want` more tokens and
    /// returns how many it can compute: `want`, fewer when only some blocks
    /// were found (a shorter prefill chunk), or 0 when it was preempted
    /// itself. Newer requests are preempted (and taken out of `plan`, their
    /// tokens refunded to `budget`) until at least one token fits.
    pub(crate) fn grow(&mut self, plan: &mut StepPlan, budget: &mut usize, id: u64, want: usize) -> usize {
        let bs = self.config.block_size as usize;
        loop {
            let index = self.position(id).expect("growing a running request");
            let r = &self.running[index];
            let needed = self.blocks_for(r.num_computed_tokens + want).saturating_sub(r.blocks.len());
            let r = &mut self.running[index];
            self.kv.allocate(&mut r.blocks, needed);
            let fits = (r.blocks.len() * bs).saturating_sub(r.num_computed_tokens).min(want);
            if fits > 0 {
                return fits;
            }
            let victim = self.running.iter().max_by_key(|r| r.admitted).expect("non-empty").id;
            if let Some(entry) = plan.remove(victim) {
                *budget += entry.query_len();
            }
            self.preempt(victim);
            if victim == id {
                return 0;
            }
        }
    }

    pub(crate) fn preempt(&mut self, id: u64) {
        let index = self.position(id).expect("preempting a running request");
        let mut r = self.running.remove(index);
        tracing::debug!(id, generated = r.generated(), "preempted: out of KV blocks");
        if r.on_shard {
            self.finished.push(r.id);
        }
        // Its full blocks stay cached, so resuming is mostly a cache hit.
        self.kv.cache_full_blocks(&r.blocks, r.computed_tokens());
        r.blocks.clear();
        r.num_computed_tokens = 0;
        r.on_shard = false;
        r.resumed = true;
        self.waiting.push_front(r);
        self.stats.preemptions += 1;
        crate::metrics::preempted();
    }
}

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
//! When the allocator is dry even after evicting cached blocks, a running
//! request is preempted: the least important one, [`victim_key`] order
//! (batch lines first, then the highest `priority` number, then the most
//! recently admitted). Its blocks go back (full ones into the tree, so its
//! resumption is mostly a cache hit) and it returns to the front of the
//! queue with prompt + generated tokens. The client sees only a pause:
//! tokens already sent are not sent again.
//!
//! An interactive request that finds no room at admission preempts batch
//! lines the same way, down to the batch floor (share.rs).

use super::request::Request;
use super::share::BatchFloor;
use super::step::StepPlan;
use super::Scheduler;
use crate::infer::RequestClass;

/// The running request with the largest key is preempted first.
fn victim_key(r: &Request) -> (RequestClass, i32, u64) {
    (r.class(), r.request.priority, r.admitted)
}

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
            let victim = self.running.iter().max_by_key(|r| victim_key(r)).expect("non-empty").id;
            self.preempt_planned(plan, budget, victim);
            if victim == id {
                return 0;
            }
        }
    }

    /// Preempts the newest batch line if more than the floor's run (for an
    /// interactive request that found no room); false when none may go.
    pub(crate) fn preempt_batch_line(&mut self, plan: &mut StepPlan, budget: &mut usize, floor: &BatchFloor) -> bool {
        if self.running_of(RequestClass::Batch) <= floor.slots {
            return false;
        }
        let victim = self
            .running
            .iter()
            .filter(|r| r.class() == RequestClass::Batch)
            .max_by_key(|r| victim_key(r))
            .expect("a batch line runs")
            .id;
        self.preempt_planned(plan, budget, victim);
        true
    }

    /// Preempts `id`, taking it out of `plan` (its tokens back to `budget`).
    fn preempt_planned(&mut self, plan: &mut StepPlan, budget: &mut usize, id: u64) {
        if let Some(entry) = plan.remove(id) {
            *budget += entry.query_len();
        }
        self.preempt(id);
    }

    pub(crate) fn preempt(&mut self, id: u64) {
        let index = self.position(id).expect("preempting a running request");
        let mut r = self.running.remove(index);
        tracing::debug!(id, generated = r.generated(), class = ?r.class(), "preempted");
        if r.on_shard {
            self.finished.push(r.id);
        }
        // Its full blocks stay cached, so resuming is mostly a cache hit.
        self.kv.cache_full_blocks(&r.blocks, r.namespace(), r.computed_tokens());
        r.blocks.clear();
        r.num_computed_tokens = 0;
        r.on_shard = false;
        r.resumed = true;
        self.waiting.push_front(r);
        self.stats.preemptions += 1;
        crate::metrics::preempted();
    }
}

//! Admitting waiting requests into the running batch.
//!
//! A request is admitted while the step has token budget, the batch has
//! room, and blocks can be found for its first chunk (admission never
//! preempts: running requests come first). Its prompt is walked down the
//! prefix tree and every fully matching block is reused:
//!
//! ```text
//!  block_size 4, prompt of 10 tokens, tree holds its first 2 blocks
//!  tokens   [ t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 ]
//!  blocks   [    b7       |    b3       | fresh ]    num_computed_tokens = 8
//!
//!  prompt of exactly 8 tokens, both blocks cached:
//!  only b7 is reused (num_computed_tokens = 4) and the second block is recomputed
//!  into a fresh block: a token must be computed to get logits, and the
//!  block holding it would be written; a shared block is never written.
//! ```
//!
//! So at most `(len - 1) / block_size` blocks are reused.

use std::time::Instant;

use super::queue::admission_order;
use super::step::{Planned, StepPlan};
use super::Scheduler;
use crate::infer::TokenCounts;

impl Scheduler {
    pub(crate) fn admit(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        if self.waiting.is_empty() || *budget == 0 || self.running.len() >= self.config.max_batch_size as usize {
            return; // ranking walks the tree for every waiting request
        }
        let order = admission_order(self.waiting.iter(), &self.kv);
        let mut latest_admitted = None;
        let mut looked_up = TokenCounts::default();
        for id in order {
            if *budget == 0 || self.running.len() >= self.config.max_batch_size as usize {
                break;
            }
            let index = self.waiting.iter().position(|r| r.id == id).expect("ranked from waiting");
            let mut r = self.waiting.remove(index).expect("index is in range");
            let bs = self.config.block_size as usize;

            let reusable = if r.wants_prompt_logprobs() { 0 } else { (r.tokens.len() - 1) / bs };
            self.kv.acquire_prefix(&mut r.blocks, &r.tokens, reusable);
            r.num_computed_tokens = r.blocks.len() * bs;
            let want = r.remaining().min(*budget);
            let needed = self.blocks_for(r.num_computed_tokens + want) - r.blocks.len();
            self.kv.allocate(&mut r.blocks, needed);
            let num_new_tokens = (r.blocks.len() * bs - r.num_computed_tokens).min(want);
            if num_new_tokens == 0 {
                // Not even one token fits: give the blocks back and wait.
                r.blocks.clear();
                r.num_computed_tokens = 0;
                self.waiting.insert(index, r);
                break;
            }

            if self.kv.caching() && !r.wants_prompt_logprobs() {
                self.stats.prefix_lookup_tokens += r.tokens.len() as u64;
                self.stats.prefix_hit_tokens += r.num_computed_tokens as u64;
                crate::metrics::prefix_lookup(r.tokens.len() as u64, r.num_computed_tokens as u64);
                looked_up.prompt += r.tokens.len() as u64;
                looked_up.cached_prompt += r.num_computed_tokens as u64;
            }
            if !r.prefill_sent {
                r.cached_tokens = r.num_computed_tokens as u32;
            }
            r.started.get_or_insert_with(Instant::now);
            r.admitted = self.next_admission;
            self.next_admission += 1;
            r.resumed = false;
            tracing::debug!(id, cached = r.num_computed_tokens, num_new_tokens, "admitted");
            *budget -= num_new_tokens;
            plan.entries.push(Planned { id, num_new_tokens, is_new: true, first_new_block: 0, draft: Vec::new() });
            self.running.push(r);
            latest_admitted = latest_admitted.max(Some(id));
        }
        if looked_up.prompt > 0 {
            self.window.record(Instant::now(), looked_up);
        }
        if let Some(latest) = latest_admitted {
            // Ids follow arrival: an older request still waiting was passed
            // over by a younger one.
            for r in self.waiting.iter_mut().filter(|r| r.id < latest) {
                r.passed_over += 1;
            }
        }
    }
}

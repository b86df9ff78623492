//! Admitting waiting requests into the running batch.
//!
//! A request is admitted while the step has token budget, the batch has
//! room, and blocks can be found for its first chunk. Admission never
//! preempts an interactive request (running requests come first), but an
//! interactive request that finds no slot or no blocks preempts batch lines
//! (newest first) down to their floor (share.rs). Batch lines, ranked last,
//! take only what is left, except the floor that stays theirs: they may pass
//! an interactive request that did not fit only while fewer than the floor's
//! slots run.
//!
//! Its prompt is walked down the prefix tree and every fully matching block
//! is reused:
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
//!
//! A request for a LoRA adapter waits until its adapter is in a slot
//! (adapter_work.rs loads it before the step is built, in admission order:
//! interactive requests' adapters before batch lines'); the blocks it may
//! reuse are those its adapter computed (its prefix-cache namespace). Slots
//! that running requests use cannot be reloaded, so steady traffic on loaded
//! adapters could keep another adapter out forever: once a request (of
//! either class) waiting for an adapter not in a slot has been passed over
//! `MAX_PASSED_OVER` times, no other adapter request is admitted until it is
//! (base-model requests still are), and the running ones drain their slots.

// The admit functions hand an unadmitted request back in their `Err`, moved
// in and out: boxing it there would allocate for every request passed over.
#![allow(clippy::result_large_err)]

use std::time::Instant;

use super::queue::{admission_order, MAX_PASSED_OVER};
use super::request::Request;
use super::share::BatchFloor;
use super::step::{Planned, StepPlan};
use super::Scheduler;
use crate::infer::{RequestClass, TokenCounts};

impl Scheduler {
    pub(crate) fn admit(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        if self.waiting.is_empty() || *budget == 0 {
            return; // ranking walks the tree for every waiting request
        }
        let order = admission_order(self.waiting.iter(), &self.kv);
        let floor = self.batch_floor();
        let loaded = |adapters: &super::Adapters, r: &Request| r.adapter.is_none_or(|a| adapters.slot_of(a).is_some());
        let starving = self.waiting.iter().any(|r| r.passed_over >= MAX_PASSED_OVER && !loaded(&self.adapters, r));
        // Per class: the youngest request admitted (fairness bookkeeping).
        let mut latest_admitted: [Option<u64>; 2] = [None; 2];
        let mut looked_up = TokenCounts::default();
        // An interactive request did not fit: later ones wait behind it.
        let mut blocked = false;
        for id in order {
            if *budget == 0 {
                break;
            }
            let index = self.waiting.iter().position(|r| r.id == id).expect("ranked from waiting");
            let class = self.waiting[index].class();
            let adapter = self.waiting[index].adapter;
            if !loaded(&self.adapters, &self.waiting[index]) || (starving && adapter.is_some()) {
                continue; // its adapter is not loaded yet, or another must get a slot first
            }
            if class == RequestClass::Interactive && blocked {
                continue;
            }
            if class == RequestClass::Batch && blocked && self.running_of(RequestClass::Batch) >= floor.slots {
                break;
            }
            let r = self.waiting.remove(index).expect("index is in range");
            let admitted = match class {
                RequestClass::Interactive => self.admit_interactive(r, plan, budget, &floor),
                RequestClass::Batch => {
                    let room = self.batch_room(plan, *budget);
                    self.admit_batch(r, room)
                }
            };
            let (mut r, num_new_tokens) = match admitted {
                Ok(admitted) => admitted,
                Err((r, pushed)) => {
                    // Back where it was (behind the batch lines preempted
                    // to the front meanwhile).
                    self.waiting.insert(index + pushed, r);
                    match class {
                        RequestClass::Interactive => {
                            blocked = true;
                            continue;
                        }
                        RequestClass::Batch => break,
                    }
                }
            };

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
            if let Some(adapter) = adapter {
                self.adapters.touch(adapter);
            }
            tracing::debug!(id, cached = r.num_computed_tokens, num_new_tokens, ?class, "admitted");
            *budget -= num_new_tokens;
            plan.entries.push(Planned { id, num_new_tokens, is_new: true, first_new_block: 0, draft: Vec::new(), decode_steps: 1 });
            self.running.push(r);
            let latest = &mut latest_admitted[class as usize];
            *latest = (*latest).max(Some(id));
        }
        if looked_up.prompt > 0 {
            self.window.record(Instant::now(), looked_up);
        }
        for r in self.waiting.iter_mut() {
            // Ids follow arrival: an older request still waiting was passed
            // over by a younger one of its class.
            if latest_admitted[r.class() as usize].is_some_and(|latest| r.id < latest) {
                r.passed_over += 1;
            }
        }
    }

    /// An interactive request gets a slot and its first chunk, preempting
    /// batch lines above their floor when there is no room otherwise.
    /// `Err` gives it back with the number of lines preempted to the front
    /// of the queue meanwhile.
    fn admit_interactive(
        &mut self,
        mut r: Request,
        plan: &mut StepPlan,
        budget: &mut usize,
        floor: &BatchFloor,
    ) -> Result<(Request, usize), (Request, usize)> {
        let max_batch = self.config.max_batch_size as usize;
        let mut pushed = 0;
        loop {
            let batch_running = self.running_of(RequestClass::Batch);
            let has_slot = self.running.len() < max_batch
                && self.running.len() - batch_running < max_batch - floor.slots;
            // The floor's tokens stay free for waiting batch lines.
            let reserved = if self.waiting.iter().any(|w| w.class() == RequestClass::Batch) {
                floor.tokens.saturating_sub(self.planned_tokens(plan, RequestClass::Batch))
            } else {
                0
            };
            let allowed = budget.saturating_sub(reserved);
            if has_slot && allowed > 0 {
                let num_new_tokens = self.first_chunk(&mut r, allowed);
                if num_new_tokens > 0 {
                    return Ok((r, num_new_tokens));
                }
            }
            if allowed == 0 || !self.preempt_batch_line(plan, budget, floor) {
                return Err((r, pushed));
            }
            pushed += 1;
        }
    }

    /// A batch line gets a slot and its first chunk only from what is free.
    fn admit_batch(&mut self, mut r: Request, budget: usize) -> Result<(Request, usize), (Request, usize)> {
        if budget == 0 || self.running.len() >= self.config.max_batch_size as usize {
            return Err((r, 0));
        }
        match self.first_chunk(&mut r, budget) {
            0 => Err((r, 0)),
            num_new_tokens => Ok((r, num_new_tokens)),
        }
    }

    /// Gives `r` its cached prefix and blocks for a first chunk of at most
    /// `allowed` tokens; returns the chunk's length. 0: not even one token
    /// fits, and `r` holds nothing again.
    fn first_chunk(&mut self, r: &mut Request, allowed: usize) -> usize {
        let bs = self.config.block_size as usize;
        let reusable = if r.wants_prompt_logprobs() { 0 } else { (r.tokens.len() - 1) / bs };
        let namespace = r.namespace();
        self.kv.acquire_prefix(&mut r.blocks, namespace, &r.tokens, reusable);
        r.num_computed_tokens = r.blocks.len() * bs;
        let want = r.remaining().min(allowed);
        let needed = self.blocks_for(r.num_computed_tokens + want) - r.blocks.len();
        self.kv.allocate(&mut r.blocks, needed);
        let num_new_tokens = (r.blocks.len() * bs - r.num_computed_tokens).min(want);
        if num_new_tokens == 0 {
            r.blocks.clear();
            r.num_computed_tokens = 0;
        }
        num_new_tokens
    }
}

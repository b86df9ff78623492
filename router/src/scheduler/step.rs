//! Building one step: drop cancelled requests, give running requests their
//! decode token (first) or their next prefill chunk, then admit waiting ones.
//!
//! The token budget (`max_batch_prefill_tokens`) counts every token computed
//! this step, a decode as 1. A chunk is cut where the budget (or the blocks
//! that could be found) ends:
//!
//! ```text
//!  budget 8, block_size 4
//!  A decode                 ▇                      1 token
//!  B prefill chunk     [8, 12) of 20 tokens   ▇▇▇▇   4 tokens
//!  C admitted          [0, 3)  of 10 tokens   ▇▇▇    3 tokens (budget ends)
//! ```
//!
//! With speculation on, a decode may carry draft tokens (speculation.rs);
//! they count against the budget too, but only what is left after one token
//! for every other decode of the step, and only as far as free blocks hold
//! their slots: drafts never preempt a request or evict a cached block.

use super::blocks::BlockId;
use crate::pb;

use super::Scheduler;

/// Prompt tokens a step may always read while requests decode, however
/// long the decode stall limit makes it (`step_budget`).
const MIN_CHUNK: usize = 16;

/// One request's part of a step.
#[derive(Debug, Clone)]
pub(crate) struct Planned {
    pub id: u64,
    /// Tokens computed: `tokens[num_computed_tokens .. num_computed_tokens + num_new_tokens]`.
    pub num_new_tokens: usize,
    /// The shard has no state for it: send it whole as a `NewRequest`.
    pub is_new: bool,
    /// `blocks[first_new_block..]` were appended for this step.
    pub first_new_block: usize,
    /// Proposed tokens after the request's last one (speculative decoding),
    /// computed after its `num_new_tokens`.
    pub draft: Vec<u32>,
    /// Tokens the shard may draw for it in this Step, one after another
    /// (multistep.rs); 1 for every entry that is not a plain decode.
    pub decode_steps: usize,
}

impl Planned {
    /// Tokens this entry computes: its own, then its draft.
    pub fn query_len(&self) -> usize {
        self.num_new_tokens + self.draft.len()
    }
}

#[derive(Debug, Default)]
pub(crate) struct StepPlan {
    pub finished_ids: Vec<u64>,
    pub entries: Vec<Planned>,
    /// Most tokens batch lines may compute in this step (share.rs); None:
    /// no interactive request runs, so no limit beyond the budget.
    pub batch_cap: Option<usize>,
}

impl StepPlan {
    /// Nothing to compute (pending `finished_ids` wait for the next step
    /// that computes something; the shard's state for them is inert).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn tokens(&self) -> usize {
        self.entries.iter().map(Planned::query_len).sum()
    }

    /// Forward passes the shard ran for this plan: one, or with multi-step
    /// decode the most tokens it drew for one request.
    pub fn passes(&self, response: &pb::StepResponse) -> u32 {
        if self.entries.iter().all(|e| e.decode_steps <= 1) {
            return 1;
        }
        let mut drawn: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
        for g in &response.generations {
            *drawn.entry(g.id).or_default() += 1;
        }
        drawn.into_values().max().unwrap_or(1).max(1)
    }

    pub fn remove(&mut self, id: u64) -> Option<Planned> {
        let index = self.entries.iter().position(|e| e.id == id)?;
        Some(self.entries.remove(index))
    }
}

impl Scheduler {
    pub(crate) fn build_step(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        self.drop_cancelled();
        let mut budget = self.step_budget();
        plan.batch_cap = self.batch_cap(budget);
        self.schedule_running(&mut plan, &mut budget);
        self.admit(&mut plan, &mut budget);
        self.plan_decode_steps(&mut plan);
        if !plan.is_empty() {
            plan.finished_ids = std::mem::take(&mut self.finished);
        }
        self.publish_occupancy();
        plan
    }

    /// The step's token budget: `--max-batch-prefill-tokens`, but while
    /// requests are decoding only as many tokens as the step is predicted to
    /// compute within `--decode-stall-ms` (cost.rs), and always every decode
    /// plus [`MIN_CHUNK`], so prompts keep moving. Reading a prompt then
    /// takes several steps, each one also a decode step for the others:
    ///
    /// ```text
    ///  1B on 2 cores, ~4.4 ms a prompt token, stall 1 s, 3 streams decoding
    ///  without: [ 3 decodes + 2,048 prompt tokens ]            ~9 s without a token
    ///  with:    [ 3 + 220 ][ 3 + 220 ] ... (10 steps)          ~1 s between tokens
    /// ```
    fn step_budget(&self) -> usize {
        let budget = self.config.max_batch_prefill_tokens as usize;
        let Some(stall) = self.config.decode_stall else { return budget };
        let decodes = self.running.iter().filter(|r| r.remaining() == 1).count();
        if decodes == 0 {
            return budget;
        }
        match self.costs.tokens_within(stall.as_secs_f64(), budget) {
            Some(fits) => fits.max(decodes + MIN_CHUNK).min(budget),
            None => budget,
        }
    }

    /// Requests whose client went away leave now; their computed KV is still
    /// good, so their full blocks are cached.
    fn drop_cancelled(&mut self) {
        self.waiting.retain(|r| !r.is_cancelled());
        let (cancelled, running): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.running).into_iter().partition(|r| r.is_cancelled());
        self.running = running;
        for r in cancelled {
            tracing::debug!(id = r.id, "request cancelled");
            self.retire(r, true);
        }
    }

    /// Takes a request out of the running set's bookkeeping: its shard state
    /// is dropped at the next step, its full blocks enter the tree when its KV
    /// is trustworthy (`cache`), and its blocks go back as it is dropped.
    pub(crate) fn retire(&mut self, r: super::Request, cache: bool) {
        if r.on_shard {
            self.finished.push(r.id);
        }
        if cache {
            self.kv.cache_full_blocks(&r.blocks, r.namespace(), r.computed_tokens());
        }
    }

    /// Decodes first (one token each keeps every stream moving), then the
    /// next chunk of requests still reading their prompt, oldest first.
    fn schedule_running(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        let max_batch = self.config.max_batch_size as usize;
        let decodes: Vec<u64> = self.running.iter().filter(|r| r.remaining() == 1).map(|r| r.id).collect();
        let prefills: Vec<u64> = self.running.iter().filter(|r| r.remaining() > 1).map(|r| r.id).collect();
        let num_decodes = decodes.len();
        for (i, id) in decodes.into_iter().chain(prefills).enumerate() {
            if *budget == 0 || plan.entries.len() >= max_batch {
                break;
            }
            // A request preempted to make room for an older one is gone.
            let Some(index) = self.position(id) else { continue };
            let room = self.chunk_room(plan, *budget, id);
            let want = self.running[index].remaining().min(room);
            if want == 0 {
                continue; // a batch line waits: the step's batch cap or floor is used (share.rs)
            }
            let first_new_block = self.running[index].blocks.len();
            let num_new_tokens = self.grow(plan, budget, id, want);
            if num_new_tokens == 0 {
                continue; // it was preempted itself
            }
            *budget -= num_new_tokens;
            let draft = if i < num_decodes && self.config.speculation.is_some() {
                // Every later decode keeps its one token.
                let later = num_decodes - i - 1;
                // A batch line's drafts count against its cap too.
                let room = budget.saturating_sub(later).min(room - num_new_tokens);
                self.draft(id, room, plan.tokens() + num_new_tokens + later)
            } else {
                Vec::new()
            };
            *budget -= draft.len();
            plan.entries.push(Planned { id, num_new_tokens, is_new: false, first_new_block, draft, decode_steps: 1 });
        }
    }

    pub(crate) fn to_proto(&self, plan: &StepPlan) -> pb::StepRequest {
        let mut request = pb::StepRequest { finished_ids: plan.finished_ids.clone(), ..Default::default() };
        for entry in &plan.entries {
            let r = &self.running[self.position(entry.id).expect("planned requests are running")];
            if entry.is_new {
                let slot = r.adapter.and_then(|a| self.adapters.slot_of(a)).unwrap_or(0);
                request.new_requests.push(r.to_new_request(entry.num_new_tokens, slot));
            } else {
                let new_block_ids: Vec<BlockId> = r.blocks[entry.first_new_block..].to_vec();
                let (decode_steps, stop_token_ids) = match entry.decode_steps {
                    0 | 1 => (0, Vec::new()),
                    n if r.request.ignore_eos => (n as u32, Vec::new()),
                    n => (n as u32, self.config.eos_token_ids.clone()),
                };
                request.scheduled.push(pb::ScheduledRequest {
                    id: entry.id,
                    num_new_tokens: entry.num_new_tokens as u32,
                    new_block_ids,
                    draft_token_ids: entry.draft.clone(),
                    decode_steps,
                    stop_token_ids,
                });
            }
        }
        request
    }
}

//! The batch class's floor (`--batch-min-share`).
//!
//! Batch lines (the Batch API, `batch/`) run in what interactive requests
//! leave: they rank after every interactive request (queue.rs), are admitted
//! only into free slots, blocks and step budget (admission.rs), and are the
//! first preempted (preemption.rs). A steady interactive load would then
//! starve them, so while batch lines are pending a fraction of the running
//! slots and of each step's token budget stays theirs:
//!
//! ```text
//!  max_batch_size 10, share 0.2, batch lines pending:
//!  slots   [ i i i i i i i i | b b ]   interactive at most 8, batch at least 2
//!  budget  [ interactive ... | >= 20% batch ]
//!  an interactive arrival preempts batch lines down to 2, never below
//! ```
//!
//! The floor reserves only what batch lines can use: with none pending,
//! interactive requests may take everything; with fewer pending than the
//! floor's slots, only as many slots are held back.
//!
//! Tokens are not all alike, though: every token a step computes lengthens
//! it, and with it the time between two tokens of every interactive stream
//! in it. So while interactive requests run, batch lines get only as many
//! tokens as keep the step within `--batch-step-slack` of the time its
//! interactive part alone is predicted to take (cost.rs), and at least one,
//! so that they always move:
//!
//! ```text
//!  4 interactive decodes, step ~17 ms, slack 0.1: batch work up to ~18.7 ms
//!  CPU, flat to ~12 tokens   [ i i i i | b b b b b b b b ]   8 batch tokens
//!  the same with a 12-token interactive chunk: ~1 ms of tokens, 1-2 batch tokens
//! ```
//!
//! With no interactive request running, batch lines fill the whole budget.

use super::step::StepPlan;
use super::Scheduler;
use crate::infer::RequestClass;

/// What batch lines may always use while some are pending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchFloor {
    /// Running slots.
    pub slots: usize,
    /// Tokens computed per step.
    pub tokens: usize,
}

impl Scheduler {
    /// The floor now: `--batch-min-share` of the slots and of the step
    /// budget (at least one of each when the share is above 0, and never
    /// all of them), limited to the batch lines there are.
    pub(crate) fn batch_floor(&self) -> BatchFloor {
        let share = self.config.batch_min_share;
        let pending = self.count(RequestClass::Batch);
        if share <= 0.0 || pending == 0 {
            return BatchFloor { slots: 0, tokens: 0 };
        }
        // At least one of each, but never all: interactive requests must
        // always be able to run (so one slot in all holds no floor).
        let of = |total: u32| match total {
            0 | 1 => 0,
            _ => ((f64::from(total) * share).ceil() as usize).clamp(1, total as usize - 1),
        };
        BatchFloor {
            slots: of(self.config.max_batch_size).min(pending),
            tokens: of(self.config.max_batch_prefill_tokens),
        }
    }

    /// Waiting + running requests of `class`.
    pub(crate) fn count(&self, class: RequestClass) -> usize {
        self.waiting.iter().chain(&self.running).filter(|r| r.class() == class).count()
    }

    pub(crate) fn running_of(&self, class: RequestClass) -> usize {
        self.running.iter().filter(|r| r.class() == class).count()
    }

    pub(crate) fn interactive_waiting(&self) -> bool {
        self.waiting.iter().any(|r| r.class() == RequestClass::Interactive)
    }

    /// Tokens `plan` computes for requests of `class`.
    pub(crate) fn planned_tokens(&self, plan: &StepPlan, class: RequestClass) -> usize {
        plan.entries
            .iter()
            .filter(|e| self.position(e.id).is_some_and(|i| self.running[i].class() == class))
            .map(|e| e.query_len())
            .sum()
    }

    /// The step's cap on batch tokens: while interactive requests run, what
    /// fits in `--batch-step-slack` of the predicted time of their part of
    /// the step (at least 1); None when none runs or no batch line waits.
    pub(crate) fn batch_cap(&self, budget: usize) -> Option<usize> {
        if self.count(RequestClass::Batch) == 0 {
            return None;
        }
        // What the interactive requests will compute: a token per decode,
        // their next chunk for the others (as far as the budget goes).
        let mut interactive = None::<usize>;
        for r in self.running.iter().filter(|r| r.class() == RequestClass::Interactive) {
            *interactive.get_or_insert(0) += r.remaining().min(budget);
        }
        let interactive = interactive?.min(budget);
        let room = self.costs.room_within(interactive, self.config.batch_step_slack, budget - interactive);
        Some(room.max(1))
    }

    /// Tokens batch lines may still add to `plan`, out of `budget`.
    pub(crate) fn batch_room(&self, plan: &StepPlan, budget: usize) -> usize {
        match plan.batch_cap {
            Some(cap) => budget.min(cap.saturating_sub(self.planned_tokens(plan, RequestClass::Batch))),
            None => budget,
        }
    }

    /// The most tokens a running request's next decode or prefill chunk may
    /// take from `budget`: all of it for an interactive request. A batch
    /// line gets what the step's batch cap leaves, and while interactive
    /// requests wait, a prefill chunk only what is left of the batch floor
    /// (the rest of the step is theirs to be admitted into).
    pub(crate) fn chunk_room(&self, plan: &StepPlan, budget: usize, id: u64) -> usize {
        let Some(index) = self.position(id) else { return budget };
        let r = &self.running[index];
        if r.class() != RequestClass::Batch {
            return budget;
        }
        let room = self.batch_room(plan, budget);
        if r.remaining() == 1 || !self.interactive_waiting() {
            return room;
        }
        let floor = self.batch_floor().tokens;
        room.min(floor.saturating_sub(self.planned_tokens(plan, RequestClass::Batch)))
    }
}

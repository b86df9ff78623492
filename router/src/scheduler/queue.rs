//! The order in which waiting requests are considered for admission.
//!
//! First by class (every interactive request before any batch line, see
//! share.rs), then by `priority` (lower first, as vLLM orders it), then
//! within one class and priority:
//!
//! 1. Resumed (preempted) requests, queue order: they already streamed
//!    tokens to a client that is waiting for the rest.
//! 2. Requests passed over `MAX_PASSED_OVER` times, queue order: the
//!    fairness bound, so cache-aware ordering cannot starve anyone.
//! 3. The rest, longest cached prefix first (its prefill is cheapest and its
//!    blocks are hot now, before eviction takes them), queue order on ties.
//!
//! Only the first `WINDOW` waiting requests are ranked, so a long queue
//! costs a bounded number of tree walks per step. The window is taken in
//! class and priority order, so batch lines queued first never hide an
//! interactive request behind them.

use std::cmp::Reverse;

use super::kv::KvCache;
use super::request::Request;
use crate::infer::RequestClass;

pub(crate) const MAX_PASSED_OVER: u32 = 8;
const WINDOW: usize = 256;

/// A waiting request's place in admission order, smallest first.
type Rank = (RequestClass, i32, u8, Reverse<usize>);

pub(crate) fn admission_order<'a>(waiting: impl Iterator<Item = &'a Request>, kv: &KvCache) -> Vec<u64> {
    let mut candidates: Vec<&Request> = waiting.collect();
    // Stable: queue order survives among equals (ids grow with arrival, but
    // a resumed request keeps its old id, so the key cannot be the id).
    candidates.sort_by_key(|r| (r.class(), r.request.priority));
    candidates.truncate(WINDOW);
    let mut ranked: Vec<(Rank, u64)> = candidates
        .into_iter()
        .map(|r| {
            let rank = if r.resumed {
                0
            } else if r.passed_over >= MAX_PASSED_OVER {
                1
            } else {
                2
            };
            let cached = if rank == 2 && !r.wants_prompt_logprobs() { kv.peek_cached_blocks(r.namespace(), &r.tokens) } else { 0 };
            ((r.class(), r.request.priority, rank, Reverse(cached)), r.id)
        })
        .collect();
    ranked.sort_by_key(|&(key, _)| key);
    ranked.into_iter().map(|(_, id)| id).collect()
}

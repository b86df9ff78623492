//! The order in which waiting requests are considered for admission.
//!
//! 1. Resumed (preempted) requests, queue order: they already streamed
//!    tokens to a client that is waiting for the rest.
//! 2. Requests passed over `MAX_PASSED_OVER` times, queue order: the
//!    fairness bound, so cache-aware ordering cannot starve anyone.
//! 3. The rest, longest cached prefix first (its prefill is cheapest and its
//!    blocks are hot now, before eviction takes them), queue order on ties.
//!
//! Only the first `WINDOW` waiting requests are ranked, so a long queue
//! costs a bounded number of tree walks per step.

use super::kv::KvCache;
use super::request::Request;

pub(crate) const MAX_PASSED_OVER: u32 = 8;
const WINDOW: usize = 256;

pub(crate) fn admission_order<'a>(waiting: impl Iterator<Item = &'a Request>, kv: &KvCache) -> Vec<u64> {
    let mut ranked: Vec<(u8, std::cmp::Reverse<usize>, u64)> = waiting
        .take(WINDOW)
        .map(|r| {
            let class = if r.resumed {
                0
            } else if r.passed_over >= MAX_PASSED_OVER {
                1
            } else {
                2
            };
            let cached = if class == 2 && !r.wants_prompt_logprobs() { kv.peek_cached_blocks(&r.tokens) } else { 0 };
            (class, std::cmp::Reverse(cached), r.id)
        })
        .collect();
    // Stable: queue order survives among equals (ids grow with arrival, but
    // a resumed request keeps its old id, so the key cannot be the id).
    ranked.sort_by_key(|&(class, cached, _)| (class, cached));
    ranked.into_iter().map(|(_, _, id)| id).collect()
}

//! Speculative decoding without a second model: n-gram proposals (prompt
//! lookup), made here because the router already holds every request's
//! tokens (a shard would need the same history, and proposing costs a few
//! microseconds of slice comparisons, nothing a step waits on).
//!
//! A decoding request whose recent tokens occurred earlier in its prompt or
//! output proposes the tokens that followed that occurrence:
//!
//! ```text
//!  tokens   ... A B C x y z ... A B C        suffix "A B C" (n = 3) seen before
//!  draft                x y z               (at most k tokens)
//! ```
//!
//! The longest n in `[ngram_min, ngram_max]` with a match wins, and its most
//! recent occurrence. drafts.rs asks for a request's draft while building a
//! step, gives it blocks, and records how it fared. The draft rides in the step as extra query tokens
//! (`ScheduledRequest.draft_token_ids`); the shard accepts a prefix of it and
//! emits one token more (see the proto). Afterwards the request's table is
//! cut back to the blocks holding computed slots, so rejected tokens' slots
//! return to the allocator and never reach the prefix tree.
//!
//! How much a request proposes adapts ([`Adaptive`]): k halves after a step
//! that accepted nothing, down to 0, doubles back after a step that accepted
//! everything, and a request at 0 probes again with k = 1 every
//! [`PROBE_AFTER`] decode steps. No request proposes while more than
//! `max_batch_size` requests run: big batches are compute-bound, and extra
//! query tokens there cost real time.

/// `--speculate ngram` and its settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeculationConfig {
    /// The most draft tokens per request and step (`--speculate-tokens`).
    pub max_tokens: usize,
    /// Shortest suffix looked up (`--ngram-min`, at least 1).
    pub ngram_min: usize,
    /// Longest suffix looked up (`--ngram-max`).
    pub ngram_max: usize,
    /// No proposals while more requests than this run
    /// (`--speculate-max-batch-size`).
    pub max_batch_size: usize,
    /// Drafts only fill a step up to this many tokens
    /// (`--speculate-max-step-tokens`).
    pub max_step_tokens: usize,
}

impl Default for SpeculationConfig {
    fn default() -> Self {
        Self { max_tokens: 4, ngram_min: 1, ngram_max: 3, max_batch_size: 8, max_step_tokens: 16 }
    }
}

/// Decode steps a request whose k fell to 0 waits before proposing again.
pub(crate) const PROBE_AFTER: u32 = 8;

/// The draft for `tokens`: up to `k` tokens that followed the most recent
/// earlier occurrence of its longest matching suffix (empty when none).
pub(crate) fn propose(tokens: &[u32], k: usize, ngram_min: usize, ngram_max: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 || len < 2 {
        return Vec::new();
    }
    for n in (ngram_min.max(1)..=ngram_max.min(len - 1)).rev() {
        let suffix = &tokens[len - n..];
        // An occurrence must end before the last token (start + n < len), so
        // at least one token follows it.
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let from = start + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// One request's speculation length, adapted to how its drafts fare.
#[derive(Debug, Default, Clone)]
pub(crate) struct Adaptive {
    /// k = max_tokens >> halvings.
    halvings: u32,
    /// Decode steps spent at k = 0.
    idle: u32,
}

impl Adaptive {
    /// The most tokens to propose this step (counts a step at k = 0).
    pub fn k(&mut self, max_tokens: usize) -> usize {
        let k = max_tokens.checked_shr(self.halvings).unwrap_or(0);
        if k > 0 || max_tokens == 0 {
            return k;
        }
        self.idle += 1;
        if self.idle < PROBE_AFTER {
            return 0;
        }
        // Probe with one token.
        self.idle = 0;
        self.halvings = usize::BITS - 1 - max_tokens.leading_zeros();
        1
    }

    /// What the shard made of a draft of `proposed` tokens.
    pub fn record(&mut self, proposed: usize, accepted: usize, max_tokens: usize) {
        if proposed == 0 {
            return;
        }
        if accepted == proposed {
            self.halvings = self.halvings.saturating_sub(1);
        } else if accepted == 0 && max_tokens.checked_shr(self.halvings).unwrap_or(0) > 0 {
            self.halvings += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_longest_recent_match() {
        //             0  1  2  3  4  5  6  7  8  9
        let tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3];
        // "1 2 3" last occurred at 5..8, followed by 7 1 2 3.
        assert_eq!(propose(&tokens, 3, 1, 3), vec![7, 1, 2]);
        assert_eq!(propose(&tokens, 10, 1, 3), vec![7, 1, 2, 3]);
        // Only 1-grams: "3" last occurred at 7, followed by 7.
        assert_eq!(propose(&tokens, 2, 1, 1), vec![7, 1]);
        assert_eq!(propose(&tokens, 0, 1, 3), Vec::<u32>::new());
    }

    #[test]
    fn no_match_no_draft() {
        assert!(propose(&[1, 2, 3, 4], 4, 1, 3).is_empty());
        assert!(propose(&[5], 4, 1, 3).is_empty());
        // The suffix itself is not a match; a 2-gram is required here.
        assert!(propose(&[1, 2, 3, 1, 3, 3], 4, 2, 3).is_empty());
        assert_eq!(propose(&[1, 2, 3, 1, 3, 3], 4, 1, 3), vec![3]);
    }

    #[test]
    fn the_draft_may_run_into_the_suffix() {
        // A repeated token: the draft continues the run.
        assert_eq!(propose(&[4, 4, 4], 5, 1, 2), vec![4]);
        assert_eq!(propose(&[8, 4, 4, 4, 4], 5, 2, 2), vec![4]);
    }

    #[test]
    fn k_shrinks_to_zero_on_failure_grows_on_success_and_probes() {
        let mut a = Adaptive::default();
        assert_eq!(a.k(4), 4);
        a.record(4, 0, 4);
        assert_eq!(a.k(4), 2);
        a.record(2, 1, 4); // partly accepted: unchanged
        assert_eq!(a.k(4), 2);
        a.record(2, 0, 4);
        assert_eq!(a.k(4), 1);
        a.record(1, 0, 4);
        // At zero: PROBE_AFTER - 1 steps without, then a probe of one token.
        for _ in 0..PROBE_AFTER - 1 {
            assert_eq!(a.k(4), 0);
        }
        assert_eq!(a.k(4), 1);
        a.record(1, 1, 4);
        assert_eq!(a.k(4), 2);
        a.record(2, 2, 4);
        assert_eq!(a.k(4), 4);
        a.record(4, 4, 4);
        assert_eq!(a.k(4), 4, "never above max_tokens");
        // A draft shorter than k that fails still counts.
        a.record(1, 0, 4);
        assert_eq!(a.k(4), 2);
        // A failed probe goes back to waiting.
        let mut b = Adaptive { halvings: 3, idle: PROBE_AFTER - 1 };
        assert_eq!(b.k(4), 1);
        b.record(1, 0, 4);
        assert_eq!(b.k(4), 0);
        // Off: always 0.
        assert_eq!(Adaptive::default().k(0), 0);
    }
}

//! What a step costs: step time as a function of the tokens it computes,
//! learnt from the steps the shards ran.
//!
//! The scheduler uses it to bound batch work while interactive requests run
//! (share.rs): a batch line may add tokens to a step only while the step's
//! predicted time stays within `--batch-step-slack` of what the interactive
//! part alone would take. How much a token costs depends on the hardware: a
//! GPU's small decode steps read the weights once for every row (extra rows
//! are nearly free), a CPU's are compute-bound sooner; both bend somewhere,
//! so the model is a curve, not a line:
//!
//! ```text
//!  seconds                               . .
//!     |                          . .  .
//!     |  . . . . . . . .  .  .           buckets: 1..=16 tokens one each,
//!     |                                  then 8 per doubling; each keeps a
//!     +---------------------------> tokens  moving average of its steps
//! ```
//!
//! A prediction interpolates between the buckets seen, after a monotone fit
//! (pool-adjacent-violators), so that a noisy bucket cannot make more tokens
//! look cheaper than fewer. Past the largest bucket seen it extrapolates in
//! proportion to the tokens, which overstates a token's cost (a step has a
//! fixed part), so the allowance grows into unseen sizes only step by step.

use std::time::Duration;

/// Buckets of one token each, up to this many tokens.
const EXACT: usize = 16;
/// Buckets per doubling above `EXACT`.
const PER_OCTAVE: f64 = 8.0;
/// Weight of a new step in its bucket's moving average.
const ALPHA: f64 = 0.2;
/// A bucket's weight in the monotone fit grows with its steps up to this.
const MAX_WEIGHT: f64 = 16.0;

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Moving averages of the steps that fell in it.
    tokens: f64,
    seconds: f64,
    steps: u32,
}

/// Step time by tokens computed (see the module comment).
#[derive(Debug, Clone, Default)]
pub(crate) struct StepCosts {
    buckets: Vec<Bucket>,
}

fn bucket_of(tokens: usize) -> usize {
    if tokens <= EXACT {
        tokens.max(1) - 1
    } else {
        EXACT - 1 + (PER_OCTAVE * (tokens as f64 / EXACT as f64).log2()).ceil() as usize
    }
}

impl StepCosts {
    /// One step of `tokens` tokens took `elapsed`.
    pub(crate) fn record(&mut self, tokens: usize, elapsed: Duration) {
        if tokens == 0 {
            return;
        }
        let index = bucket_of(tokens);
        if self.buckets.len() <= index {
            self.buckets.resize(index + 1, Bucket::default());
        }
        let b = &mut self.buckets[index];
        let (tokens, seconds) = (tokens as f64, elapsed.as_secs_f64());
        if b.steps == 0 {
            (b.tokens, b.seconds) = (tokens, seconds);
        } else {
            b.tokens += ALPHA * (tokens - b.tokens);
            b.seconds += ALPHA * (seconds - b.seconds);
        }
        b.steps = b.steps.saturating_add(1);
    }

    /// The seen buckets as (tokens, seconds), tokens increasing, seconds
    /// fitted non-decreasing.
    fn curve(&self) -> Vec<(f64, f64)> {
        // Pool adjacent violators: blocks of (weight, mean seconds, points).
        let mut blocks: Vec<(f64, f64, Vec<f64>)> = Vec::new();
        for b in self.buckets.iter().filter(|b| b.steps > 0) {
            let weight = f64::from(b.steps).min(MAX_WEIGHT);
            blocks.push((weight, b.seconds, vec![b.tokens]));
            while blocks.len() > 1 && blocks[blocks.len() - 2].1 > blocks[blocks.len() - 1].1 {
                let (w2, s2, t2) = blocks.pop().expect("two blocks");
                let (w1, s1, t1) = blocks.last_mut().expect("two blocks");
                *s1 = (*w1 * *s1 + w2 * s2) / (*w1 + w2);
                *w1 += w2;
                t1.extend(t2);
            }
        }
        blocks.into_iter().flat_map(|(_, seconds, tokens)| tokens.into_iter().map(move |t| (t, seconds))).collect()
    }

    /// Predicted seconds of a step of `tokens` tokens; None before any step.
    pub(crate) fn predict(&self, tokens: usize) -> Option<f64> {
        predict_on(&self.curve(), tokens as f64)
    }

    /// The most tokens, up to `limit`, of a step predicted to take at most
    /// `seconds`; None before any step was seen.
    pub(crate) fn tokens_within(&self, seconds: f64, limit: usize) -> Option<usize> {
        let curve = self.curve();
        predict_on(&curve, 1.0)?;
        Some(most_within(&curve, 0, seconds, limit))
    }

    /// The most tokens that can join a step of `base` tokens while its
    /// predicted time grows by at most `slack` (a fraction), up to `limit`;
    /// 0 before any step was seen.
    pub(crate) fn room_within(&self, base: usize, slack: f64, limit: usize) -> usize {
        let curve = self.curve();
        let base = base.max(1);
        let Some(now) = predict_on(&curve, base as f64) else { return 0 };
        most_within(&curve, base, now * (1.0 + slack), limit)
    }
}

/// The most tokens `n <= limit` that a step of `base` tokens can take while
/// a step of `base + n` is predicted to take at most `seconds`: predictions
/// do not decrease with tokens, so the last `n` that fits, found by halving.
fn most_within(curve: &[(f64, f64)], base: usize, seconds: f64, limit: usize) -> usize {
    let (mut fits, mut over) = (0, limit + 1);
    while over - fits > 1 {
        let mid = fits + (over - fits) / 2;
        match predict_on(curve, (base + mid) as f64) {
            Some(s) if s <= seconds => fits = mid,
            _ => over = mid,
        }
    }
    fits
}

fn predict_on(curve: &[(f64, f64)], tokens: f64) -> Option<f64> {
    let &(first_tokens, first_seconds) = curve.first()?;
    if tokens < first_tokens {
        // Smaller than any step seen: the line through the two smallest,
        // which understates a step with a flat start (so the room it gives
        // is smaller than the truth, never larger), or in proportion.
        let below = match curve.get(1) {
            Some(&(t1, s1)) if t1 > first_tokens => first_seconds - (s1 - first_seconds) * (first_tokens - tokens) / (t1 - first_tokens),
            _ => first_seconds * tokens / first_tokens,
        };
        return Some(below.clamp(0.0, first_seconds));
    }
    for pair in curve.windows(2) {
        let ((t0, s0), (t1, s1)) = (pair[0], pair[1]);
        if tokens <= t1 {
            let span = t1 - t0;
            return Some(if span <= 0.0 { s1 } else { s0 + (s1 - s0) * (tokens - t0) / span });
        }
    }
    let &(last_tokens, last_seconds) = curve.last().expect("not empty");
    Some(last_seconds * tokens / last_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: f64) -> Duration {
        Duration::from_secs_f64(ms / 1000.0)
    }

    /// A step costs `fixed` ms, and `per_token` ms for each token past `free`.
    fn learnt(fixed: f64, free: usize, per_token: f64, sizes: &[usize]) -> StepCosts {
        let mut costs = StepCosts::default();
        for _ in 0..3 {
            for &n in sizes {
                costs.record(n, ms(fixed + per_token * n.saturating_sub(free) as f64));
            }
        }
        costs
    }

    #[test]
    fn buckets_are_exact_then_eight_per_doubling() {
        assert_eq!((1..=16).map(bucket_of).collect::<Vec<_>>(), (0..16).collect::<Vec<_>>());
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(17), 16);
        assert_eq!(bucket_of(32), 15 + 8);
        assert_eq!(bucket_of(4096), 15 + 64);
        let all: Vec<usize> = (1..5000).map(bucket_of).collect();
        assert!(all.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1), "buckets skip or go back");
    }

    #[test]
    fn nothing_is_predicted_before_a_step() {
        let costs = StepCosts::default();
        assert_eq!(costs.predict(4), None);
        assert_eq!(costs.room_within(4, 0.1, 100), 0);
    }

    #[test]
    fn a_flat_then_linear_curve_gives_room_up_to_the_bend() {
        // 17 ms up to 12 tokens (memory-bound), then 1 ms a token.
        let sizes: Vec<usize> = (1..=64).collect();
        let costs = learnt(17.0, 12, 1.0, &sizes);
        assert!((costs.predict(4).unwrap() - 0.017).abs() < 1e-9);
        assert!((costs.predict(40).unwrap() - 0.045).abs() < 1e-9);
        // 4 tokens: 17 ms; 10% more is 18.7 ms, reached at 12 + 1.7 tokens.
        assert_eq!(costs.room_within(4, 0.1, 1000), 9);
        // At 30 tokens (35 ms) 10% is 3.5 ms: 3 more tokens.
        assert_eq!(costs.room_within(30, 0.1, 1000), 3);
        assert_eq!(costs.room_within(30, 0.0, 1000), 0);
        assert_eq!(costs.room_within(4, 0.1, 5), 5, "the limit caps it");
    }

    #[test]
    fn unseen_sizes_are_costed_in_proportion() {
        // Only 1..=8 seen, all 10 ms: past 8 a token is taken to cost 10/8 ms.
        let costs = learnt(10.0, 100, 0.0, &(1..=8).collect::<Vec<_>>());
        assert!((costs.predict(16).unwrap() - 0.020).abs() < 1e-9);
        // Within the flat part the room reaches its end, then 10% of 8 tokens more.
        assert_eq!(costs.room_within(2, 0.1, 1000), 6);
        assert_eq!(costs.room_within(8, 0.1, 1000), 0);
        assert_eq!(costs.room_within(8, 0.25, 1000), 2);
    }

    #[test]
    fn sizes_below_the_smallest_seen_follow_its_line_down() {
        // Seen 10 and 20 tokens: 20 and 30 ms (10 ms + 1 ms a token).
        let costs = learnt(10.0, 0, 1.0, &[10, 20]);
        assert!((costs.predict(2).unwrap() - 0.012).abs() < 1e-9);
        // A flat start is understated, so the room is too small, not too large.
        let flat = learnt(17.0, 12, 1.0, &[12, 20]);
        assert!(flat.predict(4).unwrap() < 0.017);
        assert!(flat.room_within(4, 0.1, 1000) <= 9);
        // One size seen: in proportion, never below 0.
        let one = learnt(10.0, 0, 0.0, &[8]);
        assert!((one.predict(4).unwrap() - 0.005).abs() < 1e-9);
    }

    #[test]
    fn a_noisy_bucket_cannot_make_more_tokens_cheaper() {
        let mut costs = learnt(10.0, 0, 1.0, &[1, 2, 3, 4, 5, 6, 7, 8]);
        costs.buckets[4] = Bucket { tokens: 5.0, seconds: 0.040, steps: 1 }; // one slow step at 5 tokens
        let curve = costs.curve();
        assert!(curve.windows(2).all(|w| w[0].1 <= w[1].1), "fit not monotone: {curve:?}");
        // The outlier weighs one step against its neighbours' three.
        assert!(costs.predict(5).unwrap() < 0.040);
    }

    #[test]
    fn recent_steps_move_the_average() {
        let mut costs = StepCosts::default();
        costs.record(8, ms(10.0));
        for _ in 0..40 {
            costs.record(8, ms(20.0));
        }
        assert!((costs.predict(8).unwrap() - 0.020).abs() < 1e-4);
    }
}

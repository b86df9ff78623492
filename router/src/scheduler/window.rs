//! Token counts over a sliding window of recent traffic, behind the window
//! gauges of /metrics (dollars per million output tokens, prefix-cache hit
//! ratio; written by `crate::metrics::render_window`).
//!
//! One bucket per whole second since the scheduler started. The window is the
//! last `span` of those seconds, the current (partial) one included, and rates
//! divide by the time those buckets cover, so the counts and the time always
//! describe the same interval:
//!
//! ```text
//!  span = 4 s, now = 9.25 s after the scheduler started
//!  second   …  4    5  │  6    7    8    9▏
//!           dropped    │  kept ────────────▏now
//!  covered: [6.00 s, 9.25 s) = 3.25 s   (between span - 1 and span seconds)
//!
//!  now = 2.5 s (the scheduler is younger than the span):
//!  covered: [0 s, 2.5 s) = 2.5 s
//! ```
//!
//! Counts arrive once per step (sampled tokens) and once per admission round
//! (prompt tokens looked up in the prefix cache), never per token. At most
//! `span` buckets are kept.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::infer::{TokenCounts, WindowTotals};

#[derive(Debug)]
struct Bucket {
    /// Whole seconds since `origin`.
    second: u64,
    counts: TokenCounts,
}

/// The scheduler's sliding window. Time is passed in, so tests choose it.
#[derive(Debug)]
pub(crate) struct TokenWindow {
    span_secs: u64,
    /// Second 0 (the scheduler's start).
    origin: Instant,
    /// Oldest first, `second` strictly increasing; only seconds with counts.
    buckets: VecDeque<Bucket>,
}

impl TokenWindow {
    pub fn new(span: Duration, origin: Instant) -> Self {
        assert!(span.as_secs() >= 1, "the window spans at least one second");
        Self { span_secs: span.as_secs(), origin, buckets: VecDeque::new() }
    }

    pub fn record(&mut self, now: Instant, counts: TokenCounts) {
        let second = self.second(now);
        match self.buckets.back_mut() {
            // `>=`: a caller's clock read a moment earlier lands in the
            // newest bucket rather than breaking the order.
            Some(last) if last.second >= second => last.counts += counts,
            _ => self.buckets.push_back(Bucket { second, counts }),
        }
        let first = self.first_kept(second);
        while self.buckets.front().is_some_and(|b| b.second < first) {
            self.buckets.pop_front();
        }
    }

    pub fn totals(&self, now: Instant) -> WindowTotals {
        let first = self.first_kept(self.second(now));
        let mut counts = TokenCounts::default();
        for bucket in self.buckets.iter().filter(|b| b.second >= first) {
            counts += bucket.counts;
        }
        let age = now.saturating_duration_since(self.origin);
        WindowTotals {
            span: Duration::from_secs(self.span_secs),
            covered: age.saturating_sub(Duration::from_secs(first)),
            counts,
        }
    }

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.origin).as_secs()
    }

    /// The oldest second in the window when `current` is the newest.
    fn first_kept(&self, current: u64) -> u64 {
        (current + 1).saturating_sub(self.span_secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(origin: Instant, secs: f64) -> Instant {
        origin + Duration::from_secs_f64(secs)
    }

    fn output(n: u64) -> TokenCounts {
        TokenCounts { output: n, ..Default::default() }
    }

    fn prompt(looked_up: u64, cached: u64) -> TokenCounts {
        TokenCounts { prompt: looked_up, cached_prompt: cached, ..Default::default() }
    }

    #[test]
    fn tokens_older_than_the_window_drop_out() {
        let t0 = Instant::now();
        let mut w = TokenWindow::new(Duration::from_secs(4), t0);
        w.record(at(t0, 0.5), output(100));
        w.record(at(t0, 5.5), output(10));
        w.record(at(t0, 6.1), output(20));
        w.record(at(t0, 9.0), output(30));
        // At 9.25 s the window is seconds 6..=9: 5.5 s (second 5) is out.
        let totals = w.totals(at(t0, 9.25));
        assert_eq!(totals.counts.output, 50);
        assert_eq!(totals.covered, Duration::from_secs_f64(3.25));
        assert_eq!(totals.span, Duration::from_secs(4));
        // Seconds 0 and 5 were dropped as newer seconds arrived.
        assert_eq!(w.buckets.len(), 2);
        // Later, with no new traffic, everything ages out.
        assert_eq!(w.totals(at(t0, 12.0)).counts.output, 30);
        assert_eq!(w.totals(at(t0, 13.0)).counts, TokenCounts::default());
    }

    #[test]
    fn young_window_covers_only_the_time_since_start() {
        let t0 = Instant::now();
        let mut w = TokenWindow::new(Duration::from_secs(60), t0);
        w.record(at(t0, 0.2), output(25));
        w.record(at(t0, 1.7), output(25));
        let totals = w.totals(at(t0, 2.5));
        assert_eq!(totals.covered, Duration::from_secs_f64(2.5));
        assert_eq!(totals.output_tokens_per_second(), Some(20.0));
        // $3.60 an hour is $0.001 a second; 20 tokens/s -> $50 per million.
        let cost = totals.dollars_per_million_output_tokens(3.6).unwrap();
        assert!((cost - 50.0).abs() < 1e-9, "{cost}");
    }

    #[test]
    fn one_second_window_is_the_current_second() {
        let t0 = Instant::now();
        let mut w = TokenWindow::new(Duration::from_secs(1), t0);
        w.record(at(t0, 3.9), output(7));
        w.record(at(t0, 4.1), output(8));
        let totals = w.totals(at(t0, 4.5));
        assert_eq!((totals.counts.output, totals.covered), (8, Duration::from_millis(500)));
        assert_eq!(w.buckets.len(), 1);
    }

    #[test]
    fn zero_traffic_reports_no_cost_and_no_ratio() {
        let t0 = Instant::now();
        let w = TokenWindow::new(Duration::from_secs(60), t0);
        let idle = w.totals(at(t0, 30.0));
        assert_eq!(idle.counts, TokenCounts::default());
        assert_eq!(idle.output_tokens_per_second(), Some(0.0));
        assert_eq!(idle.dollars_per_million_output_tokens(2.0), None);
        assert_eq!(idle.prefix_cache_hit_ratio(), None);
        // The instant the scheduler starts, no time is covered at all.
        let fresh = w.totals(t0);
        assert_eq!((fresh.covered, fresh.output_tokens_per_second()), (Duration::ZERO, None));
        // Prompts without a sampled token yet: a ratio, still no cost.
        let mut w = TokenWindow::new(Duration::from_secs(60), t0);
        w.record(at(t0, 1.0), prompt(10, 0));
        let totals = w.totals(at(t0, 2.0));
        assert_eq!(totals.dollars_per_million_output_tokens(2.0), None);
        assert_eq!(totals.prefix_cache_hit_ratio(), Some(0.0));
    }

    #[test]
    fn hit_ratio_is_cached_over_looked_up_prompt_tokens() {
        let t0 = Instant::now();
        let mut w = TokenWindow::new(Duration::from_secs(10), t0);
        w.record(at(t0, 1.0), prompt(9, 0));
        w.record(at(t0, 2.0), prompt(9, 8));
        w.record(at(t0, 2.0), output(4));
        let totals = w.totals(at(t0, 3.0));
        assert_eq!(totals.counts, TokenCounts { output: 4, prompt: 18, cached_prompt: 8 });
        assert_eq!(totals.prefix_cache_hit_ratio(), Some(8.0 / 18.0));
        // Once the first, uncached prompt leaves the window, only the hit remains.
        let later = w.totals(at(t0, 11.5));
        assert_eq!(later.prefix_cache_hit_ratio(), Some(8.0 / 9.0));
    }

    #[test]
    fn an_earlier_clock_reading_joins_the_newest_bucket() {
        let t0 = Instant::now();
        let mut w = TokenWindow::new(Duration::from_secs(5), t0);
        w.record(at(t0, 3.2), output(1));
        w.record(at(t0, 2.9), output(2));
        assert_eq!(w.buckets.len(), 1);
        assert_eq!(w.totals(at(t0, 3.5)).counts.output, 3);
    }
}

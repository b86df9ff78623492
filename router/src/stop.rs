//! Stop sequences, searched in the decoded text as it streams.
//!
//! Text that might be the start of a stop sequence is held back until the
//! next delta decides it, so a stop sequence split across tokens is caught
//! and none of its text reaches the client (OpenAI and TGI cut it):
//!
//! ```text
//!   stop = "END"      deltas: "foo E"  "N"    "D bar"
//!   emitted:                  "foo "   ""     ""  -> Stopped
//!   held:                     "E"      "EN"   (match)
//! ```

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Safe-to-send text (possibly empty).
    Continue(String),
    /// A stop sequence matched: send this text (what preceded the stop
    /// sequence) and end the request with finish reason "stop".
    Stopped { text: String, stop: String },
}

impl StopMatcher {
    /// `stops` must be non-empty strings (validation ensures it).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            held: String::new(),
        }
    }

    pub fn push(&mut self, delta: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Continue(delta.to_string());
        }
        self.held.push_str(delta);
        let earliest = self
            .stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()).map(|at| (at, stop)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = earliest {
            let stop = stop.clone();
            let text = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome::Stopped { text, stop };
        }
        // Keep the longest suffix that is a proper prefix of a stop sequence.
        let keep_from = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let suffix = &self.held[i..];
                self.stops.iter().any(|stop| stop.starts_with(suffix))
            })
            .unwrap_or(self.held.len());
        let text = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        StopOutcome::Continue(text)
    }

    /// The request ended without a stop sequence: release what was held.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(stops: &[&str], deltas: &[&str]) -> (Vec<String>, Option<String>) {
        let mut matcher = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for delta in deltas {
            match matcher.push(delta) {
                StopOutcome::Continue(text) => out.push(text),
                StopOutcome::Stopped { text, stop } => {
                    out.push(text);
                    return (out, Some(stop));
                }
            }
        }
        out.push(matcher.flush());
        (out, None)
    }

    #[test]
    fn stop_split_across_tokens_is_cut_entirely() {
        let (out, stop) = feed(&["END"], &["foo E", "N", "D bar"]);
        assert_eq!(out, ["foo ", "", ""]);
        assert_eq!(stop.as_deref(), Some("END"));
    }

    #[test]
    fn false_start_is_released() {
        let (out, stop) = feed(&["END"], &["foo E", "NX", " baz"]);
        assert_eq!(out.concat(), "foo ENX baz");
        assert_eq!(out[0], "foo ");
        assert_eq!(out[1], "ENX");
        assert_eq!(stop, None);
    }

    #[test]
    fn earliest_of_several_stops_wins_and_text_after_is_dropped() {
        let (out, stop) = feed(&["world", "lo w"], &["hel", "lo world and more"]);
        assert_eq!(out.concat(), "hel");
        assert_eq!(stop.as_deref(), Some("lo w"));
    }

    #[test]
    fn held_text_at_the_end_is_flushed() {
        let (out, stop) = feed(&["\n\nUser:"], &["answer", "\n\nUs"]);
        assert_eq!(out, ["answer", "", "\n\nUs"]);
        assert_eq!(stop, None);
    }

    #[test]
    fn multibyte_stop_sequences() {
        let (out, stop) = feed(&["你好"], &["é你", "好!"]);
        assert_eq!(out.concat(), "é");
        assert_eq!(stop.as_deref(), Some("你好"));
    }

    #[test]
    fn no_stops_passes_through() {
        let (out, stop) = feed(&[], &["a", "b"]);
        assert_eq!(out, ["a", "b", ""]);
        assert_eq!(stop, None);
    }
}

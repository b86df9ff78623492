//! The thinking block split off the output as it is generated.
//!
//! ```text
//!  state      reads                                      hands out
//!  Opening    leading whitespace and a possible "<think>"  - (held until decided)
//!  Thinking   the block, watching for "</think>"          reasoning (minus a possible
//!                                                         closing-tag prefix and the
//!                                                         whitespace before it)
//!  Gap        whitespace after the block                  -
//!  Answer     everything else                             content
//! ```
//!
//! `Opening` ends in `Thinking` when the tag completes; when the text cannot
//! be the tag, in `Thinking` if the output started inside the block (the
//! held text is reasoning) or in `Answer` (it is content). Whitespace at both
//! ends of the reasoning and between the block and the answer is dropped, so
//! what a client sees does not depend on where the stream was cut.

use super::{ReasoningFormat, ThinkStart};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Opening { inside: bool },
    Thinking,
    Gap,
    Answer,
}

/// What one piece of output holds: thinking, then answer (either may be empty).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

pub struct ReasoningParser {
    format: ReasoningFormat,
    state: State,
    /// Text read but not handed out yet (see the states).
    held: String,
    /// Something was handed out as reasoning: its leading whitespace is gone.
    reasoning_started: bool,
    tokens: u32,
    /// Tokens up to and including the one that ended the block.
    reasoning_tokens: u32,
}

impl ReasoningParser {
    pub fn new(format: ReasoningFormat, start: ThinkStart) -> Self {
        let state = match start {
            ThinkStart::MayOpen => State::Opening { inside: false },
            ThinkStart::Inside => State::Opening { inside: true },
            ThinkStart::Closed => State::Answer,
        };
        Self { format, state, held: String::new(), reasoning_started: false, tokens: 0, reasoning_tokens: 0 }
    }

    /// Tokens spent thinking (the tags included): OpenAI's
    /// `completion_tokens_details.reasoning_tokens`.
    pub fn reasoning_tokens(&self) -> u32 {
        match self.state {
            State::Thinking => self.tokens,
            State::Opening { inside: true } => self.tokens,
            _ => self.reasoning_tokens,
        }
    }

    /// Reads one token's text.
    pub fn push(&mut self, text: &str) -> Split {
        self.tokens += 1;
        self.push_text(text)
    }

    /// Reads text that is no token's (released at the end).
    pub fn push_text(&mut self, text: &str) -> Split {
        let mut split = Split::default();
        let mut rest = text;
        while !rest.is_empty() {
            rest = match self.state {
                State::Opening { inside } => self.read_opening(rest, inside, &mut split),
                State::Thinking => self.read_thinking(rest, &mut split),
                State::Gap => {
                    let answer = rest.trim_start();
                    if !answer.is_empty() {
                        self.state = State::Answer;
                    }
                    answer
                }
                State::Answer => {
                    split.content.push_str(rest);
                    ""
                }
            };
        }
        split
    }

    /// The output ended: whatever was held back.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        let mut split = Split::default();
        match self.state {
            // A cut-off block: what it held (a partial closing tag too) was thought.
            State::Thinking | State::Opening { inside: true } => self.reasoning(held.trim_end(), &mut split),
            State::Opening { inside: false } => split.content = held,
            State::Gap | State::Answer => {}
        }
        split
    }

    /// Holds `text` while it may still grow into whitespace + the opening
    /// tag; returns what is left for the next state.
    fn read_opening<'t>(&mut self, text: &'t str, inside: bool, split: &mut Split) -> &'t str {
        let open = self.format.open;
        let mut read = 0;
        for c in text.chars() {
            self.held.push(c);
            read += c.len_utf8();
            let candidate = self.held.trim_start();
            if candidate == open {
                self.held.clear();
                self.state = State::Thinking;
                return &text[read..];
            }
            if !open.starts_with(candidate) {
                let held = std::mem::take(&mut self.held);
                if inside {
                    self.state = State::Thinking;
                    self.thinking_text(&held, split);
                } else {
                    self.state = State::Answer;
                    split.content.push_str(&held);
                }
                return &text[read..];
            }
        }
        ""
    }

    /// Reads thinking text up to the closing tag.
    fn read_thinking<'t>(&mut self, text: &'t str, split: &mut Split) -> &'t str {
        let close = self.format.close;
        let mut read = 0;
        for c in text.chars() {
            read += c.len_utf8();
            self.held.push(c);
            if self.held.ends_with(close) {
                let held = std::mem::take(&mut self.held);
                self.reasoning(held[..held.len() - close.len()].trim_end(), split);
                self.state = State::Gap;
                self.reasoning_tokens = self.tokens;
                return &text[read..];
            }
        }
        let held = std::mem::take(&mut self.held);
        self.thinking_text(&held, split);
        ""
    }

    /// Hands out `text` as reasoning, holding back its end when it may be
    /// whitespace before the closing tag or the start of the tag.
    fn thinking_text(&mut self, text: &str, split: &mut Split) {
        let close = self.format.close;
        let partial = (1..close.len().min(text.len()) + 1)
            .rev()
            .find(|&n| text.is_char_boundary(text.len() - n) && close.starts_with(&text[text.len() - n..]))
            .unwrap_or(0);
        let before = &text[..text.len() - partial];
        let keep_from = before.trim_end().len();
        self.reasoning(&text[..keep_from], split);
        self.held = text[keep_from..].to_string();
    }

    fn reasoning(&mut self, text: &str, split: &mut Split) {
        let text = if self.reasoning_started { text } else { text.trim_start() };
        if !text.is_empty() {
            self.reasoning_started = true;
            split.reasoning.push_str(text);
        }
    }
}

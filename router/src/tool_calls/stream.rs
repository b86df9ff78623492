//! Tool calls parsed out of the output as it is generated.
//!
//! The parser reads each token's text (and its id, for openers that are
//! special tokens) and hands out [`ToolEvent`]s: content, then per call its
//! id and name first and its arguments in fragments, as OpenAI streams
//! them. A whole response is the same events, concatenated.
//!
//! ```text
//!  state       reads                                  hands out
//!  Text        free text, watching for the opener     Content (minus a possible opener prefix)
//!  ListOpen    "[" (mistral)                          -
//!  Head        {"name": "NAME", "ARGS": ...           Start { id, name }
//!  Arguments   the arguments value, up to the "}"     Arguments { fragment }
//!              closing the call object
//!  AfterCall   the separator (-> Head) or the close   -
//!              (-> Text); anything else is content
//! ```
//!
//! The grammar lays calls out exactly so (name first, compact JSON). A call
//! written otherwise (a client-side format without a grammar) is buffered
//! whole and parsed at its end, so it still comes out right, only later.
//! Whitespace between and after calls is not content.

use serde_json::Value;

use super::{Opener, ToolCall, ToolFormat};

#[derive(Debug, Clone, PartialEq)]
pub enum ToolEvent {
    /// Text for `message.content`.
    Content(String),
    /// A call begins (OpenAI's first delta of a call: id and name).
    Start { index: usize, id: String, name: String },
    /// More of call `index`'s arguments (JSON text).
    Arguments { index: usize, fragment: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Text,
    ListOpen,
    Head,
    Arguments,
    AfterCall,
}

/// Where a JSON value stands, character by character.
#[derive(Debug, Default, Clone)]
struct JsonScan {
    depth: u32,
    in_string: bool,
    escaped: bool,
}

impl JsonScan {
    /// Reads `c`; true when it closed the outermost object or array.
    fn feed(&mut self, c: char) -> bool {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_string = false;
            }
            return false;
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }
}

pub struct ToolCallParser {
    format: ToolFormat,
    state: State,
    /// Text read but not handed out yet.
    pending: String,
    /// Whitespace content after a call, released only if text follows.
    held_whitespace: String,
    /// Something was read (`Opener::AtStart` applies to the very start only).
    started: bool,
    /// The current call object does not follow the expected layout: it is
    /// buffered in `pending` and parsed whole.
    fallback: bool,
    scan: JsonScan,
    calls: Vec<ToolCall>,
    events: Vec<ToolEvent>,
}

impl ToolCallParser {
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            state: State::Text,
            pending: String::new(),
            held_whitespace: String::new(),
            started: false,
            fallback: false,
            scan: JsonScan::default(),
            calls: Vec::new(),
            events: Vec::new(),
        }
    }

    /// The calls read so far (arguments complete once their call closed).
    pub fn calls(&self) -> &[ToolCall] {
        &self.calls
    }

    /// Reads one generated token: its id and its text.
    pub fn push(&mut self, token_id: u32, text: &str) -> Vec<ToolEvent> {
        if self.format.opener == Opener::Token(token_id) && self.state == State::Text {
            let before = std::mem::take(&mut self.pending);
            self.opened(before);
        }
        for c in text.chars() {
            self.read(c);
        }
        self.take_events()
    }

    /// The output ended: what was held back.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            // A truncated call keeps what it has; a partial separator goes.
            State::Arguments | State::AfterCall => {}
            // Text, a stray opener, or a call head that never completed.
            State::Text | State::ListOpen | State::Head => self.content(&rest),
        }
        self.take_events()
    }

    fn take_events(&mut self) -> Vec<ToolEvent> {
        let mut merged: Vec<ToolEvent> = Vec::new();
        for event in self.events.drain(..) {
            match (merged.last_mut(), event) {
                (Some(ToolEvent::Content(a)), ToolEvent::Content(b)) => a.push_str(&b),
                (Some(ToolEvent::Arguments { index: i, fragment: a }), ToolEvent::Arguments { index: j, fragment: b })
                    if *i == j =>
                {
                    a.push_str(&b)
                }
                (_, event) => merged.push(event),
            }
        }
        merged
    }

    fn content(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        if !self.calls.is_empty() && text.trim().is_empty() {
            self.held_whitespace.push_str(text);
            return;
        }
        let text = std::mem::take(&mut self.held_whitespace) + text;
        self.events.push(ToolEvent::Content(text));
    }

    /// The opener was read; `before` is the text that preceded it.
    fn opened(&mut self, before: String) {
        if self.calls.is_empty() || !before.trim().is_empty() {
            self.content(&before);
        }
        self.held_whitespace.clear();
        self.started = true;
        self.state = if self.format.list_open.is_empty() { State::Head } else { State::ListOpen };
        self.begin_call();
    }

    fn begin_call(&mut self) {
        self.pending.clear();
        self.scan = JsonScan::default();
        self.fallback = false;
    }

    fn read(&mut self, c: char) {
        match self.state {
            State::Text => self.read_text(c),
            State::ListOpen => {
                if self.pending.is_empty() && c.is_whitespace() {
                    return;
                }
                self.pending.push(c);
                if self.pending == self.format.list_open {
                    self.state = State::Head;
                    self.begin_call();
                } else if !self.format.list_open.starts_with(&self.pending) {
                    self.back_to_text();
                }
            }
            State::Head => self.read_head(c),
            State::Arguments => {
                if self.scan.feed(c) {
                    self.state = State::AfterCall;
                    self.pending.clear();
                } else {
                    let index = self.calls.len() - 1;
                    self.calls[index].arguments.push(c);
                    self.events.push(ToolEvent::Arguments { index, fragment: c.to_string() });
                }
            }
            State::AfterCall => {
                self.pending.push(c);
                let (separator, close) = (self.format.separator, self.format.close);
                if !separator.is_empty() && self.pending == separator {
                    self.state = State::Head;
                    self.begin_call();
                } else if !close.is_empty() && self.pending == close {
                    self.state = State::Text;
                    self.pending.clear();
                } else if !begins(separator, &self.pending) && !begins(close, &self.pending) {
                    self.back_to_text();
                }
            }
        }
    }

    /// What was buffered is not part of a call after all: read it as text.
    fn back_to_text(&mut self) {
        let buffered = std::mem::take(&mut self.pending);
        self.state = State::Text;
        self.fallback = false;
        for c in buffered.chars() {
            self.read_text(c);
        }
    }

    fn read_text(&mut self, c: char) {
        match &self.format.opener {
            Opener::Text(opener) => {
                self.pending.push(c);
                if let Some(at) = self.pending.find(opener) {
                    let before = self.pending[..at].to_string();
                    self.opened(before);
                    return;
                }
                // Keep the longest tail that could still grow into the opener.
                let keep = (1..=opener.len().min(self.pending.len()))
                    .rev()
                    .find(|&n| self.pending.is_char_boundary(self.pending.len() - n)
                        && opener.starts_with(&self.pending[self.pending.len() - n..]))
                    .unwrap_or(0);
                let emit = self.pending[..self.pending.len() - keep].to_string();
                self.pending.drain(..self.pending.len() - keep);
                self.content(&emit);
            }
            Opener::AtStart if !self.started => {
                if c.is_whitespace() {
                    self.pending.push(c);
                } else if c == '{' {
                    self.opened(String::new());
                    self.read_head(c);
                } else {
                    self.started = true;
                    let text = std::mem::take(&mut self.pending) + &c.to_string();
                    self.content(&text);
                }
            }
            Opener::AtStart | Opener::Token(_) => self.content(&c.to_string()),
        }
    }

    fn read_head(&mut self, c: char) {
        if self.pending.is_empty() && c.is_whitespace() {
            return;
        }
        self.pending.push(c);
        let closed = self.scan.feed(c);
        if self.fallback {
            if closed {
                self.parse_whole_call();
            }
            return;
        }
        const PREFIX: &str = "{\"name\": \"";
        if self.pending.len() <= PREFIX.len() {
            if !PREFIX.starts_with(&self.pending) {
                self.fallback = true;
            }
            return;
        }
        // After the prefix: the name (a JSON string body), then `", "ARGS": `.
        let rest = &self.pending[PREFIX.len()..];
        let Some(end) = string_end(rest) else { return };
        let tail = &rest[end + 1..];
        let expected = format!(", \"{}\": ", self.format.arguments_key);
        if tail == expected {
            let name: String = serde_json::from_str(&format!("\"{}\"", &rest[..end])).unwrap_or_default();
            self.start_call(name);
            self.state = State::Arguments;
            self.pending.clear();
        } else if !expected.starts_with(tail) {
            self.fallback = true;
            if closed {
                self.parse_whole_call();
            }
        }
    }

    fn start_call(&mut self, name: String) {
        let id = self.format.new_call_id();
        self.calls.push(ToolCall { id: id.clone(), name: name.clone(), arguments: String::new() });
        self.events.push(ToolEvent::Start { index: self.calls.len() - 1, id, name });
    }

    /// A call object in another layout, read whole.
    fn parse_whole_call(&mut self) {
        let text = std::mem::take(&mut self.pending);
        let parsed: Option<(String, String)> = serde_json::from_str::<Value>(&text).ok().and_then(|call| {
            let name = call.get("name")?.as_str()?.to_string();
            let arguments = call
                .get(self.format.arguments_key)
                .or_else(|| call.get("arguments"))
                .or_else(|| call.get("parameters"))?;
            Some((name, arguments.to_string()))
        });
        self.fallback = false;
        match parsed {
            Some((name, arguments)) => {
                self.start_call(name);
                let index = self.calls.len() - 1;
                self.calls[index].arguments = arguments.clone();
                self.events.push(ToolEvent::Arguments { index, fragment: arguments });
                self.state = State::AfterCall;
            }
            None => {
                self.state = State::Text;
                self.started = true;
                self.content(&text);
            }
        }
    }
}

/// The index of the quote that ends the JSON string body at the start of
/// `s`, if it has been read.
fn string_end(s: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some(i),
            _ => {}
        }
    }
    None
}

/// Whether `pending` may still grow into the (non-empty) marker `marker`.
fn begins(marker: &str, pending: &str) -> bool {
    !marker.is_empty() && marker.starts_with(pending)
}

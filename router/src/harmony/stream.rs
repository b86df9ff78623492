//! A harmony output split as it is generated (the format is in `mod.rs`).
//!
//! ```text
//!  state     reads                                          hands out
//!  Header    a message's header, up to <|message|>:          - (held; text past
//!            role, <|channel|> NAME, to=..., <|constrain|>     MAX_HEADER is content)
//!  Body      the message, up to <|end|> (-> Between),        Reasoning, Content, or a
//!            <|return|> or <|call|> (-> Done)                call's Start + Arguments
//!  Between   <|start|> (-> Header); text here is content     Content
//!  Done      nothing more (the output ended)                 -
//! ```
//!
//! The output starts in `Header` (the prompt opened the assistant's
//! message). A model that writes no harmony at all (no header token within
//! MAX_HEADER characters) is read as plain content.

use super::{new_call_id, normalized_arguments, parse_header, Channel, HarmonyTokens};
use crate::tool_calls::stream::ToolEvent;
use crate::tool_calls::ToolCall;

/// Header text longer than this is not a header.
const MAX_HEADER: usize = 256;

/// What one piece of output holds.
#[derive(Debug, Clone, PartialEq)]
pub enum HarmonyEvent {
    /// Analysis-channel text, for `reasoning_content`.
    Reasoning(String),
    /// Content, or a piece of a tool call.
    Tool(ToolEvent),
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    Header,
    Body(Channel),
    Between,
    Done,
}

pub struct HarmonyParser {
    tokens: HarmonyTokens,
    state: State,
    header: String,
    /// A header token was read in the current header: it is harmony.
    structured: bool,
    calls: Vec<ToolCall>,
    /// The arguments of the call being read, as written.
    arguments: String,
    events: Vec<HarmonyEvent>,
    /// Tokens read since the last message ended (its successor's so far).
    message_tokens: u32,
    /// Tokens of the analysis messages that ended, headers included.
    reasoning_tokens: u32,
}

impl HarmonyParser {
    pub fn new(tokens: HarmonyTokens) -> Self {
        Self {
            tokens,
            state: State::Header,
            header: String::new(),
            structured: false,
            calls: Vec::new(),
            arguments: String::new(),
            events: Vec::new(),
            message_tokens: 0,
            reasoning_tokens: 0,
        }
    }

    /// Tokens spent in analysis messages (their headers and end tokens
    /// included): OpenAI's `completion_tokens_details.reasoning_tokens`.
    pub fn reasoning_tokens(&self) -> u32 {
        match self.state {
            State::Body(Channel::Analysis) => self.reasoning_tokens + self.message_tokens,
            _ => self.reasoning_tokens,
        }
    }

    /// The calls read so far (arguments complete once their call ended).
    pub fn calls(&self) -> &[ToolCall] {
        &self.calls
    }

    /// Reads one generated token: its id and its text.
    pub fn push(&mut self, token_id: u32, text: &str) -> Vec<HarmonyEvent> {
        if self.state != State::Done {
            self.message_tokens += 1;
        }
        self.read(token_id, text)
    }

    /// Reads text that is no token's (the detokenizer releases some at the
    /// end): text in whatever part of a message is being read.
    pub fn push_text(&mut self, text: &str) -> Vec<HarmonyEvent> {
        // No vocabulary reaches u32::MAX: the id is no header token.
        self.read(u32::MAX, text)
    }

    fn read(&mut self, token_id: u32, text: &str) -> Vec<HarmonyEvent> {
        let t = self.tokens;
        match (&self.state, token_id) {
            (State::Done, _) => {}
            (State::Header, id) if id == t.message => {
                let channel = parse_header(&std::mem::take(&mut self.header));
                if let Channel::Call(name) = &channel {
                    self.start_call(name.clone());
                }
                self.structured = false;
                self.state = State::Body(channel);
            }
            (State::Header, id) if id == t.channel || id == t.constrain || id == t.start => {
                self.structured = true;
                self.header.push(' ');
            }
            (State::Header, _) => {
                self.header.push_str(text);
                if !self.structured && self.header.len() > MAX_HEADER {
                    let held = std::mem::take(&mut self.header);
                    self.content(held);
                    self.state = State::Body(Channel::Content);
                }
            }
            (State::Body(_), id) if id == t.end => {
                self.end_message();
                self.state = State::Between;
            }
            (State::Body(_), id) if id == t.return_ || id == t.call => {
                self.end_message();
                self.state = State::Done;
            }
            (State::Body(channel), _) => {
                let channel = channel.clone();
                self.body(&channel, text);
            }
            (State::Between, id) if id == t.start => self.state = State::Header,
            (State::Between, id) if id == t.return_ || id == t.call => self.state = State::Done,
            (State::Between, _) => self.content(text.to_string()),
        }
        std::mem::take(&mut self.events)
    }

    /// The output ended: a header never completed is content (the model
    /// wrote no harmony); a call cut short keeps what it has.
    pub fn finish(&mut self) -> Vec<HarmonyEvent> {
        if self.state == State::Header && !self.header.trim().is_empty() && !self.structured {
            let held = std::mem::take(&mut self.header);
            self.content(held);
        }
        if matches!(self.state, State::Body(_)) {
            self.end_message();
        }
        self.state = State::Done;
        std::mem::take(&mut self.events)
    }

    fn body(&mut self, channel: &Channel, text: &str) {
        if text.is_empty() {
            return;
        }
        match channel {
            Channel::Analysis => self.events.push(HarmonyEvent::Reasoning(text.to_string())),
            Channel::Content => self.content(text.to_string()),
            Channel::Call(_) => {
                self.arguments.push_str(text);
                let index = self.calls.len() - 1;
                self.events.push(HarmonyEvent::Tool(ToolEvent::Arguments { index, fragment: text.to_string() }));
            }
        }
    }

    fn content(&mut self, text: String) {
        if !text.is_empty() {
            self.events.push(HarmonyEvent::Tool(ToolEvent::Content(text)));
        }
    }

    fn start_call(&mut self, name: String) {
        let id = new_call_id();
        self.events.push(HarmonyEvent::Tool(ToolEvent::Start { index: self.calls.len(), id: id.clone(), name: name.clone() }));
        self.calls.push(ToolCall { id, name, arguments: String::new() });
        self.arguments.clear();
    }

    fn end_message(&mut self) {
        if let (State::Body(Channel::Call(_)), Some(call)) = (&self.state, self.calls.last_mut()) {
            call.arguments = normalized_arguments(&std::mem::take(&mut self.arguments));
        }
        if self.state == State::Body(Channel::Analysis) {
            self.reasoning_tokens += self.message_tokens;
        }
        self.message_tokens = 0;
    }
}

//! What a choice's text means, read the same way for every API: the
//! thinking block first (`reasoning`), then tool calls (`tool_calls`) in the
//! rest, which is otherwise content.
//!
//! ```text
//!  token text ─► ReasoningParser ─┬─ reasoning ────────────────────────► Piece::Reasoning
//!                                 └─ answer ─► ToolCallParser ─┬─ text ─► Piece::Content
//!                                                              └─ calls ► Piece::CallStart / CallArguments
//! ```
//!
//! Each API turns the pieces into its own shape: chat deltas, Responses
//! items, Anthropic content blocks.

use crate::http::generation::Collected;
use crate::reasoning::stream::ReasoningParser;
use crate::reasoning::{ReasoningFormat, ThinkStart};
use crate::tool_calls::stream::{ToolCallParser, ToolEvent};
use crate::tool_calls::{ToolCall, ToolFormat};

/// One piece of a choice's output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    /// A call begins: its id and name.
    CallStart { index: usize, id: String, name: String },
    /// More of call `index`'s arguments (JSON text).
    CallArguments { index: usize, fragment: String },
}

/// How one request's choices are read (the same for each of its choices).
#[derive(Debug, Clone, Default)]
pub struct AnswerFormat {
    /// With a reasoning parser: its tags and where this prompt's output starts.
    pub reasoning: Option<(ReasoningFormat, ThinkStart)>,
    /// False: the reasoning is split off and dropped (`include_reasoning: false`).
    pub show_reasoning: bool,
    /// With tools: how the model writes calls.
    pub tools: Option<ToolFormat>,
}

impl AnswerFormat {
    pub fn parser(&self) -> AnswerParser {
        AnswerParser {
            reasoning: self.reasoning.clone().map(|(format, start)| ReasoningParser::new(format, start)),
            show_reasoning: self.show_reasoning,
            tools: self.tools.clone().map(ToolCallParser::new),
        }
    }
}

pub struct AnswerParser {
    reasoning: Option<ReasoningParser>,
    show_reasoning: bool,
    tools: Option<ToolCallParser>,
}

/// A finished choice, read whole.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answer {
    /// `None` without a reasoning parser, when it is not shown, or when the
    /// model did not think.
    pub reasoning: Option<String>,
    pub content: String,
    pub calls: Vec<ToolCall>,
    pub reasoning_tokens: u32,
}

impl AnswerParser {
    /// Reads one generated token: its id (special-token tool openers) and
    /// its visible text.
    pub fn push(&mut self, token_id: u32, text: &str) -> Vec<Piece> {
        let (reasoning, answer) = match &mut self.reasoning {
            Some(parser) => {
                let split = parser.push(text);
                (split.reasoning, split.content)
            }
            None => (String::new(), text.to_string()),
        };
        self.pieces(token_id, reasoning, &answer, false)
    }

    /// The output ended with `trailing` (text released at the end, no
    /// token's): it, and whatever was held back.
    pub fn end(&mut self, trailing: &str) -> Vec<Piece> {
        let (reasoning, answer) = match &mut self.reasoning {
            Some(parser) => {
                let mut split = parser.push_text(trailing);
                let rest = parser.finish();
                split.reasoning.push_str(&rest.reasoning);
                split.content.push_str(&rest.content);
                (split.reasoning, split.content)
            }
            None => (String::new(), trailing.to_string()),
        };
        self.pieces(u32::MAX, reasoning, &answer, true)
    }

    fn pieces(&mut self, token_id: u32, reasoning: String, answer: &str, end: bool) -> Vec<Piece> {
        let mut pieces = Vec::new();
        if self.show_reasoning && !reasoning.is_empty() {
            pieces.push(Piece::Reasoning(reasoning));
        }
        let Some(tools) = &mut self.tools else {
            if !answer.is_empty() {
                pieces.push(Piece::Content(answer.to_string()));
            }
            return pieces;
        };
        let mut events = tools.push(token_id, answer);
        if end {
            events.extend(tools.finish());
        }
        pieces.extend(events.into_iter().map(|event| match event {
            ToolEvent::Content(text) => Piece::Content(text),
            ToolEvent::Start { index, id, name } => Piece::CallStart { index, id, name },
            ToolEvent::Arguments { index, fragment } => Piece::CallArguments { index, fragment },
        }));
        pieces
    }

    /// The calls read so far.
    pub fn calls(&self) -> &[ToolCall] {
        self.tools.as_ref().map_or(&[], |t| t.calls())
    }

    pub fn reasoning_tokens(&self) -> u32 {
        self.reasoning.as_ref().map_or(0, ReasoningParser::reasoning_tokens)
    }

    /// A finished choice's pieces, read token by token as it streamed (so
    /// special-token openers are seen).
    pub fn read_all(&mut self, r: &Collected) -> Vec<Piece> {
        let mut pieces = Vec::new();
        // The visible text is a prefix of the tokens' texts (a stop sequence
        // cuts it), then whatever the detokenizer released at the end.
        let mut visible = r.text.as_str();
        for (token, text) in &r.tokens {
            // Stay on a character boundary (the stop matcher releases whole
            // strings; this only guards the slicing).
            let take = (0..=text.len().min(visible.len())).rev().find(|&n| visible.is_char_boundary(n)).unwrap_or(0);
            pieces.extend(self.push(token.token_id, &visible[..take]));
            visible = &visible[take..];
        }
        pieces.extend(self.end(visible));
        pieces
    }

    /// A finished choice read whole.
    pub fn read(mut self, r: &Collected) -> Answer {
        let pieces = self.read_all(r);
        let mut answer = Answer {
            reasoning_tokens: self.reasoning_tokens(),
            calls: self.calls().to_vec(),
            ..Default::default()
        };
        for piece in pieces {
            match piece {
                Piece::Reasoning(text) => answer.reasoning.get_or_insert_with(String::new).push_str(&text),
                Piece::Content(text) => answer.content.push_str(&text),
                Piece::CallStart { .. } | Piece::CallArguments { .. } => {}
            }
        }
        answer
    }
}

//! What a choice's text means, read the same way for every API: the
//! thinking block first (`reasoning`), then tool calls (`tool_calls`) in the
//! rest, which is otherwise content.
//!
//! ```text
//!  token text ─► ReasoningParser ─┬─ reasoning ────────────────────────► Piece::Reasoning
//!                                 └─ answer ─► ToolCallParser ─┬─ text ─► Piece::Content
//!                                                              └─ calls ► Piece::CallStart / CallArguments
//!
//!  token id + text ─► HarmonyParser (gpt-oss: the channels carry all three) ─► the same pieces
//! ```
//!
//! Each API turns the pieces into its own shape: chat deltas, Responses
//! items, Anthropic content blocks.

use crate::harmony::stream::{HarmonyEvent, HarmonyParser};
use crate::http::generation::Collected;
use crate::reasoning::stream::ReasoningParser;
use crate::reasoning::PromptReasoning;
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
    /// With a reasoning parser: how this prompt's output is read.
    pub reasoning: Option<PromptReasoning>,
    /// False: the reasoning is split off and dropped (`include_reasoning: false`).
    pub show_reasoning: bool,
    /// With tools: how the model writes calls (harmony writes them in its
    /// own channels, with or without tools).
    pub tools: Option<ToolFormat>,
}

impl AnswerFormat {
    pub fn parser(&self) -> AnswerParser {
        let reader = match &self.reasoning {
            Some(PromptReasoning::Harmony(tokens)) => Reader::Harmony(HarmonyParser::new(*tokens)),
            Some(PromptReasoning::Tags(format, start)) => Reader::Tagged {
                reasoning: Some(ReasoningParser::new(format.clone(), *start)),
                tools: self.tools.clone().map(ToolCallParser::new),
            },
            None => Reader::Tagged { reasoning: None, tools: self.tools.clone().map(ToolCallParser::new) },
        };
        AnswerParser { reader, show_reasoning: self.show_reasoning }
    }
}

pub struct AnswerParser {
    reader: Reader,
    show_reasoning: bool,
}

enum Reader {
    /// A thinking block (with a tagged reasoning parser), then the answer,
    /// with calls in the tool format's syntax (with tools).
    Tagged { reasoning: Option<ReasoningParser>, tools: Option<ToolCallParser> },
    /// gpt-oss's channels.
    Harmony(HarmonyParser),
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
        let (reasoning, answer) = match &mut self.reader {
            Reader::Harmony(parser) => {
                let events = parser.push(token_id, text);
                return self.harmony_pieces(events);
            }
            Reader::Tagged { reasoning: Some(parser), .. } => {
                let split = parser.push(text);
                (split.reasoning, split.content)
            }
            Reader::Tagged { reasoning: None, .. } => (String::new(), text.to_string()),
        };
        self.pieces(token_id, reasoning, &answer, false)
    }

    /// The output ended with `trailing` (text released at the end, no
    /// token's): it, and whatever was held back.
    pub fn end(&mut self, trailing: &str) -> Vec<Piece> {
        let (reasoning, answer) = match &mut self.reader {
            Reader::Harmony(parser) => {
                let mut events = parser.push_text(trailing);
                events.extend(parser.finish());
                return self.harmony_pieces(events);
            }
            Reader::Tagged { reasoning: Some(parser), .. } => {
                let mut split = parser.push_text(trailing);
                let rest = parser.finish();
                split.reasoning.push_str(&rest.reasoning);
                split.content.push_str(&rest.content);
                (split.reasoning, split.content)
            }
            Reader::Tagged { reasoning: None, .. } => (String::new(), trailing.to_string()),
        };
        self.pieces(u32::MAX, reasoning, &answer, true)
    }

    fn harmony_pieces(&self, events: Vec<HarmonyEvent>) -> Vec<Piece> {
        events
            .into_iter()
            .filter_map(|event| match event {
                HarmonyEvent::Reasoning(text) => self.show_reasoning.then_some(Piece::Reasoning(text)),
                HarmonyEvent::Tool(event) => Some(tool_piece(event)),
            })
            .collect()
    }

    fn pieces(&mut self, token_id: u32, reasoning: String, answer: &str, end: bool) -> Vec<Piece> {
        let mut pieces = Vec::new();
        if self.show_reasoning && !reasoning.is_empty() {
            pieces.push(Piece::Reasoning(reasoning));
        }
        let Reader::Tagged { tools: Some(tools), .. } = &mut self.reader else {
            if !answer.is_empty() {
                pieces.push(Piece::Content(answer.to_string()));
            }
            return pieces;
        };
        let mut events = tools.push(token_id, answer);
        if end {
            events.extend(tools.finish());
        }
        pieces.extend(events.into_iter().map(tool_piece));
        pieces
    }

    /// The calls read so far.
    pub fn calls(&self) -> &[ToolCall] {
        match &self.reader {
            Reader::Harmony(parser) => parser.calls(),
            Reader::Tagged { tools, .. } => tools.as_ref().map_or(&[], |t| t.calls()),
        }
    }

    pub fn reasoning_tokens(&self) -> u32 {
        match &self.reader {
            Reader::Harmony(parser) => parser.reasoning_tokens(),
            Reader::Tagged { reasoning, .. } => reasoning.as_ref().map_or(0, ReasoningParser::reasoning_tokens),
        }
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

fn tool_piece(event: ToolEvent) -> Piece {
    match event {
        ToolEvent::Content(text) => Piece::Content(text),
        ToolEvent::Start { index, id, name } => Piece::CallStart { index, id, name },
        ToolEvent::Arguments { index, fragment } => Piece::CallArguments { index, fragment },
    }
}

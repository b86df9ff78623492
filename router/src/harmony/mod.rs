//! gpt-oss's `harmony` chat format: the output is a sequence of messages,
//! each on a channel, and the channels are what the APIs split:
//!
//! ```text
//!   <|channel|>analysis<|message|>...<|end|>                          -> reasoning_content
//!   <|start|>assistant<|channel|>commentary to=functions.NAME
//!       <|constrain|>json<|message|>{"arg": ...}<|call|>              -> tool_calls (one call)
//!   <|start|>assistant<|channel|>commentary<|message|>...<|end|>      -> content (a preamble)
//!   <|start|>assistant<|channel|>final<|message|>...<|return|>        -> content
//! ```
//!
//! The prompt ends with `<|start|>assistant`, so the output opens with the
//! first message's header (`<|channel|>...`). `<|start|>`, `<|channel|>`,
//! `<|message|>`, `<|constrain|>`, `<|end|>`, `<|return|>` and `<|call|>`
//! are special tokens (they decode to no text: the parser reads their ids);
//! the recipient (`to=functions.NAME`) may sit in the header before or after
//! the channel. `<|return|>` and `<|call|>` end the output (the model's EOS
//! tokens). [`stream::HarmonyParser`] splits the output as it streams.
//!
//! With tools, `tool_choice: required` or a named function constrains the
//! output to (optionally) one analysis message, then one call of a declared
//! function with arguments valid under its schema ([`HarmonyFormat::grammar`]);
//! `auto` leaves the model to choose (harmony's own structure is what it was
//! trained on); `none` shows it no tools. A response format constrains the
//! final channel's message ([`HarmonyFormat::final_answer`]).

pub mod stream;

use serde_json::{json, Value};

use crate::grammar::{lark_literal, with_json_layout, Constraint};
use crate::tokenizer::Tokenizer;
use crate::tool_calls::{FunctionDefinition, ToolChoice};

/// The special tokens' text.
pub const START: &str = "<|start|>";
pub const END: &str = "<|end|>";
pub const MESSAGE: &str = "<|message|>";
pub const CHANNEL: &str = "<|channel|>";
pub const CONSTRAIN: &str = "<|constrain|>";
pub const RETURN: &str = "<|return|>";
pub const CALL: &str = "<|call|>";

/// Harmony's special tokens, by id in the model's vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HarmonyTokens {
    pub start: u32,
    pub end: u32,
    pub message: u32,
    pub channel: u32,
    pub constrain: u32,
    pub return_: u32,
    pub call: u32,
}

impl HarmonyTokens {
    /// The ids, when the tokenizer has every token as a special token.
    pub fn new(tokenizer: &Tokenizer) -> Option<Self> {
        let id = |text: &str| tokenizer.token_to_id(text).filter(|&id| tokenizer.is_special(id));
        Some(Self {
            start: id(START)?,
            end: id(END)?,
            message: id(MESSAGE)?,
            channel: id(CHANNEL)?,
            constrain: id(CONSTRAIN)?,
            return_: id(RETURN)?,
            call: id(CALL)?,
        })
    }
}

/// A chat template that writes harmony (gpt-oss's).
pub fn is_harmony_template(source: &str) -> bool {
    source.contains(CHANNEL) && source.contains(MESSAGE)
}

/// The harmony format of one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HarmonyFormat {
    pub tokens: HarmonyTokens,
}

impl HarmonyFormat {
    pub fn new(tokenizer: &Tokenizer) -> Option<Self> {
        HarmonyTokens::new(tokenizer).map(|tokens| Self { tokens })
    }

    /// The output grammar for `tool_choice` (module docstring): for
    /// `required` and a named function,
    ///
    /// ```text
    ///   start: analysis? call
    ///   analysis: <channel> "analysis" <message> TEXT <end> <start> "assistant"
    ///   call: <channel> "commentary to=functions.NAME " <constrain> "json" <message> ARGS <call>
    /// ```
    /// (one `call` alternative per function, ARGS its arguments' schema);
    /// `None` for `auto` and `none`.
    pub fn grammar(&self, tools: &[FunctionDefinition], choice: &ToolChoice) -> Option<Constraint> {
        let declared: Vec<&FunctionDefinition> = match choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Named(name) => tools.iter().filter(|f| &f.name == name).collect(),
            ToolChoice::Required => tools.iter().collect(),
        };
        let t = &self.tokens;
        let mut rules = vec![
            "start: analysis? call".to_string(),
            self.analysis_rule(),
            format!("call: {}", (0..declared.len()).map(|i| format!("call{i}")).collect::<Vec<_>>().join(" | ")),
        ];
        for (i, function) in declared.iter().enumerate() {
            let header = lark_literal(&format!("commentary to=functions.{} ", function.name));
            let arguments = function.parameters.clone().unwrap_or_else(|| json!({"type": "object"}));
            rules.push(format!(
                "call{i}: {} {header} {} \"json\" {} args{i} {}",
                token(t.channel),
                token(t.constrain),
                token(t.message),
                token(t.call)
            ));
            rules.push(format!("args{i}: %json {}", with_json_layout(&arguments)));
        }
        Some(Constraint::Lark(rules.join("\n") + "\n"))
    }

    /// `answer` (a response format) as the final channel's message, after
    /// (optionally) one analysis message:
    ///
    /// ```text
    ///   start: analysis? <channel> "final" <message> @answer
    /// ```
    /// The model's `<|return|>` (an EOS token) ends the output after it.
    pub fn final_answer(&self, answer: Constraint) -> Constraint {
        let t = &self.tokens;
        let main = format!(
            "start: analysis? {} \"final\" {} @answer\n{}\n",
            token(t.channel),
            token(t.message),
            self.analysis_rule()
        );
        Constraint::AfterThinking { main, answer: Box::new(answer) }
    }

    /// One analysis message and the next message's opening (TEXT is any
    /// text: it cannot hold a special token, so <|end|> ends it).
    fn analysis_rule(&self) -> String {
        let t = &self.tokens;
        format!(
            "analysis: {} \"analysis\" {} TEXT {} {} \"assistant\"\nTEXT: /(?s:.*)/",
            token(t.channel),
            token(t.message),
            token(t.end),
            token(t.start)
        )
    }
}

/// A special token in llguidance's Lark.
fn token(id: u32) -> String {
    format!("<[{id}]>")
}

/// What a message's header says it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Channel {
    /// The model's reasoning (`analysis`).
    Analysis,
    /// A call of function NAME (any channel with `to=functions.NAME`).
    Call(String),
    /// Text for the user: `final`, a `commentary` preamble, or no channel.
    Content,
}

/// Reads a header's text (role, channel, recipient, content type; the
/// special tokens between them as spaces).
pub fn parse_header(header: &str) -> Channel {
    let words: Vec<&str> = header.split_whitespace().collect();
    if let Some(to) = words.iter().find_map(|w| w.strip_prefix("to=")) {
        return Channel::Call(to.strip_prefix("functions.").unwrap_or(to).to_string());
    }
    if words.contains(&"analysis") {
        Channel::Analysis
    } else {
        Channel::Content
    }
}

/// A fresh call id, as the other formats make them.
pub fn new_call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

/// The JSON arguments of a call as OpenAI returns them: compact when they
/// parse, as written otherwise.
pub fn normalized_arguments(text: &str) -> String {
    serde_json::from_str::<Value>(text.trim()).map_or_else(|_| text.trim().to_string(), |v| v.to_string())
}

#[cfg(test)]
pub(crate) mod tests;

//! Reasoning ("thinking") models: the thinking is split off the answer.
//!
//! Qwen3 and DeepSeek-R1 think in a tagged block before they answer; the
//! block goes to `reasoning_content` (OpenAI chat), a reasoning item
//! (Responses) or a thinking block (Anthropic), the rest is the answer that
//! tool calls and structured output are read from. A [`ReasoningFormat`]
//! (`--reasoning-parser`, default from the chat template) knows the tags:
//!
//! ```text
//!   qwen3        <think>\n...\n</think>\n\nanswer    the model opens the block itself;
//!                                                    enable_thinking=false: the template
//!                                                    writes an empty block into the prompt
//!   deepseek_r1  ...\n</think>\n\nanswer             the template opens the block in the
//!                                                    prompt: the output starts inside it
//!   gpt_oss      <|channel|>analysis<|message|>...     gpt-oss's harmony channels (`crate::harmony`):
//!                <|end|><|start|>assistant<|channel|>  the analysis channel is the thinking, a
//!                final<|message|>answer<|return|>      commentary message to a function a tool
//!                                                      call, the final channel the answer
//! ```
//!
//! Harmony is more than a thinking block: its channels carry the tool calls
//! too, so with `gpt_oss` the harmony parser reads the whole output (in
//! place of the tags and of `--tool-call-parser`), and the tools' grammar
//! and a response format's are harmony messages ([`Reasoning::Harmony`]).
//!
//! Where the output starts is read from the rendered prompt
//! ([`ReasoningFormat::start`]): a prompt that ends in an open block starts
//! inside it, one that ends right after a closed block has no thinking, any
//! other starts as the family does. [`stream::ReasoningParser`] splits the
//! text as it streams; [`ReasoningFormat::after_thinking`] wraps an output
//! constraint so that it applies after the block (the block itself is free
//! text).

pub mod stream;

use crate::grammar::{lark_literal, Constraint};
use crate::harmony::{HarmonyFormat, HarmonyTokens};
use crate::tokenizer::Tokenizer;

/// The model families' ways of thinking (`--reasoning-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum ReasoningParserKind {
    Qwen3,
    #[value(name = "deepseek_r1")]
    DeepseekR1,
    /// gpt-oss's harmony channels (`harmony` is accepted too).
    #[value(name = "gpt_oss", alias = "harmony")]
    GptOss,
}

impl ReasoningParserKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen3 => "qwen3",
            Self::DeepseekR1 => "deepseek_r1",
            Self::GptOss => "gpt_oss",
        }
    }

    /// The family a chat template thinks like, when it says: a template that
    /// writes harmony's channels is gpt-oss's; one that writes `<think>` is
    /// a reasoning model's, DeepSeek's role markers telling R1 from Qwen3.
    /// `None`: not a reasoning model (or not obviously one).
    pub fn from_template(source: &str) -> Option<Self> {
        if crate::harmony::is_harmony_template(source) {
            return Some(Self::GptOss);
        }
        if !source.contains(OPEN) {
            return None;
        }
        if source.contains("<｜Assistant｜>") {
            Some(Self::DeepseekR1)
        } else {
            Some(Self::Qwen3)
        }
    }
}

/// How this model's output is read (`--reasoning-parser`, resolved
/// against the tokenizer at start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reasoning {
    /// A tagged thinking block before the answer (qwen3, deepseek_r1).
    Tags(ReasoningFormat),
    /// gpt-oss's harmony channels.
    Harmony(HarmonyFormat),
}

/// The tokenizer lacks what the reasoning parser reads.
#[derive(Debug, thiserror::Error)]
#[error("--reasoning-parser {0}: the tokenizer lacks harmony's special tokens (<|channel|>, <|message|>, ...)")]
pub struct MissingTokens(&'static str);

impl Reasoning {
    pub fn new(kind: ReasoningParserKind, tokenizer: &crate::tokenizer::Tokenizer) -> Result<Self, MissingTokens> {
        match kind {
            ReasoningParserKind::GptOss => {
                HarmonyFormat::new(tokenizer).map(Self::Harmony).ok_or(MissingTokens(kind.name()))
            }
            _ => Ok(Self::Tags(ReasoningFormat::for_tokenizer(kind, tokenizer))),
        }
    }

    pub fn kind(&self) -> ReasoningParserKind {
        match self {
            Self::Tags(format) => format.kind,
            Self::Harmony(_) => ReasoningParserKind::GptOss,
        }
    }

    /// How the output of `prompt` (as the chat template rendered it) is read.
    pub fn for_prompt(&self, prompt: &str) -> PromptReasoning {
        match self {
            Self::Tags(format) => PromptReasoning::Tags(format.clone(), format.start(prompt)),
            Self::Harmony(format) => PromptReasoning::Harmony(format.tokens),
        }
    }
}

/// How one request's output is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptReasoning {
    /// The tags, and where this prompt's output starts relative to them.
    Tags(ReasoningFormat, ThinkStart),
    /// Harmony, read by its special tokens' ids.
    Harmony(HarmonyTokens),
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Where one request's output starts, relative to the thinking block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkStart {
    /// The output may open a block (Qwen3 with thinking on).
    MayOpen,
    /// The prompt opened the block: the output starts inside it, perhaps
    /// repeating the opening tag (DeepSeek-R1).
    Inside,
    /// The prompt holds a closed block right at its end (Qwen3 with
    /// `enable_thinking: false`): the output is all answer.
    Closed,
}

/// One family's thinking tags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningFormat {
    pub kind: ReasoningParserKind,
    pub(crate) open: &'static str,
    pub(crate) close: &'static str,
    /// The tags are added tokens of the tokenizer (Qwen3's and DeepSeek's
    /// are): the grammar names them as tokens, not as text (see
    /// [`ReasoningFormat::for_tokenizer`]).
    tags_are_tokens: bool,
}

impl ReasoningFormat {
    pub fn new(kind: ReasoningParserKind) -> Self {
        // The tagged families use the same tags; they differ in who opens them.
        Self { kind, open: OPEN, close: CLOSE, tags_are_tokens: false }
    }

    /// The format for a model whose tokenizer is `tokenizer`. A tag that is
    /// an added token is one token the model emits whole, and the grammar
    /// engine (llguidance) holds every added `<...>` token as a special
    /// token that no text matches: a constraint must name it as a token.
    pub fn for_tokenizer(kind: ReasoningParserKind, tokenizer: &Tokenizer) -> Self {
        let added = tokenizer.hf().get_added_tokens_decoder();
        let is_added = |tag: &str| added.values().any(|t| t.content == tag);
        let mut format = Self::new(kind);
        format.tags_are_tokens = is_added(format.open) && is_added(format.close);
        format
    }

    /// Where the output of `prompt` (as the chat template rendered it)
    /// starts: only the prompt's end matters (earlier turns' blocks do not).
    pub fn start(&self, prompt: &str) -> ThinkStart {
        let tail = prompt.trim_end();
        if tail.ends_with(self.open) {
            return ThinkStart::Inside;
        }
        if tail.ends_with(self.close) {
            return ThinkStart::Closed;
        }
        match self.kind {
            ReasoningParserKind::DeepseekR1 => ThinkStart::Inside,
            ReasoningParserKind::Qwen3 | ReasoningParserKind::GptOss => ThinkStart::MayOpen,
        }
    }

    /// `answer` applied after the thinking block, which is free text:
    ///
    /// ```text
    ///   MayOpen   start: (think GAP?)? @answer     think[lazy]: "<think>" TEXT "</think>"
    ///   Inside    start: think GAP? @answer        think[lazy]: "<think>"? TEXT "</think>"
    ///   Closed    the answer's grammar alone
    /// ```
    /// With tags that are added tokens, `<think>` and `</think>` unquoted
    /// (the tokens, not their text) in `think: <think> TEXT? </think>`.
    /// GAP is the whitespace models write after the block; `@answer` is the
    /// answer's own grammar (its lexer apart from the block's).
    pub fn after_thinking(&self, answer: Constraint, start: ThinkStart) -> Constraint {
        let (open, optional) = match start {
            ThinkStart::Closed => return answer,
            ThinkStart::MayOpen => ("", "?"),
            ThinkStart::Inside => ("?", ""),
        };
        let think = if self.tags_are_tokens {
            // Tokens: no text matches them, so a greedy TEXT stops right
            // where the closing token comes (a lazy rule would be a
            // terminal, which cannot hold tokens).
            format!("think: {}{open} TEXT? {}\nTEXT: /(?s:.+)/", self.open, self.close)
        } else {
            let (o, c) = (lark_literal(self.open), lark_literal(self.close));
            format!("think[lazy]: {o}{open} TEXT {c}\nTEXT: /(?s:.*)/")
        };
        let main = format!("start: (think GAP?){optional} @answer\n{think}\nGAP: /[ \\t\\r\\n]+/\n");
        Constraint::AfterThinking { main, answer: Box::new(answer) }
    }
}

#[cfg(test)]
mod tests;

//! Turns API-neutral generation parameters into an [`infer::ValidRequest`].
//! Every check on client input lives here; nothing past this module sees an
//! unchecked value. Both APIs first map their body into
//! [`GenerateParameters`] (their own defaults applied, their own field names
//! for error messages), then call [`Validation::validate_prompts`] (or
//! [`Validation::tokenize`] + [`Validation::validate`]). Failures are one
//! enum, [`ValidationError`], mapped to HTTP in `http::error`.
//!
//! The checks, by concern:
//!
//! | file             | what it checks |
//! |------------------|----------------|
//! | `request.rs`     | the request's shape: `n` and fan-out, `best_of`, lengths (`truncate`, `max_tokens`), `stop`, `top_logprobs`, `min_tokens` |
//! | `prompt.rs`      | the prompt: tokenization, token ids, chat templates (with tools shown to the model) |
//! | `sampling.rs`    | sampling parameters and their ranges: the one set of ranges (the shard trusts them) |
//! | `constraints.rs` | output constraints (compiled with llguidance) and tools |
//! | `chat.rs`        | chat requests of every API: template variables, the constraint after a reasoning model's thinking |
//!
//! Order of the checks, so that a request with several faults always gets
//! the same answer: the model name (the handler asks first), the tools
//! ([`Validation::tools`], chat only), the request's shape (`n`, `best_of`,
//! `top_logprobs` without `logprobs`, a TGI temperature <= 0, then the
//! output constraint, compiled), the prompt (empty, unknown tokens, too
//! long), then lengths, every sampling range, and the output options.
//!
//! Output constraints arrive as an API-neutral [`Constraint`] (each API's
//! spelling is read by its handler: `http::openai::structured`,
//! `http::tgi`); compiling it against the tokenizer is the check.
//!
//! [`Constraint`]: crate::grammar::Constraint
//! [`infer::ValidRequest`]: crate::infer::ValidRequest

mod chat;
mod constraints;
mod prompt;
mod request;
mod sampling;
#[cfg(test)]
pub(crate) mod tests;

use std::sync::Arc;
use std::time::Instant;

use crate::chat_template::ChatTemplate;
use crate::grammar::{CompiledGrammar, GrammarCompiler};
use crate::infer::{RequestClass, ValidRequest};
use crate::tokenizer::Tokenizer;
use crate::tool_calls::ToolFormat;

pub use chat::{ChatInput, ValidChat};
pub use constraints::{one_constraint, ToolRequest, ValidTools};
pub use prompt::Prompt;
pub use request::{GenerateParameters, RequestLimits, MAX_STOP_BYTES};
pub use sampling::{Decoding, GenerationDefaults, MAX_LOGIT_BIAS};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValidationError {
    /// The body is not valid JSON or a field has the wrong type.
    #[error("invalid request body: {message}")]
    Body { field: Option<String>, message: String },
    #[error("`{field}` must not be empty")]
    Empty { field: String },
    #[error("`{field}` is out of range: {message}")]
    OutOfRange { field: String, message: String },
    #[error("`{field}`: the prompt has {tokens} tokens, more than the maximum of {max} (--max-input-tokens)")]
    InputTooLong { field: String, tokens: usize, max: u32 },
    #[error("`{field}`: {input} prompt tokens + {max_new_tokens} new tokens = {total}, more than the maximum of {max_total} (--max-total-tokens)")]
    TotalTooLong { field: String, input: usize, max_new_tokens: u64, total: u64, max_total: u32 },
    #[error("`{field}`: token id {id} is not in the vocabulary (size {vocab_size})")]
    UnknownToken { field: String, id: u64, vocab_size: u32 },
    #[error("`stop`: at most {max} stop sequences are allowed (--max-stop-sequences), got {got}")]
    TooManyStops { max: u32, got: usize },
    #[error("The model `{0}` does not exist")]
    ModelNotFound(String),
    #[error("`messages`: this model has no chat template; use a completion endpoint or start the router with --chat-template")]
    NoChatTemplate,
    #[error("`messages`: {0}")]
    ChatTemplate(String),
    #[error("`{field}`: {message}")]
    Unsupported { field: String, message: String },
    /// A schema, regex, grammar or tool definition that does not compile.
    #[error("`{field}`: {message}")]
    Grammar { field: String, message: String },
    #[error("tokenization failed: {0}")]
    Tokenizer(String),
}

impl ValidationError {
    /// The request field at fault, OpenAI's `param`.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::Body { field, .. } => field.as_deref(),
            Self::Empty { field }
            | Self::OutOfRange { field, .. }
            | Self::InputTooLong { field, .. }
            | Self::TotalTooLong { field, .. }
            | Self::UnknownToken { field, .. }
            | Self::Unsupported { field, .. }
            | Self::Grammar { field, .. } => Some(field),
            Self::TooManyStops { .. } => Some("stop"),
            Self::ModelNotFound(_) => Some("model"),
            Self::NoChatTemplate | Self::ChatTemplate(_) => Some("messages"),
            Self::Tokenizer(_) => None,
        }
    }
}

fn out_of_range(field: &str, message: impl Into<String>) -> ValidationError {
    ValidationError::OutOfRange {
        field: field.to_string(),
        message: message.into(),
    }
}

/// What the handlers need besides the `ValidRequest`.
#[derive(Debug, Clone)]
pub struct Validated {
    pub request: ValidRequest,
    pub stop: Vec<String>,
    /// Independent choices to generate from this prompt.
    pub n: u32,
}

pub struct Validation {
    pub tokenizer: Tokenizer,
    pub chat_template: Option<Arc<ChatTemplate>>,
    pub limits: RequestLimits,
    /// Token ids must be below this (the LM head's rows).
    pub vocab_size: u32,
    pub defaults: GenerationDefaults,
    /// Names a request's `model` may take: the served name first, then the
    /// model id.
    pub model_names: Vec<String>,
    /// Compiles output constraints; `None` when llguidance could not read
    /// the tokenizer (constrained requests then get a 400 saying so).
    pub grammar: Option<Arc<GrammarCompiler>>,
    /// How this model writes tool calls (`--tool-call-parser`).
    pub tool_format: ToolFormat,
    /// How this model thinks (`--reasoning-parser`); `None`: it does not.
    pub reasoning: Option<crate::reasoning::ReasoningFormat>,
}

impl Validation {
    /// The name responses give the model.
    pub fn served_model_name(&self) -> &str {
        &self.model_names[0]
    }

    /// Accepts no name, the served name, the model id, and the placeholders
    /// huggingface_hub's InferenceClient sends when given a server URL
    /// instead of a model ("tgi", "dummy").
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ValidationError> {
        const CLIENT_PLACEHOLDERS: [&str; 2] = ["tgi", "dummy"];
        match model {
            None => Ok(()),
            Some(m) if CLIENT_PLACEHOLDERS.contains(&m) || self.model_names.iter().any(|n| n == m) => Ok(()),
            Some(m) => Err(ValidationError::ModelNotFound(m.to_string())),
        }
    }

    /// Tokenizes and validates every prompt of a request (`field` names the
    /// prompt field; a list's entries are named `field[i]`).
    pub fn validate_prompts(
        &self,
        prompts: &[Prompt],
        field: &str,
        params: &GenerateParameters,
    ) -> Result<Vec<Validated>, ValidationError> {
        let grammar = self.check_shape(params)?;
        if prompts.is_empty() {
            return Err(ValidationError::Empty { field: field.into() });
        }
        self.check_fan_out(prompts.len(), field, params.n)?;
        prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                let field = if prompts.len() > 1 { format!("{field}[{i}]") } else { field.to_string() };
                let ids = self.tokenize(prompt, &field, true)?;
                self.validate_lengths_and_ranges(ids, &field, params.clone(), grammar.clone())
            })
            .collect()
    }

    /// Checks lengths and every parameter; `input_field` names the prompt
    /// field in messages ("prompt", "messages", "inputs").
    pub fn validate(
        &self,
        input_ids: Vec<u32>,
        input_field: &str,
        params: GenerateParameters,
    ) -> Result<Validated, ValidationError> {
        let grammar = self.check_shape(&params)?;
        self.validate_lengths_and_ranges(input_ids, input_field, params, grammar)
    }

    /// One prompt's lengths, sampling parameters and output options, in
    /// that order; `grammar` is the request's constraint, compiled once.
    #[tracing::instrument(level = "debug", name = "validate", skip_all)]
    fn validate_lengths_and_ranges(
        &self,
        input_ids: Vec<u32>,
        input_field: &str,
        params: GenerateParameters,
        grammar: Option<CompiledGrammar>,
    ) -> Result<Validated, ValidationError> {
        let (input_ids, max_new_tokens) = self.check_lengths(input_ids, input_field, &params)?;
        let sampling = self.sampling(&params)?;
        self.check_outputs(&params, max_new_tokens)?;
        Ok(Validated {
            request: ValidRequest {
                input_ids,
                max_new_tokens,
                params: sampling,
                ignore_eos: params.ignore_eos,
                min_tokens: params.min_tokens,
                logprobs: params.logprobs || params.top_n_tokens > 0,
                top_n_tokens: params.top_n_tokens,
                prompt_logprobs: params.prompt_logprobs,
                grammar,
                arrived: Instant::now(),
                priority: params.priority,
                class: RequestClass::Interactive,
            },
            stop: params.stop,
            n: params.n,
        })
    }
}

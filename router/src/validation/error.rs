//! The one error of validation; `http::error` maps it to each API's shape.

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

pub(super) fn out_of_range(field: &str, message: impl Into<String>) -> ValidationError {
    ValidationError::OutOfRange {
        field: field.to_string(),
        message: message.into(),
    }
}

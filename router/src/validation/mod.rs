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
//! | `params.rs`      | the plain types the handlers fill (parameters, limits, prompt, tools) |
//! | `error.rs`       | the one error, [`ValidationError`] |
//! | `validate.rs`    | the validator and the order of its checks |
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
mod error;
mod params;
mod prompt;
mod request;
mod sampling;
#[cfg(test)]
pub(crate) mod tests;
mod validate;

pub use chat::ChatInput;
pub use constraints::ValidTools;
pub use error::ValidationError;
pub use params::{Decoding, GenerateParameters, GenerationDefaults, Prompt, RequestLimits, ToolRequest};
pub use validate::{Validated, Validation};

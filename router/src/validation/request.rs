//! The request's shape: how many sequences it asks for, its lengths, its
//! stop sequences and the output options that depend on them.

use super::error::{out_of_range, ValidationError};
use super::params::{Decoding, GenerateParameters};
use super::validate::Validation;
use crate::grammar::CompiledGrammar;

/// Longest stop sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;

impl Validation {
    /// How many sequences the request asks for, checked before any prompt is
    /// tokenized or any parameter copied.
    pub(super) fn check_fan_out(&self, prompts: usize, field: &str, n: u32) -> Result<(), ValidationError> {
        let limits = &self.limits;
        if prompts > limits.max_client_batch_size as usize {
            return Err(out_of_range(
                field,
                format!("{prompts} prompts; at most {} per request (--max-client-batch-size)", limits.max_client_batch_size),
            ));
        }
        let sequences = prompts as u64 * u64::from(n);
        if sequences > u64::from(limits.max_sequences) {
            return Err(out_of_range(
                "n",
                format!(
                    "{prompts} prompt(s) x n = {n} asks for {sequences} sequences; the server runs at most {} at once",
                    limits.max_sequences
                ),
            ));
        }
        Ok(())
    }

    /// What the request asks for as a whole, before its prompt is looked at;
    /// its output constraint, compiled (once, whatever the number of prompts).
    pub(super) fn check_shape(&self, p: &GenerateParameters) -> Result<Option<CompiledGrammar>, ValidationError> {
        if p.n == 0 || p.n > self.limits.max_n {
            return Err(out_of_range("n", format!("must be in [1, {}]", self.limits.max_n)));
        }
        let unsupported = |field: &str, message: &str| ValidationError::Unsupported {
            field: format!("{}{field}", p.field_prefix),
            message: message.into(),
        };
        if p.best_of.is_some_and(|b| b != 1) {
            return Err(unsupported("best_of", "only 1 is supported"));
        }
        if p.top_n_tokens_needs_logprobs && p.top_n_tokens > 0 && !p.logprobs {
            return Err(ValidationError::Unsupported {
                field: p.top_n_tokens_field.into(),
                message: "requires `logprobs: true`".into(),
            });
        }
        if matches!(p.decoding, Decoding::GreedyUnless { .. }) && p.temperature.is_some_and(|t| t <= 0.0) {
            return Err(out_of_range("temperature", "must be strictly positive"));
        }
        match &p.constraint {
            Some((field, constraint)) => self.compile(field, constraint).map(Some),
            None => Ok(None),
        }
    }

    /// The prompt after `truncate`, and the number of new tokens (asked for,
    /// or by default whatever room the sequence has left).
    pub(super) fn check_lengths(
        &self,
        mut input_ids: Vec<u32>,
        input_field: &str,
        params: &GenerateParameters,
    ) -> Result<(Vec<u32>, u32), ValidationError> {
        let limits = &self.limits;
        if let Some(truncate) = params.truncate {
            if truncate == 0 || truncate > limits.max_input_tokens {
                return Err(out_of_range(
                    "truncate",
                    format!("must be in [1, {}] (--max-input-tokens)", limits.max_input_tokens),
                ));
            }
            let truncate = truncate as usize;
            if input_ids.len() > truncate {
                input_ids.drain(..input_ids.len() - truncate);
            }
        }
        if input_ids.len() > limits.max_input_tokens as usize {
            return Err(ValidationError::InputTooLong {
                field: input_field.into(),
                tokens: input_ids.len(),
                max: limits.max_input_tokens,
            });
        }
        let room = limits.max_total_tokens as usize - input_ids.len().min(limits.max_total_tokens as usize);
        let max_new_tokens = match params.max_new_tokens {
            Some(0) => {
                return Err(out_of_range(params.max_new_tokens_field, "must be at least 1"));
            }
            Some(n) if n > room as u64 => {
                return Err(ValidationError::TotalTooLong {
                    field: params.max_new_tokens_field.into(),
                    input: input_ids.len(),
                    max_new_tokens: n,
                    // n may be anything up to u64::MAX.
                    total: (input_ids.len() as u64).saturating_add(n),
                    max_total: limits.max_total_tokens,
                });
            }
            Some(n) => n as u32,
            // vLLM's and TGI's default: whatever room the sequence has left.
            None if room == 0 => {
                return Err(ValidationError::TotalTooLong {
                    field: input_field.into(),
                    input: input_ids.len(),
                    max_new_tokens: 1,
                    total: input_ids.len() as u64 + 1,
                    max_total: limits.max_total_tokens,
                });
            }
            None => room as u32,
        };
        Ok((input_ids, max_new_tokens))
    }

    /// Stop sequences, top logprobs and `min_tokens` (bounded by the new
    /// tokens `check_lengths` allowed).
    pub(super) fn check_outputs(&self, params: &GenerateParameters, max_new_tokens: u32) -> Result<(), ValidationError> {
        let limits = &self.limits;
        if params.stop.len() > limits.max_stop_sequences as usize {
            return Err(ValidationError::TooManyStops {
                max: limits.max_stop_sequences,
                got: params.stop.len(),
            });
        }
        if params.stop.iter().any(String::is_empty) {
            return Err(ValidationError::Empty { field: "stop".into() });
        }
        if let Some(long) = params.stop.iter().position(|s| s.len() > MAX_STOP_BYTES) {
            return Err(out_of_range(&format!("stop[{long}]"), format!("must be at most {MAX_STOP_BYTES} bytes long")));
        }
        if params.top_n_tokens > limits.max_top_n_tokens {
            return Err(out_of_range(
                params.top_n_tokens_field,
                format!("must be at most {} (--max-top-n-tokens)", limits.max_top_n_tokens),
            ));
        }
        if params.min_tokens > max_new_tokens {
            return Err(out_of_range("min_tokens", format!("must be at most the maximum of new tokens ({max_new_tokens})")));
        }
        Ok(())
    }
}

//! The request's shape: how many sequences it asks for, its lengths, its
//! stop sequences and the output options that depend on them.

use super::{out_of_range, Validation, ValidationError};
use crate::grammar::{CompiledGrammar, Constraint};
use super::sampling::Decoding;

/// Longest stop sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;

/// The router's limits on requests (from the command line and Warmup).
#[derive(Debug, Clone)]
pub struct RequestLimits {
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_stop_sequences: u32,
    pub max_top_n_tokens: u32,
    /// Largest OpenAI `n`.
    pub max_n: u32,
    /// The most prompts in one request (`--max-client-batch-size`).
    pub max_client_batch_size: u32,
    /// The most sequences (prompts x `n`) one request may ask for: the
    /// scheduler's `--max-concurrent-requests`.
    pub max_sequences: u32,
}

/// One request's parameters in API-neutral form. `None` means "not given".
/// Field names for error messages follow the API the values came from.
#[derive(Debug, Clone)]
pub struct GenerateParameters {
    pub max_new_tokens: Option<u64>,
    /// The API's name for `max_new_tokens` ("max_tokens", ...).
    pub max_new_tokens_field: &'static str,
    /// Prefix of the fields an API nests (TGI's `parameters.`), for the
    /// error about `best_of`.
    pub field_prefix: &'static str,
    /// Independent choices per prompt (OpenAI `n`), in [1, max_n].
    pub n: u32,
    /// Candidates per choice; only 1 is supported.
    pub best_of: Option<u32>,
    /// As the API's handler resolved it; see [`Decoding`]. None: greedy.
    pub temperature: Option<f32>,
    pub decoding: Decoding,
    /// Inclusive upper bound on temperature (2 for OpenAI).
    pub max_temperature: f32,
    /// 0 or -1: off.
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// (field name of the key, e.g. "logit_bias.50256", token id as given, bias)
    pub logit_bias: Vec<(String, String, f32)>,
    pub stop: Vec<String>,
    pub logprobs: bool,
    pub top_n_tokens: u32,
    pub top_n_tokens_field: &'static str,
    /// OpenAI chat: `top_logprobs` needs `logprobs: true`.
    pub top_n_tokens_needs_logprobs: bool,
    pub prompt_logprobs: bool,
    pub ignore_eos: bool,
    pub min_tokens: u32,
    /// TGI: keep only the last `truncate` prompt tokens.
    pub truncate: Option<u32>,
    /// The output constraint, and the request field it came from (named in
    /// the 400 when it does not compile).
    pub constraint: Option<(String, Constraint)>,
    /// Scheduling priority: lower runs first (vLLM's `priority`).
    pub priority: i32,
}

impl Default for GenerateParameters {
    fn default() -> Self {
        Self {
            max_new_tokens: None,
            max_new_tokens_field: "max_tokens",
            field_prefix: "",
            n: 1,
            best_of: None,
            temperature: None,
            decoding: Decoding::ByTemperature,
            max_temperature: f32::MAX,
            top_k: None,
            top_p: None,
            min_p: None,
            typical_p: None,
            repetition_penalty: None,
            frequency_penalty: None,
            presence_penalty: None,
            seed: None,
            logit_bias: Vec::new(),
            stop: Vec::new(),
            logprobs: false,
            top_n_tokens: 0,
            top_n_tokens_field: "top_n_tokens",
            top_n_tokens_needs_logprobs: false,
            prompt_logprobs: false,
            ignore_eos: false,
            min_tokens: 0,
            truncate: None,
            constraint: None,
            priority: 0,
        }
    }
}

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

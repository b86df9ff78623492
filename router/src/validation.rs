//! Turns API-neutral generation parameters into an [`infer::ValidRequest`].
//! Every check on client input lives here; nothing past this module sees an
//! unchecked value. Both APIs first map their body into
//! [`GenerateParameters`] (their own defaults applied, their own field names
//! for error messages), then call [`Validation::validate_prompts`] (or
//! [`Validation::tokenize`] + [`Validation::validate`]). Failures are one
//! enum, [`ValidationError`], mapped to HTTP in `http::error`.
//!
//! Order of the checks, so that a request with several faults always gets
//! the same answer: the model name (the handler asks first), the request's
//! shape (`n`, `best_of`, `grammar`, `top_logprobs` without `logprobs`, a
//! TGI temperature <= 0), the prompt (empty, unknown tokens, too long), then
//! lengths and every sampling range.

use std::sync::Arc;
use std::time::Instant;

use crate::chat_template::{ChatTemplate, ChatTemplateError, TemplateMessage};
use crate::infer::{SamplingParameters, ValidRequest};
use crate::tokenizer::Tokenizer;

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
    TotalTooLong { field: String, input: usize, max_new_tokens: u32, total: usize, max_total: u32 },
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
            | Self::Unsupported { field, .. } => Some(field),
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

/// The router's limits on requests (from the command line and Warmup).
#[derive(Debug, Clone)]
pub struct RequestLimits {
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_stop_sequences: u32,
    pub max_top_n_tokens: u32,
    /// Largest OpenAI `n`.
    pub max_n: u32,
}

/// Defaults from the model's generation_config.json, used by the OpenAI API
/// for fields the client omitted (as vLLM does). TGI's API keeps TGI's
/// defaults (greedy unless asked to sample).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub repetition_penalty: Option<f32>,
}

/// A prompt before tokenization.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Raw text: gets the tokenizer's special tokens (BOS).
    Text(String),
    /// A chat template's output: it spells its special tokens already.
    Chat(String),
    Tokens(Vec<u64>),
}

/// How an API chooses between greedy decoding and sampling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Decoding {
    /// OpenAI: sample at `temperature` (the API's default applied by its
    /// handler); 0 or none is greedy.
    #[default]
    ByTemperature,
    /// TGI: greedy unless `do_sample` or a warper (temperature != 1, top_k,
    /// top_p, typical_p) is given; a temperature given must be > 0.
    GreedyUnless { do_sample: bool },
}

/// One request's parameters in API-neutral form. `None` means "not given".
/// Field names for error messages follow the API the values came from.
#[derive(Debug, Clone)]
pub struct GenerateParameters {
    pub max_new_tokens: Option<u64>,
    /// The API's name for `max_new_tokens` ("max_tokens", ...).
    pub max_new_tokens_field: &'static str,
    /// Prefix of the fields an API nests (TGI's `parameters.`), for the
    /// errors about `best_of` and `grammar`.
    pub field_prefix: &'static str,
    /// Independent choices per prompt (OpenAI `n`), in [1, max_n].
    pub n: u32,
    /// Candidates per choice; only 1 is supported.
    pub best_of: Option<u32>,
    /// A grammar the output must follow (TGI `grammar`, null already
    /// dropped); not supported yet.
    pub grammar: Option<serde_json::Value>,
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
}

impl Default for GenerateParameters {
    fn default() -> Self {
        Self {
            max_new_tokens: None,
            max_new_tokens_field: "max_tokens",
            field_prefix: "",
            n: 1,
            best_of: None,
            grammar: None,
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
        }
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
        self.check_shape(params)?;
        if prompts.is_empty() {
            return Err(ValidationError::Empty { field: field.into() });
        }
        prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                let field = if prompts.len() > 1 { format!("{field}[{i}]") } else { field.to_string() };
                let ids = self.tokenize(prompt, &field, true)?;
                self.validate_lengths_and_ranges(ids, &field, params.clone())
            })
            .collect()
    }

    /// What the request asks for as a whole, before its prompt is looked at.
    fn check_shape(&self, p: &GenerateParameters) -> Result<(), ValidationError> {
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
        if p.grammar.is_some() {
            return Err(unsupported("grammar", "grammars are not supported"));
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
        Ok(())
    }

    #[tracing::instrument(level = "debug", name = "render_chat", skip_all)]
    pub fn render_chat(&self, messages: &[TemplateMessage]) -> Result<String, ValidationError> {
        if messages.is_empty() {
            return Err(ValidationError::Empty {
                field: "messages".into(),
            });
        }
        let template = self.chat_template.as_ref().ok_or(ValidationError::NoChatTemplate)?;
        template.apply(messages, true).map_err(|e| match e {
            ChatTemplateError::Render(message) => ValidationError::ChatTemplate(message),
            other => ValidationError::ChatTemplate(other.to_string()),
        })
    }

    /// Prompt token ids. Raw text gets the tokenizer's special tokens (BOS)
    /// when `add_special_tokens`; chat-template output never does (it spells
    /// them already).
    #[tracing::instrument(level = "debug", name = "tokenize", skip_all)]
    pub fn tokenize(
        &self,
        prompt: &Prompt,
        field: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ValidationError> {
        let ids = match prompt {
            Prompt::Text(text) | Prompt::Chat(text) => {
                if text.is_empty() {
                    return Err(ValidationError::Empty { field: field.into() });
                }
                let add_special_tokens = add_special_tokens && matches!(prompt, Prompt::Text(_));
                self.tokenizer
                    .encode(text, add_special_tokens)
                    .map_err(|e| ValidationError::Tokenizer(e.to_string()))?
            }
            Prompt::Tokens(ids) => ids
                .iter()
                .map(|&id| self.check_token(field, id))
                .collect::<Result<_, _>>()?,
        };
        if ids.is_empty() {
            return Err(ValidationError::Empty { field: field.into() });
        }
        Ok(ids)
    }

    fn check_token(&self, field: &str, id: u64) -> Result<u32, ValidationError> {
        if id >= u64::from(self.vocab_size) {
            return Err(ValidationError::UnknownToken {
                field: field.into(),
                id,
                vocab_size: self.vocab_size,
            });
        }
        Ok(id as u32)
    }

    /// Checks lengths and every parameter; `input_field` names the prompt
    /// field in messages ("prompt", "messages", "inputs").
    pub fn validate(
        &self,
        input_ids: Vec<u32>,
        input_field: &str,
        params: GenerateParameters,
    ) -> Result<Validated, ValidationError> {
        self.check_shape(&params)?;
        self.validate_lengths_and_ranges(input_ids, input_field, params)
    }

    #[tracing::instrument(level = "debug", name = "validate", skip_all)]
    fn validate_lengths_and_ranges(
        &self,
        mut input_ids: Vec<u32>,
        input_field: &str,
        params: GenerateParameters,
    ) -> Result<Validated, ValidationError> {
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
            Some(n) if n as usize > room => {
                return Err(ValidationError::TotalTooLong {
                    field: params.max_new_tokens_field.into(),
                    input: input_ids.len(),
                    max_new_tokens: n.min(u64::from(u32::MAX)) as u32,
                    total: input_ids.len() + n as usize,
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
                    total: input_ids.len() + 1,
                    max_total: limits.max_total_tokens,
                });
            }
            None => room as u32,
        };

        let sampling = self.sampling(&params)?;
        if params.stop.len() > limits.max_stop_sequences as usize {
            return Err(ValidationError::TooManyStops {
                max: limits.max_stop_sequences,
                got: params.stop.len(),
            });
        }
        if params.stop.iter().any(String::is_empty) {
            return Err(ValidationError::Empty { field: "stop".into() });
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
                arrived: Instant::now(),
            },
            stop: params.stop,
            n: params.n,
        })
    }

    fn sampling(&self, p: &GenerateParameters) -> Result<SamplingParameters, ValidationError> {
        let finite = |field: &str, v: f32| {
            if v.is_finite() {
                Ok(v)
            } else {
                Err(out_of_range(field, "must be a finite number"))
            }
        };
        let temperature = match p.decoding {
            Decoding::ByTemperature => p.temperature.unwrap_or(0.0),
            Decoding::GreedyUnless { do_sample } => {
                let warped = p.temperature.is_some_and(|t| t != 1.0)
                    || p.top_k.is_some()
                    || p.top_p.is_some()
                    || p.typical_p.is_some();
                if do_sample || warped {
                    p.temperature.unwrap_or(1.0)
                } else {
                    0.0
                }
            }
        };
        let temperature = finite("temperature", temperature)?;
        if temperature < 0.0 || temperature > p.max_temperature {
            let upper = if p.max_temperature == f32::MAX {
                String::new()
            } else {
                format!(" and at most {}", p.max_temperature)
            };
            return Err(out_of_range("temperature", format!("must be at least 0{upper}")));
        }
        let top_k = match p.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k.min(i64::from(u32::MAX)) as u32,
            Some(_) => return Err(out_of_range("top_k", "must be positive, or -1 or 0 to disable")),
        };
        let top_p = finite("top_p", p.top_p.unwrap_or(1.0))?;
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(out_of_range("top_p", "must be in (0, 1]"));
        }
        let min_p = finite("min_p", p.min_p.unwrap_or(0.0))?;
        if !(0.0..=1.0).contains(&min_p) {
            return Err(out_of_range("min_p", "must be in [0, 1]"));
        }
        let typical_p = finite("typical_p", p.typical_p.unwrap_or(1.0))?;
        if !(typical_p > 0.0 && typical_p <= 1.0) {
            return Err(out_of_range("typical_p", "must be in (0, 1]"));
        }
        let repetition_penalty = finite("repetition_penalty", p.repetition_penalty.unwrap_or(1.0))?;
        if repetition_penalty <= 0.0 || repetition_penalty > 100.0 {
            return Err(out_of_range("repetition_penalty", "must be in (0, 100]"));
        }
        let penalty = |field: &str, v: Option<f32>| {
            let v = finite(field, v.unwrap_or(0.0))?;
            if (-2.0..=2.0).contains(&v) {
                Ok(v)
            } else {
                Err(out_of_range(field, "must be in [-2, 2]"))
            }
        };
        let frequency_penalty = penalty("frequency_penalty", p.frequency_penalty)?;
        let presence_penalty = penalty("presence_penalty", p.presence_penalty)?;
        let mut logit_bias = Vec::with_capacity(p.logit_bias.len());
        for (field, key, bias) in &p.logit_bias {
            let id: u64 = key.parse().map_err(|_| ValidationError::OutOfRange {
                field: field.clone(),
                message: format!("`{key}` is not a token id"),
            })?;
            let id = self.check_token(field, id)?;
            if !bias.is_finite() || !(-100.0..=100.0).contains(bias) {
                return Err(out_of_range(field, "bias must be in [-100, 100]"));
            }
            logit_bias.push((id, *bias));
        }
        Ok(SamplingParameters {
            temperature,
            top_k,
            top_p,
            min_p,
            typical_p,
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            // Always concrete, so a preempted request resumes identically.
            seed: p.seed.unwrap_or_else(rand::random),
            logit_bias,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::detokenize::tests::byte_fallback_tokenizer;

    pub(crate) fn validation() -> Validation {
        Validation {
            tokenizer: byte_fallback_tokenizer(),
            chat_template: Some(Arc::new(
                ChatTemplate::new(
                    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}".into(),
                    Some("<s>".into()),
                    Some("</s>".into()),
                )
                .unwrap(),
            )),
            limits: RequestLimits {
                max_input_tokens: 10,
                max_total_tokens: 16,
                max_stop_sequences: 2,
                max_top_n_tokens: 5,
                max_n: 4,
            },
            vocab_size: 267,
            defaults: GenerationDefaults::default(),
            model_names: vec!["tiny".into(), "org/tiny".into()],
        }
    }

    fn check(ids: Vec<u32>, params: GenerateParameters) -> Result<Validated, ValidationError> {
        validation().validate(ids, "prompt", params)
    }

    #[test]
    fn default_max_new_tokens_fills_the_sequence() {
        let v = check(vec![5; 6], GenerateParameters::default()).unwrap();
        assert_eq!(v.request.max_new_tokens, 10);
        let v = check(vec![5; 6], GenerateParameters { max_new_tokens: Some(10), ..Default::default() }).unwrap();
        assert_eq!(v.request.max_new_tokens, 10);
    }

    #[test]
    fn lengths_are_enforced() {
        assert!(matches!(
            check(vec![5; 11], GenerateParameters::default()),
            Err(ValidationError::InputTooLong { tokens: 11, max: 10, .. })
        ));
        let err = check(vec![5; 6], GenerateParameters { max_new_tokens: Some(11), ..Default::default() }).unwrap_err();
        assert!(matches!(err, ValidationError::TotalTooLong { total: 17, max_total: 16, .. }));
        assert_eq!(err.param(), Some("max_tokens"));
        let err = check(vec![5; 6], GenerateParameters { max_new_tokens: Some(0), ..Default::default() }).unwrap_err();
        assert_eq!(err.param(), Some("max_tokens"));
    }

    #[test]
    fn truncate_keeps_the_last_tokens() {
        let ids: Vec<u32> = (1..=12).collect();
        let v = check(ids, GenerateParameters { truncate: Some(4), ..Default::default() }).unwrap();
        assert_eq!(v.request.input_ids, [9, 10, 11, 12]);
        let err = check(vec![1], GenerateParameters { truncate: Some(11), ..Default::default() }).unwrap_err();
        assert_eq!(err.param(), Some("truncate"));
    }

    #[test]
    fn ranges_name_the_field() {
        let cases: Vec<(GenerateParameters, &str)> = vec![
            (GenerateParameters { temperature: Some(-0.5), ..Default::default() }, "temperature"),
            (GenerateParameters { temperature: Some(2.5), max_temperature: 2.0, ..Default::default() }, "temperature"),
            (GenerateParameters { temperature: Some(f32::NAN), ..Default::default() }, "temperature"),
            (GenerateParameters { top_p: Some(0.0), ..Default::default() }, "top_p"),
            (GenerateParameters { top_p: Some(1.5), ..Default::default() }, "top_p"),
            (GenerateParameters { top_k: Some(-2), ..Default::default() }, "top_k"),
            (GenerateParameters { min_p: Some(1.5), ..Default::default() }, "min_p"),
            (GenerateParameters { typical_p: Some(0.0), ..Default::default() }, "typical_p"),
            (GenerateParameters { repetition_penalty: Some(0.0), ..Default::default() }, "repetition_penalty"),
            (GenerateParameters { frequency_penalty: Some(3.0), ..Default::default() }, "frequency_penalty"),
            (GenerateParameters { presence_penalty: Some(-2.5), ..Default::default() }, "presence_penalty"),
            (GenerateParameters { top_n_tokens: 6, ..Default::default() }, "top_n_tokens"),
            (GenerateParameters { stop: vec!["".into()], ..Default::default() }, "stop"),
            (GenerateParameters { stop: vec!["a".into(), "b".into(), "c".into()], ..Default::default() }, "stop"),
            (GenerateParameters { min_tokens: 16, ..Default::default() }, "min_tokens"),
            (
                GenerateParameters { logit_bias: vec![("logit_bias.999".into(), "999".into(), 1.0)], ..Default::default() },
                "logit_bias.999",
            ),
            (
                GenerateParameters { logit_bias: vec![("logit_bias.5".into(), "5".into(), 101.0)], ..Default::default() },
                "logit_bias.5",
            ),
            (
                GenerateParameters { logit_bias: vec![("logit_bias.x".into(), "x".into(), 1.0)], ..Default::default() },
                "logit_bias.x",
            ),
        ];
        for (params, field) in cases {
            let err = check(vec![5], params.clone()).expect_err(&format!("{params:?}"));
            assert_eq!(err.param(), Some(field), "{err}");
        }
    }

    #[test]
    fn accepted_values_reach_the_request() {
        let v = check(
            vec![5],
            GenerateParameters {
                temperature: Some(0.7),
                top_k: Some(-1),
                top_p: Some(1.0),
                seed: Some(42),
                logit_bias: vec![("logit_bias.7".into(), "7".into(), -100.0)],
                top_n_tokens: 2,
                ..Default::default()
            },
        )
        .unwrap();
        let p = &v.request.params;
        assert_eq!((p.temperature, p.top_k, p.top_p, p.seed), (0.7, 0, 1.0, 42));
        assert_eq!(p.logit_bias, [(7, -100.0)]);
        assert!(v.request.logprobs);
    }

    #[test]
    fn request_shape_is_checked_first() {
        let v = validation();
        let tgi = GenerateParameters { field_prefix: "parameters.", ..Default::default() };
        let cases: Vec<(GenerateParameters, &str)> = vec![
            (GenerateParameters { n: 0, ..Default::default() }, "n"),
            (GenerateParameters { n: 5, ..Default::default() }, "n"),
            (GenerateParameters { best_of: Some(2), ..Default::default() }, "best_of"),
            (GenerateParameters { best_of: Some(2), ..tgi.clone() }, "parameters.best_of"),
            (GenerateParameters { grammar: Some(serde_json::json!({"type": "json"})), ..tgi.clone() }, "parameters.grammar"),
            (
                GenerateParameters {
                    top_n_tokens: 2,
                    top_n_tokens_field: "top_logprobs",
                    top_n_tokens_needs_logprobs: true,
                    ..Default::default()
                },
                "top_logprobs",
            ),
            (
                GenerateParameters { temperature: Some(0.0), decoding: Decoding::GreedyUnless { do_sample: true }, ..tgi },
                "temperature",
            ),
        ];
        for (params, field) in cases {
            // An empty prompt would fail too: the request's shape is named first.
            let err = v.validate_prompts(&[Prompt::Text(String::new())], "prompt", &params).expect_err(field);
            assert_eq!(err.param(), Some(field), "{err}");
        }
        let fine = GenerateParameters { best_of: Some(1), n: 4, ..Default::default() };
        assert_eq!(v.validate_prompts(&[Prompt::Text("hi".into())], "prompt", &fine).unwrap()[0].n, 4);
    }

    #[test]
    fn tgi_decoding_is_greedy_unless_asked_to_sample() {
        let v = validation();
        let temperature = |decoding: Decoding, temperature: Option<f32>, top_k: Option<i64>| {
            let params = GenerateParameters { decoding, temperature, top_k, ..Default::default() };
            v.validate_prompts(&[Prompt::Text("hi".into())], "inputs", &params).unwrap()[0].request.params.temperature
        };
        let greedy = Decoding::GreedyUnless { do_sample: false };
        assert_eq!(temperature(greedy, None, None), 0.0);
        assert_eq!(temperature(greedy, Some(1.0), None), 0.0, "temperature 1 is no warper");
        assert_eq!(temperature(greedy, Some(0.5), None), 0.5);
        assert_eq!(temperature(greedy, None, Some(5)), 1.0);
        assert_eq!(temperature(Decoding::GreedyUnless { do_sample: true }, None, None), 1.0);
        assert_eq!(temperature(Decoding::ByTemperature, Some(0.7), None), 0.7);
        assert_eq!(temperature(Decoding::ByTemperature, None, None), 0.0);
    }

    #[test]
    fn prompt_lists_name_each_entry() {
        let v = validation();
        let params = GenerateParameters::default();
        let err = v.validate_prompts(&[], "prompt", &params).unwrap_err();
        assert!(matches!(err, ValidationError::Empty { .. }) && err.param() == Some("prompt"));
        let prompts = [Prompt::Tokens(vec![5]), Prompt::Tokens(vec![5, 300])];
        let err = v.validate_prompts(&prompts, "prompt", &params).unwrap_err();
        assert_eq!(err.param(), Some("prompt[1]"));
        // Chat-template output gets no BOS; raw text does.
        let chat = v.validate_prompts(&[Prompt::Chat("hi".into())], "messages", &params).unwrap();
        let text = v.validate_prompts(&[Prompt::Text("hi".into())], "prompt", &params).unwrap();
        assert_eq!(text[0].request.input_ids[1..], chat[0].request.input_ids[..]);
        assert_eq!(v.check_model(Some("gpt-4")).unwrap_err().param(), Some("model"));
        assert!(v.check_model(Some("org/tiny")).is_ok() && v.check_model(Some("tgi")).is_ok() && v.check_model(None).is_ok());
    }

    #[test]
    fn prompts_are_checked() {
        let v = validation();
        assert_eq!(v.tokenize(&Prompt::Text(String::new()), "prompt", true).unwrap_err().param(), Some("prompt"));
        assert_eq!(v.tokenize(&Prompt::Tokens(vec![]), "prompt", true).unwrap_err().param(), Some("prompt"));
        assert!(matches!(
            v.tokenize(&Prompt::Tokens(vec![1, 267]), "prompt", true),
            Err(ValidationError::UnknownToken { id: 267, .. })
        ));
        // Raw text gets BOS (id 1) from the post-processor.
        assert_eq!(v.tokenize(&Prompt::Text("Hello".into()), "prompt", true).unwrap()[0], 1);
        assert!(matches!(v.render_chat(&[]), Err(ValidationError::Empty { .. })));
        let rendered = v
            .render_chat(&[TemplateMessage { role: "user".into(), content: "hi".into() }])
            .unwrap();
        assert_eq!(rendered, "user: hi\n");
    }
}

//! Turns API-neutral generation parameters into an [`infer::ValidRequest`].
//! Every check on client input lives here; nothing past this module sees an
//! unchecked value. Both APIs first map their body into
//! [`GenerateParameters`] (their own defaults applied), then call
//! [`Validation::validate`]. Failures are one enum, [`ValidationError`],
//! mapped to HTTP in `http::error`.

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
pub struct Limits {
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
    Text(String),
    Tokens(Vec<u64>),
}

/// One request's parameters in API-neutral form. `None` means "not given".
/// Field names for error messages follow the API the values came from.
#[derive(Debug, Clone)]
pub struct GenerateParameters {
    pub max_new_tokens: Option<u64>,
    /// The API's name for `max_new_tokens` ("max_tokens", ...).
    pub max_new_tokens_field: &'static str,
    /// 0 is greedy.
    pub temperature: f32,
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
            temperature: 0.0,
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
}

pub struct Validation {
    pub tokenizer: Tokenizer,
    pub chat_template: Option<Arc<ChatTemplate>>,
    pub limits: Limits,
    /// Token ids must be below this (the LM head's rows).
    pub vocab_size: u32,
    pub defaults: GenerationDefaults,
}

impl Validation {
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

    /// Prompt token ids. Raw text gets the tokenizer's special tokens (BOS);
    /// chat-template output must not (it spells them already).
    #[tracing::instrument(level = "debug", name = "tokenize", skip_all)]
    pub fn tokenize(
        &self,
        prompt: &Prompt,
        field: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ValidationError> {
        let ids = match prompt {
            Prompt::Text(text) => {
                if text.is_empty() {
                    return Err(ValidationError::Empty { field: field.into() });
                }
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
    #[tracing::instrument(level = "debug", name = "validate", skip_all)]
    pub fn validate(
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
        let temperature = finite("temperature", p.temperature)?;
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
            limits: Limits {
                max_input_tokens: 10,
                max_total_tokens: 16,
                max_stop_sequences: 2,
                max_top_n_tokens: 5,
                max_n: 4,
            },
            vocab_size: 267,
            defaults: GenerationDefaults::default(),
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
            (GenerateParameters { temperature: -0.5, ..Default::default() }, "temperature"),
            (GenerateParameters { temperature: 2.5, max_temperature: 2.0, ..Default::default() }, "temperature"),
            (GenerateParameters { temperature: f32::NAN, ..Default::default() }, "temperature"),
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
                temperature: 0.7,
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

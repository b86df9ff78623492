//! Turns API-neutral generation parameters into an [`infer::ValidRequest`].
//! Every check on client input lives here; nothing past this module sees an
//! unchecked value. Both APIs first map their body into
//! [`GenerateParameters`] (their own defaults applied, their own field names
//! for error messages), then call [`Validation::validate_prompts`] (or
//! [`Validation::tokenize`] + [`Validation::validate`]). Failures are one
//! enum, [`ValidationError`], mapped to HTTP in `http::error`.
//!
//! Order of the checks, so that a request with several faults always gets
//! the same answer: the model name (the handler asks first), the tools
//! ([`Validation::tools`], chat only), the request's shape (`n`, `best_of`,
//! `top_logprobs` without `logprobs`, a TGI temperature <= 0, then the
//! output constraint, compiled), the prompt (empty, unknown tokens, too
//! long), then lengths and every sampling range.
//!
//! Output constraints arrive as an API-neutral [`Constraint`] (each API's
//! spelling is read by its handler: `http::openai::structured`,
//! `http::tgi`); compiling it against the tokenizer is the check.

use std::sync::Arc;
use std::time::Instant;

use crate::chat_template::{ChatTemplate, ChatTemplateError, TemplateMessage};
use crate::grammar::{CompiledGrammar, Constraint, GrammarCompiler};
use crate::tool_calls::{FunctionDefinition, ToolChoice, ToolFormat};
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

/// Most entries of `logit_bias` in one request (OpenAI allows 300).
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Longest stop sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;

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
    /// The most prompts in one request (`--max-client-batch-size`).
    pub max_client_batch_size: u32,
    /// The most sequences (prompts x `n`) one request may ask for: the
    /// scheduler's `--max-concurrent-requests`.
    pub max_sequences: u32,
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
        }
    }
}

/// The tools of a chat request as its handler read them (OpenAI `tools`,
/// `tool_choice`, `parallel_tool_calls`); [`Validation::tools`] checks them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolRequest {
    pub functions: Vec<FunctionDefinition>,
    /// `None`: not given (`auto` with tools, `none` without).
    pub choice: Option<ToolChoice>,
    /// `None`: not given (parallel calls allowed).
    pub parallel: Option<bool>,
}

/// Tools that passed validation.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidTools {
    pub functions: Vec<FunctionDefinition>,
    pub choice: ToolChoice,
    /// The grammar every output follows (`None` for `tool_choice: none`),
    /// with the field named when it does not compile.
    pub constraint: Option<(String, Constraint)>,
}

impl ValidTools {
    /// What the chat template shows the model: nothing for `none`.
    pub fn shown(&self) -> Option<&[FunctionDefinition]> {
        (self.choice != ToolChoice::None).then_some(self.functions.as_slice())
    }
}

/// A request's one output constraint: a response format (or a vLLM
/// `guided_*` field) and a tool-call grammar exclude each other.
pub fn one_constraint(
    format: Option<(String, Constraint)>,
    tools: Option<(String, Constraint)>,
) -> Result<Option<(String, Constraint)>, ValidationError> {
    match (format, tools) {
        (Some((field, _)), Some(_)) => Err(ValidationError::Unsupported {
            field,
            message: "cannot be combined with `tools` (unless `tool_choice` is `none`)".into(),
        }),
        (format, tools) => Ok(format.or(tools)),
    }
}

/// OpenAI's rule for function names.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
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

    /// How many sequences the request asks for, checked before any prompt is
    /// tokenized or any parameter copied.
    fn check_fan_out(&self, prompts: usize, field: &str, n: u32) -> Result<(), ValidationError> {
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
    fn check_shape(&self, p: &GenerateParameters) -> Result<Option<CompiledGrammar>, ValidationError> {
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

    /// Compiles `constraint` (from request field `field`): a 400 naming the
    /// field and the problem when it does not compile.
    pub fn compile(&self, field: &str, constraint: &Constraint) -> Result<CompiledGrammar, ValidationError> {
        let compiler = self.grammar.as_ref().ok_or_else(|| ValidationError::Unsupported {
            field: field.into(),
            message: "structured output is not available: llguidance cannot read this model's tokenizer".into(),
        })?;
        compiler.compile(constraint).map_err(|message| ValidationError::Grammar { field: field.into(), message })
    }
    /// Checks a chat request's tools: names (OpenAI's rule, no duplicates),
    /// each parameters schema (compiled alone, so a 400 names the tool), the
    /// choice. `None`: no tools, and no choice that needs them.
    pub fn tools(&self, t: &ToolRequest) -> Result<Option<ValidTools>, ValidationError> {
        for (i, f) in t.functions.iter().enumerate() {
            let field = |name: &str| format!("tools[{i}].function.{name}");
            if !valid_function_name(&f.name) {
                return Err(ValidationError::Unsupported {
                    field: field("name"),
                    message: "must be 1 to 64 letters, digits, `_` or `-`".into(),
                });
            }
            if t.functions[..i].iter().any(|g| g.name == f.name) {
                return Err(ValidationError::Unsupported {
                    field: field("name"),
                    message: format!("`{}` is declared twice", f.name),
                });
            }
            if let Some(parameters) = &f.parameters {
                self.compile(&field("parameters"), &Constraint::JsonSchema(parameters.clone()))?;
            }
        }
        let choice = match &t.choice {
            None if t.functions.is_empty() => ToolChoice::None,
            None => ToolChoice::Auto,
            Some(ToolChoice::Named(name)) if !t.functions.iter().any(|f| &f.name == name) => {
                return Err(ValidationError::Unsupported {
                    field: "tool_choice.function.name".into(),
                    message: format!("`{name}` is not one of the declared tools"),
                });
            }
            Some(choice) => choice.clone(),
        };
        if t.functions.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(ValidationError::Empty { field: "tools".into() }),
            };
        }
        let constraint = self
            .tool_format
            .grammar(&t.functions, &choice, t.parallel.unwrap_or(true))
            .map(|grammar| ("tools".to_string(), grammar));
        Ok(Some(ValidTools { functions: t.functions.clone(), choice, constraint }))
    }

    #[tracing::instrument(level = "debug", name = "render_chat", skip_all)]
    pub fn render_chat(&self, messages: &[TemplateMessage]) -> Result<String, ValidationError> {
        if messages.is_empty() {
            return Err(ValidationError::Empty {
                field: "messages".into(),
            });
        }
        self.render_chat_with_tools(messages, None)
    }

    /// The chat prompt with `tools` shown to the model (None: no tools,
    /// or `tool_choice: none`). A template that renders a `tools` variable
    /// gets them, and the messages' `tool_calls`, as they are; for one that
    /// does not, the tools are described in the system message and earlier
    /// calls written into their message's content, in the model's tool-call
    /// format.
    pub fn render_chat_with_tools(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&[FunctionDefinition]>,
    ) -> Result<String, ValidationError> {
        if messages.is_empty() {
            return Err(ValidationError::Empty {
                field: "messages".into(),
            });
        }
        let template = self.chat_template.as_ref().ok_or(ValidationError::NoChatTemplate)?;
        let rendered = if template.supports_tools() {
            let listing: Option<Vec<serde_json::Value>> =
                tools.map(|t| t.iter().map(|f| serde_json::json!({"type": "function", "function": f})).collect());
            template.apply_with_tools(messages, listing.as_deref(), true)
        } else if tools.is_some() || messages.iter().any(|m| m.tool_calls.is_some()) {
            template.apply(&self.tools_in_text(messages, tools), true)
        } else {
            template.apply(messages, true)
        };
        rendered.map_err(|e| match e {
            ChatTemplateError::Render(message) => ValidationError::ChatTemplate(message),
            other => ValidationError::ChatTemplate(other.to_string()),
        })
    }

    /// `messages` for a template that knows no tools: the tools described
    /// in the system message (merged into the client's, or a new first one),
    /// earlier calls appended to their assistant message's content.
    fn tools_in_text(&self, messages: &[TemplateMessage], tools: Option<&[FunctionDefinition]>) -> Vec<TemplateMessage> {
        let format = &self.tool_format;
        let mut out: Vec<TemplateMessage> = messages
            .iter()
            .map(|m| {
                let Some(calls) = &m.tool_calls else { return m.clone() };
                let calls: Vec<(String, String)> = calls
                    .iter()
                    .map(|c| {
                        let name = c["function"]["name"].as_str().unwrap_or_default().to_string();
                        (name, c["function"]["arguments"].to_string())
                    })
                    .collect();
                let text = format.render_calls(&calls);
                let content = if m.content.is_empty() { text } else { format!("{}\n{text}", m.content) };
                TemplateMessage { content, tool_calls: None, ..m.clone() }
            })
            .collect();
        if let Some(tools) = tools {
            let description = format.system_prompt(tools);
            match out.first_mut() {
                Some(first) if first.role == "system" => first.content = format!("{}\n\n{description}", first.content),
                _ => out.insert(0, TemplateMessage::text("system", description)),
            }
        }
        out
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
        let grammar = self.check_shape(&params)?;
        self.validate_lengths_and_ranges(input_ids, input_field, params, grammar)
    }

    #[tracing::instrument(level = "debug", name = "validate", skip_all)]
    fn validate_lengths_and_ranges(
        &self,
        mut input_ids: Vec<u32>,
        input_field: &str,
        params: GenerateParameters,
        grammar: Option<CompiledGrammar>,
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
        if p.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(out_of_range(
                "logit_bias",
                format!("at most {MAX_LOGIT_BIAS} tokens may be biased, got {}", p.logit_bias.len()),
            ));
        }
        let mut logit_bias: Vec<(u32, f32)> = Vec::with_capacity(p.logit_bias.len());
        let mut biased = std::collections::HashSet::with_capacity(p.logit_bias.len());
        for (field, key, bias) in &p.logit_bias {
            let id: u64 = key.parse().map_err(|_| ValidationError::OutOfRange {
                field: field.clone(),
                message: format!("`{key}` is not a token id"),
            })?;
            let id = self.check_token(field, id)?;
            if !bias.is_finite() || !(-100.0..=100.0).contains(bias) {
                return Err(out_of_range(field, "bias must be in [-100, 100]"));
            }
            // "5", "05" and "+5" are one token: its bias is given once.
            if !biased.insert(id) {
                return Err(out_of_range(field, format!("token id {id} is biased more than once")));
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
                max_client_batch_size: 3,
                max_sequences: 8,
            },
            vocab_size: 267,
            defaults: GenerationDefaults::default(),
            model_names: vec!["tiny".into(), "org/tiny".into()],
            grammar: Some(Arc::new(GrammarCompiler::new(&byte_fallback_tokenizer(), 267, &[2]).unwrap())),
            tool_format: ToolFormat::new(crate::tool_calls::ToolParserKind::Hermes, &byte_fallback_tokenizer()),
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
    fn max_tokens_near_u64_max_is_a_clear_error() {
        let err = check(vec![5; 6], GenerateParameters { max_new_tokens: Some(u64::MAX), ..Default::default() })
            .unwrap_err();
        assert!(matches!(err, ValidationError::TotalTooLong { total: u64::MAX, max_new_tokens: u64::MAX, .. }), "{err}");
        assert!(err.to_string().contains(&u64::MAX.to_string()), "{err}");
    }

    #[test]
    fn a_stop_sequence_has_a_length_limit() {
        let stop = |s: String| GenerateParameters { stop: vec!["ok".into(), s], ..Default::default() };
        assert!(check(vec![5; 2], stop("x".repeat(MAX_STOP_BYTES))).is_ok());
        let err = check(vec![5; 2], stop("x".repeat(MAX_STOP_BYTES + 1))).unwrap_err();
        assert_eq!(err.param(), Some("stop[1]"), "{err}");
    }

    #[test]
    fn one_token_is_biased_once_and_the_count_is_capped() {
        let bias = |keys: &[&str]| GenerateParameters {
            logit_bias: keys.iter().map(|k| (format!("logit_bias.{k}"), k.to_string(), 50.0)).collect(),
            ..Default::default()
        };
        assert_eq!(check(vec![5; 2], bias(&["05"])).unwrap().request.params.logit_bias, [(5, 50.0)]);
        for keys in [["5", "05"], ["5", "+5"], ["05", "+5"]] {
            let err = check(vec![5; 2], bias(&keys)).unwrap_err();
            assert_eq!(err.param(), Some(format!("logit_bias.{}", keys[1]).as_str()), "{err}");
            assert!(err.to_string().contains("more than once"), "{err}");
        }
        let many: Vec<String> = (0..=MAX_LOGIT_BIAS).map(|i| i.to_string()).collect();
        let keys: Vec<&str> = many.iter().map(String::as_str).collect();
        let mut v = validation();
        v.vocab_size = 4096;
        let err = v.validate(vec![5; 2], "prompt", bias(&keys)).unwrap_err();
        assert_eq!(err.param(), Some("logit_bias"), "{err}");
        assert!(v.validate(vec![5; 2], "prompt", bias(&keys[..MAX_LOGIT_BIAS])).is_ok());
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
            (
                GenerateParameters {
                    constraint: Some(("parameters.grammar.value".into(), Constraint::Regex("(a".into()))),
                    ..tgi.clone()
                },
                "parameters.grammar.value",
            ),
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
    fn tools_and_choices_are_checked() {
        let v = validation();
        let function = |name: &str, parameters: Option<serde_json::Value>| FunctionDefinition {
            name: name.into(),
            description: None,
            parameters,
            strict: None,
        };
        let declared = vec![function("get_weather", Some(serde_json::json!({"type": "object"}))), function("now", None)];
        let check = |functions: &[FunctionDefinition], choice: Option<ToolChoice>| {
            v.tools(&ToolRequest { functions: functions.to_vec(), choice, parallel: None })
        };
        let t = check(&declared, None).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert_eq!(t.constraint.unwrap().0, "tools");
        let t = check(&declared, Some(ToolChoice::None)).unwrap().unwrap();
        assert!(t.constraint.is_none() && t.shown().is_none());
        assert_eq!(check(&[], None).unwrap(), None);
        assert_eq!(check(&[], Some(ToolChoice::None)).unwrap(), None);

        let field = |functions: &[FunctionDefinition], choice: Option<ToolChoice>| {
            check(functions, choice).unwrap_err().param().unwrap().to_string()
        };
        assert_eq!(field(&[], Some(ToolChoice::Required)), "tools");
        assert_eq!(field(&declared, Some(ToolChoice::Named("nope".into()))), "tool_choice.function.name");
        assert_eq!(field(&[function("a b", None)], None), "tools[0].function.name");
        assert_eq!(field(&[function("a", Some(serde_json::json!([1])))], None), "tools[0].function.parameters");
        let bad_schema = function("b", Some(serde_json::json!({"type": "nope"})));
        assert_eq!(field(&[function("a", None), bad_schema], None), "tools[1].function.parameters");
        assert_eq!(field(&[function("a", None), function("a", None)], None), "tools[1].function.name");
    }

    #[test]
    fn tools_go_into_the_system_message_of_a_template_without_them() {
        let v = validation();
        let tools = [FunctionDefinition { name: "now".into(), description: None, parameters: None, strict: None }];
        let call = serde_json::json!({"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}});
        let messages = [
            TemplateMessage::text("user", "time?"),
            TemplateMessage { tool_calls: Some(vec![call]), ..TemplateMessage::text("assistant", "") },
            TemplateMessage { tool_call_id: Some("c1".into()), ..TemplateMessage::text("tool", "noon") },
        ];
        let rendered = v.render_chat_with_tools(&messages, Some(&tools)).unwrap();
        let lines: Vec<&str> = rendered.lines().collect();
        assert!(lines[0].starts_with("system: You can call these functions"), "{rendered}");
        assert!(rendered.contains("{\"type\":\"function\",\"function\":{\"name\":\"now\"}}"), "{rendered}");
        assert!(rendered.contains("assistant: <tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\ntool: noon"), "{rendered}");
        // Without tools (tool_choice none) the history still renders its calls.
        let rendered = v.render_chat_with_tools(&messages, None).unwrap();
        assert!(rendered.starts_with("user: time?\nassistant: <tool_call>"), "{rendered}");
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
            .render_chat(&[TemplateMessage::text("user", "hi")])
            .unwrap();
        assert_eq!(rendered, "user: hi\n");
    }
}

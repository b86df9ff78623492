//! The plain types validation reads and writes: a request's parameters in
//! API-neutral form, the router's limits, a prompt before tokenization and
//! a chat request's tools. Each API's handler fills them; the checks live
//! in the sibling files.

use crate::grammar::Constraint;
use crate::tool_calls::{FunctionDefinition, ToolChoice};

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

/// A prompt before tokenization.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Raw text: gets the tokenizer's special tokens (BOS).
    Text(String),
    /// A chat template's output: it spells its special tokens already.
    Chat(String),
    Tokens(Vec<u64>),
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

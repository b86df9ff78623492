//! The validator: what it holds (tokenizer, template, limits, defaults)
//! and the order of its checks; the checks themselves are in the sibling
//! files, as `impl Validation` blocks.

use std::sync::Arc;
use std::time::Instant;

use super::error::ValidationError;
use super::params::{GenerateParameters, GenerationDefaults, Prompt, RequestLimits};
use crate::chat_template::ChatTemplate;
use crate::grammar::{CompiledGrammar, GrammarCompiler};
use crate::infer::{AdapterCatalog, RequestClass, ValidRequest};
use crate::tokenizer::Tokenizer;
use crate::tool_calls::ToolFormat;

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
    /// Harmony (gpt-oss) replaces `tool_format` too: its channels carry the
    /// calls.
    pub reasoning: Option<crate::reasoning::Reasoning>,
    /// The LoRA adapters a request may name (the scheduler keeps it current).
    pub adapters: AdapterCatalog,
}

/// What huggingface_hub's InferenceClient sends as `model` when it was given
/// a server URL instead of a model: the base model.
const CLIENT_PLACEHOLDERS: [&str; 2] = ["tgi", "dummy"];

impl Validation {
    /// The name responses give the model.
    pub fn served_model_name(&self) -> &str {
        &self.model_names[0]
    }

    /// The LoRA adapter a request's `model` (OpenAI, Anthropic) or
    /// `adapter_id` (TGI) names: None for the base model (no name, the
    /// served name, the model id, or the placeholders huggingface_hub's
    /// InferenceClient sends when given a server URL instead of a model,
    /// "tgi" and "dummy"), the adapter's name for a loaded adapter; else a
    /// 404 listing what exists.
    pub fn check_model(&self, model: Option<&str>) -> Result<Option<String>, ValidationError> {
        match model {
            None => Ok(None),
            Some(m) if self.is_base_name(m) => Ok(None),
            Some(m) if self.adapters.borrow().iter().any(|a| a.name == m) => Ok(Some(m.to_string())),
            Some(m) => {
                let mut known = vec![format!("`{}` (the base model)", self.served_model_name())];
                known.extend(self.adapters.borrow().iter().map(|a| format!("`{}`", a.name)));
                Err(ValidationError::ModelNotFound { name: m.to_string(), known })
            }
        }
    }

    /// A name that means the base model: no adapter may take it.
    pub fn is_base_name(&self, name: &str) -> bool {
        CLIENT_PLACEHOLDERS.contains(&name) || self.model_names.iter().any(|n| n == name)
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
    /// field in messages ("prompt", "messages", "inputs"). The tests' way
    /// in; requests come through `validate_prompts`.
    #[cfg(test)]
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
                adapter: params.adapter,
                arrived: Instant::now(),
                priority: params.priority,
                class: RequestClass::Interactive,
            },
            stop: params.stop,
            n: params.n,
        })
    }
}

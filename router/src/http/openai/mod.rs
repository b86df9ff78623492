//! OpenAI-compatible `POST /v1/chat/completions` (`chat`),
//! `POST /v1/completions` (`completions`) and `GET /v1/models`; the Batch
//! API's `/v1/files` (`files`) and `/v1/batches` (`batches`), whose lines
//! run as these endpoints' requests (`batch_lines`). Each handler
//! maps its body to the router's parameters and shapes the answer; the
//! generation driver (`http::generation`) does the rest.
//!
//! Defaults follow OpenAI where the client omits a field (temperature 1,
//! top_p 1; `max_tokens` omitted = room left in the sequence for chat, 16
//! for completions as in OpenAI and vLLM), except that the model's
//! generation_config.json, when it sets temperature / top_p / top_k /
//! repetition_penalty, supplies those defaults instead (as vLLM does).
//! `n > 1` runs n independent requests with seeds `seed, seed+1, ...`.
//! Choices of a completion with a list of prompts are indexed
//! `prompt_index * n + j`, as OpenAI does.
//!
//! `usage` counts as OpenAI and vLLM do (see `generation::TokenUsage`): each
//! prompt's tokens once, however many choices it has (`prompt_tokens` and
//! `prompt_tokens_details.cached_tokens`, the latter as the prompt's first
//! choice found the prefix cache), and the tokens of every choice
//! (`completion_tokens`).

pub mod batch_lines;
pub mod batches;
pub mod chat;
pub mod completions;
pub mod files;
pub mod structured;
pub mod types;

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use super::generation::TokenUsage;
use super::state::AppState;
use crate::validation::GenerateParameters;
use types::{PromptTokensDetails, SamplingFields, StopSpec, Usage};

/// Maps the sampling fields both endpoints share into API-neutral
/// parameters; `max_new_tokens` is the endpoint's own field (with its default).
pub(crate) fn parameters(state: &AppState, s: &SamplingFields, max_new_tokens: Option<u64>) -> GenerateParameters {
    let defaults = &state.validation.defaults;
    let mut logit_bias: Vec<(String, String, f32)> = s
        .logit_bias
        .iter()
        .flatten()
        .map(|(k, &v)| (format!("logit_bias.{k}"), k.clone(), v))
        .collect();
    logit_bias.sort_by(|a, b| a.1.cmp(&b.1));
    GenerateParameters {
        max_new_tokens,
        max_new_tokens_field: "max_tokens",
        n: s.n.unwrap_or(1),
        temperature: Some(s.temperature.or(defaults.temperature).unwrap_or(1.0)),
        max_temperature: 2.0,
        top_k: s.top_k.or(defaults.top_k),
        top_p: s.top_p.or(defaults.top_p),
        min_p: s.min_p,
        typical_p: None,
        repetition_penalty: s.repetition_penalty.or(defaults.repetition_penalty),
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        seed: s.seed,
        logit_bias,
        stop: s.stop.clone().map(StopSpec::into_vec).unwrap_or_default(),
        ignore_eos: s.ignore_eos.unwrap_or(false),
        min_tokens: s.min_tokens.unwrap_or(0),
        priority: s.priority.unwrap_or(0),
        ..Default::default()
    }
}

/// What every response and chunk of one request repeats.
#[derive(Debug, Clone)]
struct ResponseId {
    id: String,
    created: u64,
    model: String,
}

impl ResponseId {
    /// `prefix` is OpenAI's: "chatcmpl" or "cmpl". The model answering is
    /// the LoRA `adapter` the request named, else the base model.
    fn new(state: &AppState, prefix: &str, adapter: Option<&str>) -> Self {
        Self {
            id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: unix_now(),
            model: adapter.unwrap_or(state.served_model_name()).to_string(),
        }
    }
}

fn fingerprint() -> String {
    format!("sluice-{}", env!("CARGO_PKG_VERSION"))
}

impl From<TokenUsage> for Usage {
    fn from(usage: TokenUsage) -> Self {
        Self {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: usage.cached_tokens },
            completion_tokens_details: None,
        }
    }
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    pub max_model_len: u32,
    /// A LoRA adapter's folder; the base model's id for the base model.
    pub root: String,
    /// The base model of a LoRA adapter; null for the base model.
    pub parent: Option<String>,
}

/// The base model first, then every LoRA adapter (with the base as `parent`).
#[utoipa::path(get, path = "/v1/models", responses((status = 200, body = ModelList)))]
pub async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    let base = state.served_model_name().to_string();
    let card = |id: String, root: String, parent: Option<String>| ModelCard {
        id,
        object: "model".into(),
        created: unix_now(),
        owned_by: "sluice".into(),
        max_model_len: state.info.max_total_tokens,
        root,
        parent,
    };
    let mut data = vec![card(base.clone(), state.info.model_id.clone(), None)];
    let adapters = state.validation.adapters.borrow().clone();
    data.extend(adapters.iter().map(|a| card(a.name.clone(), a.path.clone(), Some(base.clone()))));
    Json(ModelList { object: "list".into(), data })
}

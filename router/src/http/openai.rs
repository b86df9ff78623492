//! OpenAI-compatible `POST /v1/chat/completions` and `POST /v1/completions`.
//!
//! Defaults follow OpenAI where the client omits a field (temperature 1,
//! top_p 1; `max_tokens` omitted = room left in the sequence for chat, 16
//! for completions as in OpenAI and vLLM), except that the model's
//! generation_config.json, when it sets temperature / top_p / top_k /
//! repetition_penalty, supplies those defaults instead (as vLLM does).
//! `n > 1` runs n independent requests with seeds `seed, seed+1, ...`.
//! Choices of a completion with a list of prompts are indexed
//! `prompt_index * n + j`, as OpenAI does.

use tracing::Instrument;
use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{parse_json, ApiError, OpenAiError};
use super::generation::{Collected, Finish, GenEvent, Generation, RequestRecord};
use super::sse::{done_event, json_event, sse_response};
use super::{body_bytes, unix_now, AppState};
use crate::chat_template::TemplateMessage;
use crate::infer::{GeneratedToken, TokenLogprob};
use crate::validation::{GenerateParameters, Prompt, Validated, ValidationError};

/// OpenAI's `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by both OpenAI endpoints (flattened into each).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SamplingFields {
    /// In [0, 2]; 0 is greedy. Default 1 (or generation_config.json's).
    pub temperature: Option<f32>,
    /// In (0, 1].
    pub top_p: Option<f32>,
    /// Independent choices per prompt.
    pub n: Option<u32>,
    pub stop: Option<StopSpec>,
    pub seed: Option<u64>,
    /// In [-2, 2].
    pub frequency_penalty: Option<f32>,
    /// In [-2, 2].
    pub presence_penalty: Option<f32>,
    /// Token id (as a string) -> bias in [-100, 100].
    pub logit_bias: Option<HashMap<String, f32>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// vLLM extra: -1 or 0 disables.
    pub top_k: Option<i64>,
    /// vLLM extra: in [0, 1].
    pub min_p: Option<f32>,
    /// vLLM extra: in (0, 100], 1 disables.
    pub repetition_penalty: Option<f32>,
    /// vLLM extra: keep generating past EOS.
    pub ignore_eos: Option<bool>,
    /// vLLM extra: EOS is masked until this many tokens.
    pub min_tokens: Option<u32>,
}

/// One part of a message's content; only text parts are supported.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    /// The served model name or the model id.
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u64>),
    TokenLists(Vec<Vec<u64>>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: PromptInput,
    /// Default 16 (OpenAI's).
    pub max_tokens: Option<u64>,
    /// Alternatives per token (0..=--max-top-n-tokens); the chosen token's
    /// logprob is returned whenever this is set.
    pub logprobs: Option<u32>,
    /// Prepend the prompt to the text (and its logprobs when asked).
    pub echo: Option<bool>,
    /// Only 1 is supported.
    pub best_of: Option<u32>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobContent {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprobContent>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatDelta {
    pub role: String,
    pub content: String,
    /// Always null; present because TGI's client requires the key.
    #[schema(value_type = Option<Object>)]
    pub tool_calls: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChunkChoice>,
    /// Null except on the final chunk with `stream_options.include_usage`.
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<HashMap<String, f32>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Completion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Option<Usage>,
}

fn fingerprint() -> String {
    format!("sluice-{}", env!("CARGO_PKG_VERSION"))
}

fn usage(prompt_tokens: usize, completion_tokens: u32, cached_tokens: u32) -> Usage {
    Usage {
        prompt_tokens: prompt_tokens as u32,
        completion_tokens,
        total_tokens: prompt_tokens as u32 + completion_tokens,
        prompt_tokens_details: PromptTokensDetails { cached_tokens },
    }
}

/// Maps the shared OpenAI sampling fields into API-neutral parameters.
fn parameters(state: &AppState, s: &SamplingFields, max_new_tokens: Option<u64>) -> Result<GenerateParameters, ApiError> {
    let defaults = &state.validation.defaults;
    let n = s.n.unwrap_or(1);
    if n == 0 || n > state.validation.limits.max_n {
        return Err(ValidationError::OutOfRange {
            field: "n".into(),
            message: format!("must be in [1, {}]", state.validation.limits.max_n),
        }
        .into());
    }
    let mut logit_bias: Vec<(String, String, f32)> = s
        .logit_bias
        .iter()
        .flatten()
        .map(|(k, &v)| (format!("logit_bias.{k}"), k.clone(), v))
        .collect();
    logit_bias.sort_by(|a, b| a.1.cmp(&b.1));
    Ok(GenerateParameters {
        max_new_tokens,
        max_new_tokens_field: "max_tokens",
        temperature: s.temperature.or(defaults.temperature).unwrap_or(1.0),
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
        ..Default::default()
    })
}

/// `n` copies of a validated request; copy j samples with seed + j.
fn fan_out(validated: &Validated, n: u32) -> Vec<Validated> {
    (0..n)
        .map(|j| {
            let mut copy = validated.clone();
            copy.request.params.seed = validated.request.params.seed.wrapping_add(u64::from(j));
            copy
        })
        .collect()
}

/// Submits every request before answering, so overload is an HTTP 429 and
/// not an error inside a stream.
async fn submit(state: &AppState, requests: Vec<Validated>) -> Result<Vec<Generation>, ApiError> {
    let mut generations = Vec::with_capacity(requests.len());
    for validated in requests {
        let arrived = validated.request.arrived;
        let span = crate::telemetry::generation_span(state.served_model_name(), &validated.request);
        let stream = state.infer.generate(validated.request).instrument(span.clone()).await?;
        generations.push(Generation::new(stream, state.validation.tokenizer.clone(), validated.stop, arrived).traced(span));
    }
    Ok(generations)
}

fn flatten_content(content: &Option<MessageContent>, index: usize) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(MessageContent::Text(text)) => Ok(text.clone()),
        Some(MessageContent::Parts(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                match (part.kind.as_str(), &part.text) {
                    ("text", Some(text)) => texts.push(text.as_str()),
                    _ => {
                        return Err(ValidationError::Unsupported {
                            field: format!("messages[{index}].content[{j}]"),
                            message: format!("only text parts are supported, got type `{}`", part.kind),
                        }
                        .into())
                    }
                }
            }
            Ok(texts.join("\n"))
        }
    }
}

fn chat_logprobs(state: &AppState, token: &GeneratedToken, top: u32) -> ChatLogprobContent {
    let tokenizer = &state.validation.tokenizer;
    let entry = |id: u32, logprob: f32| {
        let text = tokenizer.token_text(id);
        ChatLogprob {
            bytes: text.as_bytes().to_vec(),
            token: text,
            logprob,
        }
    };
    let chosen = entry(token.token_id, token.logprob);
    ChatLogprobContent {
        token: chosen.token,
        logprob: chosen.logprob,
        bytes: chosen.bytes,
        top_logprobs: token
            .top_tokens
            .iter()
            .take(top as usize)
            .map(|t| entry(t.token_id, t.logprob))
            .collect(),
    }
}

#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "a completion, or an SSE stream of chunks with `stream: true`", body = ChatCompletion),
        (status = 400, body = super::error::OpenAiErrorBody),
        (status = 404, body = super::error::OpenAiErrorBody),
        (status = 429, body = super::error::OpenAiErrorBody),
        (status = 503, body = super::error::OpenAiErrorBody),
    ))]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    let mut record = RequestRecord::new("chat_completions");
    let result = chat_completions_inner(state, body, &mut record).await;
    if let Err(e) = &result {
        record.failed(e);
    }
    Ok(result?)
}

async fn chat_completions_inner(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    record: &mut RequestRecord,
) -> Result<Response, ApiError> {
    let request: ChatCompletionRequest = parse_json(&body_bytes(body)?)?;
    state.check_model(request.model.as_deref())?;
    let messages = request
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            Ok(TemplateMessage {
                role: m.role.clone(),
                content: flatten_content(&m.content, i)?,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let prompt = state.validation.render_chat(&messages)?;
    let input_ids = state.validation.tokenize(&Prompt::Text(prompt), "messages", false)?;
    let mut params = parameters(&state, &request.sampling, request.max_completion_tokens.or(request.max_tokens))?;
    if request.max_completion_tokens.is_some() {
        params.max_new_tokens_field = "max_completion_tokens";
    }
    let top_logprobs = request.top_logprobs.unwrap_or(0);
    let want_logprobs = request.logprobs.unwrap_or(false);
    if top_logprobs > 0 && !want_logprobs {
        return Err(ValidationError::Unsupported {
            field: "top_logprobs".into(),
            message: "requires `logprobs: true`".into(),
        }
        .into());
    }
    params.logprobs = want_logprobs;
    params.top_n_tokens = top_logprobs;
    params.top_n_tokens_field = "top_logprobs";
    let n = request.sampling.n.unwrap_or(1);
    let validated = state.validation.validate(input_ids, "messages", params)?;
    let prompt_tokens = validated.request.input_ids.len();
    let generations = submit(&state, fan_out(&validated, n)).await?;
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let model = state.served_model_name().to_string();

    if request.sampling.stream.unwrap_or(false) {
        let include_usage = request.sampling.stream_options.is_some_and(|o| o.include_usage);
        let record = record.take();
        return Ok(chat_stream(state, generations, id, model, prompt_tokens, want_logprobs, top_logprobs, include_usage, record));
    }

    let results = futures::future::try_join_all(generations.into_iter().map(Generation::collect)).await?;
    let completion_tokens: u32 = results.iter().map(|r| r.generated_tokens).sum();
    let cached = results.first().map_or(0, |r| r.cached_tokens);
    let choices = results
        .into_iter()
        .enumerate()
        .map(|(i, r)| ChatChoice {
            index: i as u32,
            logprobs: want_logprobs.then(|| ChatLogprobs {
                content: r.tokens.iter().map(|(t, _)| chat_logprobs(&state, t, top_logprobs)).collect(),
            }),
            finish_reason: r.finish.unwrap_or(Finish::Length).openai().to_string(),
            message: AssistantMessage {
                role: "assistant".into(),
                content: r.text,
            },
        })
        .collect();
    record.succeeded(prompt_tokens, completion_tokens);
    Ok(Json(ChatCompletion {
        id,
        object: "chat.completion".into(),
        created: unix_now(),
        model,
        system_fingerprint: fingerprint(),
        choices,
        usage: usage(prompt_tokens, completion_tokens, cached),
    })
    .into_response())
}

#[allow(clippy::too_many_arguments)]
fn chat_stream(
    state: Arc<AppState>,
    generations: Vec<Generation>,
    id: String,
    model: String,
    prompt_tokens: usize,
    want_logprobs: bool,
    top_logprobs: u32,
    include_usage: bool,
    mut record: RequestRecord,
) -> Response {
    let created = unix_now();
    let chunk = move |choices: Vec<ChatChunkChoice>, usage: Option<Usage>| ChatCompletionChunk {
        id: id.clone(),
        object: "chat.completion.chunk".into(),
        created,
        model: model.clone(),
        system_fingerprint: fingerprint(),
        choices,
        usage,
    };
    let choice = |index: usize, content: String, logprobs: Option<ChatLogprobs>, finish: Option<Finish>| ChatChunkChoice {
        index: index as u32,
        delta: ChatDelta {
            role: "assistant".into(),
            content,
            tool_calls: None,
        },
        logprobs,
        finish_reason: finish.map(|f| f.openai().to_string()),
    };
    let mut merged = futures::stream::select_all(
        generations
            .into_iter()
            .enumerate()
            .map(|(i, g)| g.into_stream().map(move |event| (i, event))),
    );
    let events = async_stream::stream! {
        let (mut completion_tokens, mut cached) = (0u32, 0u32);
        while let Some((index, event)) = merged.next().await {
            match event {
                Ok(GenEvent::Prefill { cached_tokens, .. }) => cached = cached_tokens,
                Ok(GenEvent::Token { token, visible, .. }) => {
                    let logprobs = want_logprobs.then(|| ChatLogprobs {
                        content: vec![chat_logprobs(&state, &token, top_logprobs)],
                    });
                    if !visible.is_empty() || logprobs.is_some() {
                        yield json_event(&chunk(vec![choice(index, visible, logprobs, None)], None));
                    }
                }
                Ok(GenEvent::End { finish, generated_tokens, trailing }) => {
                    completion_tokens += generated_tokens;
                    yield json_event(&chunk(vec![choice(index, trailing, None, Some(finish))], None));
                }
                Err(error) => {
                    record.failed(&error);
                    yield json_event(&error.openai_body());
                    yield done_event();
                    return;
                }
            }
        }
        record.succeeded(prompt_tokens, completion_tokens);
        if include_usage {
            yield json_event(&chunk(vec![], Some(usage(prompt_tokens, completion_tokens, cached))));
        }
        yield done_event();
    };
    sse_response(events)
}

/// Text, and optionally logprobs, of the echoed prompt.
struct Echo {
    text: String,
    logprobs: Option<CompletionLogprobs>,
}

fn echo_prompt(state: &AppState, input_ids: &[u32], prompt_logprobs: &[TokenLogprob], with_logprobs: bool) -> Echo {
    let tokenizer = &state.validation.tokenizer;
    let text = tokenizer.decode(input_ids, true).unwrap_or_default();
    let logprobs = with_logprobs.then(|| {
        let mut lp = CompletionLogprobs {
            tokens: Vec::new(),
            token_logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            text_offset: Vec::new(),
        };
        let mut offset = 0;
        for (i, &id) in input_ids.iter().enumerate() {
            let token = tokenizer.token_text(id);
            lp.text_offset.push(offset);
            offset += token.len();
            lp.tokens.push(token);
            // prompt_logprobs[i - 1] belongs to prompt token i; the first
            // token has none.
            lp.token_logprobs.push(i.checked_sub(1).and_then(|j| prompt_logprobs.get(j)).map(|t| t.logprob));
            lp.top_logprobs.push(None);
        }
        lp
    });
    Echo { text, logprobs }
}

fn completion_logprobs(state: &AppState, collected: &Collected, top: u32, start_offset: usize) -> CompletionLogprobs {
    let tokenizer = &state.validation.tokenizer;
    let mut lp = CompletionLogprobs {
        tokens: Vec::new(),
        token_logprobs: Vec::new(),
        top_logprobs: Vec::new(),
        text_offset: Vec::new(),
    };
    let mut offset = start_offset;
    for (token, text) in &collected.tokens {
        lp.tokens.push(tokenizer.token_text(token.token_id));
        lp.token_logprobs.push(Some(token.logprob));
        lp.top_logprobs.push((top > 0).then(|| {
            token
                .top_tokens
                .iter()
                .take(top as usize)
                .map(|t| (tokenizer.token_text(t.token_id), t.logprob))
                .collect()
        }));
        lp.text_offset.push(offset);
        offset += text.len();
    }
    lp
}

#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest,
    responses(
        (status = 200, description = "a completion, or an SSE stream of completions with `stream: true`", body = Completion),
        (status = 400, body = super::error::OpenAiErrorBody),
        (status = 404, body = super::error::OpenAiErrorBody),
        (status = 429, body = super::error::OpenAiErrorBody),
    ))]
pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    let mut record = RequestRecord::new("completions");
    let result = completions_inner(state, body, &mut record).await;
    if let Err(e) = &result {
        record.failed(e);
    }
    Ok(result?)
}

/// Default `max_tokens` of the completions API (OpenAI's and vLLM's).
const DEFAULT_COMPLETION_MAX_TOKENS: u64 = 16;

async fn completions_inner(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    record: &mut RequestRecord,
) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse_json(&body_bytes(body)?)?;
    state.check_model(request.model.as_deref())?;
    if request.best_of.is_some_and(|b| b != 1) {
        return Err(ValidationError::Unsupported {
            field: "best_of".into(),
            message: "only 1 is supported".into(),
        }
        .into());
    }
    let prompts: Vec<Prompt> = match request.prompt.clone() {
        PromptInput::Text(t) => vec![Prompt::Text(t)],
        PromptInput::Texts(ts) => ts.into_iter().map(Prompt::Text).collect(),
        PromptInput::Tokens(ids) => vec![Prompt::Tokens(ids)],
        PromptInput::TokenLists(lists) => lists.into_iter().map(Prompt::Tokens).collect(),
    };
    if prompts.is_empty() {
        return Err(ValidationError::Empty { field: "prompt".into() }.into());
    }
    let echo = request.echo.unwrap_or(false);
    let top = request.logprobs.unwrap_or(0);
    let mut params = parameters(
        &state,
        &request.sampling,
        Some(request.max_tokens.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS)),
    )?;
    params.logprobs = request.logprobs.is_some();
    params.top_n_tokens = top;
    params.top_n_tokens_field = "logprobs";
    params.prompt_logprobs = echo && request.logprobs.is_some();
    let n = request.sampling.n.unwrap_or(1);
    let multi = prompts.len() > 1;
    let mut validated = Vec::new();
    for (p, prompt) in prompts.iter().enumerate() {
        let field = if multi { format!("prompt[{p}]") } else { "prompt".to_string() };
        let ids = state.validation.tokenize(prompt, &field, true)?;
        validated.push(state.validation.validate(ids, &field, params.clone())?);
    }
    let prompt_tokens: Vec<usize> = validated.iter().map(|v| v.request.input_ids.len()).collect();
    let inputs: Vec<Vec<u32>> = validated.iter().map(|v| v.request.input_ids.clone()).collect();
    // Choice index = prompt index * n + j: generations are in that order.
    let all: Vec<Validated> = validated.iter().flat_map(|v| fan_out(v, n)).collect();
    let generations = submit(&state, all).await?;
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    let model = state.served_model_name().to_string();
    let total_prompt_tokens: usize = prompt_tokens.iter().sum::<usize>() * n as usize;

    if request.sampling.stream.unwrap_or(false) {
        let include_usage = request.sampling.stream_options.is_some_and(|o| o.include_usage);
        let record = record.take();
        let echoes: Vec<String> = inputs
            .iter()
            .map(|ids| if echo { state.validation.tokenizer.decode(ids, true).unwrap_or_default() } else { String::new() })
            .collect();
        return Ok(completion_stream(state, generations, id, model, n, echoes, total_prompt_tokens, top, request.logprobs.is_some(), include_usage, record));
    }

    let results = futures::future::try_join_all(generations.into_iter().map(Generation::collect)).await?;
    let completion_tokens: u32 = results.iter().map(|r| r.generated_tokens).sum();
    let cached: u32 = results.iter().map(|r| r.cached_tokens).sum();
    let mut choices = Vec::with_capacity(results.len());
    for (index, result) in results.iter().enumerate() {
        let prompt_index = index / n as usize;
        let prefix = echo.then(|| echo_prompt(&state, &inputs[prompt_index], &result.prompt_logprobs, request.logprobs.is_some()));
        let start = prefix.as_ref().map_or(0, |p| p.text.len());
        let mut logprobs = request.logprobs.is_some().then(|| completion_logprobs(&state, result, top, start));
        if let (Some(lp), Some(Echo { logprobs: Some(echoed), .. })) = (logprobs.as_mut(), prefix.as_ref()) {
            let mut echoed = echoed.clone();
            echoed.tokens.append(&mut lp.tokens);
            echoed.token_logprobs.append(&mut lp.token_logprobs);
            echoed.top_logprobs.append(&mut lp.top_logprobs);
            echoed.text_offset.append(&mut lp.text_offset);
            *lp = echoed;
        }
        choices.push(CompletionChoice {
            index: index as u32,
            text: prefix.map(|p| p.text).unwrap_or_default() + &result.text,
            logprobs,
            finish_reason: Some(result.finish.unwrap_or(Finish::Length).openai().to_string()),
        });
    }
    record.succeeded(total_prompt_tokens, completion_tokens);
    Ok(Json(Completion {
        id,
        object: "text_completion".into(),
        created: unix_now(),
        model,
        system_fingerprint: fingerprint(),
        choices,
        usage: Some(usage(total_prompt_tokens, completion_tokens, cached)),
    })
    .into_response())
}

#[allow(clippy::too_many_arguments)]
fn completion_stream(
    state: Arc<AppState>,
    generations: Vec<Generation>,
    id: String,
    model: String,
    n: u32,
    echoes: Vec<String>,
    prompt_tokens: usize,
    top: u32,
    want_logprobs: bool,
    include_usage: bool,
    mut record: RequestRecord,
) -> Response {
    let created = unix_now();
    let chunk = move |choices: Vec<CompletionChoice>, usage: Option<Usage>| Completion {
        id: id.clone(),
        object: "text_completion".into(),
        created,
        model: model.clone(),
        system_fingerprint: fingerprint(),
        choices,
        usage,
    };
    let count = generations.len();
    let mut merged = futures::stream::select_all(
        generations
            .into_iter()
            .enumerate()
            .map(|(i, g)| g.into_stream().map(move |event| (i, event))),
    );
    let events = async_stream::stream! {
        let (mut completion_tokens, mut cached) = (0u32, 0u32);
        // Per choice: byte offset of the next token's text (after the echo).
        let mut offsets: Vec<usize> = (0..count).map(|i| echoes[i / n as usize].len()).collect();
        for index in 0..count {
            let echo = &echoes[index / n as usize];
            if !echo.is_empty() {
                let choice = CompletionChoice { index: index as u32, text: echo.clone(), logprobs: None, finish_reason: None };
                yield json_event(&chunk(vec![choice], None));
            }
        }
        while let Some((index, event)) = merged.next().await {
            match event {
                Ok(GenEvent::Prefill { cached_tokens, .. }) => cached += cached_tokens,
                Ok(GenEvent::Token { token, text, visible }) => {
                    let tokenizer = &state.validation.tokenizer;
                    let text_offset = offsets[index];
                    offsets[index] += text.len();
                    let logprobs = want_logprobs.then(|| CompletionLogprobs {
                        tokens: vec![tokenizer.token_text(token.token_id)],
                        token_logprobs: vec![Some(token.logprob)],
                        top_logprobs: vec![(top > 0).then(|| token.top_tokens.iter().take(top as usize)
                            .map(|t| (tokenizer.token_text(t.token_id), t.logprob)).collect())],
                        text_offset: vec![text_offset],
                    });
                    if !visible.is_empty() || logprobs.is_some() {
                        let choice = CompletionChoice { index: index as u32, text: visible, logprobs, finish_reason: None };
                        yield json_event(&chunk(vec![choice], None));
                    }
                }
                Ok(GenEvent::End { finish, generated_tokens, trailing }) => {
                    completion_tokens += generated_tokens;
                    let choice = CompletionChoice { index: index as u32, text: trailing, logprobs: None, finish_reason: Some(finish.openai().to_string()) };
                    yield json_event(&chunk(vec![choice], None));
                }
                Err(error) => {
                    record.failed(&error);
                    yield json_event(&error.openai_body());
                    yield done_event();
                    return;
                }
            }
        }
        record.succeeded(prompt_tokens, completion_tokens);
        if include_usage {
            yield json_event(&chunk(vec![], Some(usage(prompt_tokens, completion_tokens, cached))));
        }
        yield done_event();
    };
    sse_response(events)
}

//! TGI-native `POST /generate`, `POST /generate_stream` and `POST /` (TGI's
//! compatibility route: a one-element list, or a stream with
//! `"stream": true`), in the shapes Hugging Face's `text-generation` client
//! and `huggingface_hub.InferenceClient` parse.
//!
//! Sampling follows TGI: greedy unless `do_sample` is true or a warper
//! (temperature != 1, top_k, top_p, typical_p) is given; `temperature`
//! must then be strictly positive. `watermark` is accepted and ignored.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{body_bytes, parse_json, ApiError, TgiError};
use super::generation::{Choices, Collected, Finish, GenEvent, Prepared, RequestRecord, StreamShape, TokenUsage};
use super::sse::json_event;
use super::state::AppState;
use crate::infer::TokenLogprob;
use crate::tokenizer::Tokenizer;
use super::openai::structured::schema_value;
use crate::grammar::Constraint;
use crate::validation::{Decoding, GenerateParameters, Prompt, Validated, ValidationError};

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(default)]
pub struct TgiParameters {
    /// Only 1 (or null) is supported.
    pub best_of: Option<u32>,
    /// Strictly positive.
    pub temperature: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub do_sample: bool,
    /// Default: the room left in the sequence (--max-total-tokens).
    pub max_new_tokens: Option<u64>,
    pub return_full_text: Option<bool>,
    pub stop: Vec<String>,
    /// Keep only the last `truncate` prompt tokens.
    pub truncate: Option<u32>,
    /// Accepted and ignored.
    pub watermark: bool,
    pub details: bool,
    pub decoder_input_details: bool,
    pub seed: Option<u64>,
    pub top_n_tokens: Option<u32>,
    /// The output follows `{"type": "json", "value": schema}`,
    /// `{"type": "regex", "value": regex}` or `{"type": "json_schema",
    /// "value": {"name": ..., "schema": schema}}`.
    pub grammar: Option<TgiGrammar>,
    /// Scheduling priority, lower runs first (default 0; a Sluice extra,
    /// as vLLM's `priority`).
    pub priority: Option<i32>,
    /// The LoRA adapter to generate with (its name); none: the base model.
    pub adapter_id: Option<String>,
}

/// TGI's `parameters.grammar`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TgiGrammar {
    /// `json`, `regex` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    #[schema(value_type = Object)]
    pub value: serde_json::Value,
}

impl TgiGrammar {
    /// The constraint, with the field named when it does not compile.
    fn constraint(&self) -> Result<(String, Constraint), ValidationError> {
        use serde_json::Value;
        let field = "parameters.grammar.value";
        let unsupported = |field: &str, message: String| ValidationError::Unsupported { field: field.into(), message };
        let constraint = match (self.kind.as_str(), &self.value) {
            ("json" | "json_object", value) => Constraint::JsonSchema(schema_value(field, value)?),
            // {"name": ..., "schema": {...}} as OpenAI's json_schema, or the schema.
            ("json_schema", Value::Object(map)) if map.get("schema").is_some_and(Value::is_object) => {
                Constraint::JsonSchema(map["schema"].clone())
            }
            ("json_schema", value) => Constraint::JsonSchema(schema_value(field, value)?),
            ("regex", Value::String(regex)) => Constraint::Regex(regex.clone()),
            ("regex", _) => return Err(unsupported(field, "a regex must be a string".into())),
            (other, _) => {
                return Err(unsupported(
                    "parameters.grammar.type",
                    format!("`{other}` is not one of `json`, `regex`, `json_schema`"),
                ))
            }
        };
        Ok((field.to_string(), constraint))
    }
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct TgiRequest {
    pub inputs: String,
    #[serde(default)]
    pub parameters: TgiParameters,
    /// Only read by `POST /`.
    #[serde(default)]
    pub stream: bool,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TgiFinishReason {
    Length,
    EosToken,
    StopSequence,
}

impl From<Finish> for TgiFinishReason {
    fn from(finish: Finish) -> Self {
        match finish {
            Finish::Eos => Self::EosToken,
            Finish::Length => Self::Length,
            Finish::StopSequence => Self::StopSequence,
        }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PrefillToken {
    pub id: u32,
    pub text: String,
    /// Null for the first prompt token.
    pub logprob: Option<f32>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Token {
    pub id: u32,
    pub text: String,
    pub logprob: Option<f32>,
    pub special: bool,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Details {
    pub finish_reason: TgiFinishReason,
    pub generated_tokens: u32,
    /// The seed used when sampling; null for greedy decoding.
    pub seed: Option<u64>,
    pub prefill: Vec<PrefillToken>,
    pub tokens: Vec<Token>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_tokens: Vec<Vec<Token>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct GenerateResponse {
    pub generated_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<Details>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StreamDetails {
    pub finish_reason: TgiFinishReason,
    pub generated_tokens: u32,
    pub seed: Option<u64>,
    pub input_length: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StreamResponse {
    pub index: u32,
    pub token: Token,
    pub top_tokens: Vec<Token>,
    /// Set on the last event only.
    pub generated_text: Option<String>,
    /// Set on the last event only.
    pub details: Option<StreamDetails>,
}

/// Logprobs travel as NaN when not computed; JSON gets null.
fn logprob(value: f32) -> Option<f32> {
    value.is_finite().then_some(value)
}

/// Maps a TGI body to the router's parameters and validates it.
fn validate(state: &AppState, request: &TgiRequest, stream: bool) -> Result<Validated, ApiError> {
    let p = &request.parameters;
    let adapter = state.validation.check_model(p.adapter_id.as_deref())?;
    let params = GenerateParameters {
        max_new_tokens: p.max_new_tokens,
        max_new_tokens_field: "max_new_tokens",
        field_prefix: "parameters.",
        best_of: p.best_of,
        constraint: p.grammar.as_ref().map(TgiGrammar::constraint).transpose()?,
        temperature: p.temperature,
        decoding: Decoding::GreedyUnless { do_sample: p.do_sample },
        top_k: p.top_k,
        top_p: p.top_p,
        typical_p: p.typical_p,
        repetition_penalty: p.repetition_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
        stop: p.stop.clone(),
        // Streams always carry logprobs, as TGI's do.
        logprobs: p.details || stream,
        top_n_tokens: p.top_n_tokens.unwrap_or(0),
        top_n_tokens_field: "top_n_tokens",
        prompt_logprobs: p.decoder_input_details,
        truncate: p.truncate,
        priority: p.priority.unwrap_or(0),
        adapter,
        ..Default::default()
    };
    let prompt = Prompt::Text(request.inputs.clone());
    let mut validated = state.validation.validate_prompts(&[prompt], "inputs", &params)?;
    Ok(validated.remove(0))
}

/// Shapes one TGI request's answer, buffered or streamed.
struct TgiShape {
    tokenizer: Tokenizer,
    request: TgiRequest,
    input_ids: Vec<u32>,
    top_n_tokens: u32,
    /// Reported in details; None for greedy decoding.
    seed: Option<u64>,
    /// Streaming: each token event is held until the next arrives, so the
    /// last one can carry `generated_text` and `details`.
    held: Option<StreamResponse>,
    /// Streaming: the text so far (after the prompt with `return_full_text`).
    text: String,
}

impl TgiShape {
    fn new(state: &AppState, request: TgiRequest, validated: &Validated) -> Self {
        let params = &validated.request.params;
        let text = if request.parameters.return_full_text.unwrap_or(false) { request.inputs.clone() } else { String::new() };
        Self {
            tokenizer: state.validation.tokenizer.clone(),
            input_ids: validated.request.input_ids.clone(),
            top_n_tokens: validated.request.top_n_tokens,
            seed: (params.temperature > 0.0).then_some(params.seed),
            request,
            held: None,
            text,
        }
    }

    fn token(&self, id: u32, logprob_value: f32, text: String) -> Token {
        Token { id, text, logprob: logprob(logprob_value), special: self.tokenizer.is_special(id) }
    }

    fn top_tokens(&self, top: &[TokenLogprob]) -> Vec<Token> {
        top.iter().map(|t| self.token(t.token_id, t.logprob, self.tokenizer.token_text(t.token_id))).collect()
    }

    fn response(mut self, collected: Collected) -> GenerateResponse {
        let p = &self.request.parameters;
        let details = p.details.then(|| Details {
            finish_reason: collected.finish.unwrap_or(Finish::Length).into(),
            generated_tokens: collected.generated_tokens,
            seed: self.seed,
            prefill: if p.decoder_input_details { self.prefill(&collected.prompt_logprobs) } else { Vec::new() },
            tokens: collected.tokens.iter().map(|(t, text)| self.token(t.token_id, t.logprob, text.clone())).collect(),
            top_tokens: if self.top_n_tokens > 0 {
                collected.tokens.iter().map(|(t, _)| self.top_tokens(&t.top_tokens)).collect()
            } else {
                Vec::new()
            },
        });
        self.text.push_str(&collected.text);
        GenerateResponse { generated_text: self.text, details }
    }

    /// The prompt's tokens; entry i - 1 of `prompt_logprobs` is the logprob
    /// of prompt token i.
    fn prefill(&self, prompt_logprobs: &[TokenLogprob]) -> Vec<PrefillToken> {
        self.input_ids
            .iter()
            .enumerate()
            .map(|(i, &id)| PrefillToken {
                id,
                text: self.tokenizer.token_text(id),
                logprob: i.checked_sub(1).and_then(|j| prompt_logprobs.get(j)).and_then(|t| logprob(t.logprob)),
            })
            .collect()
    }
}

impl StreamShape for TgiShape {
    fn event(&mut self, _index: usize, event: GenEvent) -> Vec<Event> {
        match event {
            GenEvent::Prefill { .. } => vec![],
            GenEvent::Token { token, visible, .. } => {
                self.text.push_str(&visible);
                let next = StreamResponse {
                    index: 0,
                    token: self.token(token.token_id, token.logprob, visible),
                    top_tokens: self.top_tokens(&token.top_tokens),
                    generated_text: None,
                    details: None,
                };
                self.held.replace(next).map(|previous| json_event(&previous)).into_iter().collect()
            }
            GenEvent::End { finish, generated_tokens, trailing, .. } => {
                self.text.push_str(&trailing);
                let Some(mut last) = self.held.take() else { return vec![] };
                last.token.text.push_str(&trailing);
                last.generated_text = Some(std::mem::take(&mut self.text));
                last.details = Some(StreamDetails {
                    finish_reason: finish.into(),
                    generated_tokens,
                    seed: self.seed,
                    input_length: self.input_ids.len() as u32,
                });
                vec![json_event(&last)]
            }
        }
    }

    fn finish(&mut self, _usage: TokenUsage) -> Vec<Event> {
        Vec::new()
    }

    fn fail(&mut self, error: &ApiError) -> Vec<Event> {
        let held = self.held.take().map(|previous| json_event(&previous));
        held.into_iter().chain([json_event(&error.tgi_body())]).collect()
    }
}

/// A TGI request's work, off the async runtime: parse, tokenize, compile its
/// grammar. `stream`: which route it came by (None for `POST /`, where the
/// body's `stream` decides).
async fn prepare(
    state: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    stream: Option<bool>,
) -> Result<Prepared<TgiShape>, ApiError> {
    let body = body_bytes(body)?;
    state
        .off_runtime(move |state| {
            let request: TgiRequest = parse_json(&body)?;
            let stream = stream.unwrap_or(request.stream);
            let validated = validate(state, &request, stream)?;
            let shape = TgiShape::new(state, request, &validated);
            Ok(Prepared { prompts: vec![validated], shape, stream })
        })
        .await
}

async fn generate_inner(
    state: &AppState,
    prepared: Result<Prepared<TgiShape>, ApiError>,
    record: &mut RequestRecord,
) -> Result<GenerateResponse, ApiError> {
    let Prepared { prompts, shape, .. } = prepared?;
    let (mut results, _) = Choices::submit(state, prompts).await?.collect(record).await?;
    Ok(shape.response(results.remove(0)))
}

async fn stream_inner(state: &AppState, prepared: Result<Prepared<TgiShape>, ApiError>, record: &mut RequestRecord) -> Result<Response, ApiError> {
    let Prepared { prompts, shape, .. } = prepared?;
    let choices = Choices::submit(state, prompts).await?;
    Ok(choices.sse(shape, record.take()))
}

#[utoipa::path(post, path = "/generate", request_body = TgiRequest,
    responses(
        (status = 200, body = GenerateResponse),
        (status = 422, body = super::error::TgiErrorBody),
        (status = 424, body = super::error::TgiErrorBody),
        (status = 429, body = super::error::TgiErrorBody),
    ))]
pub async fn generate(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<GenerateResponse>, TgiError> {
    let mut record = RequestRecord::new("generate");
    let prepared = prepare(&state, body, Some(false)).await;
    let result = generate_inner(&state, prepared, &mut record).await;
    Ok(Json(record.settle(result)?))
}

#[utoipa::path(post, path = "/generate_stream", request_body = TgiRequest,
    responses(
        (status = 200, description = "SSE stream of StreamResponse", body = StreamResponse, content_type = "text/event-stream"),
        (status = 422, body = super::error::TgiErrorBody),
        (status = 429, body = super::error::TgiErrorBody),
    ))]
pub async fn generate_stream(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, TgiError> {
    let mut record = RequestRecord::new("generate_stream");
    let prepared = prepare(&state, body, Some(true)).await;
    let result = stream_inner(&state, prepared, &mut record).await;
    Ok(record.settle(result)?)
}

/// TGI's `POST /`: `/generate` answered as a one-element list, or
/// `/generate_stream` when `stream` is true.
#[utoipa::path(post, path = "/", request_body = TgiRequest,
    responses(
        (status = 200, body = Vec<GenerateResponse>),
        (status = 422, body = super::error::TgiErrorBody),
    ))]
pub async fn compat_generate(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, TgiError> {
    let prepared = prepare(&state, body, None).await;
    if prepared.as_ref().is_ok_and(|p| p.stream) {
        let mut record = RequestRecord::new("generate_stream");
        let result = stream_inner(&state, prepared, &mut record).await;
        return Ok(record.settle(result)?);
    }
    let mut record = RequestRecord::new("generate");
    let result = generate_inner(&state, prepared, &mut record).await;
    Ok(Json(vec![record.settle(result)?]).into_response())
}

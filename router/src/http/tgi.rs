//! TGI-native `POST /generate`, `POST /generate_stream` and `POST /` (TGI's
//! compatibility route: a one-element list, or a stream with
//! `"stream": true`), in the shapes Hugging Face's `text-generation` client
//! and `huggingface_hub.InferenceClient` parse.
//!
//! Sampling follows TGI: greedy unless `do_sample` is true or a warper
//! (temperature != 1, top_k, top_p, typical_p) is given; `temperature`
//! must then be strictly positive. `watermark` is accepted and ignored.

use tracing::Instrument;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{parse_json, ApiError, TgiError};
use super::generation::{Finish, GenEvent, Generation, RequestRecord};
use super::sse::{json_event, sse_response};
use super::{body_bytes, AppState};
use crate::infer::{GeneratedToken, TokenLogprob};
use crate::validation::{GenerateParameters, Prompt, Validated, ValidationError};

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
    /// Not supported: must be null.
    #[schema(value_type = Option<Object>)]
    pub grammar: Option<serde_json::Value>,
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

struct Prepared {
    validated: Validated,
    inputs: String,
    details: bool,
    decoder_input_details: bool,
    return_full_text: bool,
    /// Reported in details; None for greedy.
    seed: Option<u64>,
}

fn prepare(state: &AppState, request: TgiRequest, stream: bool) -> Result<Prepared, ApiError> {
    let p = request.parameters;
    let unsupported = |field: &str, message: &str| -> ApiError {
        ValidationError::Unsupported {
            field: format!("parameters.{field}"),
            message: message.into(),
        }
        .into()
    };
    if p.best_of.is_some_and(|b| b != 1) {
        return Err(unsupported("best_of", "only 1 is supported"));
    }
    if p.grammar.as_ref().is_some_and(|g| !g.is_null()) {
        return Err(unsupported("grammar", "grammars are not supported"));
    }
    if p.temperature.is_some_and(|t| t <= 0.0) {
        return Err(ValidationError::OutOfRange {
            field: "temperature".into(),
            message: "must be strictly positive".into(),
        }
        .into());
    }
    let sampling = p.do_sample
        || p.temperature.is_some_and(|t| t != 1.0)
        || p.top_k.is_some()
        || p.top_p.is_some()
        || p.typical_p.is_some();
    let params = GenerateParameters {
        max_new_tokens: p.max_new_tokens,
        max_new_tokens_field: "max_new_tokens",
        temperature: if sampling { p.temperature.unwrap_or(1.0) } else { 0.0 },
        top_k: p.top_k,
        top_p: p.top_p,
        typical_p: p.typical_p,
        repetition_penalty: p.repetition_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
        stop: p.stop,
        // Streams always carry logprobs, as TGI's do.
        logprobs: p.details || stream,
        top_n_tokens: p.top_n_tokens.unwrap_or(0),
        top_n_tokens_field: "top_n_tokens",
        prompt_logprobs: p.decoder_input_details,
        truncate: p.truncate,
        ..Default::default()
    };
    let input_ids = state.validation.tokenize(&Prompt::Text(request.inputs.clone()), "inputs", true)?;
    let validated = state.validation.validate(input_ids, "inputs", params)?;
    Ok(Prepared {
        seed: sampling.then_some(validated.request.params.seed),
        validated,
        inputs: request.inputs,
        details: p.details,
        decoder_input_details: p.decoder_input_details,
        return_full_text: p.return_full_text.unwrap_or(false),
    })
}

fn token(state: &AppState, t: &GeneratedToken, text: String) -> Token {
    Token {
        id: t.token_id,
        text,
        logprob: logprob(t.logprob),
        special: state.validation.tokenizer.is_special(t.token_id),
    }
}

fn top_tokens(state: &AppState, top: &[TokenLogprob]) -> Vec<Token> {
    top.iter()
        .map(|t| Token {
            id: t.token_id,
            text: state.validation.tokenizer.token_text(t.token_id),
            logprob: logprob(t.logprob),
            special: state.validation.tokenizer.is_special(t.token_id),
        })
        .collect()
}

async fn submit(state: &AppState, prepared: &Prepared) -> Result<Generation, ApiError> {
    let request = prepared.validated.request.clone();
    let arrived = request.arrived;
    let span = crate::telemetry::generation_span(state.served_model_name(), &request);
    let stream = state.infer.generate(request).instrument(span.clone()).await?;
    Ok(Generation::new(
        stream,
        state.validation.tokenizer.clone(),
        prepared.validated.stop.clone(),
        arrived,
    )
    .traced(span))
}

async fn generate_inner(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
    record: &mut RequestRecord,
) -> Result<GenerateResponse, ApiError> {
    let request: TgiRequest = parse_json(&body_bytes(body)?)?;
    let prepared = prepare(state, request, false)?;
    let collected = submit(state, &prepared).await?.collect().await?;
    let input_ids = &prepared.validated.request.input_ids;
    record.succeeded(input_ids.len(), collected.generated_tokens);
    let details = prepared.details.then(|| {
        let prefill = if prepared.decoder_input_details {
            input_ids
                .iter()
                .enumerate()
                .map(|(i, &id)| PrefillToken {
                    id,
                    text: state.validation.tokenizer.token_text(id),
                    // Entry i - 1 is the logprob of prompt token i.
                    logprob: i
                        .checked_sub(1)
                        .and_then(|j| collected.prompt_logprobs.get(j))
                        .and_then(|t| logprob(t.logprob)),
                })
                .collect()
        } else {
            Vec::new()
        };
        Details {
            finish_reason: collected.finish.unwrap_or(Finish::Length).into(),
            generated_tokens: collected.generated_tokens,
            seed: prepared.seed,
            prefill,
            tokens: collected.tokens.iter().map(|(t, text)| token(state, t, text.clone())).collect(),
            top_tokens: if prepared.validated.request.top_n_tokens > 0 {
                collected.tokens.iter().map(|(t, _)| top_tokens(state, &t.top_tokens)).collect()
            } else {
                Vec::new()
            },
        }
    });
    let generated_text = if prepared.return_full_text {
        prepared.inputs + &collected.text
    } else {
        collected.text
    };
    Ok(GenerateResponse { generated_text, details })
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
    let result = generate_inner(&state, body, &mut record).await;
    if let Err(e) = &result {
        record.failed(e);
    }
    Ok(Json(result?))
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
    let result = async {
        let request: TgiRequest = parse_json(&body_bytes(body)?)?;
        stream_response(state, request, &mut record).await
    }
    .await;
    if let Err(e) = &result {
        record.failed(e);
    }
    Ok(result?)
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
    let body = body_bytes(body)?;
    let request: TgiRequest = parse_json(&body)?;
    if request.stream {
        let mut record = RequestRecord::new("generate_stream");
        let result = stream_response(state, request, &mut record).await;
        if let Err(e) = &result {
            record.failed(e);
        }
        return Ok(result?);
    }
    let mut record = RequestRecord::new("generate");
    let result = generate_inner(&state, Ok(body), &mut record).await;
    if let Err(e) = &result {
        record.failed(e);
    }
    Ok(Json(vec![result?]).into_response())
}

async fn stream_response(
    state: Arc<AppState>,
    request: TgiRequest,
    record: &mut RequestRecord,
) -> Result<Response, ApiError> {
    let prepared = prepare(&state, request, true)?;
    let generation = submit(&state, &prepared).await?;
    let mut record = record.take();
    let input_length = prepared.validated.request.input_ids.len();
    let mut events = generation.into_stream();
    let stream = async_stream::stream! {
        // Each token event is held until the next arrives, so the last one
        // can carry `generated_text` and `details`.
        let mut held: Option<StreamResponse> = None;
        let mut text = if prepared.return_full_text { prepared.inputs.clone() } else { String::new() };
        while let Some(event) = events.next().await {
            match event {
                Ok(GenEvent::Prefill { .. }) => {}
                Ok(GenEvent::Token { token: t, visible, .. }) => {
                    if let Some(previous) = held.take() {
                        yield json_event(&previous);
                    }
                    text.push_str(&visible);
                    held = Some(StreamResponse {
                        index: 0,
                        token: token(&state, &t, visible),
                        top_tokens: top_tokens(&state, &t.top_tokens),
                        generated_text: None,
                        details: None,
                    });
                }
                Ok(GenEvent::End { finish, generated_tokens, trailing }) => {
                    text.push_str(&trailing);
                    record.succeeded(input_length, generated_tokens);
                    if let Some(mut last) = held.take() {
                        last.token.text.push_str(&trailing);
                        last.generated_text = Some(std::mem::take(&mut text));
                        last.details = Some(StreamDetails {
                            finish_reason: finish.into(),
                            generated_tokens,
                            seed: prepared.seed,
                            input_length: input_length as u32,
                        });
                        yield json_event(&last);
                    }
                }
                Err(error) => {
                    record.failed(&error);
                    if let Some(previous) = held.take() {
                        yield json_event(&previous);
                    }
                    yield json_event(&error.tgi_body());
                    return;
                }
            }
        }
    };
    Ok(sse_response(stream))
}

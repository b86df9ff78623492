//! `POST /v1/completions`: one prompt or a list (text or token ids) -> the
//! generation driver -> a `text_completion`, or a stream of them. `echo`
//! prepends the prompt (and, with `logprobs`, its logprobs).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::types::{Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, PromptInput};
use super::structured::openai_constraint;
use super::{fingerprint, parameters, ResponseId};
use crate::http::error::{parse_json, ApiError, OpenAiError};
use crate::http::generation::{
    drive, run_collected, Collected, Finish, GenEvent, Prepared, RequestRecord, StreamShape, TokenUsage,
};
use crate::http::sse::{done_event, json_event};
use crate::http::state::AppState;
use crate::infer::{GeneratedToken, RequestClass, TokenLogprob};
use crate::tokenizer::Tokenizer;
use crate::validation::{Prompt, Validated};

/// Default `max_tokens` of the completions API (OpenAI's and vLLM's).
const DEFAULT_COMPLETION_MAX_TOKENS: u64 = 16;

#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest,
    responses(
        (status = 200, description = "a completion, or an SSE stream of completions with `stream: true`", body = Completion),
        (status = 400, body = crate::http::error::OpenAiErrorBody),
        (status = 404, body = crate::http::error::OpenAiErrorBody),
        (status = 429, body = crate::http::error::OpenAiErrorBody),
    ))]
pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    let mut record = RequestRecord::new("completions");
    let result = drive(state, body, &mut record, prepare, |shape, results, usage| {
        Json(shape.completion(&results, usage)).into_response()
    })
    .await;
    Ok(record.settle(result)?)
}

/// One Batch API line for this endpoint: what `completions` would answer,
/// in the scheduler's batch class.
pub(crate) async fn batch_line(state: &Arc<AppState>, body: Bytes) -> Result<(Completion, TokenUsage, Duration), ApiError> {
    run_collected(state, body, RequestClass::Batch, prepare, |shape, results, usage| shape.completion(&results, usage)).await
}

/// The request's work, off the async runtime: parse, tokenize every prompt,
/// compile the constraint.
fn prepare(state: &AppState, body: &[u8]) -> Result<Prepared<CompletionShape>, ApiError> {
    let request: CompletionRequest = parse_json(body)?;
    let adapter = state.validation.check_model(request.model.as_deref())?;
    let prompts: Vec<Prompt> = match request.prompt {
        PromptInput::Text(t) => vec![Prompt::Text(t)],
        PromptInput::Texts(ts) => ts.into_iter().map(Prompt::Text).collect(),
        PromptInput::Tokens(ids) => vec![Prompt::Tokens(ids)],
        PromptInput::TokenLists(lists) => lists.into_iter().map(Prompt::Tokens).collect(),
    };
    let max_tokens = request.max_tokens.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS);
    let mut params = parameters(state, &request.sampling, Some(max_tokens));
    params.adapter = adapter;
    params.best_of = request.best_of;
    params.logprobs = request.logprobs.is_some();
    params.top_n_tokens = request.logprobs.unwrap_or(0);
    params.top_n_tokens_field = "logprobs";
    let echo = request.echo.unwrap_or(false);
    params.prompt_logprobs = echo && params.logprobs;
    params.constraint = openai_constraint(request.response_format.as_ref(), &request.guided)?;
    let validated = state.validation.validate_prompts(&prompts, "prompt", &params)?;
    let shape = CompletionShape::new(state, &validated, echo, request.logprobs);
    let shape = CompletionShape { include_usage: request.sampling.stream_options.is_some_and(|o| o.include_usage), ..shape };
    Ok(Prepared { prompts: validated, shape, stream: request.sampling.stream.unwrap_or(false) })
}

/// Shapes one completions request's answer, buffered or streamed.
struct CompletionShape {
    id: ResponseId,
    tokenizer: Tokenizer,
    n: usize,
    /// `Some(top)` when `logprobs` was given.
    logprobs: Option<u32>,
    /// Per prompt: its token ids when `echo`, else none.
    echoes: Vec<Option<Vec<u32>>>,
    include_usage: bool,
    /// Streaming, per choice: the byte offset of its next token's text.
    offsets: Vec<usize>,
}

impl CompletionShape {
    fn new(state: &AppState, prompts: &[Validated], echo: bool, logprobs: Option<u32>) -> Self {
        Self {
            id: ResponseId::new(state, "cmpl", prompts.first().and_then(|v| v.request.adapter.as_deref())),
            tokenizer: state.validation.tokenizer.clone(),
            n: prompts.first().map_or(1, |p| p.n as usize),
            logprobs,
            echoes: prompts.iter().map(|p| echo.then(|| p.request.input_ids.clone())).collect(),
            include_usage: false,
            offsets: Vec::new(),
        }
    }

    fn envelope(&self, choices: Vec<CompletionChoice>, usage: Option<TokenUsage>) -> Completion {
        Completion {
            id: self.id.id.clone(),
            object: "text_completion".into(),
            created: self.id.created,
            model: self.id.model.clone(),
            system_fingerprint: fingerprint(),
            choices,
            usage: usage.map(Into::into),
        }
    }

    /// The echoed prompt's text (empty without `echo`).
    fn echo_text(&self, prompt: usize) -> String {
        self.echoes[prompt].as_ref().map_or_else(String::new, |ids| self.tokenizer.decode(ids, true).unwrap_or_default())
    }

    fn completion(&self, results: &[Collected], usage: TokenUsage) -> Completion {
        let choices = results
            .iter()
            .enumerate()
            .map(|(index, result)| {
                let prompt = index / self.n;
                let echo = self.echo_text(prompt);
                let logprobs = self.logprobs.map(|top| {
                    let mut lp = match &self.echoes[prompt] {
                        Some(ids) => prompt_logprobs(&self.tokenizer, ids, &result.prompt_logprobs),
                        None => CompletionLogprobs::default(),
                    };
                    let mut offset = echo.len();
                    for (token, text) in &result.tokens {
                        lp.push(&self.tokenizer, token, top, offset);
                        offset += text.len();
                    }
                    lp
                });
                CompletionChoice {
                    index: index as u32,
                    text: echo + &result.text,
                    logprobs,
                    finish_reason: Some(result.finish.unwrap_or(Finish::Length).openai().to_string()),
                }
            })
            .collect();
        self.envelope(choices, Some(usage))
    }

    fn chunk(&self, index: usize, text: String, logprobs: Option<CompletionLogprobs>, finish: Option<Finish>) -> Event {
        let finish_reason = finish.map(|f| f.openai().to_string());
        let choice = CompletionChoice { index: index as u32, text, logprobs, finish_reason };
        json_event(&self.envelope(vec![choice], None))
    }
}

impl StreamShape for CompletionShape {
    fn start(&mut self) -> Vec<Event> {
        let count = self.echoes.len() * self.n;
        let echoes: Vec<String> = (0..self.echoes.len()).map(|p| self.echo_text(p)).collect();
        self.offsets = (0..count).map(|index| echoes[index / self.n].len()).collect();
        (0..count)
            .filter(|index| !echoes[index / self.n].is_empty())
            .map(|index| self.chunk(index, echoes[index / self.n].clone(), None, None))
            .collect()
    }

    fn event(&mut self, index: usize, event: GenEvent) -> Vec<Event> {
        match event {
            GenEvent::Prefill { .. } => vec![],
            GenEvent::Token { token, text, visible } => {
                let offset = self.offsets[index];
                self.offsets[index] += text.len();
                let logprobs = self.logprobs.map(|top| {
                    let mut lp = CompletionLogprobs::default();
                    lp.push(&self.tokenizer, &token, top, offset);
                    lp
                });
                (!visible.is_empty() || logprobs.is_some()).then(|| self.chunk(index, visible, logprobs, None)).into_iter().collect()
            }
            GenEvent::End { finish, trailing, .. } => vec![self.chunk(index, trailing, None, Some(finish))],
        }
    }

    fn finish(&mut self, usage: TokenUsage) -> Vec<Event> {
        let mut events = Vec::with_capacity(2);
        if self.include_usage {
            events.push(json_event(&self.envelope(vec![], Some(usage))));
        }
        events.push(done_event());
        events
    }

    fn fail(&mut self, error: &ApiError) -> Vec<Event> {
        vec![json_event(&error.openai_body()), done_event()]
    }
}

impl CompletionLogprobs {
    /// Appends one generated token whose text starts at byte `offset`.
    fn push(&mut self, tokenizer: &Tokenizer, token: &GeneratedToken, top: u32, offset: usize) {
        self.tokens.push(tokenizer.token_text(token.token_id));
        self.token_logprobs.push(Some(token.logprob));
        self.top_logprobs.push((top > 0).then(|| {
            token.top_tokens.iter().take(top as usize).map(|t| (tokenizer.token_text(t.token_id), t.logprob)).collect()
        }));
        self.text_offset.push(offset);
    }
}

/// The echoed prompt's entries: `prompt_logprobs[i - 1]` belongs to prompt
/// token i; the first token has none.
fn prompt_logprobs(tokenizer: &Tokenizer, input_ids: &[u32], prompt_logprobs: &[TokenLogprob]) -> CompletionLogprobs {
    let mut lp = CompletionLogprobs::default();
    let mut offset = 0;
    for (i, &id) in input_ids.iter().enumerate() {
        let token = tokenizer.token_text(id);
        lp.text_offset.push(offset);
        offset += token.len();
        lp.tokens.push(token);
        lp.token_logprobs.push(i.checked_sub(1).and_then(|j| prompt_logprobs.get(j)).map(|t| t.logprob));
        lp.top_logprobs.push(None);
    }
    lp
}

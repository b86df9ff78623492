//! `POST /v1/chat/completions`: messages -> the chat template's prompt ->
//! the generation driver -> a `chat.completion` or a stream of
//! `chat.completion.chunk`s.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::types::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChatDelta, ChatLogprob, ChatLogprobContent, ChatLogprobs, MessageContent, Usage,
};
use super::{fingerprint, parameters, ResponseId};
use crate::chat_template::TemplateMessage;
use crate::http::error::{parse_body, ApiError, OpenAiError};
use crate::http::generation::{Choices, Collected, Finish, GenEvent, RequestRecord, StreamShape, TokenUsage};
use crate::http::sse::{done_event, json_event};
use crate::http::state::AppState;
use crate::infer::GeneratedToken;
use crate::tokenizer::Tokenizer;
use crate::validation::{Prompt, ValidationError};

#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "a completion, or an SSE stream of chunks with `stream: true`", body = ChatCompletion),
        (status = 400, body = crate::http::error::OpenAiErrorBody),
        (status = 404, body = crate::http::error::OpenAiErrorBody),
        (status = 429, body = crate::http::error::OpenAiErrorBody),
        (status = 503, body = crate::http::error::OpenAiErrorBody),
    ))]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    let mut record = RequestRecord::new("chat_completions");
    let result = chat(state, body, &mut record).await;
    Ok(record.settle(result)?)
}

async fn chat(state: Arc<AppState>, body: Result<Bytes, BytesRejection>, record: &mut RequestRecord) -> Result<Response, ApiError> {
    let request: ChatCompletionRequest = parse_body(body)?;
    state.validation.check_model(request.model.as_deref())?;
    let messages = request
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| Ok(TemplateMessage { role: m.role.clone(), content: flatten_content(&m.content, i)? }))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let prompt = Prompt::Chat(state.validation.render_chat(&messages)?);
    let mut params = parameters(&state, &request.sampling, request.max_completion_tokens.or(request.max_tokens));
    if request.max_completion_tokens.is_some() {
        params.max_new_tokens_field = "max_completion_tokens";
    }
    params.logprobs = request.logprobs.unwrap_or(false);
    params.top_n_tokens = request.top_logprobs.unwrap_or(0);
    params.top_n_tokens_field = "top_logprobs";
    params.top_n_tokens_needs_logprobs = true;
    let validated = state.validation.validate_prompts(&[prompt], "messages", &params)?;
    let choices = Choices::submit(&state, validated).await?;
    let shape = ChatShape {
        id: ResponseId::new(&state, "chatcmpl"),
        tokenizer: state.validation.tokenizer.clone(),
        logprobs: params.logprobs.then_some(params.top_n_tokens),
        include_usage: request.sampling.stream_options.is_some_and(|o| o.include_usage),
    };
    if request.sampling.stream.unwrap_or(false) {
        return Ok(choices.sse(shape, record.take()));
    }
    let (results, usage) = choices.collect(record).await?;
    Ok(Json(shape.completion(results, usage)).into_response())
}

/// A message's content as one string: text parts joined by newlines.
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

/// Shapes one chat request's answer, buffered or streamed.
struct ChatShape {
    id: ResponseId,
    tokenizer: Tokenizer,
    /// `Some(top_logprobs)` when `logprobs: true`.
    logprobs: Option<u32>,
    include_usage: bool,
}

impl ChatShape {
    fn completion(&self, results: Vec<Collected>, usage: TokenUsage) -> ChatCompletion {
        let choices = results
            .into_iter()
            .enumerate()
            .map(|(i, r)| ChatChoice {
                index: i as u32,
                logprobs: self.logprobs.map(|top| ChatLogprobs {
                    content: r.tokens.iter().map(|(t, _)| chat_logprobs(&self.tokenizer, t, top)).collect(),
                }),
                finish_reason: r.finish.unwrap_or(Finish::Length).openai().to_string(),
                message: AssistantMessage { role: "assistant".into(), content: r.text },
            })
            .collect();
        ChatCompletion {
            id: self.id.id.clone(),
            object: "chat.completion".into(),
            created: self.id.created,
            model: self.id.model.clone(),
            system_fingerprint: fingerprint(),
            choices,
            usage: usage.into(),
        }
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> Event {
        json_event(&ChatCompletionChunk {
            id: self.id.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.id.created,
            model: self.id.model.clone(),
            system_fingerprint: fingerprint(),
            choices,
            usage,
        })
    }

    fn delta(&self, index: usize, content: String, logprobs: Option<ChatLogprobs>, finish: Option<Finish>) -> Event {
        let choice = ChatChunkChoice {
            index: index as u32,
            delta: ChatDelta { role: "assistant".into(), content, tool_calls: None },
            logprobs,
            finish_reason: finish.map(|f| f.openai().to_string()),
        };
        self.chunk(vec![choice], None)
    }
}

impl StreamShape for ChatShape {
    fn event(&mut self, index: usize, event: GenEvent) -> Option<Event> {
        match event {
            GenEvent::Prefill { .. } => None,
            GenEvent::Token { token, visible, .. } => {
                let logprobs = self
                    .logprobs
                    .map(|top| ChatLogprobs { content: vec![chat_logprobs(&self.tokenizer, &token, top)] });
                (!visible.is_empty() || logprobs.is_some()).then(|| self.delta(index, visible, logprobs, None))
            }
            GenEvent::End { finish, trailing, .. } => Some(self.delta(index, trailing, None, Some(finish))),
        }
    }

    fn finish(&mut self, usage: TokenUsage) -> Vec<Event> {
        let mut events = Vec::with_capacity(2);
        if self.include_usage {
            events.push(self.chunk(vec![], Some(usage.into())));
        }
        events.push(done_event());
        events
    }

    fn fail(&mut self, error: &ApiError) -> Vec<Event> {
        vec![json_event(&error.openai_body()), done_event()]
    }
}

fn chat_logprobs(tokenizer: &Tokenizer, token: &GeneratedToken, top: u32) -> ChatLogprobContent {
    let entry = |id: u32, logprob: f32| {
        let text = tokenizer.token_text(id);
        ChatLogprob { bytes: text.as_bytes().to_vec(), token: text, logprob }
    };
    let chosen = entry(token.token_id, token.logprob);
    ChatLogprobContent {
        token: chosen.token,
        logprob: chosen.logprob,
        bytes: chosen.bytes,
        top_logprobs: token.top_tokens.iter().take(top as usize).map(|t| entry(t.token_id, t.logprob)).collect(),
    }
}

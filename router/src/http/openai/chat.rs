//! `POST /v1/chat/completions`: messages -> the chat template's prompt ->
//! the generation driver -> a `chat.completion` or a stream of
//! `chat.completion.chunk`s.
//!
//! With `tools` (and a `tool_choice` other than `none`) the tools go into the
//! prompt, the output follows the tool-call grammar, and a
//! [`ToolCallParser`] per choice turns the text back into `tool_calls`: whole
//! in a completion, as OpenAI streams them in chunks (a call's id, type and
//! name first, then its argument fragments). `finish_reason` is then
//! `tool_calls` when the model called something and stopped by itself.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::structured::{openai_constraint, tool_request};
use super::types::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChatDelta, ChatLogprob, ChatLogprobContent, ChatLogprobs, ChatMessage, FunctionCall, FunctionCallDelta,
    MessageContent, ToolCallDelta, ToolCallMessage, Usage,
};
use super::{fingerprint, parameters, ResponseId};
use crate::chat_template::TemplateMessage;
use crate::http::error::{parse_json, ApiError, OpenAiError};
use crate::http::generation::{
    drive, run_collected, Collected, Finish, GenEvent, Prepared, RequestRecord, StreamShape, TokenUsage,
};
use crate::http::sse::{done_event, json_event};
use crate::http::state::AppState;
use crate::infer::{GeneratedToken, RequestClass};
use crate::tokenizer::Tokenizer;
use crate::tool_calls::stream::{ToolCallParser, ToolEvent};
use crate::validation::{one_constraint, Prompt, ValidTools, ValidationError};

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
    let result = drive(state, body, &mut record, prepare, |mut shape, results, usage| {
        Json(shape.completion(results, usage)).into_response()
    })
    .await;
    Ok(record.settle(result)?)
}

/// One Batch API line for this endpoint: what `chat_completions` would
/// answer, in the scheduler's batch class.
pub(crate) async fn batch_line(state: &Arc<AppState>, body: Bytes) -> Result<(ChatCompletion, TokenUsage, Duration), ApiError> {
    run_collected(state, body, RequestClass::Batch, prepare, |mut shape, results, usage| shape.completion(results, usage)).await
}

/// The request's work, off the async runtime: parse, render the template,
/// tokenize, compile its constraint.
fn prepare(state: &AppState, body: &[u8]) -> Result<Prepared<ChatShape>, ApiError> {
    let request: ChatCompletionRequest = parse_json(body)?;
    state.validation.check_model(request.model.as_deref())?;
    let tools = tool_request(request.tools.as_deref(), request.tool_choice.as_ref(), request.parallel_tool_calls)?;
    let tools = state.validation.tools(&tools)?;
    let messages = request
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| template_message(m, i))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let shown = tools.as_ref().and_then(ValidTools::shown);
    let prompt = Prompt::Chat(state.validation.render_chat_with_tools(&messages, shown)?);
    let mut params = parameters(state, &request.sampling, request.max_completion_tokens.or(request.max_tokens));
    params.constraint = one_constraint(
        openai_constraint(request.response_format.as_ref(), &request.guided)?,
        tools.as_ref().and_then(|t| t.constraint.clone()),
    )?;
    if request.max_completion_tokens.is_some() {
        params.max_new_tokens_field = "max_completion_tokens";
    }
    params.logprobs = request.logprobs.unwrap_or(false);
    params.top_n_tokens = request.top_logprobs.unwrap_or(0);
    params.top_n_tokens_field = "top_logprobs";
    params.top_n_tokens_needs_logprobs = true;
    let validated = state.validation.validate_prompts(&[prompt], "messages", &params)?;
    let tool_format = shown.map(|_| state.validation.tool_format.clone());
    let shape = ChatShape {
        id: ResponseId::new(state, "chatcmpl"),
        tokenizer: state.validation.tokenizer.clone(),
        logprobs: params.logprobs.then_some(params.top_n_tokens),
        include_usage: request.sampling.stream_options.is_some_and(|o| o.include_usage),
        parsers: tool_format.map(|f| (0..params.n).map(|_| ToolCallParser::new(f.clone())).collect()),
    };
    Ok(Prepared { prompts: validated, shape, stream: request.sampling.stream.unwrap_or(false) })
}

/// A message as the chat template sees it: content flattened, earlier tool
/// calls with their arguments as JSON values (as transformers passes them).
fn template_message(m: &ChatMessage, index: usize) -> Result<TemplateMessage, ApiError> {
    let tool_calls = m
        .tool_calls
        .as_ref()
        .map(|calls| {
            calls
                .iter()
                .enumerate()
                .map(|(j, c)| {
                    let arguments: serde_json::Value = serde_json::from_str(&c.function.arguments).map_err(|e| {
                        ValidationError::Unsupported {
                            field: format!("messages[{index}].tool_calls[{j}].function.arguments"),
                            message: format!("not a JSON object: {e}"),
                        }
                    })?;
                    Ok(serde_json::json!({
                        "id": c.id, "type": "function",
                        "function": {"name": c.function.name, "arguments": arguments},
                    }))
                })
                .collect::<Result<Vec<_>, ApiError>>()
        })
        .transpose()?;
    Ok(TemplateMessage {
        role: m.role.clone(),
        content: flatten_content(&m.content, index)?,
        tool_calls,
        tool_call_id: m.tool_call_id.clone(),
        name: m.name.clone(),
    })
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
    /// With tools: each choice's tool-call parser.
    parsers: Option<Vec<ToolCallParser>>,
}

/// One choice's answer with its tool calls read out.
struct Answer {
    content: String,
    calls: Vec<ToolCallMessage>,
}

/// OpenAI's `finish_reason`: `tool_calls` when the model called something
/// and ended by itself.
fn finish_reason(finish: Finish, called: bool) -> String {
    match finish {
        Finish::Eos | Finish::StopSequence if called => "tool_calls".into(),
        other => other.openai().to_string(),
    }
}

/// Tool-call events as chunk deltas: content, and call pieces.
fn deltas(events: Vec<ToolEvent>) -> (String, Vec<ToolCallDelta>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    for event in events {
        match event {
            ToolEvent::Content(text) => content.push_str(&text),
            ToolEvent::Start { index, id, name } => calls.push(ToolCallDelta {
                index: index as u32,
                id: Some(id),
                kind: Some("function".into()),
                function: FunctionCallDelta { name: Some(name), arguments: String::new() },
            }),
            ToolEvent::Arguments { index, fragment } => calls.push(ToolCallDelta {
                index: index as u32,
                id: None,
                kind: None,
                function: FunctionCallDelta { name: None, arguments: fragment },
            }),
        }
    }
    (content, calls)
}

impl ChatShape {
    fn completion(&mut self, results: Vec<Collected>, usage: TokenUsage) -> ChatCompletion {
        let choices = results
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let answer = self.answer(i, &r);
                let called = !answer.calls.is_empty();
                ChatChoice {
                    index: i as u32,
                    logprobs: self.logprobs.map(|top| ChatLogprobs {
                        content: r.tokens.iter().map(|(t, _)| chat_logprobs(&self.tokenizer, t, top)).collect(),
                    }),
                    finish_reason: finish_reason(r.finish.unwrap_or(Finish::Length), called),
                    message: AssistantMessage {
                        role: "assistant".into(),
                        content: (!called || !answer.content.is_empty()).then_some(answer.content),
                        tool_calls: called.then_some(answer.calls),
                    },
                }
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

    /// Choice `index`'s text, with its tool calls read out when there are
    /// tools. The parser reads the visible text (stop sequences cut) token
    /// by token, so special-token openers are seen.
    fn answer(&mut self, index: usize, r: &Collected) -> Answer {
        let Some(parser) = self.parsers.as_mut().map(|p| &mut p[index]) else {
            return Answer { content: r.text.clone(), calls: Vec::new() };
        };
        let mut events = Vec::new();
        // The visible text is a prefix of the tokens' texts (a stop sequence
        // cuts it), then whatever the detokenizer released at the end.
        let mut visible = r.text.as_str();
        for (token, text) in &r.tokens {
            let take = text.len().min(visible.len());
            events.extend(parser.push(token.token_id, &visible[..take]));
            visible = &visible[take..];
        }
        events.extend(parser.push(u32::MAX, visible));
        events.extend(parser.finish());
        let (content, _) = deltas(events);
        let calls = parser
            .calls()
            .iter()
            .map(|c| ToolCallMessage {
                id: c.id.clone(),
                kind: "function".into(),
                function: FunctionCall { name: c.name.clone(), arguments: c.arguments.clone() },
            })
            .collect();
        Answer { content, calls }
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

    fn delta(
        &self,
        index: usize,
        content: String,
        tool_calls: Vec<ToolCallDelta>,
        logprobs: Option<ChatLogprobs>,
        finish: Option<String>,
    ) -> Event {
        let tool_calls = (!tool_calls.is_empty()).then_some(tool_calls);
        let choice = ChatChunkChoice {
            index: index as u32,
            delta: ChatDelta { role: "assistant".into(), content, tool_calls },
            logprobs,
            finish_reason: finish,
        };
        self.chunk(vec![choice], None)
    }

    /// Streamed text of choice `index` through its tool-call parser (when
    /// there are tools): content and call pieces.
    fn read(&mut self, index: usize, token_id: u32, text: &str, end: bool) -> (String, Vec<ToolCallDelta>, bool) {
        let Some(parser) = self.parsers.as_mut().map(|p| &mut p[index]) else {
            return (text.to_string(), Vec::new(), false);
        };
        let mut events = parser.push(token_id, text);
        if end {
            events.extend(parser.finish());
        }
        let called = !parser.calls().is_empty();
        let (content, calls) = deltas(events);
        (content, calls, called)
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
                let (content, calls, _) = self.read(index, token.token_id, &visible, false);
                (!content.is_empty() || !calls.is_empty() || logprobs.is_some())
                    .then(|| self.delta(index, content, calls, logprobs, None))
            }
            GenEvent::End { finish, trailing, .. } => {
                let (content, calls, called) = self.read(index, u32::MAX, &trailing, true);
                Some(self.delta(index, content, calls, None, Some(finish_reason(finish, called))))
            }
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

//! `POST /v1/chat/completions`: messages -> the chat template's prompt ->
//! the generation driver -> a `chat.completion` or a stream of
//! `chat.completion.chunk`s.
//!
//! Each choice's text is read by an [`AnswerParser`] (`http::answer`): a
//! reasoning model's thinking goes to `reasoning_content` (streamed as
//! `delta.reasoning_content`; `include_reasoning: false` drops it), and with
//! `tools` (and a `tool_choice` other than `none`) the tools go into the
//! prompt, the output follows the tool-call grammar, and the calls are read
//! back into `tool_calls`: whole in a completion, as OpenAI streams them in
//! chunks (a call's id, type and name first, then its argument fragments).
//! `finish_reason` is then `tool_calls` when the model called something and
//! stopped by itself. `chat_template_kwargs` (e.g. `{"enable_thinking":
//! false}`) are variables for the chat template.

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
    ChatDelta, ChatLogprob, ChatLogprobContent, ChatLogprobs, ChatMessage, CompletionTokensDetails, FunctionCall,
    FunctionCallDelta, MessageContent, ToolCallDelta, ToolCallMessage, Usage,
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
use crate::http::answer::{Answer, AnswerFormat, AnswerParser, Piece};
use crate::tokenizer::Tokenizer;
use crate::validation::{ChatInput, ValidTools, ValidationError};

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
    let adapter = state.validation.check_model(request.model.as_deref())?;
    let tools = tool_request(request.tools.as_deref(), request.tool_choice.as_ref(), request.parallel_tool_calls)?;
    let tools = state.validation.tools(&tools)?;
    let messages = request
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| template_message(m, i))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let mut params = parameters(state, &request.sampling, request.max_completion_tokens.or(request.max_tokens));
    params.adapter = adapter.clone();
    if request.max_completion_tokens.is_some() {
        params.max_new_tokens_field = "max_completion_tokens";
    }
    params.logprobs = request.logprobs.unwrap_or(false);
    params.top_n_tokens = request.top_logprobs.unwrap_or(0);
    params.top_n_tokens_field = "top_logprobs";
    params.top_n_tokens_needs_logprobs = true;
    let kwargs = request.chat_template_kwargs.clone().unwrap_or_default();
    let input = ChatInput {
        messages: &messages,
        tools: tools.as_ref(),
        kwargs: &kwargs,
        format: openai_constraint(request.response_format.as_ref(), &request.guided)?,
    };
    let chat = state.validation.validate_chat(input, params)?;
    let n = chat.prompt.n;
    let answers = AnswerFormat {
        reasoning: chat.reasoning,
        show_reasoning: request.include_reasoning.unwrap_or(true),
        tools: tools.as_ref().and_then(ValidTools::shown).map(|_| state.validation.tool_format.clone()),
    };
    let shape = ChatShape {
        id: ResponseId::new(state, "chatcmpl", adapter.as_deref()),
        tokenizer: state.validation.tokenizer.clone(),
        logprobs: request.logprobs.unwrap_or(false).then_some(request.top_logprobs.unwrap_or(0)),
        include_usage: request.sampling.stream_options.is_some_and(|o| o.include_usage),
        parsers: (0..n).map(|_| answers.parser()).collect(),
        answers,
    };
    Ok(Prepared { prompts: vec![chat.prompt], shape, stream: request.sampling.stream.unwrap_or(false) })
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
        reasoning_content: m.reasoning_content.clone(),
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
    /// How every choice is read (reasoning, tool calls).
    answers: AnswerFormat,
    /// Each choice's parser, as it streams.
    parsers: Vec<AnswerParser>,
}

/// OpenAI's `finish_reason`: `tool_calls` when the model called something
/// and ended by itself.
fn finish_reason(finish: Finish, called: bool) -> String {
    match finish {
        Finish::Eos | Finish::StopSequence if called => "tool_calls".into(),
        other => other.openai().to_string(),
    }
}

/// Pieces as one chunk delta's fields: reasoning, content, call pieces.
fn deltas(pieces: Vec<Piece>) -> (String, String, Vec<ToolCallDelta>) {
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    for piece in pieces {
        match piece {
            Piece::Reasoning(text) => reasoning.push_str(&text),
            Piece::Content(text) => content.push_str(&text),
            Piece::CallStart { index, id, name } => calls.push(ToolCallDelta {
                index: index as u32,
                id: Some(id),
                kind: Some("function".into()),
                function: FunctionCallDelta { name: Some(name), arguments: String::new() },
            }),
            Piece::CallArguments { index, fragment } => calls.push(ToolCallDelta {
                index: index as u32,
                id: None,
                kind: None,
                function: FunctionCallDelta { name: None, arguments: fragment },
            }),
        }
    }
    (reasoning, content, calls)
}

impl ChatShape {
    fn completion(&mut self, results: Vec<Collected>, mut usage: TokenUsage) -> ChatCompletion {
        let answers: Vec<Answer> = results.iter().map(|r| self.answers.parser().read(r)).collect();
        usage.reasoning_tokens = answers.iter().map(|a| a.reasoning_tokens).sum();
        let choices = results
            .into_iter()
            .zip(answers)
            .enumerate()
            .map(|(i, (r, answer))| {
                let called = !answer.calls.is_empty();
                let calls = answer
                    .calls
                    .into_iter()
                    .map(|c| ToolCallMessage {
                        id: c.id,
                        kind: "function".into(),
                        function: FunctionCall { name: c.name, arguments: c.arguments },
                    })
                    .collect();
                ChatChoice {
                    index: i as u32,
                    logprobs: self.logprobs.map(|top| ChatLogprobs {
                        content: r.tokens.iter().map(|(t, _)| chat_logprobs(&self.tokenizer, t, top)).collect(),
                    }),
                    finish_reason: finish_reason(r.finish.unwrap_or(Finish::Length), called),
                    message: AssistantMessage {
                        role: "assistant".into(),
                        content: (!called || !answer.content.is_empty()).then_some(answer.content),
                        reasoning_content: answer.reasoning,
                        tool_calls: called.then_some(calls),
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
            usage: self.usage(usage),
        }
    }

    /// OpenAI's usage, with reasoning tokens when the model may think.
    fn usage(&self, usage: TokenUsage) -> Usage {
        let mut out = Usage::from(usage);
        if self.answers.reasoning.is_some() {
            out.completion_tokens_details = Some(CompletionTokensDetails { reasoning_tokens: usage.reasoning_tokens });
        }
        out
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

    fn delta(&self, index: usize, pieces: Vec<Piece>, logprobs: Option<ChatLogprobs>, finish: Option<String>) -> Event {
        let (reasoning, content, tool_calls) = deltas(pieces);
        let choice = ChatChunkChoice {
            index: index as u32,
            delta: ChatDelta {
                role: "assistant".into(),
                content,
                reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
                tool_calls: (!tool_calls.is_empty()).then_some(tool_calls),
            },
            logprobs,
            finish_reason: finish,
        };
        self.chunk(vec![choice], None)
    }
}

impl StreamShape for ChatShape {
    fn event(&mut self, index: usize, event: GenEvent) -> Vec<Event> {
        match event {
            GenEvent::Prefill { .. } => vec![],
            GenEvent::Token { token, visible, .. } => {
                let logprobs = self
                    .logprobs
                    .map(|top| ChatLogprobs { content: vec![chat_logprobs(&self.tokenizer, &token, top)] });
                let pieces = self.parsers[index].push(token.token_id, &visible);
                (!pieces.is_empty() || logprobs.is_some()).then(|| self.delta(index, pieces, logprobs, None)).into_iter().collect()
            }
            GenEvent::End { finish, trailing, .. } => {
                let pieces = self.parsers[index].end(&trailing);
                let called = !self.parsers[index].calls().is_empty();
                vec![self.delta(index, pieces, None, Some(finish_reason(finish, called)))]
            }
        }
    }

    fn finish(&mut self, mut usage: TokenUsage) -> Vec<Event> {
        let mut events = Vec::with_capacity(2);
        if self.include_usage {
            usage.reasoning_tokens = self.parsers.iter().map(AnswerParser::reasoning_tokens).sum();
            events.push(self.chunk(vec![], Some(self.usage(usage))));
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

//! OpenAI's Responses API: `POST /v1/responses` (buffered, streamed as typed
//! events, or in the background), `GET` / `DELETE /v1/responses/{id}` and
//! `POST /v1/responses/{id}/cancel`.
//!
//! A request's input (a string, or message / `function_call` /
//! `function_call_output` / `reasoning` items), after the stored
//! conversation of `previous_response_id`, becomes chat messages; from there
//! it is a chat request: `Validation::validate_chat`, the generation driver,
//! and an [`AnswerParser`] reading each token into reasoning, text and calls.
//! [`items::OutputBuilder`] turns those pieces into output items and, when
//! streaming, the events the `openai` client parses:
//!
//! ```text
//!  response.created, response.in_progress
//!  per item: response.output_item.added
//!            reasoning: content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
//!            message:   content_part.added, output_text.delta*, output_text.done, content_part.done
//!            call:      function_call_arguments.delta*, function_call_arguments.done
//!            response.output_item.done
//!  response.completed (or response.incomplete at max_output_tokens)
//! ```
//!
//! `store` (default true) keeps the response (`store::ResponseStore`) for
//! `previous_response_id`, GET, DELETE and cancel.

pub mod items;
pub mod store;
pub mod types;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use super::answer::{AnswerFormat, AnswerParser};
use super::error::{body_bytes, parse_json, parse_part, ApiError, OpenAiError};
use super::generation::{Choices, Collected, Finish, GenEvent, RequestRecord, StreamShape, TokenUsage};
use super::openai::types::SamplingFields;
use super::openai::{parameters, unix_now};
use super::state::AppState;
use crate::chat_template::{TemplateKwargs, TemplateMessage};
use crate::grammar::Constraint;
use crate::tool_calls::{FunctionDefinition, ToolChoice};
use crate::validation::{ChatInput, ToolRequest, ValidTools, Validated, ValidationError};
use items::OutputBuilder;
use store::{Stored, StoreError, Turns};
use types::{
    ContentPart, CreateResponse, DeletedResponse, IncompleteDetails, InputFunctionCall, InputFunctionOutput,
    InputMessage, InputReasoning, MessageContent, ResponseObject, ResponseUsage, TextOptions,
};

fn unsupported(field: impl Into<String>, message: impl Into<String>) -> ApiError {
    ValidationError::Unsupported { field: field.into(), message: message.into() }.into()
}

fn not_found(error: StoreError, param: Option<&str>) -> ApiError {
    match error {
        StoreError::NotFound(_) => ApiError::NotFound { message: error.to_string(), param: param.map(str::to_string) },
        StoreError::NotCancellable(_) => unsupported("id", error.to_string()),
    }
}

#[utoipa::path(post, path = "/v1/responses", operation_id = "create_response", request_body = CreateResponse,
    responses(
        (status = 200, description = "a response object, or an SSE stream of typed events with `stream: true`", body = ResponseObject),
        (status = 400, body = crate::http::error::OpenAiErrorBody),
        (status = 404, body = crate::http::error::OpenAiErrorBody),
        (status = 429, body = crate::http::error::OpenAiErrorBody),
    ))]
pub async fn create(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    let mut record = RequestRecord::new("responses");
    let result = create_response(state, body, &mut record).await;
    Ok(record.settle(result)?)
}

async fn create_response(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    record: &mut RequestRecord,
) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let (prompt, shape) = state.off_runtime(move |state| prepare(state, &body)).await?;
    let choices = Choices::submit(&state, vec![prompt]).await?;
    if shape.response.background {
        return Ok(run_in_background(&state, choices, shape, record.take()));
    }
    if shape.stream {
        return Ok(choices.sse(shape, record.take()));
    }
    let (results, usage) = choices.collect(record).await?;
    Ok(Json(shape.finish_buffered(results, usage)).into_response())
}

/// Answers `queued` at once; the task runs the generation and stores the
/// result. Cancel aborts the task, which drops the generation. The task
/// starts only once the store holds it, so its result always finds its entry.
fn run_in_background(state: &Arc<AppState>, choices: Choices, shape: ResponsesShape, mut record: RequestRecord) -> Response {
    let mut queued = shape.response.clone();
    queued.status = "queued".into();
    let stored = Stored { response: queued.clone(), turns: shape.turns.clone() };
    let (start, started) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        if started.await.is_err() {
            return;
        }
        let id = shape.response.id.clone();
        match choices.collect(&mut record).await {
            Ok((results, usage)) => {
                shape.finish_buffered(results, usage);
            }
            Err(error) => {
                tracing::warn!(%id, %error, "background response failed");
                let mut failed = shape.response.clone();
                failed.status = "failed".into();
                failed.error = Some(serde_json::json!({"code": "server_error", "message": error.to_string()}));
                shape.store.update(Stored { response: failed, turns: shape.turns.clone() });
            }
        }
    });
    state.responses.insert(stored, Some(task.abort_handle()));
    let _ = start.send(());
    Json(queued).into_response()
}

/// Parses, resolves the conversation, validates: the prompt and its shape.
fn prepare(state: &AppState, body: &[u8]) -> Result<(Validated, ResponsesShape), ApiError> {
    let request: CreateResponse = parse_json(body)?;
    check_unsupported(&request)?;
    let adapter = state.validation.check_model(request.model.as_deref())?;
    let before = match &request.previous_response_id {
        Some(id) => Some(state.responses.get(id).map_err(|e| not_found(e, Some("previous_response_id")))?.turns),
        None => None,
    };
    let turn = input_messages(&request.input)?;
    let mut messages = before.as_ref().map(|t| t.messages()).unwrap_or_default();
    messages.extend(turn.iter().cloned());
    if let Some(instructions) = &request.instructions {
        messages.insert(0, TemplateMessage::text("system", instructions.clone()));
    }
    let tools = state.validation.tools(&tool_request(&request)?).map_err(responses_field)?;
    let mut kwargs = TemplateKwargs::new();
    if let Some(effort) = request.reasoning.as_ref().and_then(|r| r.effort.clone()) {
        // OpenAI's "none": no reasoning; Qwen3's templates spell it enable_thinking.
        if effort == "none" {
            kwargs.insert("enable_thinking".into(), Value::Bool(false));
        }
        kwargs.insert("reasoning_effort".into(), Value::String(effort));
    }
    let sampling = SamplingFields {
        temperature: request.temperature,
        top_p: request.top_p,
        seed: request.seed,
        ..Default::default()
    };
    let mut params = parameters(state, &sampling, request.max_output_tokens);
    params.max_new_tokens_field = "max_output_tokens";
    params.adapter = adapter.clone();
    let input = ChatInput { messages: &messages, tools: tools.as_ref(), kwargs: &kwargs, format: text_format(request.text.as_ref())? };
    let chat = state.validation.validate_chat(input, params)?;
    let answers = AnswerFormat {
        reasoning: chat.reasoning,
        show_reasoning: true,
        tools: tools.as_ref().and_then(ValidTools::shown).map(|_| state.validation.tool_format.clone()),
    };
    let response = ResponseObject {
        id: format!("resp_{}", uuid::Uuid::new_v4().simple()),
        object: "response",
        created_at: unix_now(),
        status: "in_progress".into(),
        background: request.background.unwrap_or(false),
        instructions: request.instructions.clone(),
        max_output_tokens: request.max_output_tokens,
        // The adapter the request named, else the base model (as chat's `model`).
        model: adapter.unwrap_or_else(|| state.served_model_name().to_string()),
        parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
        previous_response_id: request.previous_response_id.clone(),
        reasoning: request.reasoning.clone().unwrap_or_default(),
        store: request.store.unwrap_or(true),
        temperature: request.temperature,
        text: request.text.clone().unwrap_or(TextOptions {
            format: Some(types::TextFormat { kind: "text".into(), name: None, schema: None, description: None, strict: None }),
        }),
        tool_choice: request.tool_choice.clone().unwrap_or_else(|| Value::String("auto".into())),
        tools: request.tools.clone().unwrap_or_default(),
        top_p: request.top_p,
        truncation: "disabled",
        user: request.user.clone(),
        metadata: request.metadata.clone().unwrap_or_default(),
        ..Default::default()
    };
    let shape = ResponsesShape {
        parser: answers.parser(),
        builder: OutputBuilder::new(response.id.clone()),
        turns: Arc::new(Turns { before, messages: turn }),
        store: state.responses.clone(),
        stream: request.stream.unwrap_or(false),
        response,
    };
    Ok((chat.prompt, shape))
}

/// Fields Sluice reads but whose other values it cannot honour.
fn check_unsupported(request: &CreateResponse) -> Result<(), ApiError> {
    if request.background == Some(true) && request.store == Some(false) {
        return Err(unsupported("background", "a background response must be stored (`store: false` was given)"));
    }
    if request.background == Some(true) && request.stream == Some(true) {
        return Err(unsupported("background", "streaming a background response is not supported"));
    }
    if let Some(t) = request.truncation.as_deref().filter(|t| *t != "disabled") {
        return Err(unsupported("truncation", format!("`{t}` is not supported; only `disabled`")));
    }
    if let Some(t) = request.service_tier.as_deref().filter(|t| !matches!(*t, "auto" | "default")) {
        return Err(unsupported("service_tier", format!("`{t}` is not supported; only `auto` or `default`")));
    }
    if request.reasoning.as_ref().is_some_and(|r| r.summary.is_some()) {
        return Err(unsupported("reasoning.summary", "reasoning summaries are not supported; the reasoning is returned as it was written"));
    }
    Ok(())
}

/// `tools[i].function.name` (how validation names chat tools) as the
/// Responses API spells it, `tools[i].name`.
fn responses_field(error: ValidationError) -> ValidationError {
    match error {
        ValidationError::Unsupported { field, message } => {
            ValidationError::Unsupported { field: field.replace(".function.", "."), message }
        }
        ValidationError::Grammar { field, message } => ValidationError::Grammar { field: field.replace(".function.", "."), message },
        other => other,
    }
}

fn tool_request(request: &CreateResponse) -> Result<ToolRequest, ApiError> {
    let tools = request.tools.as_deref().unwrap_or_default();
    let mut functions = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        if tool.kind != "function" {
            return Err(unsupported(format!("tools[{i}].type"), format!("`{}` tools are not supported; only `function`", tool.kind)));
        }
        functions.push(FunctionDefinition {
            name: tool.name.clone(),
            description: tool.description.clone(),
            parameters: tool.parameters.clone(),
            strict: tool.strict,
        });
    }
    let choice = match &request.tool_choice {
        None => None,
        Some(Value::String(mode)) => Some(match mode.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => return Err(unsupported("tool_choice", format!("`{other}` is not one of `none`, `auto`, `required`"))),
        }),
        Some(Value::Object(choice)) => match (choice.get("type").and_then(Value::as_str), choice.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) => Some(ToolChoice::Named(name.to_string())),
            _ => return Err(unsupported("tool_choice", "must be `none`, `auto`, `required` or {\"type\": \"function\", \"name\": ...}")),
        },
        Some(_) => return Err(unsupported("tool_choice", "must be a string or an object")),
    };
    Ok(ToolRequest { functions, choice, parallel: request.parallel_tool_calls })
}

/// `text.format` as a constraint on the answer.
fn text_format(text: Option<&TextOptions>) -> Result<Option<(String, Constraint)>, ApiError> {
    let Some(format) = text.and_then(|t| t.format.as_ref()) else { return Ok(None) };
    match format.kind.as_str() {
        "text" => Ok(None),
        "json_object" => Ok(Some(("text.format".into(), Constraint::JsonObject))),
        "json_schema" => match &format.schema {
            Some(schema) => Ok(Some(("text.format.schema".into(), Constraint::JsonSchema(schema.clone())))),
            None => Err(ValidationError::Empty { field: "text.format.schema".into() }.into()),
        },
        other => Err(unsupported("text.format.type", format!("`{other}` is not one of `text`, `json_object`, `json_schema`"))),
    }
}

/// `input` as chat messages: a string is one user message; a list's items
/// in order, calls joined to the assistant message before them and a
/// reasoning item's text given to the assistant message after it.
fn input_messages(input: &Value) -> Result<Vec<TemplateMessage>, ApiError> {
    let items = match input {
        Value::String(text) if text.is_empty() => return Err(ValidationError::Empty { field: "input".into() }.into()),
        Value::String(text) => return Ok(vec![TemplateMessage::text("user", text.clone())]),
        Value::Array(items) if items.is_empty() => return Err(ValidationError::Empty { field: "input".into() }.into()),
        Value::Array(items) => items,
        _ => return Err(unsupported("input", "must be a string or a list of items")),
    };
    let mut messages: Vec<TemplateMessage> = Vec::with_capacity(items.len());
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let field = format!("input[{i}]");
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let m: InputMessage = parse_part(item, &field)?;
                let mut message = TemplateMessage::text(role(&m.role, &field)?, message_text(&m.content, &field)?);
                if message.role == "assistant" {
                    message.reasoning_content = reasoning.take();
                }
                messages.push(message);
            }
            "function_call" => {
                let call: InputFunctionCall = parse_part(item, &field)?;
                let arguments: Value = serde_json::from_str(&call.arguments)
                    .map_err(|e| unsupported(format!("{field}.arguments"), format!("not JSON: {e}")))?;
                let call = serde_json::json!({
                    "id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                });
                match messages.last_mut() {
                    Some(last) if last.role == "assistant" => last.tool_calls.get_or_insert_with(Vec::new).push(call),
                    _ => messages.push(TemplateMessage {
                        tool_calls: Some(vec![call]),
                        reasoning_content: reasoning.take(),
                        ..TemplateMessage::text("assistant", "")
                    }),
                }
            }
            "function_call_output" => {
                let output: InputFunctionOutput = parse_part(item, &field)?;
                messages.push(TemplateMessage { tool_call_id: Some(output.call_id), ..TemplateMessage::text("tool", output.output) });
            }
            "reasoning" => {
                let r: InputReasoning = parse_part(item, &field)?;
                if r.encrypted_content.is_some() {
                    return Err(unsupported(format!("{field}.encrypted_content"), "Sluice neither writes nor reads encrypted reasoning"));
                }
                let text: Vec<String> = r.content.unwrap_or_default().into_iter().filter_map(|p| p.text).collect();
                reasoning = Some(text.join("\n"));
            }
            other => return Err(unsupported(format!("{field}.type"), format!("`{other}` items are not supported"))),
        }
    }
    Ok(messages)
}

fn role(role: &str, field: &str) -> Result<&'static str, ApiError> {
    Ok(match role {
        "user" => "user",
        "assistant" => "assistant",
        "system" | "developer" => "system",
        other => return Err(unsupported(format!("{field}.role"), format!("`{other}` is not one of `user`, `assistant`, `system`, `developer`"))),
    })
}

/// A message's text: its text parts joined by newlines.
fn message_text(content: &MessageContent, field: &str) -> Result<String, ApiError> {
    let parts = match content {
        MessageContent::Text(text) => return Ok(text.clone()),
        MessageContent::Parts(parts) => parts,
    };
    let mut texts = Vec::with_capacity(parts.len());
    for (j, ContentPart { kind, text, .. }) in parts.iter().enumerate() {
        match (kind.as_str(), text) {
            ("input_text" | "output_text", Some(text)) => texts.push(text.as_str()),
            _ => return Err(unsupported(format!("{field}.content[{j}]"), format!("only text parts are supported, got type `{kind}`"))),
        }
    }
    Ok(texts.join("\n"))
}

/// Shapes one response, buffered or streamed, and stores it when asked.
struct ResponsesShape {
    response: ResponseObject,
    parser: AnswerParser,
    builder: OutputBuilder,
    /// This response's turn: its input now, its output added at the end.
    turns: Arc<Turns>,
    store: Arc<store::ResponseStore>,
    stream: bool,
}

impl ResponsesShape {
    /// The finished response (status, output, usage), stored when `store`.
    fn finished(&mut self, finish: Finish, usage: TokenUsage) -> ResponseObject {
        let mut response = self.response.clone();
        response.output = self.builder.items();
        if finish == Finish::Length {
            response.status = "incomplete".into();
            response.incomplete_details = Some(IncompleteDetails { reason: "max_output_tokens".into() });
        } else {
            response.status = "completed".into();
        }
        response.usage = Some(ResponseUsage {
            input_tokens: usage.prompt_tokens,
            input_tokens_details: types::InputTokensDetails { cached_tokens: usage.cached_tokens },
            output_tokens: usage.completion_tokens,
            output_tokens_details: types::OutputTokensDetails { reasoning_tokens: self.parser.reasoning_tokens() },
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
        });
        if response.store {
            let turns = Arc::new(Turns {
                before: self.turns.before.clone(),
                messages: self.turns.messages.iter().cloned().chain(self.builder.message()).collect(),
            });
            let stored = Stored { response: response.clone(), turns };
            if response.background {
                self.store.update(stored);
            } else {
                self.store.insert(stored, None);
            }
        }
        response
    }

    fn finish_buffered(mut self, results: Vec<Collected>, usage: TokenUsage) -> ResponseObject {
        let result = &results[0];
        for piece in self.parser.read_all(result) {
            self.builder.push(piece);
        }
        self.builder.close();
        self.finished(result.finish.unwrap_or(Finish::Length), usage)
    }
}

impl StreamShape for ResponsesShape {
    fn start(&mut self) -> Vec<Event> {
        let created = self.builder.event("response.created", serde_json::json!({"response": self.response}));
        let progress = self.builder.event("response.in_progress", serde_json::json!({"response": self.response}));
        vec![created, progress]
    }

    fn event(&mut self, _index: usize, event: GenEvent) -> Vec<Event> {
        let pieces = match event {
            GenEvent::Prefill { .. } => return vec![],
            GenEvent::Token { token, visible, .. } => self.parser.push(token.token_id, &visible),
            GenEvent::End { finish, trailing, .. } => {
                self.builder.finish = Some(finish);
                self.parser.end(&trailing)
            }
        };
        pieces.into_iter().flat_map(|piece| self.builder.push(piece)).collect()
    }

    fn finish(&mut self, usage: TokenUsage) -> Vec<Event> {
        let mut events = self.builder.close();
        let finish = self.builder.finish.unwrap_or(Finish::Length);
        let response = self.finished(finish, usage);
        let kind = if finish == Finish::Length { "response.incomplete" } else { "response.completed" };
        events.push(self.builder.event(kind, serde_json::json!({"response": response})));
        events
    }

    fn fail(&mut self, error: &ApiError) -> Vec<Event> {
        let body = error.openai_body().error;
        let mut failed = self.response.clone();
        failed.status = "failed".into();
        failed.error = Some(serde_json::json!({"code": body.code.clone().unwrap_or_else(|| "server_error".into()), "message": body.message}));
        vec![
            self.builder.event("error", serde_json::json!({"code": body.code, "message": body.message, "param": body.param})),
            self.builder.event("response.failed", serde_json::json!({"response": failed})),
        ]
    }
}

#[utoipa::path(get, path = "/v1/responses/{id}", operation_id = "retrieve_response", params(("id" = String, Path, description = "the response's id")),
    responses((status = 200, body = ResponseObject), (status = 404, body = crate::http::error::OpenAiErrorBody)))]
pub async fn retrieve(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<ResponseObject>, OpenAiError> {
    Ok(Json(state.responses.get(&id).map_err(|e| not_found(e, None))?.response))
}

#[utoipa::path(delete, path = "/v1/responses/{id}", operation_id = "delete_response", params(("id" = String, Path, description = "the response's id")),
    responses((status = 200, body = DeletedResponse), (status = 404, body = crate::http::error::OpenAiErrorBody)))]
pub async fn delete(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<DeletedResponse>, OpenAiError> {
    state.responses.delete(&id).map_err(|e| not_found(e, None))?;
    Ok(Json(DeletedResponse { id, object: "response", deleted: true }))
}

/// Stops a background response; others are a 400.
#[utoipa::path(post, path = "/v1/responses/{id}/cancel", operation_id = "cancel_response", params(("id" = String, Path, description = "the response's id")),
    responses((status = 200, body = ResponseObject), (status = 400, body = crate::http::error::OpenAiErrorBody),
              (status = 404, body = crate::http::error::OpenAiErrorBody)))]
pub async fn cancel(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<ResponseObject>, OpenAiError> {
    Ok(Json(state.responses.cancel(&id).map_err(|e| not_found(e, None))?.response))
}

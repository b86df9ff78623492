//! Anthropic's Messages API: `POST /v1/messages` (buffered or streamed) and
//! `POST /v1/messages/count_tokens`, with Anthropic's error shape.
//!
//! `system` and `messages` become chat messages (`tool_use` blocks an
//! assistant's `tool_calls`, `tool_result` blocks `tool` messages, `thinking`
//! blocks the assistant's `reasoning_content`); from there it is a chat
//! request: `Validation::validate_chat`, the generation driver, and an
//! [`AnswerParser`] reading each token into thinking, text and tool calls,
//! which [`blocks::BlockBuilder`] turns into content blocks and, streaming,
//! into Anthropic's events:
//!
//! ```text
//!  message_start, ping
//!  per block: content_block_start, content_block_delta*, content_block_stop
//!             (thinking_delta, text_delta, input_json_delta)
//!  message_delta (stop_reason, stop_sequence, usage), message_stop
//! ```
//!
//! `thinking: {"type": "enabled" | "disabled"}` sets the template's
//! `enable_thinking`; `budget_tokens` is checked as Anthropic checks it
//! (at least 1024, below `max_tokens`) but not enforced: `max_tokens` bounds
//! the whole answer, thinking included.

pub mod blocks;
pub mod types;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::answer::{AnswerFormat, AnswerParser};
use super::error::{body_bytes, parse_json, parse_part, AnthropicError, ApiError};
use super::generation::{Choices, Collected, Finish, GenEvent, RequestRecord, StreamShape, TokenUsage};
use super::openai::parameters;
use super::openai::types::{SamplingFields, StopSpec};
use super::sse::named_event;
use super::state::AppState;
use crate::chat_template::{TemplateKwargs, TemplateMessage};
use crate::tool_calls::{FunctionDefinition, ToolChoice as Choice};
use crate::validation::{ChatInput, ToolRequest, ValidTools, Validated, ValidationError};
use blocks::BlockBuilder;
use types::{
    CountTokensRequest, CountTokensResponse, InputMessage, Message, MessagesRequest, TextBlock, Thinking, ThinkingBlock,
    Tool, ToolChoice, ToolResultBlock, ToolUseBlock, Usage,
};

fn unsupported(field: impl Into<String>, message: impl Into<String>) -> ApiError {
    ValidationError::Unsupported { field: field.into(), message: message.into() }.into()
}

#[utoipa::path(post, path = "/v1/messages", request_body = MessagesRequest,
    responses(
        (status = 200, description = "a message, or an SSE stream of events with `stream: true`", body = Message),
        (status = 400, body = crate::http::error::AnthropicErrorBody),
        (status = 404, body = crate::http::error::AnthropicErrorBody),
        (status = 429, body = crate::http::error::AnthropicErrorBody),
    ))]
pub async fn messages(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AnthropicError> {
    let mut record = RequestRecord::new("messages");
    let result = create_message(state, body, &mut record).await;
    Ok(record.settle(result)?)
}

async fn create_message(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    record: &mut RequestRecord,
) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let (prompt, shape, stream) = state.off_runtime(move |state| prepare(state, &body)).await?;
    let choices = Choices::submit(&state, vec![prompt]).await?;
    if stream {
        return Ok(choices.sse(shape, record.take()));
    }
    let (results, usage) = choices.collect(record).await?;
    Ok(Json(shape.finish_buffered(results, usage)).into_response())
}

#[utoipa::path(post, path = "/v1/messages/count_tokens", request_body = CountTokensRequest,
    responses((status = 200, body = CountTokensResponse), (status = 400, body = crate::http::error::AnthropicErrorBody)))]
pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<CountTokensResponse>, AnthropicError> {
    let body = body_bytes(body)?;
    Ok(Json(state.off_runtime(move |state| count(state, &body)).await?))
}

/// The prompt's tokens as `/v1/messages` would send them.
fn count(state: &AppState, body: &[u8]) -> Result<CountTokensResponse, ApiError> {
    let request: CountTokensRequest = parse_json(body)?;
    state.validation.check_model(Some(&request.model))?;
    let conversation = Conversation::read(&request.messages, request.system.as_ref())?;
    let tools = state.validation.tools(&tool_request(request.tools.as_deref(), request.tool_choice.as_ref())?)?;
    let kwargs = thinking_kwargs(state, request.thinking.as_ref(), None)?;
    let shown = tools.as_ref().and_then(ValidTools::shown);
    let rendered = state.validation.render_chat_with_tools(&conversation.messages, shown, &kwargs)?;
    let ids = state.validation.tokenize(&crate::validation::Prompt::Chat(rendered), "messages", true)?;
    Ok(CountTokensResponse { input_tokens: ids.len() as u32 })
}

fn prepare(state: &AppState, body: &[u8]) -> Result<(Validated, MessagesShape, bool), ApiError> {
    let request: MessagesRequest = parse_json(body)?;
    check_unsupported(&request)?;
    let adapter = state.validation.check_model(Some(&request.model))?;
    let conversation = Conversation::read(&request.messages, request.system.as_ref())?;
    let tools = state.validation.tools(&tool_request(request.tools.as_deref(), request.tool_choice.as_ref())?)?;
    let kwargs = thinking_kwargs(state, request.thinking.as_ref(), Some(request.max_tokens))?;
    let sampling = SamplingFields {
        temperature: request.temperature,
        top_p: request.top_p,
        top_k: request.top_k,
        stop: request.stop_sequences.clone().map(StopSpec::Many),
        ..Default::default()
    };
    let mut params = parameters(state, &sampling, Some(request.max_tokens));
    params.max_temperature = 1.0;
    params.adapter = adapter;
    let input = ChatInput { messages: &conversation.messages, tools: tools.as_ref(), kwargs: &kwargs, format: None };
    let chat = state.validation.validate_chat(input, params)?;
    let answers = AnswerFormat {
        reasoning: chat.reasoning,
        show_reasoning: true,
        tools: tools.as_ref().and_then(ValidTools::shown).map(|_| state.validation.tool_format.clone()),
    };
    let message = Message {
        id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
        kind: "message",
        role: "assistant",
        model: request.model.clone(),
        content: Vec::new(),
        stop_reason: None,
        stop_sequence: None,
        usage: Usage { input_tokens: chat.prompt.request.input_ids.len() as u32, ..Default::default() },
    };
    let shape = MessagesShape { message, parser: answers.parser(), builder: BlockBuilder::default(), end: None };
    Ok((chat.prompt, shape, request.stream.unwrap_or(false)))
}

fn check_unsupported(request: &MessagesRequest) -> Result<(), ApiError> {
    if let Some(tier) = request.service_tier.as_deref().filter(|t| !matches!(*t, "auto" | "standard_only")) {
        return Err(unsupported("service_tier", format!("`{tier}` is not supported; only `auto` or `standard_only`")));
    }
    Ok(())
}

/// `thinking` as the chat template's `enable_thinking`.
fn thinking_kwargs(state: &AppState, thinking: Option<&Thinking>, max_tokens: Option<u64>) -> Result<TemplateKwargs, ApiError> {
    let mut kwargs = TemplateKwargs::new();
    let Some(thinking) = thinking else { return Ok(kwargs) };
    let enabled = match thinking.kind.as_str() {
        "enabled" => true,
        "disabled" => false,
        other => return Err(unsupported("thinking.type", format!("`{other}` is not one of `enabled`, `disabled`"))),
    };
    if enabled {
        if state.validation.reasoning.is_none() {
            return Err(unsupported("thinking", "this model does not think (the server has no --reasoning-parser)"));
        }
        let budget = thinking.budget_tokens.ok_or_else(|| ValidationError::Empty { field: "thinking.budget_tokens".into() })?;
        if budget < 1024 || max_tokens.is_some_and(|max| budget >= max) {
            return Err(ValidationError::OutOfRange {
                field: "thinking.budget_tokens".into(),
                message: "must be at least 1024 and less than `max_tokens`".into(),
            }
            .into());
        }
    }
    kwargs.insert("enable_thinking".into(), Value::Bool(enabled));
    Ok(kwargs)
}

fn tool_request(tools: Option<&[Tool]>, choice: Option<&ToolChoice>) -> Result<ToolRequest, ApiError> {
    let tools = tools.unwrap_or_default();
    let mut functions = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        if let Some(kind) = tool.kind.as_deref().filter(|k| *k != "custom") {
            return Err(unsupported(format!("tools[{i}].type"), format!("`{kind}` tools are not supported; only custom tools")));
        }
        functions.push(FunctionDefinition {
            name: tool.name.clone(),
            description: tool.description.clone(),
            parameters: Some(tool.input_schema.clone()),
            strict: None,
        });
    }
    let parallel = choice.and_then(|c| c.disable_parallel_tool_use).map(|disable| !disable);
    let choice = match choice {
        None => None,
        Some(c) => Some(match (c.kind.as_str(), &c.name) {
            ("auto", _) => Choice::Auto,
            ("any", _) => Choice::Required,
            ("none", _) => Choice::None,
            ("tool", Some(name)) => Choice::Named(name.clone()),
            ("tool", None) => return Err(ValidationError::Empty { field: "tool_choice.name".into() }.into()),
            (other, _) => return Err(unsupported("tool_choice.type", format!("`{other}` is not one of `auto`, `any`, `tool`, `none`"))),
        }),
    };
    Ok(ToolRequest { functions, choice, parallel })
}

/// `system` and `messages` as chat messages.
struct Conversation {
    messages: Vec<TemplateMessage>,
}

impl Conversation {
    fn read(messages: &[Value], system: Option<&Value>) -> Result<Self, ApiError> {
        let mut out = Vec::with_capacity(messages.len() + 1);
        if let Some(system) = system {
            out.push(TemplateMessage::text("system", text_of(system, "system")?));
        }
        if messages.is_empty() {
            return Err(ValidationError::Empty { field: "messages".into() }.into());
        }
        for (i, message) in messages.iter().enumerate() {
            let field = format!("messages[{i}]");
            let message: InputMessage = parse_part(message, &field)?;
            match message.role.as_str() {
                "user" => user_turn(&message.content, &field, &mut out)?,
                "assistant" => out.push(assistant_turn(&message.content, &field)?),
                other => return Err(unsupported(format!("{field}.role"), format!("`{other}` is not one of `user`, `assistant`"))),
            }
        }
        Ok(Self { messages: out })
    }
}

/// A string, or text blocks joined by newlines.
fn text_of(content: &Value, field: &str) -> Result<String, ApiError> {
    match content {
        Value::String(text) => Ok(text.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (j, block) in blocks.iter().enumerate() {
                let block: TextBlock = parse_part(block, &format!("{field}[{j}]"))?;
                if block.kind != "text" {
                    return Err(unsupported(format!("{field}[{j}].type"), format!("`{}` blocks are not supported here; only `text`", block.kind)));
                }
                texts.push(block.text);
            }
            Ok(texts.join("\n"))
        }
        _ => Err(unsupported(field, "must be a string or a list of text blocks")),
    }
}

/// The blocks of a message's `content` (a string is one text block).
fn blocks_of(content: &Value, field: &str) -> Result<Vec<(String, Value)>, ApiError> {
    match content {
        Value::String(text) => Ok(vec![("text".into(), json!({"type": "text", "text": text}))]),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(j, block)| match block.get("type").and_then(Value::as_str) {
                Some(kind) => Ok((kind.to_string(), block.clone())),
                None => Err(ValidationError::Empty { field: format!("{field}.content[{j}].type") }.into()),
            })
            .collect(),
        _ => Err(unsupported(format!("{field}.content"), "must be a string or a list of blocks")),
    }
}

/// A user turn: its tool results become `tool` messages (in order), its
/// text a user message.
fn user_turn(content: &Value, field: &str, out: &mut Vec<TemplateMessage>) -> Result<(), ApiError> {
    let mut texts = Vec::new();
    for (j, (kind, block)) in blocks_of(content, field)?.into_iter().enumerate() {
        let at = format!("{field}.content[{j}]");
        match kind.as_str() {
            "text" => texts.push(parse_part::<TextBlock>(&block, &at)?.text),
            "tool_result" => {
                let result: ToolResultBlock = parse_part(&block, &at)?;
                let text = match &result.content {
                    None => String::new(),
                    Some(content) => text_of(content, &format!("{at}.content"))?,
                };
                let text = if result.is_error == Some(true) { format!("Error: {text}") } else { text };
                out.push(TemplateMessage { tool_call_id: Some(result.tool_use_id), ..TemplateMessage::text("tool", text) });
            }
            other => return Err(unsupported(format!("{at}.type"), format!("`{other}` blocks are not supported in user turns; only `text` and `tool_result`"))),
        }
    }
    if !texts.is_empty() {
        out.push(TemplateMessage::text("user", texts.join("\n")));
    }
    Ok(())
}

/// An assistant turn: text, thinking and tool calls.
fn assistant_turn(content: &Value, field: &str) -> Result<TemplateMessage, ApiError> {
    let mut message = TemplateMessage::text("assistant", "");
    for (j, (kind, block)) in blocks_of(content, field)?.into_iter().enumerate() {
        let at = format!("{field}.content[{j}]");
        match kind.as_str() {
            "text" => message.content.push_str(&parse_part::<TextBlock>(&block, &at)?.text),
            "thinking" => message.reasoning_content = Some(parse_part::<ThinkingBlock>(&block, &at)?.thinking),
            "tool_use" => {
                let call: ToolUseBlock = parse_part(&block, &at)?;
                if !call.input.is_object() {
                    return Err(unsupported(format!("{at}.input"), "must be an object"));
                }
                message.tool_calls.get_or_insert_with(Vec::new).push(json!({
                    "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.input},
                }));
            }
            other => return Err(unsupported(format!("{at}.type"), format!("`{other}` blocks are not supported in assistant turns; only `text`, `thinking` and `tool_use`"))),
        }
    }
    Ok(message)
}

/// Shapes one message, buffered or streamed.
struct MessagesShape {
    message: Message,
    parser: AnswerParser,
    builder: BlockBuilder,
    /// How the generation ended and the stop sequence that ended it.
    end: Option<(Finish, Option<String>)>,
}

impl MessagesShape {
    /// Anthropic's `stop_reason`: `tool_use` when the model called something
    /// and ended by itself.
    fn stop_reason(&self, finish: Finish) -> &'static str {
        match finish {
            Finish::Eos | Finish::StopSequence if !self.parser.calls().is_empty() => "tool_use",
            Finish::Eos => "end_turn",
            Finish::StopSequence => "stop_sequence",
            Finish::Length => "max_tokens",
        }
    }

    fn finish_buffered(mut self, results: Vec<Collected>, usage: TokenUsage) -> Message {
        let result = &results[0];
        for piece in self.parser.read_all(result) {
            self.builder.push(piece);
        }
        self.builder.close();
        let finish = result.finish.unwrap_or(Finish::Length);
        let mut message = self.message.clone();
        message.content = self.builder.blocks();
        message.stop_reason = Some(self.stop_reason(finish).into());
        message.stop_sequence = result.stop.clone();
        message.usage = anthropic_usage(usage);
        message
    }
}

fn anthropic_usage(usage: TokenUsage) -> Usage {
    Usage {
        input_tokens: usage.prompt_tokens,
        output_tokens: usage.completion_tokens,
        cache_read_input_tokens: usage.cached_tokens,
        cache_creation_input_tokens: 0,
    }
}

impl StreamShape for MessagesShape {
    fn start(&mut self) -> Vec<Event> {
        vec![
            named_event("message_start", &json!({"type": "message_start", "message": self.message})),
            named_event("ping", &json!({"type": "ping"})),
        ]
    }

    fn event(&mut self, _index: usize, event: GenEvent) -> Vec<Event> {
        let pieces = match event {
            GenEvent::Prefill { .. } => return vec![],
            GenEvent::Token { token, visible, .. } => self.parser.push(token.token_id, &visible),
            GenEvent::End { finish, stop, trailing, .. } => {
                self.end = Some((finish, stop));
                self.parser.end(&trailing)
            }
        };
        pieces.into_iter().flat_map(|piece| self.builder.push(piece)).collect()
    }

    fn finish(&mut self, usage: TokenUsage) -> Vec<Event> {
        let mut events = self.builder.close();
        let (finish, stop) = self.end.clone().unwrap_or((Finish::Length, None));
        let delta = json!({
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason(finish), "stop_sequence": stop},
            "usage": anthropic_usage(usage),
        });
        events.push(named_event("message_delta", &delta));
        events.push(named_event("message_stop", &json!({"type": "message_stop"})));
        events
    }

    fn fail(&mut self, error: &ApiError) -> Vec<Event> {
        vec![named_event("error", &error.anthropic_body())]
    }
}

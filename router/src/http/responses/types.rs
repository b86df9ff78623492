//! OpenAI Responses API wire types: the request, the response object, its
//! output items and the stream's events. Requests refuse unknown fields (a
//! 400 naming the field): a field Sluice does not act on is never taken
//! silently.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// `POST /v1/responses`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateResponse {
    pub model: Option<String>,
    /// A string (one user message) or a list of items: messages
    /// (`{"role", "content"}`), `function_call`, `function_call_output` and
    /// `reasoning` items.
    #[schema(value_type = Object)]
    pub input: Value,
    /// A system message put first (not carried over by `previous_response_id`).
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u64>,
    /// In [0, 2].
    pub temperature: Option<f32>,
    /// In (0, 1].
    pub top_p: Option<f32>,
    /// Function tools (`{"type": "function", "name", "description", "parameters", "strict"}`).
    pub tools: Option<Vec<FunctionTool>>,
    /// `none`, `auto`, `required` or `{"type": "function", "name": ...}`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    pub text: Option<TextOptions>,
    /// `{"effort": ...}`: passed to the chat template as `reasoning_effort`;
    /// `"none"` also sets `enable_thinking: false` (no thinking).
    pub reasoning: Option<ReasoningOptions>,
    /// Continue the conversation of a stored response.
    pub previous_response_id: Option<String>,
    /// Default true: keep the response for `previous_response_id` and GET.
    pub store: Option<bool>,
    pub stream: Option<bool>,
    /// Run after answering (`status: queued`); GET polls it, cancel stops it.
    pub background: Option<bool>,
    /// Returned as given.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Map<String, Value>>,
    pub user: Option<String>,
    pub seed: Option<u64>,
    /// Only `disabled`: a conversation longer than the context is a 400.
    pub truncation: Option<String>,
    /// Only `auto` and `default`.
    pub service_tier: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FunctionTool {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TextOptions {
    pub format: Option<TextFormat>,
}

#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TextFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasoningOptions {
    pub effort: Option<String>,
    /// Sluice writes no summaries: only null.
    pub summary: Option<String>,
}

/// A message item of `input`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputMessage {
    #[serde(rename = "type")]
    pub _kind: Option<String>,
    pub role: String,
    #[serde(default)]
    #[serde(rename = "id")]
    pub _id: Option<String>,
    #[serde(default)]
    #[serde(rename = "status")]
    pub _status: Option<String>,
    pub content: MessageContent,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// `input_text` (and `output_text`, `refusal` in earlier assistant items).
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    /// Set on earlier `output_text` parts; nothing to do with them.
    #[serde(default)]
    #[serde(rename = "annotations")]
    pub _annotations: Option<Vec<Value>>,
    #[serde(default)]
    #[serde(rename = "logprobs")]
    pub _logprobs: Option<Vec<Value>>,
}

/// A `function_call` item of `input` (an earlier call of the model).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputFunctionCall {
    #[serde(rename = "type")]
    pub _kind: String,
    pub call_id: String,
    pub name: String,
    /// The arguments as a JSON string.
    pub arguments: String,
    #[serde(default)]
    #[serde(rename = "id")]
    pub _id: Option<String>,
    #[serde(default)]
    #[serde(rename = "status")]
    pub _status: Option<String>,
}

/// A `function_call_output` item of `input` (the client's result of a call).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputFunctionOutput {
    #[serde(rename = "type")]
    pub _kind: String,
    pub call_id: String,
    pub output: String,
    #[serde(default)]
    #[serde(rename = "id")]
    pub _id: Option<String>,
    #[serde(default)]
    #[serde(rename = "status")]
    pub _status: Option<String>,
}

/// A `reasoning` item of `input` (an earlier response's thinking).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputReasoning {
    #[serde(rename = "type")]
    pub _kind: String,
    #[serde(default)]
    #[serde(rename = "id")]
    pub _id: Option<String>,
    #[serde(default)]
    #[serde(rename = "summary")]
    pub _summary: Vec<Value>,
    #[serde(default)]
    pub content: Option<Vec<ContentPart>>,
    #[serde(default)]
    #[serde(rename = "status")]
    pub _status: Option<String>,
    /// Sluice returns none and reads none: only null.
    #[serde(default)]
    pub encrypted_content: Option<String>,
}

/// The response object (create, GET, cancel, and the stream's events).
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct ResponseObject {
    pub id: String,
    pub object: &'static str,
    pub created_at: u64,
    /// `queued`, `in_progress`, `completed`, `incomplete`, `cancelled` or `failed`.
    pub status: String,
    pub background: bool,
    #[schema(value_type = Option<Object>)]
    pub error: Option<Value>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u64>,
    pub model: String,
    pub output: Vec<OutputItem>,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    pub reasoning: ReasoningOptions,
    pub store: bool,
    pub temperature: Option<f32>,
    pub text: TextOptions,
    #[schema(value_type = Object)]
    pub tool_choice: Value,
    pub tools: Vec<FunctionTool>,
    pub top_p: Option<f32>,
    pub truncation: &'static str,
    pub usage: Option<ResponseUsage>,
    pub user: Option<String>,
    #[schema(value_type = Object)]
    pub metadata: serde_json::Map<String, Value>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct IncompleteDetails {
    /// `max_output_tokens`.
    pub reason: String,
}

/// One output item: the model's thinking, its message, or a call.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    Reasoning {
        id: String,
        summary: Vec<Value>,
        content: Vec<TextPart>,
        status: String,
    },
    Message {
        id: String,
        role: String,
        status: String,
        content: Vec<TextPart>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
        status: String,
    },
}

/// `output_text` (with its `annotations` and `logprobs`) or `reasoning_text`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextPart {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub annotations: Option<Vec<Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub logprobs: Option<Vec<Value>>,
}

impl TextPart {
    pub fn output(text: String) -> Self {
        Self { kind: "output_text", text, annotations: Some(Vec::new()), logprobs: Some(Vec::new()) }
    }

    pub fn reasoning(text: String) -> Self {
        Self { kind: "reasoning_text", text, annotations: None, logprobs: None }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: u32,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: u32,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct InputTokensDetails {
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct OutputTokensDetails {
    pub reasoning_tokens: u32,
}

/// `DELETE /v1/responses/{id}`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DeletedResponse {
    pub id: String,
    pub object: &'static str,
    pub deleted: bool,
}

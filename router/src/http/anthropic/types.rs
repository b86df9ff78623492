//! Anthropic Messages API wire types. Requests refuse unknown fields (a 400
//! naming the field): a field Sluice does not act on is never taken
//! silently. `cache_control` is accepted on every block: Sluice caches
//! prompt prefixes by itself (`--prefix-caching`), so the hint is already
//! followed.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// `POST /v1/messages`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MessagesRequest {
    pub model: String,
    pub max_tokens: u64,
    /// `{"role": "user" | "assistant", "content": string | blocks}`; blocks are
    /// `text`, `tool_use`, `tool_result` and `thinking`.
    #[schema(value_type = Vec<Object>)]
    pub messages: Vec<Value>,
    /// A string or a list of text blocks.
    #[schema(value_type = Option<Object>)]
    pub system: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    pub stream: Option<bool>,
    /// In [0, 1].
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    /// `{"type": "enabled", "budget_tokens": N}` or `{"type": "disabled"}`:
    /// the chat template's `enable_thinking`.
    pub thinking: Option<Thinking>,
    #[serde(rename = "metadata")]
    pub _metadata: Option<Metadata>,
    /// Only `auto` and `standard_only`.
    pub service_tier: Option<String>,
    /// Accepted: the prefix cache reuses repeated prompts by itself.
    #[schema(value_type = Option<Object>)]
    #[serde(rename = "cache_control")]
    pub _cache_control: Option<Value>,
}

/// `POST /v1/messages/count_tokens`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CountTokensRequest {
    pub model: String,
    #[schema(value_type = Vec<Object>)]
    pub messages: Vec<Value>,
    #[schema(value_type = Option<Object>)]
    pub system: Option<Value>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    pub thinking: Option<Thinking>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CountTokensResponse {
    pub input_tokens: u32,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// Only `custom` (or absent).
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub name: String,
    pub description: Option<String>,
    #[schema(value_type = Object)]
    pub input_schema: Value,
    #[schema(value_type = Option<Object>)]
    #[serde(rename = "cache_control")]
    pub _cache_control: Option<Value>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolChoice {
    /// `auto`, `any`, `tool` or `none`.
    #[serde(rename = "type")]
    pub kind: String,
    /// With `tool`.
    pub name: Option<String>,
    pub disable_parallel_tool_use: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Thinking {
    /// `enabled` or `disabled`.
    #[serde(rename = "type")]
    pub kind: String,
    /// With `enabled`: at least 1024 and below `max_tokens`.
    pub budget_tokens: Option<u64>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    #[serde(rename = "user_id")]
    pub _user_id: Option<String>,
}

/// One message of `messages`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputMessage {
    pub role: String,
    pub content: Value,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextBlock {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: String,
    #[serde(rename = "cache_control")]
    pub _cache_control: Option<Value>,
    /// An earlier answer's citations, sent back: nothing to act on.
    #[serde(rename = "citations")]
    pub _citations: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolUseBlock {
    #[serde(rename = "type")]
    pub _kind: String,
    pub id: String,
    pub name: String,
    pub input: Value,
    #[serde(rename = "cache_control")]
    pub _cache_control: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolResultBlock {
    #[serde(rename = "type")]
    pub _kind: String,
    pub tool_use_id: String,
    /// A string or text blocks.
    #[serde(default)]
    pub content: Option<Value>,
    pub is_error: Option<bool>,
    #[serde(rename = "cache_control")]
    pub _cache_control: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThinkingBlock {
    #[serde(rename = "type")]
    pub _kind: String,
    pub thinking: String,
    /// Returned empty by Sluice; whatever comes back is not checked.
    #[serde(rename = "signature")]
    pub _signature: Option<String>,
    #[serde(rename = "cache_control")]
    pub _cache_control: Option<Value>,
}

/// A block of the answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Thinking {
        thinking: String,
        /// Sluice does not sign thinking: always empty.
        signature: String,
    },
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        #[schema(value_type = Object)]
        input: Value,
    },
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Message {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: &'static str,
    pub model: String,
    pub content: Vec<ContentBlock>,
    /// `end_turn`, `max_tokens`, `stop_sequence` or `tool_use`; null while streaming.
    pub stop_reason: Option<String>,
    pub stop_sequence: Option<String>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct Usage {
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cache_read_input_tokens: u32,
    pub cache_creation_input_tokens: u32,
}

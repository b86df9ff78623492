//! OpenAI's wire types: request bodies, responses and stream chunks.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::structured::{GuidedFields, ResponseFormat, Tool, ToolChoiceSpec};

/// OpenAI's `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by both OpenAI endpoints (flattened into each).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SamplingFields {
    /// In [0, 2]; 0 is greedy. Default 1 (or generation_config.json's).
    pub temperature: Option<f32>,
    /// In (0, 1].
    pub top_p: Option<f32>,
    /// Independent choices per prompt.
    pub n: Option<u32>,
    pub stop: Option<StopSpec>,
    pub seed: Option<u64>,
    /// In [-2, 2].
    pub frequency_penalty: Option<f32>,
    /// In [-2, 2].
    pub presence_penalty: Option<f32>,
    /// Token id (as a string) -> bias in [-100, 100].
    pub logit_bias: Option<HashMap<String, f32>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    #[serde(rename = "user")]
    pub _user: Option<String>,
    /// vLLM extra: -1 or 0 disables.
    pub top_k: Option<i64>,
    /// vLLM extra: in [0, 1].
    pub min_p: Option<f32>,
    /// vLLM extra: in (0, 100], 1 disables.
    pub repetition_penalty: Option<f32>,
    /// vLLM extra: keep generating past EOS.
    pub ignore_eos: Option<bool>,
    /// vLLM extra: EOS is masked until this many tokens.
    pub min_tokens: Option<u32>,
    /// vLLM extra: scheduling priority, lower runs first (default 0).
    pub priority: Option<i32>,
}

/// One part of a message's content; only text parts are supported.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    /// An assistant turn's calls (sent back in a tool-calling loop).
    pub tool_calls: Option<Vec<ToolCallMessage>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    /// An assistant turn's thinking, as this API returned it.
    pub reasoning_content: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    /// The served model name or the model id.
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    /// `text`, `json_object` or `json_schema` (see `structured`).
    pub response_format: Option<ResponseFormat>,
    pub tools: Option<Vec<Tool>>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name": ...}}`.
    pub tool_choice: Option<ToolChoiceSpec>,
    /// Default true: the model may make several calls in one answer.
    pub parallel_tool_calls: Option<bool>,
    /// Variables for the chat template (e.g. `{"enable_thinking": false}`
    /// for Qwen3): any JSON values, under names the server does not set.
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<crate::chat_template::TemplateKwargs>,
    /// Default true: a reasoning model's thinking is returned in
    /// `reasoning_content`; false drops it.
    pub include_reasoning: Option<bool>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub guided: GuidedFields,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u64>),
    TokenLists(Vec<Vec<u64>>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: PromptInput,
    /// Default 16 (OpenAI's).
    pub max_tokens: Option<u64>,
    /// Alternatives per token (0..=--max-top-n-tokens); the chosen token's
    /// logprob is returned whenever this is set.
    pub logprobs: Option<u32>,
    /// Prepend the prompt to the text (and its logprobs when asked).
    pub echo: Option<bool>,
    /// Only 1 is supported.
    pub best_of: Option<u32>,
    /// `text`, `json_object` or `json_schema` (see `structured`).
    pub response_format: Option<ResponseFormat>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub guided: GuidedFields,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionTokensDetails {
    /// Generated tokens spent thinking (the thinking block's tags included).
    pub reasoning_tokens: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
    /// With a reasoning model (chat).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobContent {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprobContent>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    pub role: String,
    /// Null when the answer is only tool calls.
    pub content: Option<String>,
    /// A reasoning model's thinking (absent when it did not think, or with
    /// `include_reasoning: false`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallMessage>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatDelta {
    pub role: String,
    pub content: String,
    /// More of a reasoning model's thinking.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Pieces of tool calls; null otherwise (TGI's client requires the key).
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChunkChoice>,
    /// Null except on the final chunk with `stream_options.include_usage`.
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<HashMap<String, f32>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Completion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Option<Usage>,
}

/// A call in a request's earlier assistant message, and in responses.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ToolCallMessage {
    pub id: String,
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON string.
    pub arguments: String,
}

/// A streamed piece of a call: id, type and name in its first delta, then
/// argument fragments.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

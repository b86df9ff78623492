//! The Batch API's objects as OpenAI's clients read them (`file`, `batch`,
//! paged lists), and the line formats of output and error files.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// The endpoints a batch may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub enum Endpoint {
    #[serde(rename = "/v1/chat/completions")]
    ChatCompletions,
    #[serde(rename = "/v1/completions")]
    Completions,
}

impl Endpoint {
    pub const ALL: [Endpoint; 2] = [Endpoint::ChatCompletions, Endpoint::Completions];

    pub fn path(self) -> &'static str {
        match self {
            Self::ChatCompletions => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }

    pub fn from_path(path: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.path() == path)
    }
}

/// A batch's life:
///
/// ```text
///  validating ─► in_progress ─► finalizing ─► completed
///      │              ├─────────────────────► expired    (completion window passed)
///      │              └─► cancelling ───────► cancelled  (POST .../cancel)
///      └─► failed                                          (no request line)
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BatchStatus {
    Validating,
    InProgress,
    Finalizing,
    Completed,
    Failed,
    Expired,
    Cancelling,
    Cancelled,
}

impl BatchStatus {
    pub fn name(self) -> &'static str {
        match self {
            Self::Validating => "validating",
            Self::InProgress => "in_progress",
            Self::Finalizing => "finalizing",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Expired => "expired",
            Self::Cancelling => "cancelling",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        [
            Self::Validating,
            Self::InProgress,
            Self::Finalizing,
            Self::Completed,
            Self::Failed,
            Self::Expired,
            Self::Cancelling,
            Self::Cancelled,
        ]
        .into_iter()
        .find(|s| s.name() == name)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct FileObject {
    pub id: String,
    /// Always "file".
    pub object: &'static str,
    pub bytes: u64,
    pub created_at: u64,
    pub filename: String,
    /// "batch" (uploads) or "batch_output" (a batch's output and error files).
    pub purpose: String,
    /// Always "processed": an upload is checked before it is stored.
    pub status: &'static str,
    pub expires_at: Option<u64>,
    pub status_details: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DeletedFile {
    pub id: String,
    pub object: &'static str,
    pub deleted: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct RequestCounts {
    pub total: u64,
    pub completed: u64,
    pub failed: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct InputTokensDetails {
    pub cached_tokens: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct OutputTokensDetails {
    pub reasoning_tokens: u64,
}

/// Tokens of the batch's finished lines (OpenAI's `usage`), and what they
/// cost: the machine time of the steps they took part in, each step's time
/// split by the tokens each request computed (`compute_seconds`), priced at
/// `--hourly-cost` (`cost_dollars`, null without it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, ToSchema)]
pub struct BatchUsage {
    pub input_tokens: u64,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: u64,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: u64,
    pub compute_seconds: f64,
    pub cost_dollars: Option<f64>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BatchErrors {
    /// Always "list".
    pub object: &'static str,
    pub data: Vec<BatchErrorEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BatchErrorEntry {
    pub code: String,
    pub message: String,
    pub param: Option<String>,
    pub line: Option<u64>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BatchObject {
    pub id: String,
    /// Always "batch".
    pub object: &'static str,
    pub endpoint: Endpoint,
    pub model: String,
    pub errors: Option<BatchErrors>,
    pub input_file_id: String,
    pub completion_window: String,
    pub status: BatchStatus,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub created_at: u64,
    pub in_progress_at: Option<u64>,
    pub expires_at: u64,
    pub finalizing_at: Option<u64>,
    pub completed_at: Option<u64>,
    pub failed_at: Option<u64>,
    pub expired_at: Option<u64>,
    pub cancelling_at: Option<u64>,
    pub cancelled_at: Option<u64>,
    pub request_counts: RequestCounts,
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
    pub usage: BatchUsage,
}

/// A page of a list (`GET /v1/files`, `GET /v1/batches`), newest first.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Page<T> {
    /// Always "list".
    pub object: &'static str,
    pub data: Vec<T>,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
    pub has_more: bool,
}

impl<T> Page<T> {
    /// `items` holds up to `limit + 1` entries: one more than the page
    /// tells whether there are more.
    pub fn new(mut items: Vec<T>, limit: usize, id: impl Fn(&T) -> &str) -> Self {
        let has_more = items.len() > limit;
        items.truncate(limit);
        Self {
            object: "list",
            first_id: items.first().map(|t| id(t).to_string()),
            last_id: items.last().map(|t| id(t).to_string()),
            data: items,
            has_more,
        }
    }
}

/// What one request line came to, as its output or error file line says.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LineOutcome {
    pub id: String,
    pub custom_id: Option<String>,
    pub response: Option<LineResponse>,
    pub error: Option<LineError>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LineResponse {
    pub status_code: u16,
    pub request_id: String,
    pub body: Value,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LineError {
    pub code: String,
    pub message: String,
}

impl LineOutcome {
    /// Lines with a 200 response go to the output file, the rest to the
    /// error file.
    pub fn succeeded(&self) -> bool {
        self.response.as_ref().is_some_and(|r| r.status_code == 200)
    }
}

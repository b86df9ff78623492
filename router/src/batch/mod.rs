//! The Batch API: OpenAI's `/v1/files` and `/v1/batches`, durable, run in
//! the capacity interactive requests leave.
//!
//! 1. `POST /v1/files` (http/openai/files.rs) -> [`Batches::upload`]: the
//!    JSONL is checked (`input`: UTF-8, line limit, unique `custom_id`s)
//!    and stored whole.
//! 2. `POST /v1/batches` -> [`Batches::create`]: every line is parsed
//!    against the endpoint and stored as a pending request (or, malformed,
//!    as a finished error line); the batch starts in `validating`.
//! 3. The runner (`runner`), one task: moves batches through their states
//!    and keeps up to `--max-batch-size` lines in flight, each run through
//!    the same generation driver as the endpoint's online requests, in the
//!    scheduler's batch class (below every interactive request; see
//!    scheduler/share.rs). Each line's result is committed as it finishes.
//! 4. When every line is done: `finalizing`, the output and error files
//!    are written, `completed`.
//!
//! `store` owns the SQLite file (one thread; every write a durable
//! transaction), `types` the wire objects. A restart resumes every
//! unfinished batch: done lines keep their one result, pending ones (also
//! those in flight when the server stopped) run again.

pub mod input;
pub mod runner;
pub mod store;
pub mod types;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;
use tokio::sync::Notify;
use utoipa::ToSchema;

use store::{NewBatch, Store, StoreError};
use types::{BatchObject, BatchStatus, DeletedFile, Endpoint, FileObject, Page};

/// How long a batch may take; OpenAI accepts only this window.
pub const COMPLETION_WINDOW: &str = "24h";
const COMPLETION_WINDOW_SECS: u64 = 24 * 3600;

/// What a list page holds when the client does not say, and at most.
pub const DEFAULT_PAGE: usize = 20;
pub const MAX_PAGE: usize = 100;

/// OpenAI's metadata limits.
const MAX_METADATA_PAIRS: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

/// The Batch API's settings, fixed at startup.
#[derive(Debug, Clone)]
pub struct BatchConfig {
    pub data_dir: PathBuf,
    /// Largest upload, in bytes (HTTP 413 above).
    pub max_file_bytes: usize,
    /// Most request lines in one file.
    pub max_lines: usize,
    /// The `model` batch objects name.
    pub model: String,
    /// Dollars per hour (`--hourly-cost`): prices each batch's compute time.
    pub hourly_cost: Option<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("no {kind} with id {id:?}")]
    NotFound { kind: &'static str, id: String },
    /// The client's input cannot be used (HTTP 400).
    #[error("{0}")]
    Invalid(String),
    #[error("the file is larger than the server's limit of {limit} bytes (--batch-max-file-bytes)")]
    TooLarge { limit: usize },
    /// The request does not fit the batch's state (HTTP 409).
    #[error("{0}")]
    Conflict(String),
    /// This server runs without the Batch API (its default data folder was
    /// in use at start; tests that build the app without a store).
    #[error(
        "the Batch API is off on this server: its data folder was in use by another Sluice server when it \
         started (start each server with its own --data-dir)"
    )]
    Disabled,
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<input::InvalidInput> for BatchError {
    fn from(e: input::InvalidInput) -> Self {
        Self::Invalid(e.0)
    }
}

/// `POST /v1/batches`'s body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateBatch {
    pub input_file_id: String,
    /// `/v1/chat/completions` or `/v1/completions`.
    pub endpoint: String,
    /// Only `24h`.
    pub completion_window: String,
    /// Up to 16 string pairs, returned as given.
    pub metadata: Option<HashMap<String, String>>,
}

/// What the HTTP handlers and the runner share: the store, the limits, and
/// the bell that wakes the runner when a batch changes.
pub struct Batches {
    store: Store,
    pub config: BatchConfig,
    wake: Arc<Notify>,
}

impl Batches {
    /// Opens the database under `--data-dir` (see store.rs for the lock).
    pub fn open(config: BatchConfig) -> Result<Self, StoreError> {
        let store = Store::open(&config.data_dir)?;
        Ok(Self { store, config, wake: Arc::new(Notify::new()) })
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The runner's bell.
    pub fn wake(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// Stores an upload after checking it (`purpose` must be `batch`).
    pub async fn upload(&self, filename: String, purpose: &str, content: Vec<u8>) -> Result<FileObject, BatchError> {
        if purpose != "batch" {
            return Err(BatchError::Invalid(format!("`purpose` {purpose:?} is not supported; only \"batch\" is")));
        }
        if content.len() > self.config.max_file_bytes {
            return Err(BatchError::TooLarge { limit: self.config.max_file_bytes });
        }
        let max_lines = self.config.max_lines;
        let (content, lines) = blocking(move || {
            let lines = input::check_upload(&content, max_lines)?;
            Ok((content, lines))
        })
        .await?;
        if lines == 0 {
            return Err(BatchError::Invalid("the file holds no request line".into()));
        }
        let file = FileObject::new(filename, purpose, content.len() as u64, unix_now());
        Ok(self.store.insert_file(file, content).await?)
    }

    pub async fn file(&self, id: &str) -> Result<FileObject, BatchError> {
        self.store.file(id.to_string()).await?.ok_or_else(|| not_found("file", id))
    }

    pub async fn file_content(&self, id: &str) -> Result<Vec<u8>, BatchError> {
        self.store.file_content(id.to_string()).await?.ok_or_else(|| not_found("file", id))
    }

    pub async fn delete_file(&self, id: &str) -> Result<DeletedFile, BatchError> {
        match self.store.delete_file(id.to_string()).await? {
            true => Ok(DeletedFile { id: id.to_string(), object: "file", deleted: true }),
            false => Err(not_found("file", id)),
        }
    }

    pub async fn files(&self, after: Option<String>, limit: usize) -> Result<Page<FileObject>, BatchError> {
        let files = self.store.files(after.clone(), limit).await?;
        let files = files.ok_or_else(|| not_found("file", after.as_deref().unwrap_or_default()))?;
        Ok(Page::new(files, limit, |f| &f.id))
    }

    /// Checks the request and its input file's lines (a duplicate
    /// `custom_id` is a 400; other bad lines go to the error file) and
    /// stores the batch in `validating` for the runner.
    pub async fn create(&self, request: CreateBatch) -> Result<BatchObject, BatchError> {
        let endpoint = Endpoint::from_path(&request.endpoint).ok_or_else(|| {
            let known: Vec<&str> = Endpoint::ALL.iter().map(|e| e.path()).collect();
            BatchError::Invalid(format!("`endpoint` {:?} is not supported; use one of {known:?}", request.endpoint))
        })?;
        if request.completion_window != COMPLETION_WINDOW {
            return Err(BatchError::Invalid(format!(
                "`completion_window` {:?} is not supported; only \"{COMPLETION_WINDOW}\" is",
                request.completion_window
            )));
        }
        let metadata = request.metadata.map(check_metadata).transpose()?;
        let file = self.file(&request.input_file_id).await?;
        if file.purpose != "batch" {
            return Err(BatchError::Invalid(format!(
                "`input_file_id` {:?} has purpose {:?}, not \"batch\"",
                file.id, file.purpose
            )));
        }
        let content = self.file_content(&file.id).await?;
        let max_lines = self.config.max_lines;
        let lines = blocking(move || Ok(input::parse(&content, Some(endpoint), max_lines)?)).await?;
        let now = unix_now();
        let batch = NewBatch {
            id: format!("batch_{}", uuid::Uuid::new_v4().simple()),
            endpoint,
            input_file_id: file.id,
            completion_window: request.completion_window,
            created_at: now,
            expires_at: now + COMPLETION_WINDOW_SECS,
            metadata,
        };
        let id = self.store.create_batch(batch, lines).await?;
        self.wake.notify_one();
        tracing::info!(batch = %id, "batch created");
        self.batch(&id).await
    }

    pub async fn batch(&self, id: &str) -> Result<BatchObject, BatchError> {
        let (model, cost) = (self.config.model.clone(), self.config.hourly_cost);
        self.store.batch(id.to_string(), model, cost).await?.ok_or_else(|| not_found("batch", id))
    }

    pub async fn batches(&self, after: Option<String>, limit: usize) -> Result<Page<BatchObject>, BatchError> {
        let (model, cost) = (self.config.model.clone(), self.config.hourly_cost);
        let batches = self.store.batches(after.clone(), limit, model, cost).await?;
        let batches = batches.ok_or_else(|| not_found("batch", after.as_deref().unwrap_or_default()))?;
        Ok(Page::new(batches, limit, |b| &b.id))
    }

    /// Asks the runner to stop a batch: `cancelling` now, `cancelled` (with
    /// the results of the lines that finished) once its lines in flight
    /// are stopped. Cancelling a batch that is already being cancelled
    /// answers its state; one that has ended is a 409.
    pub async fn cancel(&self, id: &str) -> Result<BatchObject, BatchError> {
        const CANCELLABLE: &[BatchStatus] = &[BatchStatus::Validating, BatchStatus::InProgress];
        let status = self.store.transition(id.to_string(), CANCELLABLE, BatchStatus::Cancelling, unix_now()).await?;
        match status {
            None => return Err(not_found("batch", id)),
            Some(s) if CANCELLABLE.contains(&s) || s == BatchStatus::Cancelling || s == BatchStatus::Cancelled => {}
            Some(s) => {
                return Err(BatchError::Conflict(format!("batch {id:?} is {} and can no longer be cancelled", s.name())))
            }
        }
        self.wake.notify_one();
        self.batch(id).await
    }
}

fn not_found(kind: &'static str, id: &str) -> BatchError {
    BatchError::NotFound { kind, id: id.to_string() }
}

fn check_metadata(metadata: HashMap<String, String>) -> Result<serde_json::Value, BatchError> {
    if metadata.len() > MAX_METADATA_PAIRS {
        return Err(BatchError::Invalid(format!("`metadata` has {} keys; at most {MAX_METADATA_PAIRS} are allowed", metadata.len())));
    }
    for (key, value) in &metadata {
        if key.chars().count() > MAX_METADATA_KEY || value.chars().count() > MAX_METADATA_VALUE {
            return Err(BatchError::Invalid(format!(
                "`metadata.{key}`: keys may have {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE}"
            )));
        }
    }
    // Sorted keys: the object reads the same however the client ordered it.
    let sorted: std::collections::BTreeMap<_, _> = metadata.into_iter().collect();
    Ok(serde_json::to_value(sorted).expect("strings serialize"))
}

/// Runs CPU work that grows with the upload (parsing a file of up to
/// `--batch-max-file-bytes`) off the async workers.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> Result<T, BatchError> + Send + 'static) -> Result<T, BatchError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result,
        Err(error) => std::panic::resume_unwind(error.into_panic()),
    }
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

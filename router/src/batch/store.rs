//! The Batch API's durable state: one SQLite file under `--data-dir`,
//! owned by one thread ([`Store`] sends it closures), so no two writers
//! ever race and a slow disk never blocks the async runtime.
//!
//! ```text
//!  files    id, purpose, filename, bytes, created_at, content (the bytes)
//!  batches  id, endpoint, input_file_id, status, <status>_at times,
//!           output/error file ids, errors, metadata, request counts, usage
//!  lines    (batch_id, line) -> custom_id, body, state, outcome, usage
//!           state: 0 pending (never run, or in flight when the server
//!           stopped: run again), 1 done (its outcome is final)
//! ```
//!
//! Durability: write-ahead log with `synchronous=FULL`, so every commit is
//! on disk when it returns. A line's outcome, its state `done` and the
//! batch's counters change in one transaction: after a crash a line is
//! either done with its one outcome, or pending and run again; never lost,
//! never twice. Finalizing (writing the output and error files, the batch's
//! final status) is one transaction too.
//!
//! The file is opened in exclusive locking mode: a second server pointed at
//! the same `--data-dir` fails at startup instead of running the same
//! batches twice. The lock goes with the process, however it ends.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use tokio::sync::oneshot;

use super::input::InputLine;
use super::types::{
    BatchErrorEntry, BatchErrors, BatchObject, BatchStatus, BatchUsage, Endpoint, FileObject, InputTokensDetails,
    LineError, LineOutcome, OutputTokensDetails, RequestCounts,
};

/// The database file inside `--data-dir`.
pub const DB_FILE: &str = "batches.sqlite3";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("--data-dir {0}: {1}")]
    Dir(PathBuf, std::io::Error),
    #[error("--data-dir {0} is in use by another Sluice server; give each server its own --data-dir")]
    InUse(PathBuf),
    #[error("the batch database failed: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("the batch database has stopped")]
    Stopped,
    #[error("the batch database holds a value it cannot read: {0}")]
    Corrupt(String),
}

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

/// A handle on the database thread; cheap to clone. The thread ends when
/// the last handle is dropped, and that drop waits for it: the connection,
/// and with it the lock, is closed once the drop returns.
#[derive(Clone)]
pub struct Store {
    thread: Arc<DbThread>,
}

struct DbThread {
    jobs: Option<mpsc::Sender<Job>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for DbThread {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop after the jobs queued.
        self.jobs.take();
        // (A job holding the last handle ends on the thread itself: no join.)
        if let Some(handle) = self.handle.take().filter(|h| h.thread().id() != std::thread::current().id()) {
            let _ = handle.join();
        }
    }
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT,
    errors TEXT,
    metadata TEXT,
    total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0, compute_seconds REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT,
    body TEXT,
    done INTEGER NOT NULL DEFAULT 0,
    succeeded INTEGER,
    outcome TEXT,
    PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
";

/// Token counts and machine time of one finished line.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LineUsage {
    pub input_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    pub compute_seconds: f64,
}

/// A new batch, checked.
#[derive(Debug, Clone)]
pub struct NewBatch {
    pub id: String,
    pub endpoint: Endpoint,
    pub input_file_id: String,
    pub completion_window: String,
    pub created_at: u64,
    pub expires_at: u64,
    pub metadata: Option<serde_json::Value>,
}

/// A batch the runner has work to do for.
#[derive(Debug, Clone, PartialEq)]
pub struct ActiveBatch {
    pub id: String,
    pub endpoint: Endpoint,
    pub status: BatchStatus,
    pub expires_at: u64,
}

/// A request line waiting to run.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingLine {
    pub line: u64,
    pub custom_id: String,
    pub body: String,
}

impl Store {
    /// Opens (creating) the database in `dir` (created 0700) and takes its
    /// lock.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let connection = open_connection(dir)?;
        let (jobs, receiver) = mpsc::channel::<Job>();
        let handle = std::thread::Builder::new()
            .name("sluice-batch-db".into())
            .spawn(move || {
                let mut connection = connection;
                for job in receiver {
                    job(&mut connection);
                }
            })
            .map_err(|e| StoreError::Dir(dir.to_path_buf(), e))?;
        Ok(Self { thread: Arc::new(DbThread { jobs: Some(jobs), handle: Some(handle) }) })
    }

    /// Runs `f` on the database thread.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, result) = oneshot::channel();
        let job: Job = Box::new(move |connection| {
            let _ = reply.send(f(connection));
        });
        let jobs = self.thread.jobs.as_ref().ok_or(StoreError::Stopped)?;
        jobs.send(job).map_err(|_| StoreError::Stopped)?;
        result.await.map_err(|_| StoreError::Stopped)?
    }

    // -- files --------------------------------------------------------------

    pub async fn insert_file(&self, file: FileObject, content: Vec<u8>) -> Result<FileObject, StoreError> {
        self.call(move |c| {
            insert_file(c, &file, &content)?;
            Ok(file)
        })
        .await
    }

    pub async fn file(&self, id: String) -> Result<Option<FileObject>, StoreError> {
        self.call(move |c| {
            Ok(c.query_row(&format!("SELECT {FILE_COLUMNS} FROM files WHERE id = ?1"), [&id], file_row).optional()?)
        })
        .await
    }

    pub async fn file_content(&self, id: String) -> Result<Option<Vec<u8>>, StoreError> {
        self.call(move |c| Ok(c.query_row("SELECT content FROM files WHERE id = ?1", [&id], |r| r.get(0)).optional()?))
            .await
    }

    /// False when there was no such file.
    pub async fn delete_file(&self, id: String) -> Result<bool, StoreError> {
        self.call(move |c| Ok(c.execute("DELETE FROM files WHERE id = ?1", [&id])? > 0)).await
    }

    /// Newest first, after the file `after` (None: from the newest).
    pub async fn files(&self, after: Option<String>, limit: usize) -> Result<Option<Vec<FileObject>>, StoreError> {
        self.call(move |c| {
            let Some(before) = seq_of(c, "files", after.as_deref())? else { return Ok(None) };
            let mut query =
                c.prepare(&format!("SELECT {FILE_COLUMNS} FROM files WHERE seq < ?1 ORDER BY seq DESC LIMIT ?2"))?;
            let rows = query.query_map(params![before, limit as i64 + 1], file_row)?;
            Ok(Some(rows.collect::<Result<_, _>>()?))
        })
        .await
    }

    // -- batches ------------------------------------------------------------

    /// Stores a batch in `validating` with its lines: requests pending,
    /// invalid lines already done with their error.
    pub async fn create_batch(&self, batch: NewBatch, lines: Vec<InputLine>) -> Result<String, StoreError> {
        self.call(move |c| {
            let tx = c.transaction()?;
            tx.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, expires_at, metadata, total)
                 VALUES (?1, ?2, ?3, ?4, 'validating', ?5, ?6, ?7, ?8)",
                params![
                    batch.id,
                    batch.endpoint.path(),
                    batch.input_file_id,
                    batch.completion_window,
                    batch.created_at as i64,
                    batch.expires_at as i64,
                    batch.metadata.as_ref().map(|m| m.to_string()),
                    lines.len() as i64,
                ],
            )?;
            for line in &lines {
                match line {
                    InputLine::Request { line, custom_id, body } => {
                        tx.execute(
                            "INSERT INTO lines (batch_id, line, custom_id, body) VALUES (?1, ?2, ?3, ?4)",
                            params![batch.id, *line as i64, custom_id, body],
                        )?;
                    }
                    InputLine::Invalid { line, custom_id, message } => {
                        let outcome = LineOutcome {
                            id: line_result_id(),
                            custom_id: custom_id.clone(),
                            response: None,
                            error: Some(LineError { code: "invalid_request_line".into(), message: message.clone() }),
                        };
                        tx.execute(
                            "INSERT INTO lines (batch_id, line, custom_id, done, succeeded, outcome) VALUES (?1, ?2, ?3, 1, 0, ?4)",
                            params![batch.id, *line as i64, custom_id, to_json(&outcome)],
                        )?;
                        tx.execute("UPDATE batches SET failed = failed + 1 WHERE id = ?1", [&batch.id])?;
                    }
                }
            }
            tx.commit()?;
            Ok(batch.id)
        })
        .await
    }

    pub async fn batch(&self, id: String, model: String, hourly_cost: Option<f64>) -> Result<Option<BatchObject>, StoreError> {
        self.call(move |c| {
            c.query_row(&format!("SELECT {BATCH_COLUMNS} FROM batches WHERE id = ?1"), [&id], |row| {
                Ok(batch_row(row, &model, hourly_cost))
            })
            .optional()?
            .transpose()
        })
        .await
    }

    /// Newest first, after the batch `after` (None: from the newest); None
    /// when `after` names no batch.
    pub async fn batches(
        &self,
        after: Option<String>,
        limit: usize,
        model: String,
        hourly_cost: Option<f64>,
    ) -> Result<Option<Vec<BatchObject>>, StoreError> {
        self.call(move |c| {
            let Some(before) = seq_of(c, "batches", after.as_deref())? else { return Ok(None) };
            let mut query =
                c.prepare(&format!("SELECT {BATCH_COLUMNS} FROM batches WHERE seq < ?1 ORDER BY seq DESC LIMIT ?2"))?;
            let rows = query.query_map(params![before, limit as i64 + 1], |row| Ok(batch_row(row, &model, hourly_cost)))?;
            let mut batches = Vec::new();
            for row in rows {
                batches.push(row??);
            }
            Ok(Some(batches))
        })
        .await
    }

    /// Moves batch `id` from one of `from` to `to`, stamping `<to>_at`;
    /// returns the status it had (None: no such batch). Nothing changes when
    /// its status is not in `from`.
    pub async fn transition(&self, id: String, from: &'static [BatchStatus], to: BatchStatus, now: u64) -> Result<Option<BatchStatus>, StoreError> {
        self.call(move |c| {
            let tx = c.transaction()?;
            let status = status_of(&tx, &id)?;
            if status.is_some_and(|s| from.contains(&s)) {
                set_status(&tx, &id, to, now)?;
            }
            tx.commit()?;
            Ok(status)
        })
        .await
    }

    /// Batches with work left for the runner, oldest first.
    pub async fn active_batches(&self) -> Result<Vec<ActiveBatch>, StoreError> {
        self.call(|c| {
            let mut query = c.prepare(
                "SELECT id, endpoint, status, expires_at FROM batches
                 WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling') ORDER BY seq",
            )?;
            let rows = query.query_map([], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?, row.get::<_, String>(2)?, row.get::<_, i64>(3)?))
            })?;
            let mut active = Vec::new();
            for row in rows {
                let (id, endpoint, status, expires_at) = row?;
                active.push(ActiveBatch {
                    endpoint: Endpoint::from_path(&endpoint).ok_or_else(|| StoreError::Corrupt(format!("endpoint {endpoint:?}")))?,
                    status: parse_status(&status)?,
                    expires_at: expires_at as u64,
                    id,
                });
            }
            Ok(active)
        })
        .await
    }

    /// Up to `limit` pending lines of a batch after line `after`, in order.
    pub async fn pending_lines(&self, batch_id: String, after: u64, limit: usize) -> Result<Vec<PendingLine>, StoreError> {
        self.call(move |c| {
            let mut query = c.prepare(
                "SELECT line, custom_id, body FROM lines WHERE batch_id = ?1 AND done = 0 AND line > ?2 ORDER BY line LIMIT ?3",
            )?;
            let rows = query.query_map(params![batch_id, after as i64, limit as i64], |row| {
                Ok(PendingLine { line: row.get::<_, i64>(0)? as u64, custom_id: row.get(1)?, body: row.get(2)? })
            })?;
            Ok(rows.collect::<Result<_, _>>()?)
        })
        .await
    }

    /// Records a line's outcome, once: false (and nothing written) when it
    /// was already done or its batch is no longer running.
    pub async fn finish_line(&self, batch_id: String, line: u64, outcome: LineOutcome, usage: LineUsage) -> Result<bool, StoreError> {
        self.call(move |c| {
            let tx = c.transaction()?;
            // A line that finished while its batch was being cancelled still
            // counts; once the batch has ended, nothing does.
            if !matches!(status_of(&tx, &batch_id)?, Some(BatchStatus::InProgress | BatchStatus::Cancelling)) {
                return Ok(false);
            }
            let succeeded = outcome.succeeded();
            let changed = tx.execute(
                "UPDATE lines SET done = 1, succeeded = ?3, outcome = ?4 WHERE batch_id = ?1 AND line = ?2 AND done = 0",
                params![batch_id, line as i64, succeeded, to_json(&outcome)],
            )?;
            if changed == 0 {
                return Ok(false);
            }
            tx.execute(
                "UPDATE batches SET completed = completed + ?2, failed = failed + ?3, input_tokens = input_tokens + ?4,
                 cached_tokens = cached_tokens + ?5, output_tokens = output_tokens + ?6, compute_seconds = compute_seconds + ?7
                 WHERE id = ?1",
                params![
                    batch_id,
                    succeeded as i64,
                    !succeeded as i64,
                    usage.input_tokens as i64,
                    usage.cached_tokens as i64,
                    usage.output_tokens as i64,
                    usage.compute_seconds,
                ],
            )?;
            tx.commit()?;
            Ok(true)
        })
        .await
    }

    /// Whether every line of the batch is done.
    pub async fn all_done(&self, batch_id: String) -> Result<bool, StoreError> {
        self.call(move |c| {
            let pending: i64 =
                c.query_row("SELECT COUNT(*) FROM lines WHERE batch_id = ?1 AND done = 0", [&batch_id], |r| r.get(0))?;
            Ok(pending == 0)
        })
        .await
    }

    /// Ends a batch in `status` (completed, cancelled or expired): writes its
    /// output file (the lines that succeeded) and error file (those that
    /// failed; with `expired`, also those never run), each only when it has
    /// a line, in input order, and sets the status, in one transaction.
    pub async fn finalize(&self, batch_id: String, status: BatchStatus, now: u64) -> Result<(), StoreError> {
        self.call(move |c| {
            let tx = c.transaction()?;
            let mut output = Vec::new();
            let mut errors = Vec::new();
            let mut expired = 0u64;
            {
                let mut query = tx.prepare("SELECT custom_id, done, succeeded, outcome FROM lines WHERE batch_id = ?1 ORDER BY line")?;
                let mut rows = query.query([&batch_id])?;
                while let Some(row) = rows.next()? {
                    let custom_id: Option<String> = row.get(0)?;
                    let done: bool = row.get(1)?;
                    if done {
                        let succeeded: bool = row.get(2)?;
                        let outcome: String = row.get(3)?;
                        let file = if succeeded { &mut output } else { &mut errors };
                        file.extend_from_slice(outcome.as_bytes());
                        file.push(b'\n');
                    } else if status == BatchStatus::Expired {
                        expired += 1;
                        let outcome = LineOutcome {
                            id: line_result_id(),
                            custom_id,
                            response: None,
                            error: Some(LineError {
                                code: "batch_expired".into(),
                                message: "This request could not be executed before the completion window expired.".into(),
                            }),
                        };
                        errors.extend_from_slice(to_json(&outcome).as_bytes());
                        errors.push(b'\n');
                    }
                }
            }
            let write = |content: Vec<u8>, name: &str| -> Result<Option<String>, StoreError> {
                if content.is_empty() {
                    return Ok(None);
                }
                let file = FileObject::new(format!("{batch_id}_{name}.jsonl"), "batch_output", content.len() as u64, now);
                insert_file(&tx, &file, &content)?;
                Ok(Some(file.id))
            };
            let output_id = write(output, "output")?;
            let error_id = write(errors, "error")?;
            tx.execute(
                "UPDATE batches SET output_file_id = ?2, error_file_id = ?3, failed = failed + ?4 WHERE id = ?1",
                params![batch_id, output_id, error_id, expired as i64],
            )?;
            set_status(&tx, &batch_id, status, now)?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    /// Ends a batch that cannot run at all in `failed`, with why.
    pub async fn fail(&self, batch_id: String, errors: Vec<BatchErrorEntry>, now: u64) -> Result<(), StoreError> {
        self.call(move |c| {
            let tx = c.transaction()?;
            tx.execute("UPDATE batches SET errors = ?2 WHERE id = ?1", params![batch_id, to_json(&errors)])?;
            set_status(&tx, &batch_id, BatchStatus::Failed, now)?;
            tx.commit()?;
            Ok(())
        })
        .await
    }
}

/// Checks that `dir` can hold the database and is not in use, without
/// keeping it (the launcher asks before starting anything).
pub fn check_available(dir: &Path) -> Result<(), StoreError> {
    open_connection(dir).map(drop)
}

fn open_connection(dir: &Path) -> Result<Connection, StoreError> {
    create_private_dir(dir)?;
    let path = dir.join(DB_FILE);
    let connection = Connection::open(&path)?;
    // Another server's lock is an answer, not something to wait for.
    connection.busy_timeout(std::time::Duration::ZERO)?;
    // Exclusive locking before the first access to a WAL database: SQLite
    // then keeps the WAL index in memory (no -shm file) and holds the lock
    // for as long as the connection lives.
    connection.pragma_update(None, "locking_mode", "EXCLUSIVE")?;
    let in_use = |e: rusqlite::Error| match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => StoreError::InUse(dir.to_path_buf()),
        _ => StoreError::Sqlite(e),
    };
    connection.pragma_update(None, "journal_mode", "WAL").map_err(in_use)?;
    connection.pragma_update(None, "synchronous", "FULL")?;
    // Takes the lock now rather than at the first batch.
    connection.execute_batch("BEGIN EXCLUSIVE; COMMIT;").map_err(in_use)?;
    connection.execute_batch(SCHEMA)?;
    Ok(connection)
}

fn create_private_dir(dir: &Path) -> Result<(), StoreError> {
    let failed = |e| StoreError::Dir(dir.to_path_buf(), e);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(failed)
    }
    #[cfg(not(unix))]
    std::fs::create_dir_all(dir).map_err(failed)
}

/// The `seq` below which a page after `after` starts: past the newest for
/// None, None when `after` names nothing in `table`.
fn seq_of(c: &Connection, table: &str, after: Option<&str>) -> Result<Option<i64>, StoreError> {
    match after {
        None => Ok(Some(i64::MAX)),
        Some(id) => Ok(c.query_row(&format!("SELECT seq FROM {table} WHERE id = ?1"), [id], |r| r.get(0)).optional()?),
    }
}

fn insert_file(c: &Connection, file: &FileObject, content: &[u8]) -> Result<(), StoreError> {
    c.execute(
        "INSERT INTO files (id, purpose, filename, bytes, created_at, content) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![file.id, file.purpose, file.filename, file.bytes as i64, file.created_at as i64, content],
    )?;
    Ok(())
}

const FILE_COLUMNS: &str = "id, purpose, filename, bytes, created_at";

fn file_row(row: &rusqlite::Row) -> rusqlite::Result<FileObject> {
    let mut file = FileObject::new(row.get(2)?, "", row.get::<_, i64>(3)? as u64, row.get::<_, i64>(4)? as u64);
    file.id = row.get(0)?;
    file.purpose = row.get(1)?;
    Ok(file)
}

impl FileObject {
    /// A new file's object, with a fresh id.
    pub fn new(filename: String, purpose: &str, bytes: u64, created_at: u64) -> Self {
        Self {
            id: format!("file-{}", uuid::Uuid::new_v4().simple()),
            object: "file",
            bytes,
            created_at,
            filename,
            purpose: purpose.to_string(),
            status: "processed",
            expires_at: None,
            status_details: None,
        }
    }
}

const BATCH_COLUMNS: &str = "id, endpoint, input_file_id, completion_window, status, created_at, expires_at,
    in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at,
    output_file_id, error_file_id, errors, metadata, total, completed, failed,
    input_tokens, cached_tokens, output_tokens, compute_seconds";

/// One `batches` row as its object; the outer error is SQLite's, the inner
/// one a value this code did not write.
fn batch_row(row: &rusqlite::Row, model: &str, hourly_cost: Option<f64>) -> Result<BatchObject, StoreError> {
    let time = |i: usize| -> rusqlite::Result<Option<u64>> { Ok(row.get::<_, Option<i64>>(i)?.map(|t| t as u64)) };
    let endpoint: String = row.get(1)?;
    let errors: Option<String> = row.get(16)?;
    let metadata: Option<String> = row.get(17)?;
    let count = |i: usize| -> rusqlite::Result<u64> { Ok(row.get::<_, i64>(i)? as u64) };
    let (input_tokens, cached_tokens, output_tokens) = (count(21)?, count(22)?, count(23)?);
    let compute_seconds: f64 = row.get(24)?;
    Ok(BatchObject {
        id: row.get(0)?,
        object: "batch",
        endpoint: Endpoint::from_path(&endpoint).ok_or_else(|| StoreError::Corrupt(format!("endpoint {endpoint:?}")))?,
        model: model.to_string(),
        errors: errors
            .map(|e| serde_json::from_str(&e).map(|data| BatchErrors { object: "list", data }))
            .transpose()
            .map_err(|e| StoreError::Corrupt(format!("errors: {e}")))?,
        input_file_id: row.get(2)?,
        completion_window: row.get(3)?,
        status: parse_status(&row.get::<_, String>(4)?)?,
        created_at: row.get::<_, i64>(5)? as u64,
        expires_at: row.get::<_, i64>(6)? as u64,
        in_progress_at: time(7)?,
        finalizing_at: time(8)?,
        completed_at: time(9)?,
        failed_at: time(10)?,
        expired_at: time(11)?,
        cancelling_at: time(12)?,
        cancelled_at: time(13)?,
        output_file_id: row.get(14)?,
        error_file_id: row.get(15)?,
        metadata: metadata
            .map(|m| serde_json::from_str(&m))
            .transpose()
            .map_err(|e| StoreError::Corrupt(format!("metadata: {e}")))?,
        request_counts: RequestCounts { total: count(18)?, completed: count(19)?, failed: count(20)? },
        usage: BatchUsage {
            input_tokens,
            input_tokens_details: InputTokensDetails { cached_tokens },
            output_tokens,
            output_tokens_details: OutputTokensDetails { reasoning_tokens: 0 },
            total_tokens: input_tokens + output_tokens,
            compute_seconds,
            cost_dollars: hourly_cost.map(|dollars| dollars * compute_seconds / 3600.0),
        },
    })
}

fn parse_status(name: &str) -> Result<BatchStatus, StoreError> {
    BatchStatus::parse(name).ok_or_else(|| StoreError::Corrupt(format!("status {name:?}")))
}

fn status_of(tx: &Transaction, id: &str) -> Result<Option<BatchStatus>, StoreError> {
    let status: Option<String> = tx.query_row("SELECT status FROM batches WHERE id = ?1", [id], |r| r.get(0)).optional()?;
    status.map(|s| parse_status(&s)).transpose()
}

fn set_status(tx: &Transaction, id: &str, status: BatchStatus, now: u64) -> Result<(), StoreError> {
    // The column name comes from the enum, never from input.
    tx.execute(
        &format!("UPDATE batches SET status = ?2, {}_at = ?3 WHERE id = ?1", status.name()),
        params![id, status.name(), now as i64],
    )?;
    Ok(())
}

/// The id of one line's result (`batch_req_...`).
pub fn line_result_id() -> String {
    format!("batch_req_{}", uuid::Uuid::new_v4().simple())
}

fn to_json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("plain data serializes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::types::LineResponse;

    fn temp_dir() -> PathBuf {
        std::env::temp_dir().join(format!("sluice-store-test-{}", uuid::Uuid::new_v4().simple()))
    }

    fn new_batch(id: &str) -> NewBatch {
        NewBatch {
            id: id.into(),
            endpoint: Endpoint::Completions,
            input_file_id: "file-x".into(),
            completion_window: "24h".into(),
            created_at: 1,
            expires_at: 100,
            metadata: None,
        }
    }

    fn answered(custom_id: &str, status_code: u16) -> LineOutcome {
        LineOutcome {
            id: line_result_id(),
            custom_id: Some(custom_id.into()),
            response: Some(LineResponse { status_code, request_id: "req".into(), body: serde_json::json!({"ok": custom_id}) }),
            error: None,
        }
    }

    fn request(line: u64) -> InputLine {
        InputLine::Request { line, custom_id: format!("c{line}"), body: "{}".into() }
    }

    #[tokio::test]
    async fn lines_finish_once_and_survive_a_reopen() {
        let dir = temp_dir();
        let store = Store::open(&dir).unwrap();
        let invalid = InputLine::Invalid { line: 2, custom_id: None, message: "line 2: bad".into() };
        store.create_batch(new_batch("b"), vec![request(1), invalid, request(3), request(4)]).await.unwrap();
        assert!(matches!(Store::open(&dir), Err(StoreError::InUse(_))), "a second server must not open it");
        // Lines finish only while the batch runs.
        assert!(!store.finish_line("b".into(), 1, answered("c1", 200), LineUsage::default()).await.unwrap());
        store.transition("b".into(), &[BatchStatus::Validating], BatchStatus::InProgress, 5).await.unwrap();
        let usage = LineUsage { input_tokens: 3, cached_tokens: 1, output_tokens: 2, compute_seconds: 0.5 };
        assert!(store.finish_line("b".into(), 3, answered("c3", 200), usage).await.unwrap());
        assert!(!store.finish_line("b".into(), 3, answered("c3", 200), usage).await.unwrap(), "done twice");
        assert!(store.finish_line("b".into(), 4, answered("c4", 400), LineUsage::default()).await.unwrap());
        let pending = store.pending_lines("b".into(), 0, 10).await.unwrap();
        assert_eq!(pending.iter().map(|l| l.line).collect::<Vec<_>>(), [1]);
        drop(store);

        // The lock went with the store; what was committed is there.
        let store = Store::open(&dir).unwrap();
        let batch = store.batch("b".into(), "m".into(), Some(3600.0)).await.unwrap().unwrap();
        assert_eq!(batch.request_counts, RequestCounts { total: 4, completed: 1, failed: 2 });
        assert_eq!((batch.usage.input_tokens, batch.usage.output_tokens, batch.usage.total_tokens), (3, 2, 5));
        assert_eq!(batch.usage.cost_dollars, Some(0.5));
        assert_eq!(batch.in_progress_at, Some(5));
        assert!(!store.all_done("b".into()).await.unwrap());

        // Expiry: the line never run goes to the error file, in input order.
        store.finalize("b".into(), BatchStatus::Expired, 9).await.unwrap();
        let batch = store.batch("b".into(), "m".into(), None).await.unwrap().unwrap();
        assert_eq!((batch.status, batch.expired_at), (BatchStatus::Expired, Some(9)));
        assert_eq!(batch.request_counts.failed, 3);
        let errors = store.file_content(batch.error_file_id.unwrap()).await.unwrap().unwrap();
        let errors: Vec<LineOutcome> =
            String::from_utf8(errors).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let codes: Vec<_> = errors
            .iter()
            .map(|e| (e.custom_id.clone(), e.error.as_ref().map(|e| e.code.clone()), e.response.as_ref().map(|r| r.status_code)))
            .collect();
        assert_eq!(
            codes,
            [
                (Some("c1".into()), Some("batch_expired".into()), None),
                (None, Some("invalid_request_line".into()), None),
                (Some("c4".into()), None, Some(400)),
            ]
        );
        let output = store.file_content(batch.output_file_id.unwrap()).await.unwrap().unwrap();
        assert_eq!(String::from_utf8(output).unwrap().lines().count(), 1);
        // An ended batch takes no more results.
        assert!(!store.finish_line("b".into(), 1, answered("c1", 200), LineUsage::default()).await.unwrap());
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn pages_go_newest_first() {
        let dir = temp_dir();
        let store = Store::open(&dir).unwrap();
        for id in ["a", "b", "c"] {
            store.create_batch(new_batch(id), vec![request(1)]).await.unwrap();
        }
        let ids = |batches: Vec<BatchObject>| batches.into_iter().map(|b| b.id).collect::<Vec<_>>();
        let page = store.batches(None, 2, "m".into(), None).await.unwrap().unwrap();
        assert_eq!(ids(page), ["c", "b", "a"], "limit + 1 rows tell whether there are more");
        let page = store.batches(Some("b".into()), 2, "m".into(), None).await.unwrap().unwrap();
        assert_eq!(ids(page), ["a"]);
        assert!(store.batches(Some("zz".into()), 2, "m".into(), None).await.unwrap().is_none());
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }
}

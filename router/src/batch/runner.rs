//! The batch runner: one task that moves batches through their states and
//! keeps their lines running.
//!
//! Every pass (a line finished, the bell rang, or a tick went by):
//!
//! ```text
//!  validating  ── no request line ──► failed
//!              └────────────────────► in_progress
//!  in_progress ── past expires_at ──► (lines in flight stopped) expired
//!              ── every line done ──► finalizing ──► completed
//!  cancelling  ── lines in flight stopped ─────────► cancelled
//!  then: start lines, oldest batch first, up to `capacity` in flight
//! ```
//!
//! A line runs as a task through the [`LineExecutor`] (the HTTP side's
//! generation driver, in the scheduler's batch class); its result is
//! committed before anything else happens to its batch, so the store never
//! says done for a line whose result it does not hold. Stopping a line (a
//! cancelled or expired batch, a draining server) aborts its task, which
//! drops its generation: the scheduler frees its blocks at the next step.
//! A line stopped by a draining server is still pending in the store and
//! runs again after the restart.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use serde_json::Value;
use tokio::sync::Notify;
use tokio::task::{AbortHandle, JoinSet};

use super::store::{line_result_id, ActiveBatch, LineUsage, PendingLine, Store, StoreError};
use super::types::{BatchErrorEntry, BatchStatus, Endpoint, LineOutcome, LineResponse};
use super::unix_now;

/// How often the runner looks at the clock (expiry) and the draining flag
/// when nothing else wakes it.
const TICK: Duration = Duration::from_millis(250);

/// Pending lines read from the store at a time.
const READ_AHEAD: usize = 256;

/// How long a line the server could not take (it was shutting down) waits
/// before it is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// What running one line came to.
#[derive(Debug, Clone, PartialEq)]
pub enum LineRun {
    /// The endpoint's answer (an error's too): it is the line's result.
    Answered { status_code: u16, body: Value, usage: LineUsage },
    /// The server could not take it now (shutting down): not a result, the
    /// line stays pending.
    Retry,
}

/// Runs one request line as its endpoint would (http/openai/batch_lines.rs).
pub trait LineExecutor: Send + Sync + 'static {
    fn run(&self, endpoint: Endpoint, body: String) -> BoxFuture<'static, LineRun>;
}

fn panicked() -> LineRun {
    tracing::error!("a batch line's request panicked");
    let body = serde_json::json!({"error": {"message": "the server failed this request", "type": "server_error", "param": null, "code": null}});
    LineRun::Answered { status_code: 500, body, usage: LineUsage::default() }
}

/// A line in flight.
struct Running {
    batch: String,
    line: PendingLine,
}

pub struct Runner {
    store: Store,
    executor: Arc<dyn LineExecutor>,
    wake: Arc<Notify>,
    /// Set when the server drains: every line in flight stops and nothing
    /// new starts.
    draining: Arc<AtomicBool>,
    /// Lines in flight at most.
    capacity: usize,
    tasks: JoinSet<(Running, LineRun)>,
    /// Per batch: the line numbers in flight and how to stop them.
    in_flight: HashMap<String, HashMap<u64, AbortHandle>>,
    /// Lines read from the store, not started yet, oldest batch first.
    queued: VecDeque<(String, Endpoint, PendingLine)>,
    /// Per batch: the last line read from the store.
    read_up_to: HashMap<String, u64>,
}

impl Runner {
    pub fn new(
        store: Store,
        executor: Arc<dyn LineExecutor>,
        wake: Arc<Notify>,
        draining: Arc<AtomicBool>,
        capacity: usize,
    ) -> Self {
        Self {
            store,
            executor,
            wake,
            draining,
            capacity: capacity.max(1),
            tasks: JoinSet::new(),
            in_flight: HashMap::new(),
            queued: VecDeque::new(),
            read_up_to: HashMap::new(),
        }
    }

    /// Runs until the server drains. A store failure is logged and retried
    /// at the next tick (a full disk may clear).
    pub async fn run(mut self) {
        loop {
            if self.draining.load(Ordering::SeqCst) {
                self.stop_all();
                return;
            }
            if let Err(error) = self.pass().await {
                tracing::error!(%error, "batch runner");
            }
            tokio::select! {
                Some(joined) = self.tasks.join_next(), if !self.tasks.is_empty() => {
                    if let Err(error) = self.on_joined(joined).await {
                        tracing::error!(%error, "batch runner: recording a line");
                    }
                }
                () = self.wake.notified() => {}
                () = tokio::time::sleep(TICK) => {}
            }
        }
    }

    /// Advances every batch's state, then starts lines into free capacity.
    async fn pass(&mut self) -> Result<(), StoreError> {
        let now = unix_now();
        for batch in self.store.active_batches().await? {
            self.advance(&batch, now).await?;
        }
        self.start_lines().await
    }

    async fn advance(&mut self, batch: &ActiveBatch, now: u64) -> Result<(), StoreError> {
        let id = batch.id.clone();
        match batch.status {
            BatchStatus::Validating => {
                if self.total(&id).await? == 0 {
                    let error = BatchErrorEntry {
                        code: "empty_file".into(),
                        message: "the input file holds no request line".into(),
                        param: Some("input_file_id".into()),
                        line: None,
                    };
                    self.store.fail(id, vec![error], now).await?;
                } else {
                    self.store.transition(id, &[BatchStatus::Validating], BatchStatus::InProgress, now).await?;
                }
            }
            BatchStatus::InProgress if now >= batch.expires_at => {
                self.stop_batch(&id);
                tracing::warn!(batch = %id, "batch expired");
                self.store.finalize(id, BatchStatus::Expired, now).await?;
            }
            BatchStatus::InProgress => {
                let running = self.in_flight.get(&id).is_some_and(|lines| !lines.is_empty());
                let idle = !running && !self.queued.iter().any(|(b, _, _)| *b == id);
                if idle && self.store.all_done(id.clone()).await? {
                    self.store.transition(id.clone(), &[BatchStatus::InProgress], BatchStatus::Finalizing, now).await?;
                    self.finish(id, BatchStatus::Completed, now).await?;
                }
            }
            // A restart between the two steps above.
            BatchStatus::Finalizing => self.finish(id, BatchStatus::Completed, now).await?,
            BatchStatus::Cancelling => {
                self.stop_batch(&id);
                self.finish(id, BatchStatus::Cancelled, now).await?;
            }
            _ => {}
        }
        Ok(())
    }

    async fn finish(&mut self, id: String, status: BatchStatus, now: u64) -> Result<(), StoreError> {
        self.read_up_to.remove(&id);
        self.store.finalize(id.clone(), status, now).await?;
        tracing::info!(batch = %id, status = status.name(), "batch finished");
        Ok(())
    }

    async fn total(&self, id: &str) -> Result<u64, StoreError> {
        let id = id.to_string();
        self.store
            .call(move |c| Ok(c.query_row("SELECT total FROM batches WHERE id = ?1", [&id], |r| r.get::<_, i64>(0))? as u64))
            .await
    }

    /// Starts queued lines while there is room, reading more from the
    /// store (batches in creation order) when the queue runs dry.
    async fn start_lines(&mut self) -> Result<(), StoreError> {
        while self.tasks.len() < self.capacity {
            if self.queued.is_empty() && !self.read_more().await? {
                return Ok(());
            }
            let Some((batch, endpoint, line)) = self.queued.pop_front() else { return Ok(()) };
            // A panic in the line's path answers it with a 500 instead of
            // leaving it pending forever.
            let run = std::panic::AssertUnwindSafe(self.executor.run(endpoint, line.body.clone())).catch_unwind();
            let number = line.line;
            let running = Running { batch: batch.clone(), line };
            let handle = self.tasks.spawn(async move { (running, run.await.unwrap_or_else(|_| panicked())) });
            self.in_flight.entry(batch).or_default().insert(number, handle);
        }
        Ok(())
    }

    /// Reads the next pending lines of the oldest in-progress batch that
    /// has unread ones; false when there are none.
    async fn read_more(&mut self) -> Result<bool, StoreError> {
        for batch in self.store.active_batches().await? {
            if batch.status != BatchStatus::InProgress {
                continue;
            }
            let after = self.read_up_to.get(&batch.id).copied().unwrap_or(0);
            let lines = self.store.pending_lines(batch.id.clone(), after, READ_AHEAD).await?;
            let Some(last) = lines.last() else { continue };
            self.read_up_to.insert(batch.id.clone(), last.line);
            self.queued.extend(lines.into_iter().map(|line| (batch.id.clone(), batch.endpoint, line)));
            return Ok(true);
        }
        Ok(false)
    }

    async fn on_joined(&mut self, joined: Result<(Running, LineRun), tokio::task::JoinError>) -> Result<(), StoreError> {
        let (running, run) = match joined {
            Ok(result) => result,
            Err(error) if error.is_cancelled() => return Ok(()), // stopped on purpose
            Err(error) => std::panic::resume_unwind(error.into_panic()), // caught in the task already
        };
        let Running { batch, line } = running;
        if let Some(lines) = self.in_flight.get_mut(&batch) {
            lines.remove(&line.line);
        }
        match run {
            LineRun::Answered { status_code, body, usage } => {
                let outcome = LineOutcome {
                    id: line_result_id(),
                    custom_id: Some(line.custom_id.clone()),
                    response: Some(LineResponse { status_code, request_id: format!("req_{}", uuid::Uuid::new_v4().simple()), body }),
                    error: None,
                };
                let succeeded = outcome.succeeded();
                if self.store.finish_line(batch, line.line, outcome, usage).await? {
                    crate::metrics::batch_line(succeeded, usage.input_tokens, usage.output_tokens);
                }
            }
            LineRun::Retry => {
                tokio::time::sleep(RETRY_AFTER).await;
                let endpoint = self.store.active_batches().await?.into_iter().find(|b| b.id == batch).map(|b| b.endpoint);
                if let Some(endpoint) = endpoint {
                    self.queued.push_front((batch, endpoint, line));
                }
            }
        }
        Ok(())
    }

    /// Stops every line of `batch` in flight or queued.
    fn stop_batch(&mut self, batch: &str) {
        for (_, handle) in self.in_flight.remove(batch).unwrap_or_default() {
            handle.abort();
        }
        self.queued.retain(|(b, _, _)| b != batch);
    }

    fn stop_all(&mut self) {
        let stopped: usize = self.in_flight.values().map(HashMap::len).sum();
        if stopped > 0 {
            tracing::info!(stopped, "draining: batch lines in flight stop and run again after the restart");
        }
        self.tasks.abort_all();
        self.in_flight.clear();
        self.queued.clear();
    }
}

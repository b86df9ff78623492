//! The responses /v1/responses keeps: for `previous_response_id`, GET,
//! DELETE and cancel. Bounded in count (`--responses-store-capacity`, the
//! oldest go first) and in age (`--responses-store-ttl`); a response that
//! was pushed out, expired or deleted is a 404 like one that never existed.
//!
//! Owner: `AppState` holds the one store; its state sits behind one mutex,
//! held only for map operations (never across an await).
//!
//! A stored conversation is a [`Turns`] chain: each response holds its own
//! turn (its input and output) and an `Arc` to the turns before it, so a
//! long conversation is stored once, however many of its responses are
//! kept, and outlives the eviction of its earlier responses' entries.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::AbortHandle;

use super::types::ResponseObject;
use crate::chat_template::TemplateMessage;

/// One response's turn of a conversation, after the turns before it.
#[derive(Debug, Default)]
pub struct Turns {
    pub before: Option<Arc<Turns>>,
    pub messages: Vec<TemplateMessage>,
}

impl Turns {
    /// Every message of the conversation, oldest first.
    pub fn messages(&self) -> Vec<TemplateMessage> {
        let mut chain = vec![self];
        while let Some(before) = chain.last().and_then(|t| t.before.as_deref()) {
            chain.push(before);
        }
        chain.iter().rev().flat_map(|t| t.messages.iter().cloned()).collect()
    }
}

#[derive(Debug, Clone)]
pub struct Stored {
    pub response: ResponseObject,
    /// The conversation up to and including this response.
    pub turns: Arc<Turns>,
}

struct Entry {
    stored: Stored,
    at: Instant,
    /// A background response still running: aborting its task drops its
    /// generation (the scheduler frees its blocks).
    running: Option<AbortHandle>,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// Ids in insertion order (an id deleted early stays here until it
    /// reaches the front, where it is skipped).
    order: VecDeque<String>,
}

pub struct ResponseStore {
    inner: Mutex<Inner>,
    capacity: usize,
    ttl: Duration,
}

/// Why an id has no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("no response with id `{0}`: it was never stored (`store: false`), was deleted, or was evicted (the server keeps the last --responses-store-capacity responses for --responses-store-ttl seconds)")]
    NotFound(String),
    #[error("response `{0}` is not running in the background: only background responses can be cancelled")]
    NotCancellable(String),
}

impl ResponseStore {
    pub fn new(capacity: usize, ttl: Duration) -> Self {
        Self { inner: Mutex::new(Inner::default()), capacity, ttl }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // The map stays consistent even if a holder panicked: every
        // operation below is one insert or remove.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keeps `stored` under its id; `running`: the task of a background response.
    pub fn insert(&self, stored: Stored, running: Option<AbortHandle>) {
        let now = Instant::now();
        let mut inner = self.lock();
        let id = stored.response.id.clone();
        if inner.entries.insert(id.clone(), Entry { stored, at: now, running }).is_none() {
            inner.order.push_back(id);
        }
        self.evict(&mut inner, now);
    }

    /// Replaces a response that is still stored (a background response
    /// finishing); false when it is gone (deleted, evicted).
    pub fn update(&self, stored: Stored) -> bool {
        let mut inner = self.lock();
        match inner.entries.get_mut(&stored.response.id) {
            // Cancelled while it was finishing: it stays cancelled.
            Some(entry) if entry.stored.response.status == "cancelled" => false,
            Some(entry) => {
                entry.stored = stored;
                entry.running = None;
                true
            }
            None => false,
        }
    }

    pub fn get(&self, id: &str) -> Result<Stored, StoreError> {
        let now = Instant::now();
        let mut inner = self.lock();
        self.evict(&mut inner, now);
        inner.entries.get(id).map(|e| e.stored.clone()).ok_or_else(|| StoreError::NotFound(id.to_string()))
    }

    /// Forgets a response (a background one still running is stopped).
    pub fn delete(&self, id: &str) -> Result<(), StoreError> {
        let entry = self.lock().entries.remove(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        if let Some(task) = entry.running {
            task.abort();
        }
        Ok(())
    }

    /// Stops a background response and marks it cancelled; the response as
    /// it now stands.
    pub fn cancel(&self, id: &str) -> Result<Stored, StoreError> {
        let mut inner = self.lock();
        let entry = inner.entries.get_mut(id).ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        if !entry.stored.response.background {
            return Err(StoreError::NotCancellable(id.to_string()));
        }
        if let Some(task) = entry.running.take() {
            task.abort();
            entry.stored.response.status = "cancelled".into();
        }
        Ok(entry.stored.clone())
    }

    /// Drops expired entries and the oldest beyond capacity.
    fn evict(&self, inner: &mut Inner, now: Instant) {
        while let Some(id) = inner.order.front().cloned() {
            let expired = inner.entries.get(&id).is_none_or(|e| now.saturating_duration_since(e.at) > self.ttl);
            if !(expired || inner.entries.len() > self.capacity) {
                break;
            }
            inner.order.pop_front();
            // The id may have been deleted and stored again later: only an
            // entry stored at or before this position goes.
            if let Some(entry) = inner.entries.remove(&id) {
                if let Some(task) = entry.running {
                    task.abort();
                }
            }
        }
    }

    /// Entries held (tests, and the invariant below).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(id: &str) -> Stored {
        let response = ResponseObject { id: id.into(), ..ResponseObject::default() };
        Stored { response, turns: Arc::new(Turns::default()) }
    }

    #[test]
    fn the_oldest_go_first_and_the_count_is_bounded() {
        let store = ResponseStore::new(2, Duration::from_secs(60));
        for id in ["a", "b", "c"] {
            store.insert(stored(id), None);
        }
        assert_eq!(store.get("a").unwrap_err(), StoreError::NotFound("a".into()));
        assert!(store.get("b").is_ok() && store.get("c").is_ok());
        assert_eq!(store.len(), 2);
        store.delete("b").unwrap();
        assert!(store.get("b").is_err() && store.delete("b").is_err());
        store.insert(stored("d"), None);
        store.insert(stored("e"), None);
        assert!(store.get("c").is_err(), "capacity 2 holds d and e");
        assert!(store.get("d").is_ok() && store.get("e").is_ok());
    }

    #[test]
    fn entries_expire() {
        let store = ResponseStore::new(8, Duration::from_millis(20));
        store.insert(stored("a"), None);
        assert!(store.get("a").is_ok());
        std::thread::sleep(Duration::from_millis(40));
        assert!(store.get("a").is_err());
        assert_eq!(store.len(), 0);
    }

    #[test]
    fn a_conversation_outlives_its_evicted_turns() {
        let first = Arc::new(Turns { before: None, messages: vec![TemplateMessage::text("user", "1")] });
        let second = Arc::new(Turns { before: Some(first), messages: vec![TemplateMessage::text("assistant", "2")] });
        let store = ResponseStore::new(1, Duration::from_secs(60));
        store.insert(stored("first"), None);
        store.insert(Stored { turns: second, ..stored("second") }, None);
        let contents: Vec<String> = store.get("second").unwrap().turns.messages().into_iter().map(|m| m.content).collect();
        assert_eq!(contents, ["1", "2"]);
    }

    #[tokio::test]
    async fn only_background_responses_cancel() {
        let store = ResponseStore::new(8, Duration::from_secs(60));
        store.insert(stored("fg"), None);
        assert_eq!(store.cancel("fg").unwrap_err(), StoreError::NotCancellable("fg".into()));
        let task = tokio::spawn(std::future::pending::<()>());
        let mut bg = stored("bg");
        bg.response.background = true;
        bg.response.status = "in_progress".into();
        store.insert(bg, Some(task.abort_handle()));
        assert_eq!(store.cancel("bg").unwrap().response.status, "cancelled");
        assert!(task.await.unwrap_err().is_cancelled());
    }
}

//! The adapter work done between steps, before the next one is built: the
//! only time the shards' adapter slots change (`adapters.rs` keeps the
//! books).
//!
//! 1. Adapters unloaded by name that no request uses any more leave their
//!    slots (UnloadAdapter).
//! 2. Queued load commands (`POST /v1/load_lora_adapter`, `--lora-adapters`)
//!    run: each adapter is checked by the shards and goes into a slot if one
//!    is free or can be freed, else it is only checked (it is loaded when a
//!    request needs it). The caller gets the shards' reason when they refuse.
//! 3. Waiting requests whose adapter is in no slot get it loaded, in
//!    admission order (interactive requests first, then by priority), as far
//!    as the requests the next step could admit and the slots no running
//!    request uses allow. When that load fails, the
//!    adapter's waiting requests fail and its name is unloaded.
//!
//! Every RPC carries the finished ids not yet sent in a step, so the shard
//! drops those requests (which may have used the slot) first.

use std::collections::HashSet;

use super::adapters::AdapterId;
use super::queue::admission_order;
use super::Scheduler;
use crate::client::{ClientError, Shard};
use crate::infer::{AdapterError, AdapterLoaded, InferError, RequestClass, SchedulerFailure};
use crate::pb::{LoadAdapterRequest, LoadAdapterResponse, UnloadAdapterRequest};

impl Scheduler {
    /// Steps 1-3 of the module comment. Fails only when the shards do not
    /// answer in time (as a step past its deadline would).
    pub(crate) async fn adapter_work<S: Shard>(&mut self, shard: &mut S) -> Result<(), SchedulerFailure> {
        if !self.adapters.enabled() {
            return Ok(());
        }
        let used = self.adapters_in_use();
        for slot in self.adapters.collect(&used) {
            let request = UnloadAdapterRequest { slot, finished_ids: std::mem::take(&mut self.finished) };
            if let Err(e) = self.with_deadline(shard.unload_adapter(request)).await? {
                // The router's books say empty; the next load replaces it anyway.
                tracing::warn!(slot, "emptying an adapter slot failed: {e}");
            }
        }
        while let Some(load) = self.pending_loads.pop_front() {
            let result = self.load_command(shard, &load.name, &load.path).await?;
            let _ = load.reply.send(result);
        }
        self.load_for_waiting(shard).await?;
        self.publish_occupancy();
        Ok(())
    }

    /// The adapters of every waiting and running request.
    pub(crate) fn adapters_in_use(&self) -> HashSet<AdapterId> {
        self.waiting.iter().chain(&self.running).filter_map(|r| r.adapter).collect()
    }

    fn running_adapters(&self) -> HashSet<AdapterId> {
        self.running.iter().filter_map(|r| r.adapter).collect()
    }

    fn waiting_adapters(&self) -> HashSet<AdapterId> {
        self.waiting.iter().filter_map(|r| r.adapter).collect()
    }

    async fn with_deadline<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> Result<Result<T, ClientError>, SchedulerFailure> {
        let limit = self.config.step_deadline.steady;
        tokio::time::timeout(limit, call).await.map_err(|_| SchedulerFailure::AdapterDeadline(limit))
    }

    /// Loads adapter `id`'s folder into `slot` (0: only checks it).
    async fn load_into<S: Shard>(
        &mut self,
        shard: &mut S,
        slot: u32,
        path: &str,
    ) -> Result<Result<LoadAdapterResponse, ClientError>, SchedulerFailure> {
        if slot > 0 {
            self.adapters.vacate(slot);
        }
        let request = LoadAdapterRequest { slot, path: path.to_string(), finished_ids: std::mem::take(&mut self.finished) };
        self.with_deadline(shard.load_adapter(request)).await
    }

    /// A load command: register `name` for `path` once the shards accept it.
    async fn load_command<S: Shard>(
        &mut self,
        shard: &mut S,
        name: &str,
        path: &str,
    ) -> Result<Result<AdapterLoaded, AdapterError>, SchedulerFailure> {
        if self.adapters.is_registered(name) {
            return Ok(Err(AdapterError::Invalid {
                field: "lora_name",
                message: format!("an adapter named `{name}` is already loaded; unload it first"),
            }));
        }
        let slot = self.adapters.pick_slot(&self.running_adapters(), &self.waiting_adapters()).unwrap_or(0);
        let answer = match self.load_into(shard, slot, path).await? {
            Ok(answer) => answer,
            Err(e) => return Ok(Err(refusal(name, e))),
        };
        let id = self.adapters.register(name.to_string(), path.to_string());
        if slot > 0 {
            self.adapters.placed(id, slot);
        }
        crate::metrics::adapter_loaded();
        tracing::info!(adapter = name, path, slot, rank = answer.rank, "adapter loaded");
        Ok(Ok(AdapterLoaded { rank: answer.rank, target_modules: answer.target_modules, slot: (slot > 0).then_some(slot) }))
    }

    /// Step 3: slots for the adapters of the requests admission may take next.
    async fn load_for_waiting<S: Shard>(&mut self, shard: &mut S) -> Result<(), SchedulerFailure> {
        // Interactive requests may also take the slots of batch lines above
        // their floor (admission.rs preempts those).
        let preemptible = if self.interactive_waiting() {
            self.running_of(RequestClass::Batch).saturating_sub(self.batch_floor().slots)
        } else {
            0
        };
        let room = (self.config.max_batch_size as usize).saturating_sub(self.running.len()) + preemptible;
        if room == 0 || self.waiting.is_empty() {
            return Ok(());
        }
        let mut needed = Vec::new();
        for id in admission_order(self.waiting.iter(), &self.kv).into_iter().take(room) {
            let r = self.waiting.iter().find(|r| r.id == id).expect("ranked from waiting");
            match r.adapter {
                Some(a) if self.adapters.slot_of(a).is_none() && !needed.contains(&a) => needed.push(a),
                _ => {}
            }
        }
        // Adapters loaded now are pinned too, until their requests run.
        let mut pinned = self.running_adapters();
        for adapter in needed {
            let Some(slot) = self.adapters.pick_slot(&pinned, &self.waiting_adapters()) else { break };
            let path = self.adapters.path(adapter).to_string();
            match self.load_into(shard, slot, &path).await? {
                Ok(_) => {
                    self.adapters.placed(adapter, slot);
                    crate::metrics::adapter_loaded();
                    pinned.insert(adapter);
                }
                Err(e) => self.adapter_broken(adapter, e),
            }
        }
        Ok(())
    }

    /// An adapter that loaded before cannot be loaded now (its files changed):
    /// the requests waiting for it fail, and its name is unloaded.
    fn adapter_broken(&mut self, adapter: AdapterId, error: ClientError) {
        let name = self.adapters.name(adapter).to_string();
        let reason = refusal(&name, error);
        tracing::error!(adapter = name, "{reason}; unloading it");
        let (failed, waiting) = std::mem::take(&mut self.waiting).into_iter().partition(|r| r.adapter == Some(adapter));
        self.waiting = waiting;
        for r in failed {
            r.send(Err(InferError::Generation(reason.to_string())));
        }
        self.adapters.retire(adapter);
    }
}

/// The shards' answer to a load, as the caller sees it: INVALID_ARGUMENT is
/// the adapter's fault (their message says what), anything else theirs.
fn refusal(name: &str, error: ClientError) -> AdapterError {
    match error {
        ClientError::Status(status) if status.code() == tonic::Code::InvalidArgument => {
            AdapterError::Refused { name: name.into(), message: status.message().to_string() }
        }
        other => AdapterError::Shard { name: name.into(), message: other.to_string() },
    }
}

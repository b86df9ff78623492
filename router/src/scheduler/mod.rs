//! The scheduler: one tokio task that owns every request's state, the KV
//! block allocator and the prefix tree, and runs the shard group one step at
//! a time (iteration-level continuous batching).
//!
//! ```text
//!  Infer::generate ──Command──►┌──────────── scheduler task ─────────────┐
//!                              │ waiting (queue.rs)   running  kv.rs     │
//!                              │   (blocks.rs allocator, radix.rs tree)  │
//!                              │   1 cancel    (step.rs)                 │
//!                              │   2 running: decode / next chunk,       │
//!                              │     blocks on demand (preemption.rs),   │
//!                              │     drafts (drafts.rs, speculation.rs)  │
//!                              │   3 admit waiting (admission.rs)        │
//!                              │   4 all decoding, none waiting: several │
//!                              │     draws per Step (multistep.rs)       │
//!                              │   ──Step──► shard ──► apply (apply.rs)  │
//!                              └──── InferEvent per request ─────────────┘
//! ```
//!
//! A request's KV blocks are its `kv::BlockTable`: they go back to the
//! allocator when the request is dropped, whichever way it leaves; caching
//! its full blocks in the prefix tree is a separate, explicit step.
//!
//! Commands keep arriving while a step is in flight (submissions join the
//! waiting queue); the next step is built as soon as the last one returns.
//! A `Stats` snapshot carries the token counts of recent traffic
//! (`window.rs`), from which /metrics derives its window gauges.
//!
//! LoRA adapters: the scheduler also owns the adapter registry and the
//! shards' adapter slots (`adapters.rs`). Before building a step it loads
//! what the next step needs and empties what nobody needs
//! (`adapter_work.rs`); admission takes a request only once its adapter is
//! in a slot, and a slot that running requests use never changes. Each
//! adapter has its own prefix-cache namespace (radix.rs).
//!
//! Invariants of [`Scheduler`], asserted after every step in debug builds
//! (`check_invariants`):
//! - a block is free, or referenced by running requests and/or the tree, and
//!   its ref count is exactly (running tables listing it) + (1 if cached);
//! - waiting requests hold no blocks;
//! - no block has two writers: a running request's blocks from index
//!   `num_computed_tokens / block_size` on (the ones it writes) are referenced by
//!   it alone and are not in the tree;
//! - a running request's blocks cover its computed tokens, and at least one
//!   of its tokens is not computed yet (the one to compute next);
//! - at most `max_batch_size` requests run;
//! - every running request's adapter is in a slot (and the registry's own
//!   invariants, `Adapters::check_invariants`);
//! - when no request is running or waiting, free + cached = total.

mod adapter_work;
mod adapters;
mod admission;
mod apply;
pub mod blocks;
mod cost;
mod drafts;
mod kv;
mod multistep;
mod preemption;
mod queue;
pub mod radix;
mod request;
mod share;
mod speculation;
mod step;
mod trace;
mod window;

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

use crate::client::Shard;
use crate::infer::{Command, Entry, Infer, InferError, RequestClass, SchedulerFailure, SchedulerStats, ShardInfo};

pub use speculation::SpeculationConfig;

use adapters::{Adapters, PendingLoad};
use cost::StepCosts;
use kv::KvCache;
use request::Request;
use window::TokenWindow;

/// The scheduler's limits, fixed at startup.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens computed per step, summed over requests (a decode counts 1).
    pub max_batch_prefill_tokens: u32,
    /// KV token slots in all (num_blocks * block_size unless capped lower;
    /// 0: no cap). Only this many slots' worth of blocks are handed out.
    pub max_batch_total_tokens: u32,
    /// Requests per step.
    pub max_batch_size: u32,
    /// Waiting + running; over it -> `InferError::Overloaded` (HTTP 429).
    pub max_concurrent_requests: u32,
    pub block_size: u32,
    pub num_blocks: u32,
    pub prefix_caching: bool,
    pub eos_token_ids: Vec<u32>,
    /// Span of the sliding window behind the window gauges of /metrics
    /// (`--cost-window-secs`, at least one second).
    pub metrics_window: Duration,
    /// How long one Step RPC may take before the shards count as stuck.
    pub step_deadline: StepDeadline,
    /// Test-only (SLUICE_FAULT=router-scheduler-panic:N): panic before the
    /// N-th step. Always None in production.
    pub panic_at_step: Option<u64>,
    /// Speculative decoding (`--speculate ngram`); None: off.
    pub speculation: Option<SpeculationConfig>,
    /// Fraction of the running slots and step budget batch lines may
    /// always use while pending (`--batch-min-share`, in [0, 1); share.rs).
    pub batch_min_share: f64,
    /// While interactive requests run, batch lines may lengthen a step by
    /// at most this fraction of its predicted time (`--batch-step-slack`;
    /// cost.rs, share.rs).
    pub batch_step_slack: f64,
    /// Dollars per hour (`--hourly-cost`): each step's cost is shared out
    /// to the adapters (and the base model) of its requests in /metrics.
    pub hourly_cost: Option<f64>,
    /// Most tokens one Step may draw per decoding request (`--decode-steps`;
    /// multistep.rs); 1: one.
    pub decode_steps: u32,
    /// While requests decode, a step is kept to about this long by its
    /// budget (`--decode-stall-ms`; step.rs); None: the budget alone.
    pub decode_stall: Option<Duration>,
}

/// How long one Step RPC may take. Past it the scheduler fails every request
/// in flight and stops (`SchedulerFailure::StepDeadline`): a shard that
/// does not answer (stopped, deadlocked in a collective) would otherwise
/// hold every request, and every slot, forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepDeadline {
    /// Every step's limit (`--step-timeout`).
    pub steady: Duration,
    /// The limit of the first [`StepDeadline::FIRST_STEPS`] steps
    /// (`--first-steps-timeout`), only while the shards said they may still
    /// compile kernels for shapes warmup did not run
    /// (`WarmupResponse.compilation_pending`: Triton on CUDA). None: nothing
    /// compiles after warmup (CPU), so a stuck shard is caught at `steady`
    /// from the first step.
    pub first_steps: Option<Duration>,
}

impl StepDeadline {
    pub const FIRST_STEPS: u64 = 16;

    /// The limit of the step that follows `steps_done` finished ones.
    pub fn for_step(&self, steps_done: u64) -> Duration {
        match self.first_steps {
            Some(first) if steps_done < Self::FIRST_STEPS => first.max(self.steady),
            _ => self.steady,
        }
    }
}

impl Default for StepDeadline {
    fn default() -> Self {
        Self { steady: Duration::from_secs(120), first_steps: None }
    }
}

/// Starts the scheduler task; the returned handle submits to it. The task
/// ends when every `Infer` clone is dropped and no request is left, or when
/// it fails ([`Infer::failed`] then resolves).
pub fn spawn<S: Shard>(shard: S, config: SchedulerConfig, info: ShardInfo) -> Infer {
    let (commands, receiver) = mpsc::channel(1024);
    let mut scheduler = Scheduler::new(config, info.max_loras);
    let adapters = scheduler.adapters.catalog();
    // The queue and KV gauges exist from the first scrape (an endpoint
    // picker reads them before any request arrives).
    scheduler.publish_occupancy();
    let (failure_tx, failure) = watch::channel(None);
    let task = tokio::spawn(run(scheduler, shard, receiver));
    tokio::spawn(async move {
        let failure = match task.await {
            Ok(Ok(())) => return,
            Ok(Err(failure)) => failure,
            Err(e) if e.is_panic() => SchedulerFailure::Panicked(panic_message(e.into_panic())),
            Err(_) => return, // cancelled: the runtime is shutting down
        };
        tracing::error!("{failure}");
        let _ = failure_tx.send(Some(failure));
    });
    Infer { commands, info: Arc::new(info), failure, adapters }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(message) => *message,
        Err(payload) => payload.downcast_ref::<&str>().map_or("(no message)", |m| m).to_string(),
    }
}

async fn run<S: Shard>(
    mut scheduler: Scheduler,
    mut shard: S,
    mut commands: mpsc::Receiver<Command>,
) -> Result<(), SchedulerFailure> {
    let mut open = true;
    loop {
        while let Ok(command) = commands.try_recv() {
            scheduler.handle(command);
        }
        if let Err(failure) = scheduler.adapter_work(&mut shard).await {
            scheduler.fail_all(&failure);
            return Err(failure);
        }
        let plan = scheduler.build_step();
        if plan.is_empty() {
            // Nothing can run: wait for the world to change.
            if !open && scheduler.is_idle() {
                return Ok(());
            }
            match commands.recv().await {
                Some(command) => scheduler.handle(command),
                None if scheduler.is_idle() => return Ok(()),
                None => open = false,
            }
            continue;
        }
        if scheduler.config.panic_at_step == Some(scheduler.stats.steps + 1) {
            panic!("SLUICE_FAULT: injected scheduler panic before step {}", scheduler.stats.steps + 1);
        }
        let request = scheduler.to_proto(&plan);
        let (step_span, step_trace) = scheduler.trace_step(&plan);
        let started = Instant::now();
        // Tokio's clock: tests that pause time see the fake shard's latency.
        let clock = tokio::time::Instant::now();
        let limit = scheduler.config.step_deadline.for_step(scheduler.stats.steps);
        scheduler.stats.step_in_flight_since = Some(started);
        scheduler.stats.step_deadline = Some(started + limit);
        let deadline = tokio::time::sleep(limit);
        let step = shard.step_traced(request, step_trace);
        tokio::pin!(step, deadline);
        let result = loop {
            tokio::select! {
                result = &mut step => break Some(result),
                () = &mut deadline => break None,
                command = commands.recv(), if open => match command {
                    Some(command) => scheduler.handle(command),
                    None => open = false,
                },
            }
        };
        let Some(result) = result else {
            let failure = SchedulerFailure::StepDeadline(limit);
            scheduler.fail_all(&failure);
            return Err(failure);
        };
        if let Ok(response) = &result {
            // A multi-step decode ran its passes one after another: each
            // counts as a step of the plan's size.
            let passes = plan.passes(response);
            scheduler.costs.record(plan.tokens(), clock.elapsed() / passes);
        }
        scheduler.apply(plan, result, started);
        drop(step_span);
        if cfg!(debug_assertions) {
            scheduler.check_invariants();
        }
    }
}

pub(crate) struct Scheduler {
    config: SchedulerConfig,
    /// Front first; preempted requests re-enter at the front.
    waiting: VecDeque<Request>,
    /// Admission order, oldest first: the last one is preempted first.
    running: Vec<Request>,
    kv: KvCache,
    /// Requests whose shard-side state goes in the next step's
    /// `finished_ids`.
    finished: Vec<u64>,
    next_id: u64,
    next_admission: u64,
    draining: bool,
    drained: Vec<oneshot::Sender<()>>,
    stats: SchedulerStats,
    /// Recent token counts (window.rs), reported with every snapshot.
    window: TokenWindow,
    /// LoRA adapters: the registry and the slots.
    adapters: Adapters,
    /// Load commands for the next point between steps (adapter_work.rs).
    pending_loads: VecDeque<PendingLoad>,
    /// Step time by tokens, learnt from the steps run (cost.rs).
    costs: StepCosts,
}

impl Scheduler {
    fn new(mut config: SchedulerConfig, max_loras: u32) -> Self {
        assert!(config.block_size > 0 && config.max_batch_prefill_tokens > 0 && config.max_batch_size > 0);
        // max_batch_total_tokens caps the blocks in use (0: no cap).
        if config.max_batch_total_tokens > 0 {
            config.num_blocks = config.num_blocks.min(config.max_batch_total_tokens / config.block_size);
        }
        let kv = KvCache::new(config.num_blocks, config.block_size, config.prefix_caching);
        let stats = SchedulerStats { blocks_total: config.num_blocks, ..Default::default() };
        let window = TokenWindow::new(config.metrics_window, Instant::now());
        Self {
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            kv,
            finished: Vec::new(),
            next_id: 0,
            next_admission: 0,
            draining: false,
            drained: Vec::new(),
            stats,
            window,
            adapters: Adapters::new(max_loras),
            pending_loads: VecDeque::new(),
            costs: StepCosts::default(),
        }
    }

    fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(entries, ack) => {
                let result = self.submit(entries);
                // A dropped ack means the caller is gone; the request's
                // closed event channel cancels it at the next step.
                let _ = ack.send(result);
            }
            Command::Stats(reply) => {
                let _ = reply.send(self.snapshot());
            }
            Command::Drain(reply) => {
                self.draining = true;
                self.drained.push(reply);
            }
            Command::LoadAdapter { name, path, reply } if self.adapters.enabled() => {
                self.pending_loads.push_back(PendingLoad { name, path, reply });
            }
            Command::UnloadAdapter { name, reply } if self.adapters.enabled() => {
                let result = self.adapters.unregister(&name);
                if result.is_ok() {
                    tracing::info!(adapter = name, "adapter unloaded (its running requests finish with it)");
                }
                let _ = reply.send(result);
            }
            Command::LoadAdapter { reply, .. } => {
                let _ = reply.send(Err(crate::infer::AdapterError::Disabled));
            }
            Command::UnloadAdapter { reply, .. } => {
                let _ = reply.send(Err(crate::infer::AdapterError::Disabled));
            }
        }
        self.notify_drained();
    }

    fn submit(&mut self, entries: Vec<Entry>) -> Result<(), InferError> {
        if self.draining {
            return Err(InferError::ShuttingDown);
        }
        let limit = self.config.max_concurrent_requests as usize;
        if entries.len() > limit {
            return Err(InferError::Unschedulable(format!(
                "the request asks for {} sequences; the server runs at most {limit} at once",
                entries.len()
            )));
        }
        // Batch lines do not count: the batch runner bounds its own, and they
        // must never make an interactive request wait for a 429.
        let active = self.waiting.len() + self.running.len() - self.count(RequestClass::Batch);
        let asked = entries.iter().filter(|e| e.request.class == RequestClass::Interactive).count();
        if asked > 0 && active + asked > limit {
            // The client learns no queue depth; the log does.
            tracing::debug!(active, asked, "overloaded: --max-concurrent-requests reached");
            return Err(InferError::Overloaded(
                "the server is at its limit of concurrent requests; retry shortly".into(),
            ));
        }
        let mut adapters = Vec::with_capacity(entries.len());
        for entry in &entries {
            self.check_schedulable(entry)?;
            let adapter = entry.request.adapter.as_deref().map(|name| self.adapters.resolve(name));
            adapters.push(adapter.transpose().map_err(InferError::UnknownAdapter)?);
        }
        for (entry, adapter) in entries.into_iter().zip(adapters) {
            let id = self.next_id;
            self.next_id += 1;
            self.waiting.push_back(Request::new(id, entry, self.kv.new_table(), adapter));
        }
        self.publish_occupancy();
        Ok(())
    }

    /// Rejects what could never run, however empty the server: without this
    /// a request larger than the KV cache would wait (or be preempted)
    /// forever.
    fn check_schedulable(&self, entry: &Entry) -> Result<(), InferError> {
        let request = &entry.request;
        if request.input_ids.is_empty() {
            return Err(InferError::Unschedulable("the prompt has no tokens".into()));
        }
        if request.max_new_tokens == 0 {
            return Err(InferError::Unschedulable("max_new_tokens must be at least 1".into()));
        }
        let total = request.input_ids.len() as u64 + request.max_new_tokens as u64;
        let slots = self.config.num_blocks as u64 * self.config.block_size as u64;
        if total > slots {
            return Err(InferError::Unschedulable(format!(
                "prompt ({} tokens) + max_new_tokens ({}) = {total} exceeds the KV cache ({slots} token slots)",
                request.input_ids.len(),
                request.max_new_tokens
            )));
        }
        Ok(())
    }

    /// The scheduler stops: every request, running or waiting, ends with an
    /// error that says why (clients see it before the router exits).
    fn fail_all(&mut self, failure: &SchedulerFailure) {
        for r in self.running.drain(..).chain(self.waiting.drain(..)) {
            r.send(Err(failure.unavailable()));
        }
    }

    fn notify_drained(&mut self) {
        if self.draining && self.is_idle() {
            for reply in self.drained.drain(..) {
                let _ = reply.send(());
            }
        }
    }

    fn snapshot(&mut self) -> SchedulerStats {
        self.kv.reclaim();
        SchedulerStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            blocks_total: self.config.num_blocks,
            blocks_free: self.kv.num_free(),
            blocks_cached: self.kv.num_cached(),
            window: self.window.totals(Instant::now()),
            adapters: self.adapters.stats(),
            ..self.stats.clone()
        }
    }

    /// The queue, batch and KV gauges of /metrics.
    fn publish_occupancy(&mut self) {
        self.kv.reclaim();
        crate::metrics::occupancy(crate::metrics::Occupancy {
            waiting: self.waiting.len(),
            running: self.running.len(),
            blocks_total: self.config.num_blocks,
            blocks_free: self.kv.num_free(),
            blocks_cached: self.kv.num_cached(),
            tree_blocks: self.kv.tree_blocks(),
        });
        if self.adapters.enabled() {
            let active: HashSet<u32> = self.adapters.slots_of(self.running.iter().filter_map(|r| r.adapter)).collect();
            crate::metrics::adapter_occupancy(&self.adapters.stats(), active.len());
        }
    }

    fn position(&self, id: u64) -> Option<usize> {
        self.running.iter().position(|r| r.id == id)
    }

    /// Panics with a description of the first broken invariant (see the
    /// module comment). Runs after every step where debug assertions are on.
    pub(crate) fn check_invariants(&mut self) {
        self.kv.reclaim();
        assert!(self.running.len() <= self.config.max_batch_size as usize, "too many running requests");
        for r in &self.waiting {
            assert!(r.blocks.is_empty(), "waiting request {} holds blocks", r.id);
        }
        let bs = self.config.block_size as usize;
        for r in &self.running {
            assert!(r.num_computed_tokens < r.tokens.len(), "request {} has nothing left to compute", r.id);
            assert!(r.blocks.len() * bs >= r.num_computed_tokens, "request {} computed past its blocks", r.id);
            for &b in &r.blocks[(r.num_computed_tokens / bs).min(r.blocks.len())..] {
                assert_eq!(self.kv.ref_count(b), 1, "block {b} written by request {} is shared", r.id);
                assert!(!self.kv.is_cached(b), "block {b} written by request {} is in the tree", r.id);
            }
            if let Some(adapter) = r.adapter {
                assert!(self.adapters.slot_of(adapter).is_some(), "request {} runs without its adapter in a slot", r.id);
            }
        }
        self.adapters.check_invariants(&self.adapters_in_use());
        self.kv.check_invariants(self.running.iter().map(|r| &r.blocks[..]));
        if self.is_idle() {
            assert_eq!(
                self.kv.num_free() + self.kv.num_cached(),
                self.config.num_blocks,
                "blocks leaked with no request left"
            );
        }
    }
}

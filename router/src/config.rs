//! The router's configuration: one typed struct parsed from the command line
//! (every flag also reads an environment variable), and the limits resolved
//! from it plus what the shards reported at startup.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser};

use crate::http::serve::ServeOptions;
use crate::scheduler::StepDeadline;

#[derive(Debug, Clone, Parser)]
#[command(name = "sluice-router", version, about = "Sluice router: HTTP API in front of the model shards")]
pub struct RouterConfig {
    /// Unix socket file of shard rank 0 (e.g. /tmp/sluice-server-0).
    #[arg(long, env = "SLUICE_MASTER_SHARD_UDS_PATH", default_value = "/tmp/sluice-server-0")]
    pub master_shard_uds_path: String,
    /// Model folder with tokenizer.json (and tokenizer_config.json,
    /// chat_template.jinja, generation_config.json).
    #[arg(long, env = "SLUICE_TOKENIZER")]
    pub tokenizer: PathBuf,
    /// Shown in /info.
    #[arg(long, env = "SLUICE_MODEL_ID", default_value = "sluice")]
    pub model_id: String,
    /// Fault injection for the fault tests; never set in production.
    #[arg(long, env = "SLUICE_FAULT", hide = true)]
    pub fault: Option<String>,
    #[command(flatten)]
    pub serving: ServingFlags,
}

/// The flags a user may give the launcher or the router alike: the HTTP
/// server, request and batch limits, the API, timeouts, telemetry, cost and
/// speculation. Declared once, here, with one help text and one environment
/// variable each; `sluice-launcher` flattens the same struct into its own
/// command line and hands every value on with [`ServingFlags::router_args`].
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct ServingFlags {
    /// Address the HTTP server binds. (Its variable is not HOSTNAME: containers
    /// and pods set that to their own name, which would silently change the
    /// address.)
    #[arg(long, env = "SLUICE_HOSTNAME", default_value = "0.0.0.0")]
    pub hostname: String,
    /// Port the HTTP server binds.
    #[arg(long, short, env = "PORT", default_value_t = 8080)]
    pub port: u16,
    /// The longest prompt, in tokens. Default: --max-total-tokens - 1.
    #[arg(long, env = "SLUICE_MAX_INPUT_TOKENS")]
    pub max_input_tokens: Option<u32>,
    /// The longest sequence (prompt + generated tokens) of one request.
    /// Default: the model's max_position_embeddings, at most 4096.
    #[arg(long, env = "SLUICE_MAX_TOTAL_TOKENS")]
    pub max_total_tokens: Option<u32>,
    /// The step's token budget: the most tokens one step computes, summed
    /// over its requests (a prefill chunk counts its tokens, a decode 1, a
    /// speculative draft token 1). TGI's name, kept for its command lines:
    /// TGI with chunked prefill also takes the running decodes off it.
    /// Default: --max-total-tokens, at most 4096.
    #[arg(long, env = "SLUICE_MAX_BATCH_PREFILL_TOKENS")]
    pub max_batch_prefill_tokens: Option<u32>,
    /// Cap on the KV token slots in use at once. Default: everything the
    /// shards' KV cache holds.
    #[arg(long, env = "SLUICE_MAX_BATCH_TOTAL_TOKENS")]
    pub max_batch_total_tokens: Option<u32>,
    /// The most requests in one step. Default: --max-concurrent-requests.
    #[arg(long, env = "SLUICE_MAX_BATCH_SIZE")]
    pub max_batch_size: Option<u32>,
    /// Requests waiting or running at once; more get HTTP 429.
    #[arg(long, env = "SLUICE_MAX_CONCURRENT_REQUESTS", default_value_t = 128)]
    pub max_concurrent_requests: u32,
    /// The most stop sequences one request may give.
    #[arg(long, env = "SLUICE_MAX_STOP_SEQUENCES", default_value_t = 4)]
    pub max_stop_sequences: u32,
    /// The most alternatives (`top_n_tokens` / `top_logprobs`) one request
    /// may ask for.
    #[arg(long, env = "SLUICE_MAX_TOP_N_TOKENS", default_value_t = 5)]
    pub max_top_n_tokens: u32,
    /// The largest OpenAI `n` (choices per prompt).
    #[arg(long, env = "SLUICE_MAX_N", default_value_t = 8)]
    pub max_n: u32,
    /// The most prompts one /v1/completions request may list.
    #[arg(long, env = "SLUICE_MAX_CLIENT_BATCH_SIZE", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_client_batch_size: u32,
    /// Reuse the KV blocks of shared prompt prefixes (on by default; env
    /// SLUICE_PREFIX_CACHING=false turns it off).
    #[arg(long, env = "SLUICE_PREFIX_CACHING", default_value_t = true, num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set, overrides_with = "no_prefix_caching")]
    pub prefix_caching: bool,
    /// Turn prefix caching off.
    #[arg(long, overrides_with = "prefix_caching")]
    pub no_prefix_caching: bool,
    /// Serve the web page at GET /: a chat playground and a live dashboard of
    /// /metrics (on by default; SLUICE_WEB_UI=false turns it off).
    #[arg(long, env = "SLUICE_WEB_UI", default_value_t = true, num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set, overrides_with = "no_web_ui")]
    pub web_ui: bool,
    /// Turn the web page off: GET / answers 404 (TGI's POST / stays).
    #[arg(long, overrides_with = "web_ui")]
    pub no_web_ui: bool,
    /// Model name of the OpenAI API (`model`). Default: --model-id.
    #[arg(long, env = "SLUICE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Chat template replacing the model's: a file path or an inline Jinja
    /// template.
    #[arg(long, env = "SLUICE_CHAT_TEMPLATE")]
    pub chat_template: Option<String>,
    /// How the model writes tool calls, parsed back into `tool_calls`:
    /// hermes (Qwen2.5, SmolLM2, Hermes), llama3_json (Llama 3.x) or
    /// mistral. Default: chosen from the chat template (hermes when it does
    /// not say).
    #[arg(long, env = "SLUICE_TOOL_CALL_PARSER", value_enum)]
    pub tool_call_parser: Option<crate::tool_calls::ToolParserKind>,
    /// How the model thinks, split off the answer into `reasoning_content`
    /// (and the Responses and Anthropic APIs' reasoning/thinking items):
    /// qwen3, deepseek_r1 or gpt_oss (alias harmony: gpt-oss's channels,
    /// which carry its tool calls too). Default: chosen from the chat
    /// template (one that writes harmony's channels is gpt-oss's, one that
    /// writes <think> a reasoning model's); none otherwise.
    #[arg(long, env = "SLUICE_REASONING_PARSER", value_enum)]
    pub reasoning_parser: Option<crate::reasoning::ReasoningParserKind>,
    /// The most responses /v1/responses keeps for `previous_response_id`
    /// and GET (the oldest go first).
    #[arg(long, env = "SLUICE_RESPONSES_STORE_CAPACITY", default_value_t = 1024)]
    pub responses_store_capacity: u32,
    /// Seconds a stored response is kept; after that (or after it was
    /// pushed out) its id is a 404.
    #[arg(long, env = "SLUICE_RESPONSES_STORE_TTL", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..))]
    pub responses_store_ttl: u64,
    /// Require `Authorization: Bearer KEY` on every API request (not on
    /// /health, /ready and /metrics). Give it in the environment: a command
    /// line is readable by every local user.
    #[arg(long, env = "API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Require the API key on /metrics too (off: Prometheus and an endpoint
    /// picker scrape it without one). Needs --api-key.
    #[arg(long, env = "SLUICE_METRICS_AUTH", requires = "api_key")]
    pub metrics_auth: bool,
    /// Allowed CORS origin (scheme://host[:port], or * for any); repeat, or
    /// separate with commas, for several.
    #[arg(long, env = "SLUICE_CORS_ALLOW_ORIGIN", value_delimiter = ',', value_parser = parse_origin)]
    pub cors_allow_origin: Vec<String>,
    /// Largest request body in bytes (HTTP 413 above).
    #[arg(long, env = "SLUICE_PAYLOAD_LIMIT", default_value_t = 2_000_000)]
    pub payload_limit: usize,
    /// Most open HTTP connections; one more is answered 503 and closed.
    #[arg(long, env = "SLUICE_MAX_CONNECTIONS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Seconds a client has to send a request's head; also how long a
    /// keep-alive connection may sit idle between requests.
    #[arg(long, env = "SLUICE_HEADER_TIMEOUT", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout: u64,
    /// Seconds a request body may go without a byte arriving (HTTP 408).
    #[arg(long, env = "SLUICE_BODY_TIMEOUT", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_timeout: u64,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT.
    #[arg(long, env = "SLUICE_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Seconds one step may take before the shards count as stuck: in-flight
    /// requests then fail (503), /health fails and the server exits non-zero,
    /// to be restarted. Applies from the first step unless the shards may
    /// still compile kernels (see --first-steps-timeout).
    #[arg(long, env = "SLUICE_STEP_TIMEOUT", default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub step_timeout: u64,
    /// --step-timeout of the first 16 steps after warmup, used only when the
    /// shards say kernels may still compile then (Triton on CUDA; never on CPU).
    #[arg(long, env = "SLUICE_FIRST_STEPS_TIMEOUT", default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub first_steps_timeout: u64,
    /// Readiness fails when the shards made no progress for this many seconds.
    #[arg(long, env = "SLUICE_PROGRESS_TIMEOUT", default_value_t = 60)]
    pub progress_timeout: u64,
    /// Log JSON lines instead of human-readable text.
    #[arg(long, env = "SLUICE_JSON_OUTPUT")]
    pub json_output: bool,
    /// OTLP/gRPC collector (e.g. http://localhost:4317): traces are exported
    /// only when this is set.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the router's spans (default sluice-router); the
    /// shards report as NAME-shard (default sluice-shard), with their rank as
    /// the `sluice.rank` resource attribute.
    #[arg(long, env = "OTEL_SERVICE_NAME")]
    pub otlp_service_name: Option<String>,
    /// What the deployment costs per hour, in dollars: shown in /info, and
    /// /metrics turns it into dollars per million output tokens.
    #[arg(long, env = "SLUICE_HOURLY_COST", value_name = "DOLLARS", value_parser = parse_hourly_cost)]
    pub hourly_cost: Option<f64>,
    /// Seconds of recent traffic behind the window gauges of /metrics (cost
    /// per million output tokens, prefix-cache hit ratio).
    #[arg(long, env = "SLUICE_COST_WINDOW_SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=MAX_COST_WINDOW_SECS))]
    pub cost_window_secs: u64,
    /// Speculative decoding: `ngram` proposes the tokens that followed the
    /// latest earlier occurrence of a request's last n tokens (prompt lookup)
    /// and verifies them in the same step. Off when unset.
    #[arg(long, env = "SLUICE_SPECULATE", value_enum)]
    pub speculate: Option<Speculate>,
    /// The most draft tokens per request and step (with --speculate).
    #[arg(long, env = "SLUICE_SPECULATE_TOKENS", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub speculate_tokens: u32,
    /// Shortest suffix of a request's tokens looked up (with --speculate ngram).
    #[arg(long, env = "SLUICE_NGRAM_MIN", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub ngram_min: u32,
    /// Longest suffix looked up (with --speculate ngram).
    #[arg(long, env = "SLUICE_NGRAM_MAX", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub ngram_max: u32,
    /// No request speculates while more than this many run: large batches
    /// are compute-bound and gain nothing from extra query tokens.
    #[arg(long, env = "SLUICE_SPECULATE_MAX_BATCH_SIZE", default_value_t = 8)]
    pub speculate_max_batch_size: u32,
    /// Most tokens (the requests' own and their drafts) a step may compute
    /// with drafts in it: drafts fill the room up to it. On CPU, decode steps
    /// of up to 16 tokens take the fast decode path.
    #[arg(long, env = "SLUICE_SPECULATE_MAX_STEP_TOKENS", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub speculate_max_step_tokens: u32,
    /// Multi-step decode: while every running request is decoding and none
    /// waits, one Step asks the shard for up to this many tokens per
    /// request, saving the round trip between them (fewer when the steps
    /// would take over 100 ms together, so arrivals and streams wait at
    /// most about that). Tokens then reach clients in bursts of up to this
    /// many. 1: one token per Step.
    #[arg(long, env = "SLUICE_DECODE_STEPS", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub decode_steps: u32,
    /// While requests are decoding, a step that also reads prompts is kept
    /// to about this many milliseconds (predicted from the steps run): the
    /// prompt chunks shrink to fit, so a running stream waits about that
    /// at most for its next token while new prompts are read. With nothing
    /// decoding a step may take the whole --max-batch-prefill-tokens.
    /// 0: no limit but the budget.
    #[arg(long, env = "SLUICE_DECODE_STALL_MS", default_value_t = 1000)]
    pub decode_stall_ms: u64,
    /// Folder of the Batch API's database (uploaded files, batches, their
    /// results), created with mode 0700. One server per folder: a given
    /// folder in use is an error. Default: $XDG_DATA_HOME/sluice, else
    /// ~/.local/share/sluice (in use by another server: the Batch API is off).
    #[arg(long, env = "SLUICE_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Fraction of the running slots and of each step's token budget that
    /// Batch API lines may always use while they are pending, however busy
    /// interactive traffic is; the rest of the time they only fill what
    /// interactive requests leave. In [0, 1).
    #[arg(long, env = "SLUICE_BATCH_MIN_SHARE", default_value_t = 0.1, value_parser = parse_share)]
    pub batch_min_share: f64,
    /// While interactive requests run, batch lines may lengthen a step by
    /// at most this fraction of the time the interactive part alone is
    /// predicted to take (learnt from the steps run; at least one batch
    /// token per step): what a batch costs interactive streams' time per
    /// output token. 0 gives batch lines one token a step while any
    /// interactive request runs.
    #[arg(long, env = "SLUICE_BATCH_STEP_SLACK", default_value_t = 0.1, value_parser = parse_slack)]
    pub batch_step_slack: f64,
    /// Largest Batch API upload (`POST /v1/files`), in bytes (HTTP 413 above).
    #[arg(long, env = "SLUICE_BATCH_MAX_FILE_BYTES", default_value_t = 100_000_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_max_file_bytes: u64,
    /// Most request lines in one Batch API input file.
    #[arg(long, env = "SLUICE_BATCH_MAX_LINES", default_value_t = 50_000,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_max_lines: u32,
    /// LoRA adapters to serve, as NAME=PATH_OR_HUB_ID: a PEFT folder
    /// (adapter_config.json + adapter_model.safetensors), or, where no such
    /// folder exists, a Hugging Face Hub id ORG/NAME[@REVISION] that
    /// sluice-launcher fetches into the Hub cache before it starts the
    /// shards (the cache alone with HF_HUB_OFFLINE=1; sluice-router itself
    /// takes folders only). Several after one flag, the flag repeated, or
    /// comma-separated. Requests pick one by name (OpenAI `model`, TGI
    /// `adapter_id`). A bad adapter stops the server at start with the
    /// reason.
    #[arg(long, env = "SLUICE_LORA_ADAPTERS", num_args = 1.., value_delimiter = ',', value_name = "NAME=PATH_OR_HUB_ID",
          value_parser = parse_lora_adapter)]
    pub lora_adapters: Vec<LoraAdapter>,
}

/// One `--lora-adapters` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraAdapter {
    pub name: String,
    /// A folder; given to the launcher, also a Hub id, which it replaces
    /// with the folder it fetched before handing the entry on.
    pub path: String,
}

impl std::fmt::Display for LoraAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.name, self.path)
    }
}

fn parse_lora_adapter(value: &str) -> Result<LoraAdapter, String> {
    match value.split_once('=') {
        Some((name, path)) if !name.trim().is_empty() && !path.trim().is_empty() => {
            Ok(LoraAdapter { name: name.trim().to_string(), path: path.trim().to_string() })
        }
        _ => Err(format!("`{value}` is not NAME=PATH_OR_HUB_ID (e.g. sql=/adapters/sql-lora or sql=acme/sql-lora)")),
    }
}

/// `--data-dir`'s default: the user's data folder (XDG base directories).
fn default_data_dir(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    let absolute = |name: &str| var(name).map(PathBuf::from).filter(|p| p.is_absolute());
    match (absolute("XDG_DATA_HOME"), absolute("HOME")) {
        (Some(data), _) => data.join("sluice"),
        (None, Some(home)) => home.join(".local/share/sluice"),
        // No home (a bare container user): beside the working directory.
        (None, None) => PathBuf::from("sluice-data"),
    }
}

fn parse_slack(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(slack) if (0.0..=10.0).contains(&slack) => Ok(slack),
        _ => Err(format!("`{value}` is not a slack: give a fraction in [0, 10] (e.g. 0.1 for 10%)")),
    }
}

fn parse_share(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(share) if (0.0..1.0).contains(&share) => Ok(share),
        _ => Err(format!("`{value}` is not a share: give a fraction in [0, 1) (e.g. 0.1)")),
    }
}

impl ServingFlags {
    /// Whether to reuse cached prefixes, after `--prefix-caching` and
    /// `--no-prefix-caching` (the later one on the command line wins).
    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching && !self.no_prefix_caching
    }

    /// Whether to serve the web page, after `--web-ui` and `--no-web-ui`
    /// (the later one on the command line wins).
    pub fn web_ui(&self) -> bool {
        self.web_ui && !self.no_web_ui
    }

    /// The Batch API's folder: `--data-dir`, or the user's data folder.
    pub fn data_dir(&self) -> PathBuf {
        self.data_dir.clone().unwrap_or_else(|| default_data_dir(|name| std::env::var_os(name)))
    }

    /// The router's service name in traces.
    pub fn otlp_service_name(&self) -> &str {
        self.otlp_service_name.as_deref().unwrap_or("sluice-router")
    }

    /// These flags as the router's command line, every value spelled out:
    /// what the launcher starts the router with. The API key is not among
    /// them (a command line is readable by every local user); the launcher
    /// hands it over in the router's environment.
    pub fn router_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        let mut flag = |name: &str, value: String| {
            args.push(format!("--{name}"));
            args.push(value);
        };
        flag("hostname", self.hostname.clone());
        flag("port", self.port.to_string());
        let optional = [
            ("max-input-tokens", self.max_input_tokens),
            ("max-total-tokens", self.max_total_tokens),
            ("max-batch-prefill-tokens", self.max_batch_prefill_tokens),
            ("max-batch-total-tokens", self.max_batch_total_tokens),
            ("max-batch-size", self.max_batch_size),
        ];
        for (name, value) in optional {
            if let Some(value) = value {
                flag(name, value.to_string());
            }
        }
        let numbers = [
            ("max-concurrent-requests", u64::from(self.max_concurrent_requests)),
            ("max-stop-sequences", u64::from(self.max_stop_sequences)),
            ("max-top-n-tokens", u64::from(self.max_top_n_tokens)),
            ("max-n", u64::from(self.max_n)),
            ("max-client-batch-size", u64::from(self.max_client_batch_size)),
            ("payload-limit", self.payload_limit as u64),
            ("max-connections", u64::from(self.max_connections)),
            ("header-timeout", self.header_timeout),
            ("body-timeout", self.body_timeout),
            ("shutdown-timeout", self.shutdown_timeout),
            ("step-timeout", self.step_timeout),
            ("first-steps-timeout", self.first_steps_timeout),
            ("progress-timeout", self.progress_timeout),
            ("cost-window-secs", self.cost_window_secs),
            ("speculate-tokens", u64::from(self.speculate_tokens)),
            ("ngram-min", u64::from(self.ngram_min)),
            ("ngram-max", u64::from(self.ngram_max)),
            ("speculate-max-batch-size", u64::from(self.speculate_max_batch_size)),
            ("speculate-max-step-tokens", u64::from(self.speculate_max_step_tokens)),
            ("decode-steps", u64::from(self.decode_steps)),
            ("decode-stall-ms", self.decode_stall_ms),
            ("batch-max-file-bytes", self.batch_max_file_bytes),
            ("batch-max-lines", u64::from(self.batch_max_lines)),
            ("responses-store-capacity", u64::from(self.responses_store_capacity)),
            ("responses-store-ttl", self.responses_store_ttl),
        ];
        for (name, value) in numbers {
            flag(name, value.to_string());
        }
        let strings = [
            ("served-model-name", &self.served_model_name),
            ("chat-template", &self.chat_template),
            ("otlp-endpoint", &self.otlp_endpoint),
            ("otlp-service-name", &self.otlp_service_name),
        ];
        for (name, value) in strings {
            if let Some(value) = value {
                flag(name, value.clone());
            }
        }
        if let Some(parser) = self.tool_call_parser {
            flag("tool-call-parser", parser.name().to_string());
        }
        if let Some(parser) = self.reasoning_parser {
            flag("reasoning-parser", parser.name().to_string());
        }
        // f64's Display round-trips: the router parses back the same price.
        if let Some(dollars) = self.hourly_cost {
            flag("hourly-cost", dollars.to_string());
        }
        flag("batch-min-share", self.batch_min_share.to_string());
        flag("batch-step-slack", self.batch_step_slack.to_string());
        if let Some(dir) = &self.data_dir {
            flag("data-dir", dir.display().to_string());
        }
        if let Some(Speculate::Ngram) = self.speculate {
            flag("speculate", "ngram".to_string());
        }
        for adapter in &self.lora_adapters {
            flag("lora-adapters", adapter.to_string());
        }
        for origin in &self.cors_allow_origin {
            flag("cors-allow-origin", origin.clone());
        }
        if !self.prefix_caching() {
            args.push("--no-prefix-caching".into());
        }
        if !self.web_ui() {
            args.push("--no-web-ui".into());
        }
        if self.json_output {
            args.push("--json-output".into());
        }
        if self.metrics_auth {
            args.push("--metrics-auth".into());
        }
        args
    }
}

/// `--speculate` methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Speculate {
    /// Prompt lookup: n-gram matches in the request's own tokens.
    Ngram,
}

/// An hour: a longer window would hide what the price buys now.
const MAX_COST_WINDOW_SECS: u64 = 3600;

fn parse_hourly_cost(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(dollars) if dollars.is_finite() && dollars >= 0.0 => Ok(dollars),
        _ => Err(format!("`{value}` is not a price: give dollars per hour, a number >= 0 (e.g. 2.5)")),
    }
}

/// Request and batch limits after defaults were filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedLimits {
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_batch_prefill_tokens: u32,
    pub max_batch_size: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("--max-input-tokens ({input}) must be less than --max-total-tokens ({total})")]
    InputNotBelowTotal { input: u32, total: u32 },
    #[error("--max-total-tokens ({total}) exceeds the model's max_position_embeddings ({model})")]
    TotalAboveModel { total: u32, model: u32 },
    #[error("--{0} must be at least 1")]
    Zero(&'static str),
    #[error("SLUICE_FAULT={0:?}: expected router-scheduler-panic:N (N >= 1) or a shard-... value")]
    Fault(String),
    #[error("--ngram-min ({min}) must not exceed --ngram-max ({max})")]
    NgramRange { min: u32, max: u32 },
}

/// Longest default sequence: keeps CPU warmup and KV reservations modest.
const DEFAULT_MAX_TOTAL_TOKENS: u32 = 4096;

impl RouterConfig {
    pub fn served_model_name(&self) -> &str {
        self.serving.served_model_name.as_deref().unwrap_or(&self.model_id)
    }

    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_secs(self.serving.shutdown_timeout)
    }

    pub fn cost_window(&self) -> Duration {
        Duration::from_secs(self.serving.cost_window_secs)
    }

    pub fn serve_options(&self) -> ServeOptions {
        ServeOptions {
            max_connections: self.serving.max_connections as usize,
            header_timeout: Duration::from_secs(self.serving.header_timeout),
            body_timeout: Duration::from_secs(self.serving.body_timeout),
        }
    }

    /// `--first-steps-timeout` applies only when the shards said kernels may
    /// still compile after warmup (`compilation_pending`).
    pub fn step_deadline(&self, compilation_pending: bool) -> StepDeadline {
        StepDeadline {
            steady: Duration::from_secs(self.serving.step_timeout),
            first_steps: compilation_pending.then(|| Duration::from_secs(self.serving.first_steps_timeout)),
        }
    }

    /// `SLUICE_FAULT=router-scheduler-panic:N`: the scheduler panics before
    /// its N-th step. Values for the shards (`shard-...`) are theirs.
    pub fn scheduler_panic_at(&self) -> Result<Option<u64>, ConfigError> {
        let Some(fault) = self.fault.as_deref().map(str::trim).filter(|f| !f.is_empty()) else {
            return Ok(None);
        };
        if fault.starts_with("shard-") {
            return Ok(None);
        }
        match fault.strip_prefix("router-scheduler-panic:").and_then(|n| n.parse::<u64>().ok()) {
            Some(n) if n >= 1 => Ok(Some(n)),
            _ => Err(ConfigError::Fault(fault.to_string())),
        }
    }

    /// The speculation settings; None when `--speculate` is not given.
    pub fn speculation(&self) -> Result<Option<crate::scheduler::SpeculationConfig>, ConfigError> {
        let Some(Speculate::Ngram) = self.serving.speculate else { return Ok(None) };
        if self.serving.ngram_min > self.serving.ngram_max {
            return Err(ConfigError::NgramRange { min: self.serving.ngram_min, max: self.serving.ngram_max });
        }
        Ok(Some(crate::scheduler::SpeculationConfig {
            max_tokens: self.serving.speculate_tokens as usize,
            ngram_min: self.serving.ngram_min as usize,
            ngram_max: self.serving.ngram_max as usize,
            max_batch_size: self.serving.speculate_max_batch_size as usize,
            max_step_tokens: self.serving.speculate_max_step_tokens as usize,
        }))
    }

    /// Fills in defaults from the model's `max_position_embeddings` (0:
    /// unknown) and checks the limits against each other. Called before
    /// Warmup, which needs them.
    pub fn resolve_limits(&self, max_position_embeddings: u32) -> Result<ResolvedLimits, ConfigError> {
        let model = if max_position_embeddings == 0 { u32::MAX } else { max_position_embeddings };
        let max_total_tokens = self.serving.max_total_tokens.unwrap_or(model.min(DEFAULT_MAX_TOTAL_TOKENS));
        if max_total_tokens > model {
            return Err(ConfigError::TotalAboveModel { total: max_total_tokens, model });
        }
        let max_input_tokens = self.serving.max_input_tokens.unwrap_or(max_total_tokens.saturating_sub(1));
        if max_input_tokens >= max_total_tokens {
            return Err(ConfigError::InputNotBelowTotal { input: max_input_tokens, total: max_total_tokens });
        }
        let checks = [
            ("max-input-tokens", max_input_tokens),
            ("max-concurrent-requests", self.serving.max_concurrent_requests),
            ("max-n", self.serving.max_n),
        ];
        if let Some((name, _)) = checks.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::Zero(name));
        }
        let max_batch_prefill_tokens = self
            .serving
            .max_batch_prefill_tokens
            .unwrap_or(max_total_tokens.min(DEFAULT_MAX_TOTAL_TOKENS));
        let max_batch_size = self.serving.max_batch_size.unwrap_or(self.serving.max_concurrent_requests);
        if max_batch_prefill_tokens == 0 {
            return Err(ConfigError::Zero("max-batch-prefill-tokens"));
        }
        if max_batch_size == 0 {
            return Err(ConfigError::Zero("max-batch-size"));
        }
        Ok(ResolvedLimits {
            max_input_tokens,
            max_total_tokens,
            max_batch_prefill_tokens,
            max_batch_size,
        })
    }
}

/// A `--cors-allow-origin` value: `*`, or what an `Origin` header holds.
fn parse_origin(value: &str) -> Result<String, String> {
    let value = value.trim();
    if value == "*" || (value.contains("://") && axum::http::HeaderValue::from_str(value).is_ok()) {
        Ok(value.to_string())
    } else {
        Err(format!("{value:?} is not an origin (scheme://host[:port], or * for any)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> RouterConfig {
        let mut argv = vec!["sluice-router", "--tokenizer", "model"];
        argv.extend_from_slice(args);
        RouterConfig::try_parse_from(argv).unwrap()
    }

    /// What the launcher hands on is what the user gave it: every flag set
    /// to a value other than its default, through `router_args`, parses
    /// back to the same flags (the key travels in the environment instead).
    #[test]
    fn router_args_hand_on_every_flag() {
        let given = parse(&[
            "--hostname", "127.0.0.1", "--port", "9000", "--max-input-tokens", "100", "--max-total-tokens", "200",
            "--max-batch-prefill-tokens", "300", "--max-batch-total-tokens", "4000", "--max-batch-size", "8",
            "--max-concurrent-requests", "9", "--max-stop-sequences", "2", "--max-top-n-tokens", "3", "--max-n", "2",
            "--max-client-batch-size", "7", "--no-prefix-caching", "--no-web-ui", "--served-model-name", "m",
            "--chat-template", "t.jinja", "--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1",
            "--responses-store-capacity", "5", "--responses-store-ttl", "60", "--api-key", "k", "--metrics-auth",
            "--cors-allow-origin", "http://a,http://b", "--payload-limit", "10", "--max-connections", "5",
            "--header-timeout", "6", "--body-timeout", "7", "--shutdown-timeout", "8", "--step-timeout", "45",
            "--first-steps-timeout", "90", "--progress-timeout", "20", "--json-output",
            "--otlp-endpoint", "http://o:4317", "--otlp-service-name", "svc", "--hourly-cost", "1.25",
            "--cost-window-secs", "30", "--speculate", "ngram", "--speculate-tokens", "6", "--ngram-min", "2",
            "--ngram-max", "4", "--speculate-max-batch-size", "3", "--speculate-max-step-tokens", "32",
            "--data-dir", "/srv/sluice", "--batch-min-share", "0.25", "--batch-max-file-bytes", "1000",
            "--batch-max-lines", "10",
            "--lora-adapters", "sql=/a/sql", "chat=/a/chat",
        ])
        .serving;
        let args = given.router_args();
        assert!(!args.iter().any(|a| a == "k"), "the key is not on the command line: {args:?}");
        // The router gets the key from its environment; --metrics-auth needs it.
        let mut argv = vec!["sluice-router".to_string(), "--tokenizer".into(), "m".into(), "--api-key".into(), "k".into()];
        argv.extend(args);
        let handed = RouterConfig::try_parse_from(argv).unwrap().serving;
        assert_eq!(handed, given);
        // Defaults hand on as defaults.
        let defaults = parse(&[]).serving;
        let mut argv = vec!["sluice-router".to_string(), "--tokenizer".into(), "m".into()];
        argv.extend(defaults.router_args());
        assert_eq!(RouterConfig::try_parse_from(argv).unwrap().serving, defaults);
    }

    #[test]
    fn the_web_page_is_on_unless_turned_off() {
        assert!(parse(&[]).serving.web_ui());
        assert!(!parse(&["--no-web-ui"]).serving.web_ui());
        assert!(!parse(&["--web-ui=false"]).serving.web_ui());
        // The later flag wins.
        assert!(parse(&["--no-web-ui", "--web-ui"]).serving.web_ui());
        assert!(!parse(&["--web-ui", "--no-web-ui"]).serving.web_ui());
    }

    #[test]
    fn batch_flags() {
        let config = parse(&[]);
        assert_eq!((config.serving.batch_min_share, config.serving.batch_max_lines), (0.1, 50_000));
        let vars = |vars: &'static [(&str, &str)]| move |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.into());
        assert_eq!(default_data_dir(vars(&[("XDG_DATA_HOME", "/x"), ("HOME", "/h")])), PathBuf::from("/x/sluice"));
        assert_eq!(default_data_dir(vars(&[("XDG_DATA_HOME", "rel"), ("HOME", "/h")])), PathBuf::from("/h/.local/share/sluice"));
        assert_eq!(parse(&["--data-dir", "/d"]).serving.data_dir(), PathBuf::from("/d"));
        for bad in ["--batch-min-share=1", "--batch-min-share=-0.1", "--batch-min-share=nan", "--batch-max-lines=0"] {
            let mut argv = vec!["sluice-router", "--tokenizer", "model"];
            argv.push(bad);
            let err = RouterConfig::try_parse_from(argv).unwrap_err().to_string();
            assert!(err.contains(bad.split('=').next().unwrap()), "{bad}: {err}");
        }
    }

    #[test]
    fn lora_adapters_are_name_equals_path_however_given() {
        let adapter = |name: &str, path: &str| LoraAdapter { name: name.into(), path: path.into() };
        let config = parse(&["--lora-adapters", "a=/x", "b=/y,c=/z", "--lora-adapters", "d=rel/w"]);
        assert_eq!(
            config.serving.lora_adapters,
            [adapter("a", "/x"), adapter("b", "/y"), adapter("c", "/z"), adapter("d", "rel/w")]
        );
        for bad in ["nopath", "=/x", "a="] {
            let error = RouterConfig::try_parse_from(["sluice-router", "--tokenizer", "m", "--lora-adapters", bad])
                .unwrap_err()
                .to_string();
            assert!(error.contains("is not NAME=PATH"), "{bad}: {error}");
        }
    }

    #[test]
    fn the_first_steps_timeout_applies_only_while_kernels_may_compile() {
        let config = parse(&["--step-timeout", "10", "--first-steps-timeout", "90"]);
        let compiled = config.step_deadline(false);
        assert_eq!((compiled.steady, compiled.first_steps), (Duration::from_secs(10), None));
        let compiling = config.step_deadline(true);
        assert_eq!(compiling.first_steps, Some(Duration::from_secs(90)));
    }

    #[test]
    fn metrics_auth_needs_an_api_key() {
        assert!(!parse(&[]).serving.metrics_auth, "off by default");
        assert!(parse(&["--api-key", "k", "--metrics-auth"]).serving.metrics_auth);
        let error = RouterConfig::try_parse_from(["sluice-router", "--tokenizer", "m", "--metrics-auth"])
            .unwrap_err()
            .to_string();
        assert!(error.contains("--api-key"), "{error}");
    }

    #[test]
    fn cors_origins_are_checked_when_parsed() {
        let config = parse(&["--cors-allow-origin", "*,https://app.example:8443"]);
        assert_eq!(config.serving.cors_allow_origin, ["*", "https://app.example:8443"]);
        let error = RouterConfig::try_parse_from(["sluice-router", "--tokenizer", "m", "--cors-allow-origin", "app\nx"])
            .unwrap_err()
            .to_string();
        assert!(error.contains("is not an origin"), "{error}");
    }

    #[test]
    fn defaults_follow_the_model() {
        let limits = parse(&[]).resolve_limits(8192).unwrap();
        assert_eq!(
            limits,
            ResolvedLimits { max_input_tokens: 4095, max_total_tokens: 4096, max_batch_prefill_tokens: 4096, max_batch_size: 128 }
        );
        let limits = parse(&[]).resolve_limits(512).unwrap();
        assert_eq!((limits.max_input_tokens, limits.max_total_tokens), (511, 512));
    }

    #[test]
    fn inconsistent_limits_fail_loudly() {
        let config = parse(&["--max-input-tokens", "100", "--max-total-tokens", "100"]);
        assert!(matches!(config.resolve_limits(8192), Err(ConfigError::InputNotBelowTotal { .. })));
        let config = parse(&["--max-total-tokens", "9000"]);
        assert!(matches!(config.resolve_limits(8192), Err(ConfigError::TotalAboveModel { .. })));
        let config = parse(&["--max-batch-size", "0"]);
        assert_eq!(config.resolve_limits(8192), Err(ConfigError::Zero("max-batch-size")));
    }

    #[test]
    fn names_and_flags() {
        let config = parse(&["--model-id", "org/m", "--cors-allow-origin", "https://a.example", "--cors-allow-origin", "http://b:8080", "--json-output"]);
        assert_eq!(config.served_model_name(), "org/m");
        assert_eq!(config.serving.cors_allow_origin, ["https://a.example", "http://b:8080"]);
        assert!(config.serving.json_output);
        assert!(RouterConfig::try_parse_from(["sluice-router", "--tokenizer", "m", "--port", "x"]).is_err());
    }

    #[test]
    fn price_and_window() {
        let config = parse(&[]);
        assert_eq!((config.serving.hourly_cost, config.cost_window()), (None, Duration::from_secs(60)));
        let config = parse(&["--hourly-cost", "2.5", "--cost-window-secs", "30"]);
        assert_eq!((config.serving.hourly_cost, config.serving.cost_window_secs), (Some(2.5), 30));
        assert_eq!(parse(&["--hourly-cost", "0"]).serving.hourly_cost, Some(0.0));
        let try_parse = |args: &[&str]| {
            let mut argv = vec!["sluice-router", "--tokenizer", "model"];
            argv.extend_from_slice(args);
            RouterConfig::try_parse_from(argv).map_err(|e| e.to_string())
        };
        for bad in ["--hourly-cost=-1", "--hourly-cost=nan", "--hourly-cost=inf", "--hourly-cost=$2"] {
            let err = try_parse(&[bad]).unwrap_err();
            assert!(err.contains("--hourly-cost") && err.contains("not a price"), "{bad}: {err}");
        }
        for bad in ["--cost-window-secs=0", "--cost-window-secs=3601"] {
            assert!(try_parse(&[bad]).unwrap_err().contains("--cost-window-secs"), "{bad}");
        }
    }
}

//! The router's configuration: one typed struct parsed from the command line
//! (every flag also reads an environment variable), and the limits resolved
//! from it plus what the shards reported at startup.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

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
    #[arg(long, env = "MODEL_ID", default_value = "sluice")]
    pub model_id: String,
    /// OpenAI `model` name; default: --model-id.
    #[arg(long, env = "SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    #[arg(long, env = "SLUICE_HOSTNAME", default_value = "0.0.0.0")]
    pub hostname: String,
    #[arg(long, env = "PORT", default_value_t = 8080)]
    pub port: u16,
    /// Default: --max-total-tokens - 1.
    #[arg(long, env = "MAX_INPUT_TOKENS")]
    pub max_input_tokens: Option<u32>,
    /// Prompt + generated tokens per request. Default: the model's
    /// max_position_embeddings, at most 4096.
    #[arg(long, env = "MAX_TOTAL_TOKENS")]
    pub max_total_tokens: Option<u32>,
    /// Tokens one step may compute. Default: --max-total-tokens, at most 4096.
    #[arg(long, env = "MAX_BATCH_PREFILL_TOKENS")]
    pub max_batch_prefill_tokens: Option<u32>,
    /// KV token slots to use. Default: all that Warmup reports.
    #[arg(long, env = "MAX_BATCH_TOTAL_TOKENS")]
    pub max_batch_total_tokens: Option<u32>,
    /// Requests per step. Default: --max-concurrent-requests.
    #[arg(long, env = "MAX_BATCH_SIZE")]
    pub max_batch_size: Option<u32>,
    /// Waiting + running requests; more get HTTP 429.
    #[arg(long, env = "MAX_CONCURRENT_REQUESTS", default_value_t = 128)]
    pub max_concurrent_requests: u32,
    #[arg(long, env = "MAX_STOP_SEQUENCES", default_value_t = 4)]
    pub max_stop_sequences: u32,
    #[arg(long, env = "MAX_TOP_N_TOKENS", default_value_t = 5)]
    pub max_top_n_tokens: u32,
    /// Largest OpenAI `n`.
    #[arg(long, env = "SLUICE_MAX_N", default_value_t = 8)]
    pub max_n: u32,
    /// The most prompts in one /v1/completions request (a list of prompts).
    #[arg(long, env = "MAX_CLIENT_BATCH_SIZE", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_client_batch_size: u32,
    #[arg(long, env = "SLUICE_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,
    /// A chat template file, or the template itself; overrides the model's.
    #[arg(long, env = "SLUICE_CHAT_TEMPLATE")]
    pub chat_template: Option<String>,
    /// How the model writes tool calls (hermes, llama3_json, mistral).
    /// Default: from the chat template; hermes when it does not say.
    #[arg(long, env = "TOOL_CALL_PARSER", value_enum)]
    pub tool_call_parser: Option<crate::tool_calls::ToolParserKind>,
    /// Require `Authorization: Bearer KEY` (not on /health and /ready).
    #[arg(long, env = "API_KEY")]
    pub api_key: Option<String>,
    /// Allowed CORS origin (e.g. https://app.example.com, or * for any);
    /// repeat or separate with commas for several.
    #[arg(long, env = "CORS_ALLOW_ORIGIN", value_delimiter = ',', value_parser = parse_origin)]
    pub cors_allow_origin: Vec<String>,
    /// Largest request body in bytes (HTTP 413 above).
    #[arg(long, env = "PAYLOAD_LIMIT", default_value_t = 2_000_000)]
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
    /// requests then fail and the router exits non-zero (the launcher stops
    /// the server; an orchestrator restarts it).
    #[arg(long, env = "SLUICE_STEP_TIMEOUT", default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub step_timeout: u64,
    /// --step-timeout of the first steps after warmup, which may compile kernels.
    #[arg(long, env = "SLUICE_FIRST_STEPS_TIMEOUT", default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub first_steps_timeout: u64,
    /// Fault injection for the fault tests; never set in production.
    #[arg(long, env = "SLUICE_FAULT", hide = true)]
    pub fault: Option<String>,
    /// Readiness fails when the shards made no progress for this many seconds.
    #[arg(long, env = "SLUICE_PROGRESS_TIMEOUT", default_value_t = 60)]
    pub progress_timeout: u64,
    /// Log JSON lines instead of human-readable text.
    #[arg(long, env = "JSON_OUTPUT")]
    pub json_output: bool,
    /// OTLP/gRPC collector (e.g. http://localhost:4317): traces are exported
    /// only when this is set.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    #[arg(long, env = "OTEL_SERVICE_NAME", default_value = "sluice-router")]
    pub otlp_service_name: String,
    /// What the deployment costs per hour, in dollars: shown in /info, and
    /// /metrics turns it into dollars per million output tokens.
    #[arg(long, env = "HOURLY_COST", value_name = "DOLLARS", value_parser = parse_hourly_cost)]
    pub hourly_cost: Option<f64>,
    /// Seconds of recent traffic behind the window gauges of /metrics (cost
    /// per million output tokens, prefix-cache hit ratio).
    #[arg(long, env = "COST_WINDOW_SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=MAX_COST_WINDOW_SECS))]
    pub cost_window_secs: u64,
    /// Speculative decoding: `ngram` proposes the tokens that followed the
    /// latest earlier occurrence of a request's last n tokens (prompt lookup)
    /// and verifies them in the same step. Off when unset.
    #[arg(long, env = "SPECULATE", value_enum)]
    pub speculate: Option<Speculate>,
    /// The most draft tokens per request and step (with --speculate).
    #[arg(long, env = "SPECULATE_TOKENS", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub speculate_tokens: u32,
    /// Shortest suffix of a request's tokens looked up (with --speculate ngram).
    #[arg(long, env = "NGRAM_MIN", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub ngram_min: u32,
    /// Longest suffix looked up (with --speculate ngram).
    #[arg(long, env = "NGRAM_MAX", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub ngram_max: u32,
    /// No request speculates while more than this many run: large batches
    /// are compute-bound and gain nothing from extra query tokens.
    #[arg(long, env = "SPECULATE_MAX_BATCH_SIZE", default_value_t = 8)]
    pub speculate_max_batch_size: u32,
    /// Most tokens (the requests' own and their drafts) a step may compute
    /// with drafts in it: drafts fill the room up to it. On CPU, decode steps
    /// of up to 16 tokens take the fast decode path.
    #[arg(long, env = "SPECULATE_MAX_STEP_TOKENS", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub speculate_max_step_tokens: u32,
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
        self.served_model_name.as_deref().unwrap_or(&self.model_id)
    }

    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_secs(self.shutdown_timeout)
    }

    pub fn cost_window(&self) -> Duration {
        Duration::from_secs(self.cost_window_secs)
    }

    pub fn serve_options(&self) -> ServeOptions {
        ServeOptions {
            max_connections: self.max_connections as usize,
            header_timeout: Duration::from_secs(self.header_timeout),
            body_timeout: Duration::from_secs(self.body_timeout),
        }
    }

    pub fn step_deadline(&self) -> StepDeadline {
        StepDeadline {
            steady: Duration::from_secs(self.step_timeout),
            first_steps: Duration::from_secs(self.first_steps_timeout),
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
        let Some(Speculate::Ngram) = self.speculate else { return Ok(None) };
        if self.ngram_min > self.ngram_max {
            return Err(ConfigError::NgramRange { min: self.ngram_min, max: self.ngram_max });
        }
        Ok(Some(crate::scheduler::SpeculationConfig {
            max_tokens: self.speculate_tokens as usize,
            ngram_min: self.ngram_min as usize,
            ngram_max: self.ngram_max as usize,
            max_batch_size: self.speculate_max_batch_size as usize,
            max_step_tokens: self.speculate_max_step_tokens as usize,
        }))
    }

    /// Fills in defaults from the model's `max_position_embeddings` (0:
    /// unknown) and checks the limits against each other. Called before
    /// Warmup, which needs them.
    pub fn resolve_limits(&self, max_position_embeddings: u32) -> Result<ResolvedLimits, ConfigError> {
        let model = if max_position_embeddings == 0 { u32::MAX } else { max_position_embeddings };
        let max_total_tokens = self.max_total_tokens.unwrap_or(model.min(DEFAULT_MAX_TOTAL_TOKENS));
        if max_total_tokens > model {
            return Err(ConfigError::TotalAboveModel { total: max_total_tokens, model });
        }
        let max_input_tokens = self.max_input_tokens.unwrap_or(max_total_tokens.saturating_sub(1));
        if max_input_tokens >= max_total_tokens {
            return Err(ConfigError::InputNotBelowTotal { input: max_input_tokens, total: max_total_tokens });
        }
        let checks = [
            ("max-input-tokens", max_input_tokens),
            ("max-concurrent-requests", self.max_concurrent_requests),
            ("max-n", self.max_n),
        ];
        if let Some((name, _)) = checks.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::Zero(name));
        }
        let max_batch_prefill_tokens = self
            .max_batch_prefill_tokens
            .unwrap_or(max_total_tokens.min(DEFAULT_MAX_TOTAL_TOKENS));
        let max_batch_size = self.max_batch_size.unwrap_or(self.max_concurrent_requests);
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
pub fn parse_origin(value: &str) -> Result<String, String> {
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

    #[test]
    fn cors_origins_are_checked_when_parsed() {
        let config = parse(&["--cors-allow-origin", "*,https://app.example:8443"]);
        assert_eq!(config.cors_allow_origin, ["*", "https://app.example:8443"]);
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
        assert_eq!(config.cors_allow_origin, ["https://a.example", "http://b:8080"]);
        assert!(config.json_output);
        assert!(RouterConfig::try_parse_from(["sluice-router", "--tokenizer", "m", "--port", "x"]).is_err());
    }

    #[test]
    fn price_and_window() {
        let config = parse(&[]);
        assert_eq!((config.hourly_cost, config.cost_window()), (None, Duration::from_secs(60)));
        let config = parse(&["--hourly-cost", "2.5", "--cost-window-secs", "30"]);
        assert_eq!((config.hourly_cost, config.cost_window_secs), (Some(2.5), 30));
        assert_eq!(parse(&["--hourly-cost", "0"]).hourly_cost, Some(0.0));
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

//! Sluice router: everything between an HTTP request and the model shards.
//!
//! A request travels through the modules in this order:
//!
//! 1. `http`        - axum app: OpenAI (`http::openai`, `http::responses`),
//!    Anthropic (`http::anthropic`) and TGI (`http::tgi`) routes map bodies
//!    to parameters and shape answers; `http::generation` drives every
//!    generation (submission, `n` choices, collected or streamed results,
//!    usage); `http::answer` reads each choice's text into reasoning, content
//!    and tool calls; `http::error` maps every error to HTTP; `http::webui`
//!    serves the web page (chat, dashboard) at `GET /`.
//! 2. `validation`  - every check on client input: parses parameters and
//!    prompts into a [`validation::Validated`] request; owns the tokenizer
//!    (`tokenizer`), chat templates (`chat_template`) and output constraints:
//!    `grammar` compiles them with llguidance (a bad one is a 400 here),
//!    `tool_calls` turns declared tools into one and, back in `http`, parses
//!    the calls out of the text.
//! 3. `infer`       - the contract between HTTP and the scheduler: handlers
//!    submit a `ValidRequest` and get a stream of events back (dropping it
//!    cancels the request); the value types both sides share.
//! 4. `scheduler`   - one task owning the queue, the running set, the KV
//!    blocks (`scheduler::blocks`, the allocator; `scheduler::radix`, the
//!    prefix tree); builds one `Step` at a time.
//! 5. `client`      - the gRPC client of the shard group (tonic, unix sockets).
//! 6. back in `http`: `detokenize` turns tokens into text incrementally,
//!    `stop` cuts stop sequences, each API shapes its response.
//!
//! Structured output: `grammar` compiles constraints (JSON schema, regex,
//! choice, Lark/GBNF) with llguidance at validation time; `tool_calls` turns
//! declared tools into such a grammar and parses calls back out of the text;
//! `reasoning` splits a reasoning model's thinking off the answer (and puts
//! the answer's grammar after it); `harmony` splits gpt-oss's channels
//! (reasoning, tool calls, answer; `--reasoning-parser gpt_oss`), and
//! `http::answer` reads each choice's output through one or the other.
//!
//! The Batch API (`batch`): uploaded JSONL files and batches kept in an
//! SQLite file under `--data-dir`; its runner sends each line through the
//! generation driver of `http` in the scheduler's batch class, which runs
//! below every interactive request (scheduler/share.rs).
//!
//! Beside the path: `metrics` names and records every Prometheus series,
//! `telemetry` sets up logs and traces, `config` is the one typed
//! configuration built from the command line at startup (its
//! `ServingFlags` are the launcher's flags too), `cli` starts everything.
//! `testing` holds test doubles (an in-process shard behind the same
//! `client::Shard` trait), compiled for tests only: the crate's own, and
//! those that turn on the `testing` feature (router/tests do).
//!
//! Everything is crate-private unless listed below: the public surface is
//! what the launcher's binaries (launcher/src), the scheduler's integration
//! tests (router/tests) and the launcher's tests use, and nothing else.

pub mod pb;

/// The contract between the HTTP side and the scheduler: submit a
/// `ValidRequest`, read `InferEvent`s back.
pub mod infer;
/// The scheduler task (`spawn`) and its limits; its KV block allocator and
/// prefix tree, which the property tests drive directly.
pub mod scheduler;
/// The shard group's client and the `Shard` trait the fake shard implements.
pub mod client;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

mod http;
mod batch;
mod validation;
mod tokenizer;
mod chat_template;
mod detokenize;
mod stop;
mod grammar;
mod tool_calls;
mod reasoning;
mod harmony;

mod cli;
mod config;
mod metrics;
mod telemetry;

/// `sluice-router`'s entry point (launcher/src/bin/sluice-router.rs).
pub use cli::main;
/// The router's command line, and the flags the launcher shares with it
/// (the launcher rewrites `--lora-adapters` Hub ids into folders).
pub use config::{LoraAdapter, RouterConfig, ServingFlags};
/// The launcher checks `--data-dir` before it loads any weights.
pub use batch::store::check_available as check_data_dir;

#[cfg(test)]
mod tests {
    /// The scheduler checks its invariants after every step only where debug
    /// assertions are on (`Scheduler::check_invariants`, the allocator's and
    /// the radix tree's `debug_assert!`s). The test command builds in the
    /// release profile with them turned on for this crate (scripts/test.sh);
    /// this fails if a change there lets the suite run without them.
    #[test]
    // The constant is what is checked: it depends on the build profile.
    #[allow(clippy::assertions_on_constants)]
    fn invariant_checks_are_compiled_in() {
        assert!(
            cfg!(debug_assertions),
            "debug assertions are off: the scheduler's invariant checks are not running"
        );
    }
}

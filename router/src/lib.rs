//! Sluice router: everything between an HTTP request and the model shards.
//!
//! A request travels through the modules in this order:
//!
//! 1. `http`        - axum app: OpenAI (`http::openai`) and TGI (`http::tgi`)
//!    routes map bodies to parameters and shape answers; `http::generation`
//!    drives every generation (submission, `n` choices, collected or
//!    streamed results, usage); `http::error` maps every error to HTTP;
//!    `http::webui` serves the web page (chat, dashboard) at `GET /`.
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
//! declared tools into such a grammar and parses calls back out of the text.
//!
//! Beside the path: `metrics` names and records every Prometheus series,
//! `telemetry` sets up logs and traces, `config` is the one typed
//! configuration built from the command line at startup (its
//! `ServingFlags` are the launcher's flags too), `cli` starts everything. `testing` holds test doubles (an in-process shard behind the
//! same `client::Shard` trait).

pub mod pb {
    //! Generated from proto/sluice/v1/shard.proto by build.rs.
    tonic::include_proto!("sluice.v1");
}

pub mod http;
pub mod validation;
pub mod tokenizer;
pub mod chat_template;
pub mod infer;
pub mod scheduler;
pub mod client;
pub mod detokenize;
pub mod stop;
pub mod grammar;
pub mod tool_calls;

pub mod cli;
pub mod config;
pub mod metrics;
pub mod telemetry;
pub mod testing;

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

//! Sluice router: everything between an HTTP request and the model shards.
//!
//! A request travels through the modules in this order:
//!
//! 1. `http`        - axum app: OpenAI and TGI routes, SSE, error mapping.
//! 2. `validation`  - parses bodies into a [`infer::ValidRequest`]; owns the
//!    tokenizer (`tokenizer`) and chat templates (`chat_template`).
//! 3. `infer`       - the seam: handlers submit a `ValidRequest`, get a stream
//!    of events back. Dropping the stream cancels the request.
//! 4. `scheduler`   - one task owning the queue, running set, block allocator
//!    (`blocks`) and prefix tree (`radix`); builds one `Step` at a time.
//! 5. `client`      - the gRPC client of the shard group (tonic, unix sockets).
//! 6. back in `http`: `detokenize` turns tokens into text incrementally,
//!    `stop` cuts stop sequences, responses are shaped per API.
//!
//! Structured output: `grammar` compiles constraints (JSON schema, regex,
//! choice, Lark/GBNF) with llguidance at validation time; `tool_calls` turns
//! declared tools into such a grammar and parses calls back out of the text.
//!
//! `fake_shard` is an in-process shard behind the same `client::Shard` trait,
//! for tests. `metrics` records Prometheus series; `config` is the one typed
//! configuration built from the command line at startup.

pub mod pb {
    //! Generated from proto/sluice/v1/shard.proto by build.rs.
    tonic::include_proto!("sluice.v1");
}

pub mod infer;
pub mod blocks;
pub mod client;
pub mod fake_shard;
pub mod radix;
pub mod scheduler;
pub mod chat_template;
pub mod cli;
pub mod config;
pub mod detokenize;
pub mod grammar;
pub mod http;
pub mod metrics;
pub mod stop;
pub mod telemetry;
pub mod tokenizer;
pub mod tool_calls;
pub mod validation;

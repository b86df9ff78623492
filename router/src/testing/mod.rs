//! Test doubles, public so that the crate's integration tests (router/tests)
//! and other crates' tests can use them.
//!
//! - `fake_shard` - an in-process shard behind the same `client::Shard`
//!   trait as the real gRPC client, checking every step it is sent.

pub mod fake_shard;

//! `sluice-launcher`: one command that serves a model.
//!
//! It runs the other two programs and watches them (see `supervise` for the
//! sequence):
//!
//! ```text
//! sluice-launcher
//!   ├─ sluice-server download-adapter ORG/NAME (resolve) -> adapter folder, per Hub id in --lora-adapters
//!   ├─ sluice-server download-weights MODEL   (resolve)  -> model folder
//!   ├─ sluice-server serve ... rank 0..N-1    (shard)    -> unix sockets PATH-0 ...
//!   └─ sluice-router ...                      (router)   -> HTTP on HOST:PORT
//! ```
//!
//! Modules:
//! - `args`      the command line, one typed struct (every flag also an env var);
//! - `exe`       where `sluice-server` / `sluice-router` are found;
//! - `resolve`   step 1: model id and adapter Hub ids -> local folders;
//! - `shard`     step 2: shard commands, stale sockets, gRPC Health;
//! - `sockets`   where the shard sockets live (a private folder by default);
//! - `router`    step 3: router command, port check, HTTP health;
//! - `supervise` the whole life: start in order, watch, stop in order;
//! - `children`  spawning (parent-death signal, process groups), output
//!   forwarding, stopping;
//! - `log`       text or JSON lines for the launcher and its children.

mod args;
mod children;
mod exe;
mod log;
mod resolve;
mod router;
mod shard;
mod sockets;
mod supervise;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = args::Args::from_env();
    if args.dry_run {
        println!("{}", args.dry_run_report());
        return ExitCode::SUCCESS;
    }
    log::init(args.serving.json_output);
    // Current-thread on purpose: children get a parent-death signal tied to
    // the thread that forks them, and this thread lives as long as the process.
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(supervise::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

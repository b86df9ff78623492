//! The launcher's life, start to end:
//!
//! 1. check the HTTP port is free (before anything slow), resolve the
//!    `--lora-adapters` Hub ids to folders, resolve the model;
//! 2. start the shards, wait until each answers Health;
//! 3. start the router, wait until `GET /health` answers;
//! 4. supervise: the first child to exit stops everything (exit 1, with its
//!    last lines); SIGTERM/SIGINT stops the router first (it drains), then the
//!    shards (exit 0); a second signal kills everything at once (exit 1).
//!
//! Steps 2 and 3 also watch for children exiting and signals, so a failed
//! start ends in seconds instead of waiting for readiness forever.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::args::Args;
use crate::children::{Children, Exited};
use crate::exe::Executables;
use crate::log::ChildLines;
use crate::sockets::ShardSockets;
use crate::{resolve, router, shard};

/// How long the others get to stop after a child died; nothing is worth
/// draining then, since a lost shard fails every in-flight request.
const AFTER_FAILURE_GRACE: Duration = Duration::from_secs(5);
/// How long shards get to exit after SIGTERM in an orderly shutdown.
const SHARD_GRACE: Duration = Duration::from_secs(10);
/// Added to --shutdown-timeout before the router is killed: it needs a
/// moment beyond draining to exit.
const ROUTER_EXTRA_GRACE: Duration = Duration::from_secs(5);

/// A signal this soon after the first is the same one delivered twice (for
/// example to the launcher and again to its process group by `timeout`), not
/// a person asking a second time.
const DUPLICATE_SIGNAL_WINDOW: Duration = Duration::from_millis(500);

/// SIGTERM and SIGINT, installed before any child exists so none is missed.
struct Signals {
    term: Signal,
    int: Signal,
}

impl Signals {
    fn install() -> Result<Self> {
        Ok(Self { term: signal(SignalKind::terminate())?, int: signal(SignalKind::interrupt())? })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// What ended a wait before it was done.
enum Interrupt {
    ChildExited(Exited),
    Signal(&'static str),
}

pub async fn run(mut args: Args) -> Result<()> {
    let mut signals = Signals::install()?;
    let lines = ChildLines { json: args.serving.json_output };
    if args.trust_remote_code {
        tracing::warn!("--trust-remote-code has no effect: Sluice never runs model code from the Hub");
    }
    let exes = Executables::find()?;
    router::check_port_free(&args)?;
    // Before minutes of weight loading: the router would fail on it later
    // (the default folder in use only turns the Batch API off).
    if let Some(dir) = &args.serving.data_dir {
        sluice_router::check_data_dir(dir)?;
    }

    // Adapters before the model: a wrong adapter id is found in seconds,
    // not after the model's download. The shards (--lora-root) and the
    // router get the folders.
    let Some(adapters) = resolve::resolve_adapters(&exes.server, &args, lines, signals.recv()).await? else {
        return Ok(());
    };
    args.serving.lora_adapters = adapters;
    let Some(model) = resolve::resolve(&exes.server, &args, lines, signals.recv()).await? else {
        return Ok(());
    };

    let sockets = ShardSockets::new(&args)?;
    shard::remove_stale_sockets(args.num_shard, &sockets)?;
    let mut children = Children::new(lines);
    for rank in 0..args.num_shard {
        let command = shard::command(&exes.server, &args, &sockets, &model.dir, rank);
        if let Err(e) = children.spawn(&shard::name(rank), command) {
            children.stop(|_| true, AFTER_FAILURE_GRACE).await;
            return Err(e);
        }
    }
    tracing::info!(
        "Started {} shard(s) on {}; waiting until they answer Health",
        args.num_shard,
        shard::device_name(args.device, shard::gpu_present())
    );
    if let Some(interrupt) = until(&mut children, &mut signals, shard::wait_all_healthy(args.num_shard, &sockets)).await {
        return end(interrupt, &children, &mut signals, &args, true).await;
    }
    tracing::info!("All shards answer Health; starting the router");

    let command = router::command(&exes.router, &args, &sockets.socket(0), &model.dir, &model.name);
    if let Err(e) = children.spawn(router::NAME, command) {
        children.stop(|_| true, AFTER_FAILURE_GRACE).await;
        return Err(e);
    }
    if let Some(interrupt) = until(&mut children, &mut signals, router::wait_ready(&args)).await {
        return end(interrupt, &children, &mut signals, &args, true).await;
    }
    tracing::info!("Sluice is ready at http://{}:{}", args.serving.hostname, args.serving.port);

    let interrupt = tokio::select! {
        exited = children.next_exit() => Interrupt::ChildExited(exited),
        sig = signals.recv() => Interrupt::Signal(sig),
    };
    end(interrupt, &children, &mut signals, &args, false).await
}

/// Runs `ready` unless a child exits or a signal comes first.
async fn until(children: &mut Children, signals: &mut Signals, ready: impl Future<Output = ()>) -> Option<Interrupt> {
    tokio::select! {
        () = ready => None,
        exited = children.next_exit() => Some(Interrupt::ChildExited(exited)),
        sig = signals.recv() => Some(Interrupt::Signal(sig)),
    }
}

async fn end(
    interrupt: Interrupt,
    children: &Children,
    signals: &mut Signals,
    args: &Args,
    starting: bool,
) -> Result<()> {
    match interrupt {
        Interrupt::ChildExited(exited) => child_failed(exited, children, starting).await,
        Interrupt::Signal(sig) => shut_down(sig, children, signals, args).await,
    }
}

/// A child exited on its own: stop the others, show its last lines, fail.
async fn child_failed(exited: Exited, children: &Children, starting: bool) -> Result<()> {
    let Exited { name, status } = exited;
    tracing::error!("{name} exited ({status}); stopping the others");
    // Its own group too: what it started may outlive it.
    children.stop(|_| true, AFTER_FAILURE_GRACE).await;
    let tail = children.get(&name).map(|c| c.tail()).unwrap_or_default();
    if !tail.is_empty() {
        tracing::error!("Last {} lines of {name}:", tail.len());
        for line in &tail {
            tracing::error!("  {name}: {line}");
        }
    }
    let when = if starting { " while starting" } else { "" };
    // Killed by a signal (the OOM killer, a person): its last line is not
    // about why, so it is not quoted.
    if std::os::unix::process::ExitStatusExt::signal(&status).is_some() {
        bail!("{name} exited{when} ({status})");
    }
    let last = tail
        .iter()
        .rev()
        .map(|l| crate::log::message_of(l))
        .find(|l| !l.is_empty())
        .unwrap_or_else(|| "no output".to_string());
    bail!("{name} exited{when} ({status}): {last}")
}

/// Orderly stop: router first (it stops accepting and drains in-flight
/// requests within --shutdown-timeout), then the shards. A second signal
/// cuts this short.
async fn shut_down(sig: &str, children: &Children, signals: &mut Signals, args: &Args) -> Result<()> {
    let first = Instant::now();
    let drain = Duration::from_secs(args.serving.shutdown_timeout);
    tracing::info!(
        "Received {sig}: the router finishes in-flight requests (up to {}s), then the shards stop",
        args.serving.shutdown_timeout
    );
    let orderly = async {
        children.stop(|c| c.name == router::NAME, drain + ROUTER_EXTRA_GRACE).await;
        children.stop(|c| c.name != router::NAME, SHARD_GRACE).await;
    };
    tokio::select! {
        () = orderly => {
            tracing::info!("Stopped");
            Ok(())
        }
        second = second_signal(signals, first) => {
            tracing::warn!("Received a second signal ({second}): killing every child now");
            children.kill_all().await;
            bail!("stopped by a second signal ({second}); children were killed")
        }
    }
}

/// The next signal that is not a duplicate of the one received at `first`.
async fn second_signal(signals: &mut Signals, first: Instant) -> &'static str {
    loop {
        let sig = signals.recv().await;
        if first.elapsed() >= DUPLICATE_SIGNAL_WINDOW {
            return sig;
        }
        tracing::debug!("Ignoring {sig} {:?} after the first one", first.elapsed());
    }
}

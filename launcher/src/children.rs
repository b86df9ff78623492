//! The launcher's child processes: spawning them so they cannot outlive the
//! launcher, forwarding their output, and stopping them.
//!
//! Every child
//! - gets PR_SET_PDEATHSIG = SIGKILL, so the kernel kills it when the
//!   launcher dies, even by SIGKILL. (The signal fires when the *thread* that
//!   forked exits, which is why the launcher runs a current-thread runtime:
//!   every child is forked by the main thread, which lives as long as the process.)
//! - leads its own process group: a Ctrl-C in a terminal reaches only the
//!   launcher, which then stops the children in order (router first, so it can
//!   drain), and a signal sent to the group also reaches the child's own children.
//! - has stdout and stderr forwarded line by line, and its last lines kept
//!   for the error report when it dies.

use std::collections::VecDeque;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::sync::{mpsc, watch};

use crate::log::ChildLines;

/// Lines of a child's output kept for its error report.
pub const TAIL_LINES: usize = 20;

/// How long a dead child's output pipes may stay open (held by a grandchild)
/// before its exit is reported without the rest of its output.
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// Makes `command` safe to spawn from the launcher: parent-death signal, own
/// process group, killed if its handle is dropped.
pub fn harden(command: &mut Command) {
    let launcher = nix::unistd::getpid();
    command.process_group(0).kill_on_drop(true);
    // SAFETY: the closure runs between fork and exec and only makes
    // async-signal-safe system calls (prctl, getppid); it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The launcher may have died between fork and prctl; then no
            // signal will ever come, so refuse to start.
            if nix::unistd::getppid() != launcher {
                return Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// The last lines a child printed (both streams, in arrival order).
#[derive(Clone, Default)]
pub struct Tail(Arc<Mutex<VecDeque<String>>>);

impl Tail {
    pub fn push(&self, line: String) {
        let mut lines = self.0.lock().unwrap();
        if lines.len() == TAIL_LINES {
            lines.pop_front();
        }
        lines.push_back(line);
    }

    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().iter().cloned().collect()
    }
}

/// Forwards every line of `stream` to the launcher's output and `tail`.
pub async fn forward_lines(
    stream: impl AsyncRead + Unpin,
    source: String,
    lines: ChildLines,
    tail: Tail,
) {
    let mut reader = BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                // Children may print invalid UTF-8 (a truncated multi-byte
                // token); never let that stop the forwarding.
                let line = String::from_utf8_lossy(&buf);
                let line = line.trim_end_matches(['\n', '\r']).to_string();
                lines.print(&source, &line);
                tail.push(line);
            }
        }
    }
}

/// A child the launcher supervises.
pub struct Child {
    pub name: String,
    pid: Pid,
    tail: Tail,
    status: watch::Receiver<Option<ExitStatus>>,
}

impl Child {
    pub fn has_exited(&self) -> bool {
        self.status.borrow().is_some()
    }

    pub fn tail(&self) -> Vec<String> {
        self.tail.lines()
    }

    /// Sends `signal` to the child's process group: the child and what it
    /// started (workers of a shard). A group outlives its leader while any
    /// member lives, and the kernel does not hand out a pid that still names
    /// a group, so this is sent even after the leader was reaped; an empty
    /// group (ESRCH) is ignored. Signals are sent only while the launcher
    /// stops, seconds after any child exited.
    pub fn signal(&self, signal: Signal) {
        let _ = killpg(self.pid, signal);
    }

    async fn wait(&self) {
        let mut status = self.status.clone();
        let _ = status.wait_for(Option::is_some).await;
    }
}

/// A child that exited, reported after its output was drained.
#[derive(Debug)]
pub struct Exited {
    pub name: String,
    pub status: ExitStatus,
}

/// Every child of the launcher.
pub struct Children {
    lines: ChildLines,
    children: Vec<Child>,
    exits_tx: mpsc::UnboundedSender<Exited>,
    exits_rx: mpsc::UnboundedReceiver<Exited>,
}

impl Children {
    pub fn new(lines: ChildLines) -> Self {
        let (exits_tx, exits_rx) = mpsc::unbounded_channel();
        Self { lines, children: Vec::new(), exits_tx, exits_rx }
    }

    /// Starts `command` (hardened, output forwarded) as child `name`.
    pub fn spawn(&mut self, name: &str, mut command: Command) -> Result<()> {
        harden(&mut command);
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let program = command.as_std().get_program().to_string_lossy().into_owned();
        let mut child = command
            .spawn()
            .with_context(|| format!("cannot start {name} (`{program}`)"))?;
        let pid = Pid::from_raw(child.id().expect("a just-spawned child has a pid") as i32);
        let tail = Tail::default();
        let stdout = tokio::spawn(forward_lines(
            child.stdout.take().expect("stdout is piped"),
            name.to_string(),
            self.lines,
            tail.clone(),
        ));
        let stderr = tokio::spawn(forward_lines(
            child.stderr.take().expect("stderr is piped"),
            name.to_string(),
            self.lines,
            tail.clone(),
        ));
        let (status_tx, status_rx) = watch::channel(None);
        let exits = self.exits_tx.clone();
        let child_name = name.to_string();
        tokio::spawn(async move {
            let status = match child.wait().await {
                Ok(status) => status,
                // wait() fails only if the child was already reaped, which
                // nothing else here does; report it as dead all the same.
                Err(_) => std::os::unix::process::ExitStatusExt::from_raw(-1),
            };
            let _ = status_tx.send(Some(status));
            let _ = tokio::time::timeout(DRAIN_GRACE, async {
                let _ = stdout.await;
                let _ = stderr.await;
            })
            .await;
            let _ = exits.send(Exited { name: child_name, status });
        });
        self.children.push(Child { name: name.to_string(), pid, tail, status: status_rx });
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&Child> {
        self.children.iter().find(|c| c.name == name)
    }

    /// The next child to exit. Pends forever when there are no children.
    pub async fn next_exit(&mut self) -> Exited {
        match self.exits_rx.recv().await {
            Some(exited) => exited,
            // Unreachable: `self` holds a sender.
            None => std::future::pending().await,
        }
    }

    /// SIGTERM to the process groups of the children `which` selects, then
    /// SIGKILL to those still alive after `grace`. Returns when all of them
    /// are gone; whatever they left behind in their groups is killed then.
    /// SIGCONT follows the SIGTERM: a stopped child (SIGSTOP, a debugger, the
    /// very shard whose stuck step ended the server) would otherwise hold
    /// the signal pending for the whole grace.
    pub async fn stop(&self, which: impl Fn(&Child) -> bool, grace: Duration) {
        let selected: Vec<&Child> = self.children.iter().filter(|c| which(c)).collect();
        for child in &selected {
            child.signal(Signal::SIGTERM);
            child.signal(Signal::SIGCONT);
        }
        let all_exited = wait_all(&selected);
        if tokio::time::timeout(grace, all_exited).await.is_err() {
            for child in selected.iter().filter(|c| !c.has_exited()) {
                tracing::warn!("{} did not stop within {grace:?}; killing it", child.name);
                child.signal(Signal::SIGKILL);
            }
            wait_all(&selected).await;
        }
        for child in &selected {
            child.signal(Signal::SIGKILL);
        }
    }

    /// SIGKILL to every child, then waits until all are reaped.
    pub async fn kill_all(&self) {
        let all: Vec<&Child> = self.children.iter().collect();
        for child in &all {
            child.signal(Signal::SIGKILL);
        }
        wait_all(&all).await;
    }
}

async fn wait_all(children: &[&Child]) {
    for child in children {
        child.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::time::Instant;

    use super::*;

    /// A stopped child still handles the SIGTERM of `stop` at once (its
    /// trap runs) instead of sitting out the grace until SIGKILL.
    #[tokio::test(flavor = "current_thread")]
    async fn a_stopped_child_gets_its_sigterm() {
        let mut children = Children::new(ChildLines { json: false });
        let mut command = Command::new("sh");
        command.args(["-c", "trap 'exit 3' TERM; echo up; while :; do sleep 0.05; done"]);
        children.spawn("stopped", command).unwrap();
        let child = children.get("stopped").unwrap();
        while child.tail().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        child.signal(Signal::SIGSTOP);
        let started = Instant::now();
        children.stop(|_| true, Duration::from_secs(60)).await;
        assert!(started.elapsed() < Duration::from_secs(30), "waited {:?}", started.elapsed());
        let exited = children.next_exit().await;
        assert_eq!(exited.status.code(), Some(3), "{:?}", exited.status.signal());
    }
}

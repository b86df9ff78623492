//! Step 3: the router, the HTTP front. It connects to shard 0, warms the
//! shards up, then binds HTTP; so its `GET /health` answering 200 means the
//! whole server is ready.

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::Command;

use crate::args::Args;

pub const NAME: &str = "router";

const POLL_INTERVAL: Duration = Duration::from_millis(200);
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Fails when `hostname:port` cannot be bound, so that a taken port is
/// reported in a second, before any shard spends minutes loading weights.
pub fn check_port_free(args: &Args) -> Result<()> {
    std::net::TcpListener::bind((args.serving.hostname.as_str(), args.serving.port))
        .map(drop)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => anyhow!(
                "port {} on {} is already in use; stop what uses it or choose another --port",
                args.serving.port,
                args.serving.hostname
            ),
            _ => anyhow!("cannot listen on {}:{}: {e}", args.serving.hostname, args.serving.port),
        })
}

pub fn command(router: &Path, args: &Args, master_socket: &Path, model_dir: &Path, model_name: &str) -> Command {
    let mut command = Command::new(router);
    command
        .arg("--master-shard-uds-path")
        .arg(master_socket)
        .arg("--tokenizer")
        .arg(model_dir)
        .arg("--model-id")
        .arg(model_name)
        .args(args.serving.router_args());
    // Through the environment: a command line is readable by every local
    // user (/proc/PID/cmdline), the environment only by this one.
    match &args.serving.api_key {
        Some(key) => command.env("API_KEY", key),
        None => command.env_remove("API_KEY"),
    };
    command
}

/// Returns once `GET /health` answers 200. Pends while the router starts;
/// the caller races this against children exiting.
pub async fn wait_ready(args: &Args) {
    let host = probe_host(&args.serving.hostname);
    loop {
        if let Ok(Ok(200)) = tokio::time::timeout(PROBE_TIMEOUT, health_status(host, args.serving.port)).await {
            return;
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Where to reach a server bound to `hostname`: a wildcard address is
/// reachable on loopback.
fn probe_host(hostname: &str) -> &str {
    match hostname {
        "0.0.0.0" => "127.0.0.1",
        "::" | "[::]" => "::1",
        other => other,
    }
}

/// The status code of one plain HTTP/1.1 `GET /health`.
async fn health_status(host: &str, port: u16) -> std::io::Result<u16> {
    let mut stream = TcpStream::connect((host, port)).await?;
    let request = format!("GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    // The status line is all we read: "HTTP/1.1 200 OK\r\n".
    let mut head = [0u8; 64];
    let mut len = 0;
    while len < head.len() && !head[..len].contains(&b'\n') {
        let n = stream.read(&mut head[len..]).await?;
        if n == 0 {
            break;
        }
        len += n;
    }
    parse_status(&head[..len]).ok_or_else(|| std::io::Error::other("not an HTTP response"))
}

fn parse_status(head: &[u8]) -> Option<u16> {
    let line = std::str::from_utf8(head).ok()?.lines().next()?;
    let mut parts = line.split_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/"))?;
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::test_args;
    use clap::Parser;
    use sluice_router::{RouterConfig, ServingFlags};

    fn router_command(args: &[&str]) -> Command {
        let args = test_args(args);
        command(Path::new("r"), &args, Path::new("/tmp/sluice-server-0"), Path::new("/model"), "org/m")
    }

    fn argv(args: &[&str]) -> Vec<String> {
        router_command(args).as_std().get_args().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn the_api_key_goes_through_the_environment_not_the_command_line() {
        let command = router_command(&["--api-key", "s3cret"]);
        assert!(!command.as_std().get_args().any(|a| a.to_string_lossy().contains("s3cret")));
        let env: Vec<_> = command.as_std().get_envs().collect();
        assert!(env.contains(&(std::ffi::OsStr::new("API_KEY"), Some(std::ffi::OsStr::new("s3cret")))));
        let command = router_command(&[]);
        assert!(command.as_std().get_envs().any(|(k, v)| k == "API_KEY" && v.is_none()));
    }

    /// The router parses the command the launcher starts it with back into
    /// the flags the launcher was given (the key goes in the environment).
    #[test]
    fn the_router_gets_the_flags_the_launcher_was_given() {
        for flags in [
            &[][..],
            &[
                "--max-input-tokens", "10", "--max-total-tokens", "20", "--max-batch-prefill-tokens", "30",
                "--max-batch-total-tokens", "40", "--max-batch-size", "5", "--served-model-name", "m",
                "--chat-template", "{{x}}", "--tool-call-parser", "mistral", "--api-key", "k", "--otlp-endpoint",
                "http://o", "--otlp-service-name", "s", "--cors-allow-origin", "http://a,http://b", "--no-prefix-caching",
                "--no-web-ui",
                "--json-output", "--hourly-cost", "2.75", "--cost-window-secs", "30", "--step-timeout", "9",
                "--max-connections", "7", "--header-timeout", "3", "--body-timeout", "4", "--max-n", "3",
                "--speculate", "ngram", "--speculate-tokens", "6", "--ngram-min", "2", "--ngram-max", "4",
                "--speculate-max-batch-size", "3", "--speculate-max-step-tokens", "12",
            ][..],
        ] {
            let given = test_args(flags).serving;
            let got = argv(flags);
            assert_eq!(
                got[..6],
                ["--master-shard-uds-path", "/tmp/sluice-server-0", "--tokenizer", "/model", "--model-id", "org/m"]
            );
            let _env = crate::args::ENV_LOCK.read().unwrap_or_else(|e| e.into_inner());
            let router = RouterConfig::try_parse_from(std::iter::once("sluice-router".to_string()).chain(got)).unwrap();
            assert_eq!(router.serving, ServingFlags { api_key: None, ..given });
        }
        assert!(!argv(&[]).contains(&"--speculate".to_string()));
    }

    #[test]
    fn status_lines_parse() {
        assert_eq!(parse_status(b"HTTP/1.1 200 OK\r\ncontent-length: 0"), Some(200));
        assert_eq!(parse_status(b"HTTP/1.0 503 Service Unavailable\r\n"), Some(503));
        assert_eq!(parse_status(b"SSH-2.0-OpenSSH\r\n"), None);
        assert_eq!(parse_status(b""), None);
    }

    #[test]
    fn a_taken_port_is_reported() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port().to_string();
        let args = test_args(&["--hostname", "127.0.0.1", "--port", &port]);
        let err = check_port_free(&args).unwrap_err().to_string();
        assert!(err.contains(&format!("port {port} on 127.0.0.1 is already in use")), "{err}");
        drop(taken);
        check_port_free(&args).unwrap();
    }
}

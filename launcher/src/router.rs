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
    std::net::TcpListener::bind((args.hostname.as_str(), args.port))
        .map(drop)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => anyhow!(
                "port {} on {} is already in use; stop what uses it or choose another --port",
                args.port,
                args.hostname
            ),
            _ => anyhow!("cannot listen on {}:{}: {e}", args.hostname, args.port),
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
        .arg("--hostname")
        .arg(&args.hostname)
        .arg("--port")
        .arg(args.port.to_string())
        .arg("--max-concurrent-requests")
        .arg(args.max_concurrent_requests.to_string())
        .arg("--max-stop-sequences")
        .arg(args.max_stop_sequences.to_string())
        .arg("--max-top-n-tokens")
        .arg(args.max_top_n_tokens.to_string())
        .arg("--payload-limit")
        .arg(args.payload_limit.to_string())
        .arg("--shutdown-timeout")
        .arg(args.shutdown_timeout.to_string());
    let optional_numbers = [
        ("--max-input-tokens", args.max_input_tokens),
        ("--max-total-tokens", args.max_total_tokens),
        ("--max-batch-prefill-tokens", args.max_batch_prefill_tokens),
        ("--max-batch-total-tokens", args.max_batch_total_tokens),
        ("--max-batch-size", args.max_batch_size),
        ("--step-timeout", args.step_timeout),
        ("--speculate-tokens", args.speculate_tokens),
        ("--ngram-min", args.ngram_min),
        ("--ngram-max", args.ngram_max),
        ("--speculate-max-batch-size", args.speculate_max_batch_size),
        ("--speculate-max-step-tokens", args.speculate_max_step_tokens),
        ("--max-client-batch-size", args.max_client_batch_size),
        ("--max-connections", args.max_connections),
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
    ];
    for (flag, value) in optional_numbers {
        if let Some(value) = value {
            command.arg(flag).arg(value.to_string());
        }
    }
    // f64's Display round-trips: the router parses back the same price.
    if let Some(dollars) = args.hourly_cost {
        command.arg("--hourly-cost").arg(dollars.to_string());
    }
    if let Some(secs) = args.cost_window_secs {
        command.arg("--cost-window-secs").arg(secs.to_string());
    }
    let optional_strings = [
        ("--served-model-name", &args.served_model_name),
        ("--chat-template", &args.chat_template),
        ("--tool-call-parser", &args.tool_call_parser),
        ("--otlp-endpoint", &args.otlp_endpoint),
        ("--otlp-service-name", &args.otlp_service_name),
    ];
    for (flag, value) in optional_strings {
        if let Some(value) = value {
            command.arg(flag).arg(value);
        }
    }
    // Through the environment: a command line is readable by every local
    // user (/proc/PID/cmdline), the environment only by this one.
    match &args.api_key {
        Some(key) => command.env("API_KEY", key),
        None => command.env_remove("API_KEY"),
    };
    for origin in &args.cors_allow_origin {
        command.arg("--cors-allow-origin").arg(origin);
    }
    if !args.prefix_caching() {
        command.arg("--no-prefix-caching");
    }
    if args.json_output {
        command.arg("--json-output");
    }
    if let Some(crate::args::Speculate::Ngram) = args.speculate {
        command.arg("--speculate").arg("ngram");
    }
    command
}

/// Returns once `GET /health` answers 200. Pends while the router starts;
/// the caller races this against children exiting.
pub async fn wait_ready(args: &Args) {
    let host = probe_host(&args.hostname);
    loop {
        if let Ok(Ok(200)) = tokio::time::timeout(PROBE_TIMEOUT, health_status(host, args.port)).await {
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

    #[test]
    fn defaults_become_router_flags() {
        assert_eq!(
            argv(&[]),
            [
                "--master-shard-uds-path", "/tmp/sluice-server-0", "--tokenizer", "/model", "--model-id", "org/m",
                "--hostname", "0.0.0.0", "--port", "8080", "--max-concurrent-requests", "128",
                "--max-stop-sequences", "4", "--max-top-n-tokens", "5", "--payload-limit", "2000000",
                "--shutdown-timeout", "30",
            ]
        );
    }

    #[test]
    fn optional_flags_are_passed_when_set() {
        let got = argv(&[
            "--max-input-tokens", "10", "--max-total-tokens", "20", "--max-batch-prefill-tokens", "30",
            "--max-batch-total-tokens", "40", "--max-batch-size", "5", "--served-model-name", "m",
            "--chat-template", "{{x}}", "--tool-call-parser", "mistral", "--api-key", "k", "--otlp-endpoint",
            "http://o", "--otlp-service-name", "s", "--cors-allow-origin", "http://a,http://b", "--no-prefix-caching", "--json-output", "--hourly-cost", "2.75",
            "--cost-window-secs", "30", "--step-timeout", "9",
            "--max-connections", "7", "--header-timeout", "3", "--body-timeout", "4",
        ]);
        let tail = &got[20..];
        assert_eq!(
            tail,
            [
                "--max-input-tokens", "10", "--max-total-tokens", "20", "--max-batch-prefill-tokens", "30",
                "--max-batch-total-tokens", "40", "--max-batch-size", "5", "--step-timeout", "9",
                "--max-connections", "7", "--header-timeout", "3", "--body-timeout", "4", "--hourly-cost", "2.75",
                "--cost-window-secs", "30", "--served-model-name", "m",
                "--chat-template", "{{x}}", "--tool-call-parser", "mistral",
                "--otlp-endpoint", "http://o", "--otlp-service-name", "s", "--cors-allow-origin", "http://a", "--cors-allow-origin", "http://b",
                "--no-prefix-caching", "--json-output",
            ]
        );
    }

    #[test]
    fn speculation_flags_are_passed_when_set() {
        let got = argv(&[
            "--speculate", "ngram", "--speculate-tokens", "6", "--ngram-min", "2", "--ngram-max", "4",
            "--speculate-max-batch-size", "3", "--speculate-max-step-tokens", "12",
        ]);
        assert_eq!(
            &got[20..],
            [
                "--speculate-tokens", "6", "--ngram-min", "2", "--ngram-max", "4", "--speculate-max-batch-size", "3",
                "--speculate-max-step-tokens", "12", "--speculate",
                "ngram",
            ]
        );
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

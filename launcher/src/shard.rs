//! Step 2: the shard processes, one per tensor-parallel rank.
//!
//! Shard `rank` is `sluice-server serve MODEL_DIR --uds-path BASE ...` with the
//! torch.distributed variables in its environment; it listens on the unix
//! socket `BASE-rank`. It is ready when that socket answers the gRPC `Health` call.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use hyper_util::rt::TokioIo;
use sluice_router::pb::shard_client::ShardClient;
use sluice_router::pb::HealthRequest;
use tokio::net::UnixStream;
use tokio::process::Command;
use tonic::transport::{Endpoint, Uri};

use crate::args::{Args, Device};
use crate::sockets::ShardSockets;

const POLL_INTERVAL: Duration = Duration::from_millis(200);
/// One Health call: a forward pass, the first of which may be slow on CUDA
/// (kernel compilation).
const HEALTH_TIMEOUT: Duration = Duration::from_secs(60);

pub fn name(rank: u32) -> String {
    format!("shard-{rank}")
}

fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// torch threads for each of `num_shard` CPU shards on a host with `cores`.
fn cpu_threads_per_shard(cores: usize, num_shard: u32) -> usize {
    (cores / num_shard.max(1) as usize).max(1)
}

pub fn command(server: &Path, args: &Args, sockets: &ShardSockets, model_dir: &Path, rank: u32) -> Command {
    let mut command = Command::new(server);
    command
        .arg("serve")
        .arg(model_dir)
        .arg("--uds-path")
        .arg(sockets.base())
        .arg("--block-size")
        .arg(args.block_size.to_string());
    let device = device_name(args.device, gpu_present());
    command.arg("--device").arg(device);
    if device == "cpu" && args.num_shard > 1 {
        // Shards on one host share its cores: each takes its part rather than
        // every shard's torch taking all of them.
        command.arg("--num-threads").arg(cpu_threads_per_shard(available_cores(), args.num_shard).to_string());
    }
    if let Some(dtype) = &args.dtype {
        command.arg("--dtype").arg(dtype);
    }
    if let Some(bytes) = args.kv_cache_bytes {
        command.arg("--kv-cache-bytes").arg(bytes.to_string());
    }
    if let Some(dtype) = &args.kv_cache_dtype {
        command.arg("--kv-cache-dtype").arg(dtype);
    }
    if let Some(mode) = &args.cpu_kernels {
        command.arg("--cpu-kernels").arg(mode);
    }
    if let Some(rows) = args.cpu_block_rows {
        command.arg("--cpu-block-rows").arg(rows.to_string());
    }
    if let Some(bytes) = args.max_weight_memory {
        command.arg("--max-weight-memory").arg(bytes.to_string());
    }
    if args.expert_parallel {
        command.arg("--expert-parallel");
    }
    let max_loras = args.max_loras();
    if max_loras > 0 {
        command.arg("--max-loras").arg(max_loras.to_string());
        command.arg("--max-lora-rank").arg(args.max_lora_rank.to_string());
        if let Some(dtype) = &args.lora_dtype {
            command.arg("--lora-dtype").arg(dtype);
        }
        // Adapters load from --lora-root, or from the folders named at start.
        let roots = args.lora_root.iter().map(|root| root.as_os_str().to_owned());
        for root in roots.chain(args.serving.lora_adapters.iter().map(|a| a.path.clone().into())) {
            command.arg("--lora-root").arg(root);
        }
    }
    if args.serving.json_output {
        command.arg("--json-output");
    }
    if let Some(endpoint) = &args.serving.otlp_endpoint {
        command.arg("--otlp-endpoint").arg(endpoint);
        command.arg("--otlp-service-name").arg(shard_service_name(args.serving.otlp_service_name.as_deref()));
    }
    command
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", args.num_shard.to_string())
        .env("LOCAL_WORLD_SIZE", args.num_shard.to_string())
        .env("MASTER_ADDR", &args.master_addr)
        .env("MASTER_PORT", args.master_port.to_string())
        // The router's alone: a shard has no use for it.
        .env_remove("API_KEY");
    command
}

/// The shards' OpenTelemetry service name: the router's name + "-shard".
pub fn shard_service_name(router_name: Option<&str>) -> String {
    match router_name {
        Some(name) => format!("{name}-shard"),
        None => "sluice-shard".to_string(),
    }
}

/// The shard's `--device`: `auto` means CUDA when an NVIDIA GPU is visible.
pub fn device_name(device: Device, gpu_present: bool) -> &'static str {
    match device {
        Device::Cpu => "cpu",
        Device::Cuda => "cuda",
        Device::Auto if gpu_present => "cuda",
        Device::Auto => "cpu",
    }
}

/// Whether the NVIDIA driver reports a GPU that CUDA_VISIBLE_DEVICES does
/// not hide. (Asking torch would cost a Python start-up of seconds.)
pub fn gpu_present() -> bool {
    let hidden = std::env::var("CUDA_VISIBLE_DEVICES")
        .is_ok_and(|v| v.trim().is_empty() || v.trim() == "-1");
    !hidden
        && std::fs::read_dir("/proc/driver/nvidia/gpus").is_ok_and(|mut gpus| gpus.next().is_some())
}

/// Removes socket files left by an earlier run, so that a shard can bind and
/// "the socket exists" means "this run's shard made it". Refuses to touch a
/// path that is not a socket, or a socket some live server still answers on.
pub fn remove_stale_sockets(num_shard: u32, sockets: &ShardSockets) -> Result<()> {
    for rank in 0..num_shard {
        let path = sockets.socket(rank);
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        if !meta.file_type().is_socket() {
            bail!("{} exists and is not a socket; choose another --shard-uds-path", path.display());
        }
        if std::os::unix::net::UnixStream::connect(&path).is_ok() {
            bail!(
                "another server is listening on {}; stop it or choose another --shard-uds-path",
                path.display()
            );
        }
        std::fs::remove_file(&path)
            .with_context(|| format!("cannot remove the stale socket {}", path.display()))?;
    }
    Ok(())
}

/// Returns once every shard socket answers Health. Pends while they load;
/// the caller races this against the shards exiting.
///
/// With several shards a Health call runs a forward pass, a collective over
/// all ranks: rank 0 answers only once every rank got its call. So the calls
/// go to all ranks at once, and only when every socket exists.
pub async fn wait_all_healthy(num_shard: u32, sockets: &ShardSockets) {
    let sockets: Vec<PathBuf> = (0..num_shard).map(|rank| sockets.socket(rank)).collect();
    loop {
        if sockets.iter().all(|s| s.exists()) && all_healthy(&sockets).await {
            return;
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

async fn all_healthy(sockets: &[PathBuf]) -> bool {
    let mut calls = tokio::task::JoinSet::new();
    for socket in sockets {
        let socket = socket.clone();
        calls.spawn(async move {
            let answer = tokio::time::timeout(HEALTH_TIMEOUT, health(&socket)).await;
            (socket, answer)
        });
    }
    let mut healthy = true;
    while let Some(joined) = calls.join_next().await {
        match joined {
            Ok((_, Ok(Ok(())))) => {}
            Ok((socket, Ok(Err(e)))) => {
                tracing::debug!("{} not healthy yet: {e:#}", socket.display());
                healthy = false;
            }
            Ok((socket, Err(_))) => {
                tracing::debug!("{} did not answer Health within {HEALTH_TIMEOUT:?}", socket.display());
                healthy = false;
            }
            Err(_) => healthy = false,
        }
    }
    healthy
}

/// One gRPC Health call over the unix socket `socket`.
pub async fn health(socket: &Path) -> Result<()> {
    let socket: PathBuf = socket.to_path_buf();
    // The URI is required by tonic but unused: the connector dials the socket.
    let channel = Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await?;
    ShardClient::new(channel).health(HealthRequest {}).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::test_args;

    fn sockets(args: &Args) -> ShardSockets {
        let mut args = args.clone();
        args.shard_uds_path.get_or_insert_with(|| "/tmp/sluice-server".into());
        ShardSockets::new(&args).unwrap()
    }

    fn argv(cmd: &Command) -> Vec<String> {
        cmd.as_std().get_args().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    fn env(cmd: &Command, key: &str) -> Option<String> {
        cmd.as_std()
            .get_envs()
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.map(|v| v.to_string_lossy().into_owned()))
    }

    #[test]
    fn optional_flags_are_passed_only_when_set() {
        let args = test_args(&[]);
        let cmd = command(Path::new("srv"), &args, &sockets(&args), Path::new("/m"), 0);
        let device = device_name(Device::Auto, gpu_present());
        assert_eq!(argv(&cmd), ["serve", "/m", "--uds-path", "/tmp/sluice-server", "--block-size", "16", "--device", device]);

        let args = test_args(&[
            "--dtype", "float16", "--device", "cpu", "--kv-cache-bytes", "1024", "--json-output",
            "--block-size", "32", "--shard-uds-path", "/s", "--kv-cache-dtype", "float32", "--cpu-kernels", "off",
            "--cpu-block-rows", "0", "--max-weight-memory", "4096", "--expert-parallel",
        ]);
        let cmd = command(Path::new("srv"), &args, &sockets(&args), Path::new("/m"), 0);
        assert_eq!(
            argv(&cmd),
            ["serve", "/m", "--uds-path", "/s", "--block-size", "32", "--device", "cpu", "--dtype", "float16",
             "--kv-cache-bytes", "1024", "--kv-cache-dtype", "float32", "--cpu-kernels", "off",
             "--cpu-block-rows", "0", "--max-weight-memory", "4096", "--expert-parallel", "--json-output"]
        );
    }

    #[test]
    fn lora_flags_reach_the_shards_with_every_allowed_folder() {
        let args = test_args(&["--lora-root", "/roots/a", "--lora-adapters", "sql=/x/sql", "--max-lora-rank", "8"]);
        let cmd = command(Path::new("srv"), &args, &sockets(&args), Path::new("/m"), 0);
        let args_given = argv(&cmd);
        let at = args_given.iter().position(|a| a == "--max-loras").expect("--max-loras passed");
        assert_eq!(
            args_given[at..],
            ["--max-loras", "4", "--max-lora-rank", "8", "--lora-root", "/roots/a", "--lora-root", "/x/sql"]
        );
        let args = test_args(&["--lora-root", "/roots/a", "--lora-dtype", "float32"]);
        let cmd = command(Path::new("srv"), &args, &sockets(&args), Path::new("/m"), 0);
        let args_given = argv(&cmd);
        let at = args_given.iter().position(|a| a == "--lora-dtype").expect("--lora-dtype passed");
        assert_eq!(args_given[at + 1], "float32");
        let args = test_args(&[]);
        let cmd = command(Path::new("srv"), &args, &sockets(&args), Path::new("/m"), 0);
        assert!(!argv(&cmd).iter().any(|a| a.contains("lora")), "no LoRA flags without adapters");
    }

    #[test]
    fn tracing_flags_reach_the_shards() {
        let args = test_args(&["--otlp-endpoint", "http://c:4317", "--device", "cpu"]);
        let cmd = command(Path::new("srv"), &args, &sockets(&args), Path::new("/m"), 1);
        let argv = argv(&cmd);
        assert_eq!(
            argv[argv.len() - 4..],
            ["--otlp-endpoint", "http://c:4317", "--otlp-service-name", "sluice-shard"]
        );
        let args = test_args(&["--otlp-endpoint", "http://c:4317", "--otlp-service-name", "llm"]);
        let cmd = command(Path::new("srv"), &args, &sockets(&args), Path::new("/m"), 0);
        assert_eq!(argv_last(&cmd), "llm-shard");
    }

    fn argv_last(cmd: &Command) -> String {
        argv(cmd).pop().unwrap()
    }

    #[test]
    fn auto_device_follows_the_gpu() {
        assert_eq!(device_name(Device::Auto, true), "cuda");
        assert_eq!(device_name(Device::Auto, false), "cpu");
        assert_eq!(device_name(Device::Cpu, true), "cpu");
        assert_eq!(device_name(Device::Cuda, false), "cuda");
    }

    #[test]
    fn cpu_shards_split_the_cores() {
        assert_eq!(cpu_threads_per_shard(16, 4), 4);
        assert_eq!(cpu_threads_per_shard(2, 2), 1);
        assert_eq!(cpu_threads_per_shard(2, 4), 1);
        let args = test_args(&["--num-shard", "2", "--device", "cpu"]);
        let cmd = command(Path::new("srv"), &args, &sockets(&args), Path::new("/m"), 0);
        let argv: Vec<String> = cmd.as_std().get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        let at = argv.iter().position(|a| a == "--num-threads").expect("--num-threads passed");
        assert_eq!(argv[at + 1], cpu_threads_per_shard(available_cores(), 2).to_string());
        let args = test_args(&["--device", "cpu"]);
        let single = command(Path::new("srv"), &args, &sockets(&args), Path::new("/m"), 0);
        assert!(!single.as_std().get_args().any(|a| a == "--num-threads"), "one shard keeps torch's default");
    }

    #[test]
    fn each_rank_gets_the_torch_distributed_environment() {
        let args = test_args(&["--num-shard", "4", "--master-addr", "10.1.2.3", "--master-port", "29777"]);
        let cmd = command(Path::new("srv"), &args, &sockets(&args), Path::new("/m"), 2);
        assert_eq!(env(&cmd, "RANK").as_deref(), Some("2"));
        assert_eq!(env(&cmd, "LOCAL_RANK").as_deref(), Some("2"));
        assert_eq!(env(&cmd, "WORLD_SIZE").as_deref(), Some("4"));
        assert_eq!(env(&cmd, "MASTER_ADDR").as_deref(), Some("10.1.2.3"));
        assert_eq!(env(&cmd, "MASTER_PORT").as_deref(), Some("29777"));
        let api_key_removed = cmd.as_std().get_envs().any(|(k, v)| k == "API_KEY" && v.is_none());
        assert!(api_key_removed, "shards never see the API key");
    }

    #[test]
    fn stale_sockets_are_removed_but_live_ones_and_other_files_are_not() {
        let dir = std::env::temp_dir().join(format!("sluice-shard-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let base = dir.join("s").to_string_lossy().into_owned();
        let args = test_args(&["--num-shard", "2", "--shard-uds-path", &base]);
        let sockets = sockets(&args);

        // A socket whose server is gone leaves its file behind.
        drop(std::os::unix::net::UnixListener::bind(sockets.socket(0)).unwrap());
        remove_stale_sockets(2, &sockets).unwrap();
        assert!(!sockets.socket(0).exists());

        let live = std::os::unix::net::UnixListener::bind(sockets.socket(1)).unwrap();
        let err = remove_stale_sockets(2, &sockets).unwrap_err().to_string();
        assert!(err.contains("another server is listening"), "{err}");
        assert!(sockets.socket(1).exists());
        drop(live);

        std::fs::remove_file(sockets.socket(1)).unwrap();
        std::fs::write(sockets.socket(1), "not a socket").unwrap();
        let err = remove_stale_sockets(2, &sockets).unwrap_err().to_string();
        assert!(err.contains("is not a socket"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}

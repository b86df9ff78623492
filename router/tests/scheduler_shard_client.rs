//! The tonic shard client over unix sockets, against two in-process gRPC
//! "ranks": discovery, fan-out of every step (and adapter load) to every
//! rank, rank 0's answer.

use std::sync::{Arc, Mutex};

use sluice_router::client::{Shard as _, ShardGroup};
use sluice_router::pb::shard_server::{Shard, ShardServer};
use sluice_router::pb::*;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

#[derive(Clone)]
struct Rank {
    rank: u32,
    urls: Vec<String>,
    num_blocks: u32,
    steps: Arc<Mutex<Vec<StepRequest>>>,
    /// LoadAdapter (path) and UnloadAdapter ("") calls: (slot, path).
    adapters: Arc<Mutex<Vec<(u32, String)>>>,
    fail_steps: bool,
}

#[tonic::async_trait]
impl Shard for Rank {
    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        Ok(Response::new(InfoResponse { rank: self.rank, world_size: 2, block_size: 16, ..Default::default() }))
    }
    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        Ok(Response::new(HealthResponse {}))
    }
    async fn service_discovery(
        &self,
        _: Request<ServiceDiscoveryRequest>,
    ) -> Result<Response<ServiceDiscoveryResponse>, Status> {
        Ok(Response::new(ServiceDiscoveryResponse { urls: self.urls.clone() }))
    }
    async fn warmup(&self, _: Request<WarmupRequest>) -> Result<Response<WarmupResponse>, Status> {
        // Only rank 1 may still compile kernels: the group must say so.
        Ok(Response::new(WarmupResponse {
            num_blocks: self.num_blocks,
            kv_cache_bytes: 0,
            compilation_pending: self.rank == 1,
            lora_bytes: 1000 + self.rank as u64,
        }))
    }
    async fn step(&self, request: Request<StepRequest>) -> Result<Response<StepResponse>, Status> {
        if self.fail_steps {
            return Err(Status::internal("rank failed"));
        }
        let request = request.into_inner();
        self.steps.lock().unwrap().push(request.clone());
        let generations = request
            .new_requests
            .iter()
            .map(|n| Generation { id: n.id, token_id: 1000 + self.rank, ..Default::default() })
            .collect();
        Ok(Response::new(StepResponse { generations, ..Default::default() }))
    }
    async fn clear_cache(&self, _: Request<ClearCacheRequest>) -> Result<Response<ClearCacheResponse>, Status> {
        Ok(Response::new(ClearCacheResponse {}))
    }
    async fn load_adapter(&self, request: Request<LoadAdapterRequest>) -> Result<Response<LoadAdapterResponse>, Status> {
        let request = request.into_inner();
        if request.path.contains("bad") && self.rank == 1 {
            return Err(Status::invalid_argument("rank 1 refuses it"));
        }
        self.adapters.lock().unwrap().push((request.slot, request.path));
        Ok(Response::new(LoadAdapterResponse { rank: 8 + self.rank, target_modules: vec!["q_proj".into()] }))
    }
    async fn unload_adapter(&self, request: Request<UnloadAdapterRequest>) -> Result<Response<UnloadAdapterResponse>, Status> {
        self.adapters.lock().unwrap().push((request.into_inner().slot, String::new()));
        Ok(Response::new(UnloadAdapterResponse {}))
    }
}

type Logs = (Arc<Mutex<Vec<StepRequest>>>, Arc<Mutex<Vec<(u32, String)>>>);

/// Serves two ranks under `dir`; returns their step and adapter logs.
fn serve(dir: &std::path::Path, fail_rank_1: bool) -> Vec<Logs> {
    let paths: Vec<_> = (0..2).map(|r| dir.join(format!("shard-{r}"))).collect();
    let urls: Vec<String> = paths.iter().map(|p| format!("unix://{}", p.display())).collect();
    let mut logs = Vec::new();
    for (rank, path) in paths.iter().enumerate() {
        let (steps, adapters) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
        logs.push((steps.clone(), adapters.clone()));
        let service = Rank {
            rank: rank as u32,
            urls: urls.clone(),
            num_blocks: 100 - rank as u32,
            steps,
            adapters,
            fail_steps: fail_rank_1 && rank == 1,
        };
        let listener = tokio::net::UnixListener::bind(path).unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(ShardServer::new(service))
                .serve_with_incoming(UnixListenerStream::new(listener)),
        );
    }
    logs
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-client-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn steps_go_to_every_rank_and_rank_0_answers() {
    let dir = temp_dir("ok");
    let logs = serve(&dir, false);
    let mut group = ShardGroup::connect(dir.join("shard-0").to_str().unwrap()).await.unwrap();
    assert_eq!(group.world_size(), 2);
    assert_eq!(group.info().await.unwrap().rank, 0);
    group.health().await.unwrap();
    let warmed = group.warmup(64, 8, 128).await.unwrap();
    assert_eq!((warmed.num_blocks, warmed.lora_bytes), (99, 1000), "the smallest rank's num_blocks, rank 0's bytes");
    assert!(warmed.compilation_pending, "one rank still compiling holds every step");
    group.clear_cache().await.unwrap();

    let step = StepRequest {
        finished_ids: vec![3],
        new_requests: vec![NewRequest { id: 7, token_ids: vec![1, 2], num_new_tokens: 2, ..Default::default() }],
        scheduled: vec![],
    };
    let response = group.step(step.clone()).await.unwrap();
    assert_eq!(response.generations[0].token_id, 1000, "rank 0's answer");
    for (steps, _) in &logs {
        assert_eq!(steps.lock().unwrap().as_slice(), std::slice::from_ref(&step));
    }

    // Adapters load on every rank; rank 0 answers; any rank's refusal fails it.
    let load = LoadAdapterRequest { slot: 2, path: "/a/sql".into(), finished_ids: vec![4] };
    assert_eq!(group.load_adapter(load).await.unwrap().rank, 8);
    group.unload_adapter(UnloadAdapterRequest { slot: 2, finished_ids: vec![] }).await.unwrap();
    for (_, adapters) in &logs {
        assert_eq!(adapters.lock().unwrap().as_slice(), [(2, "/a/sql".to_string()), (2, String::new())]);
    }
    let refused = group.load_adapter(LoadAdapterRequest { slot: 1, path: "/a/bad".into(), finished_ids: vec![] }).await;
    assert!(matches!(refused, Err(sluice_router::client::ClientError::Status(s)) if s.code() == tonic::Code::InvalidArgument));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn an_error_from_any_rank_fails_the_step() {
    let dir = temp_dir("fail");
    serve(&dir, true);
    let mut group = ShardGroup::connect(dir.join("shard-0").to_str().unwrap()).await.unwrap();
    assert!(group.step(StepRequest::default()).await.is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn connecting_to_a_missing_socket_is_a_connection_error() {
    let dir = temp_dir("missing");
    let err = ShardGroup::connect(dir.join("nothing-here").to_str().unwrap()).await.unwrap_err();
    assert!(matches!(err, sluice_router::client::ClientError::Connection(_)), "{err:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

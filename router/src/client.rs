//! The gRPC client of the shard group (tonic over unix domain sockets).
//!
//! Rank 0's socket is the entry point: `ServiceDiscovery` lists every rank's
//! URL (`unix:///path-RANK`), and the group keeps one channel per rank. A
//! step goes to every rank at once (tensor parallelism: each rank computes
//! its slice, they agree through torch.distributed) and rank 0's answer is
//! the group's answer.

use std::future::Future;

use futures::future::try_join_all;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::pb::shard_client::ShardClient;
use crate::pb::{
    ClearCacheRequest, HealthRequest, InfoRequest, InfoResponse, LoadAdapterRequest, LoadAdapterResponse,
    ServiceDiscoveryRequest, StepRequest, StepResponse, UnloadAdapterRequest, WarmupRequest, WarmupResponse,
};

/// What the shard group's Warmup settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Warmed {
    /// KV blocks every rank holds.
    pub num_blocks: u32,
    /// The first steps may still compile kernels (`WarmupResponse.compilation_pending`).
    pub compilation_pending: bool,
    /// Bytes rank 0's adapter slots take (`WarmupResponse.lora_bytes`).
    pub lora_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be reached (names the path and the cause).
    #[error("cannot connect to shard: {0}")]
    Connection(String),
    #[error("shard returned an error: {0}")]
    Status(#[from] tonic::Status),
    #[error("shard group is inconsistent: {0}")]
    Protocol(String),
}

/// What the scheduler needs from a shard group; implemented by [`ShardGroup`]
/// and by the test double `testing::fake_shard::FakeShard`.
pub trait Shard: Send + 'static {
    fn step(&mut self, request: StepRequest) -> impl Future<Output = Result<StepResponse, ClientError>> + Send;

    /// Checks a LoRA adapter and, with a slot (1..=max_loras), loads it
    /// there; slot 0 keeps nothing (see the proto's LoadAdapter).
    fn load_adapter(
        &mut self,
        request: LoadAdapterRequest,
    ) -> impl Future<Output = Result<LoadAdapterResponse, ClientError>> + Send;

    /// Empties an adapter slot.
    fn unload_adapter(&mut self, request: UnloadAdapterRequest) -> impl Future<Output = Result<(), ClientError>> + Send;

    /// `step` with the step's trace context (see telemetry.rs); shards that
    /// do not trace ignore it.
    fn step_traced(
        &mut self,
        request: StepRequest,
        trace: StepTrace,
    ) -> impl Future<Output = Result<StepResponse, ClientError>> + Send {
        let _ = trace;
        self.step(request)
    }
}

/// gRPC metadata key of the request spans a step serves (repeated).
pub const LINK_METADATA_KEY: &str = "sluice-link-traceparent";

/// A step's trace context, sent as gRPC metadata: `traceparent` (the step
/// span) and one `sluice-link-traceparent` entry per request span it serves.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTrace {
    pub traceparent: Option<String>,
    pub links: Vec<String>,
}

impl StepTrace {
    /// `request` with this context in its metadata (values that are not
    /// valid header text are left out; they never are, being hex).
    pub fn attach<T>(&self, request: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(request);
        let metadata = request.metadata_mut();
        if let Some(value) = self.traceparent.as_deref().and_then(|v| v.parse().ok()) {
            metadata.insert("traceparent", value);
        }
        for value in self.links.iter().filter_map(|v| v.parse().ok()) {
            metadata.append(LINK_METADATA_KEY, value);
        }
        request
    }
}

/// One tonic channel per rank, rank order.
#[derive(Debug, Clone)]
pub struct ShardGroup {
    clients: Vec<ShardClient<Channel>>,
}

/// `unix:///tmp/sluice-server-0` or `/tmp/sluice-server-0` -> the socket path.
fn socket_path(url: &str) -> &str {
    url.strip_prefix("unix://").unwrap_or(url)
}

async fn connect_uds(path: &str) -> Result<ShardClient<Channel>, ClientError> {
    let socket = path.to_string();
    // The URI is required by tonic but unused: the connector ignores it and
    // dials the socket file.
    let channel = Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(socket).await?)) }
        }))
        .await
        .map_err(|e| ClientError::Connection(format!("{path}: {e:?}")))?;
    Ok(ShardClient::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX))
}

impl ShardGroup {
    /// Connects to rank 0 at `master_uds_path` (a socket file path, e.g.
    /// /tmp/sluice-server-0), calls ServiceDiscovery, connects to every rank.
    pub async fn connect(master_uds_path: &str) -> Result<Self, ClientError> {
        let mut master = connect_uds(socket_path(master_uds_path)).await?;
        let urls = master.service_discovery(ServiceDiscoveryRequest {}).await?.into_inner().urls;
        if urls.is_empty() {
            return Err(ClientError::Protocol("ServiceDiscovery returned no shards".into()));
        }
        let clients = try_join_all(urls.iter().map(|url| connect_uds(socket_path(url)))).await?;
        Ok(Self { clients })
    }

    pub fn world_size(&self) -> usize {
        self.clients.len()
    }

    /// Rank 0's facts.
    pub async fn info(&mut self) -> Result<InfoResponse, ClientError> {
        Ok(self.clients[0].info(InfoRequest {}).await?.into_inner())
    }

    /// Ok when every rank answers.
    pub async fn health(&mut self) -> Result<(), ClientError> {
        try_join_all(self.clients.iter_mut().map(|c| c.health(HealthRequest {}))).await?;
        Ok(())
    }

    /// Warms every rank up. The group has as many blocks as its smallest
    /// member (each rank holds its slice of every block), and compilation is
    /// pending when any rank says so (a step waits for its slowest rank);
    /// the adapter slots' bytes are rank 0's.
    pub async fn warmup(
        &mut self,
        max_batch_prefill_tokens: u32,
        max_batch_size: u32,
        max_total_tokens: u32,
    ) -> Result<Warmed, ClientError> {
        let responses = try_join_all(self.clients.iter_mut().map(|c| {
            c.warmup(WarmupRequest { max_batch_prefill_tokens, max_batch_size, max_total_tokens })
        }))
        .await?;
        let responses: Vec<WarmupResponse> = responses.into_iter().map(tonic::Response::into_inner).collect();
        let num_blocks = responses
            .iter()
            .map(|r| r.num_blocks)
            .min()
            .ok_or_else(|| ClientError::Protocol("no shards".into()))?;
        let compilation_pending = responses.iter().any(|r| r.compilation_pending);
        Ok(Warmed { num_blocks, compilation_pending, lora_bytes: responses[0].lora_bytes })
    }

    pub async fn clear_cache(&mut self) -> Result<(), ClientError> {
        try_join_all(self.clients.iter_mut().map(|c| c.clear_cache(ClearCacheRequest {}))).await?;
        Ok(())
    }
}

impl Shard for ShardGroup {
    /// Sends the same step to every rank; an error from any rank fails the
    /// step, otherwise rank 0's response is the answer.
    fn step(&mut self, request: StepRequest) -> impl Future<Output = Result<StepResponse, ClientError>> + Send {
        self.step_traced(request, StepTrace::default())
    }

    /// Every rank loads its slice of the adapter; rank 0's answer.
    fn load_adapter(
        &mut self,
        request: LoadAdapterRequest,
    ) -> impl Future<Output = Result<LoadAdapterResponse, ClientError>> + Send {
        let all = try_join_all(self.clients.iter_mut().map(|c| c.load_adapter(request.clone())));
        async move { Ok(all.await?.swap_remove(0).into_inner()) }
    }

    fn unload_adapter(&mut self, request: UnloadAdapterRequest) -> impl Future<Output = Result<(), ClientError>> + Send {
        let all = try_join_all(self.clients.iter_mut().map(|c| c.unload_adapter(request.clone())));
        async move {
            all.await?;
            Ok(())
        }
    }

    fn step_traced(
        &mut self,
        request: StepRequest,
        trace: StepTrace,
    ) -> impl Future<Output = Result<StepResponse, ClientError>> + Send {
        let calls = self.clients.iter_mut().map(|c| {
            let request = trace.attach(request.clone());
            async move { c.step(request).await }
        });
        let all = try_join_all(calls);
        async move {
            let mut responses = all.await?;
            Ok(responses.swap_remove(0).into_inner())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_trace_goes_into_grpc_metadata() {
        let trace = StepTrace {
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            links: vec![
                "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01".into(),
                "00-0af7651916cd43dd8448eb211c80319c-2222222222222222-01".into(),
            ],
        };
        let request = trace.attach(());
        let metadata = request.metadata();
        assert_eq!(metadata.get("traceparent").unwrap(), trace.traceparent.as_deref().unwrap());
        let links: Vec<&str> = metadata.get_all(LINK_METADATA_KEY).iter().map(|v| v.to_str().unwrap()).collect();
        assert_eq!(links, trace.links);
        // No context: no metadata at all.
        assert!(StepTrace::default().attach(()).metadata().is_empty());
    }
}

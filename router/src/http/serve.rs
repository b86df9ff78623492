//! The HTTP server loop: the axum app on hyper's HTTP/1.1, with the limits
//! `axum::serve` leaves out, so that slow, idle or numerous clients cannot
//! hold the server:
//!
//! - at most `max_connections` open connections; one more is answered 503
//!   (with `Retry-After`) and closed at once;
//! - a request head must arrive within `header_timeout` (hyper's header read
//!   timeout; it also bounds how long a keep-alive connection may sit idle
//!   between requests);
//! - a request body must arrive within `body_timeout`.
//!
//! Graceful shutdown: when `shutdown` resolves, no connection is accepted
//! any more; open ones finish their request in flight and close, and
//! `serve` returns when all are gone.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use hyper::body::Incoming;
use hyper::Request;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tower::ServiceBuilder;
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutBody};

/// The server's connection limits (see the module comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeOptions {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
}

/// What a connection over the limit reads before it is closed.
const OVER_CAPACITY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-type: text/plain\r\n\
connection: close\r\ncontent-length: 36\r\n\r\ntoo many connections; retry shortly\n";

/// A failed accept that is about the server, not one client (out of file
/// descriptors): pause before the next, instead of spinning.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

pub async fn serve(
    listener: TcpListener,
    app: Router,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) {
    let service = ServiceBuilder::new()
        .layer(RequestBodyTimeoutLayer::new(options.body_timeout))
        .map_request(|request: Request<TimeoutBody<Incoming>>| request.map(Body::new))
        .service(app);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(options.header_timeout);
    let permits = Arc::new(Semaphore::new(options.max_connections));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(max_connections = options.max_connections, "connection refused: too many open");
            tokio::spawn(refuse(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let connection = http
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("connection closed: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Answers a connection over the limit and closes it, without reading it.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(OVER_CAPACITY)).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use axum::routing::{get, post};
    use tokio::io::AsyncReadExt;

    use super::*;

    async fn start(options: ServeOptions) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let app = Router::new()
            .route("/health", get(|| async { "ok" }))
            .route("/echo", post(|body: axum::body::Bytes| async move { body }));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, app, options, async {
            let _ = stopped.await;
        }));
        (address, stop)
    }

    /// Reads until the peer closes (or `limit` passes): what the server sent.
    async fn read_to_close(stream: &mut TcpStream, limit: Duration) -> Option<String> {
        let mut out = Vec::new();
        match tokio::time::timeout(limit, stream.read_to_end(&mut out)).await {
            Ok(_) => Some(String::from_utf8_lossy(&out).into_owned()),
            Err(_) => None,
        }
    }

    const OPTIONS: ServeOptions = ServeOptions {
        max_connections: 4,
        header_timeout: Duration::from_millis(300),
        body_timeout: Duration::from_millis(300),
    };

    #[tokio::test]
    async fn a_request_head_that_trickles_in_is_cut_off() {
        let (address, _stop) = start(OPTIONS).await;
        let mut stream = TcpStream::connect(address).await.unwrap();
        let started = Instant::now();
        stream.write_all(b"GET /health HTTP/1.1\r\n").await.unwrap();
        for _ in 0..20 {
            if stream.write_all(b"x-slow: 1\r\n").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let answer = read_to_close(&mut stream, Duration::from_secs(10)).await;
        assert!(answer.is_some(), "the connection stayed open");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[tokio::test]
    async fn an_idle_connection_is_closed() {
        let (address, _stop) = start(OPTIONS).await;
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let answer = read_to_close(&mut stream, Duration::from_secs(10)).await.expect("closed when idle");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn a_body_that_never_arrives_is_cut_off() {
        let (address, _stop) = start(OPTIONS).await;
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nabc").await.unwrap();
        let answer = read_to_close(&mut stream, Duration::from_secs(10)).await.expect("closed");
        assert!(!answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn connections_over_the_limit_are_refused_then_served_again() {
        let (address, _stop) = start(ServeOptions { header_timeout: Duration::from_secs(30), ..OPTIONS }).await;
        let mut held = Vec::new();
        for _ in 0..OPTIONS.max_connections {
            let mut stream = TcpStream::connect(address).await.unwrap();
            stream.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
            let mut head = [0u8; 12];
            stream.read_exact(&mut head).await.unwrap();
            held.push(stream);
        }
        let mut extra = TcpStream::connect(address).await.unwrap();
        let answer = read_to_close(&mut extra, Duration::from_secs(10)).await.expect("refused at once");
        assert!(answer.starts_with("HTTP/1.1 503") && answer.contains("too many connections"), "{answer}");
        drop(held);
        let mut served = None;
        for _ in 0..100 {
            let mut stream = TcpStream::connect(address).await.unwrap();
            stream.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
            let answer = read_to_close(&mut stream, Duration::from_secs(10)).await.unwrap_or_default();
            if answer.starts_with("HTTP/1.1 200") {
                served = Some(answer);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(served.is_some(), "the freed slots were never reused");
    }

    #[tokio::test]
    async fn shutdown_stops_accepting() {
        let (address, stop) = start(OPTIONS).await;
        stop.send(()).unwrap();
        let mut refused = false;
        for _ in 0..100 {
            if TcpStream::connect(address).await.is_err() {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(refused, "still accepting after shutdown");
    }
}

//! The axum application: routes, middleware and the small endpoints
//! (health, readiness, info, tokenize, metrics, OpenAPI).
//!
//! - `state`      - what every handler shares (`AppState`, `Info`).
//! - `openai`     - OpenAI's endpoints (`chat`, `completions`, models) and wire types.
//! - `responses`  - OpenAI's Responses API (create, stream, store, GET/DELETE/cancel).
//! - `anthropic`  - Anthropic's Messages API (`/v1/messages`, `count_tokens`).
//! - `tgi`        - TGI's endpoints and wire types.
//! - `lora`       - loading and unloading LoRA adapters (vLLM's endpoints).
//! - `generation` - the generation driver every API hands validated requests
//!   to: submission, `n` choices, collected or streamed results, usage.
//! - `answer`     - reads a choice's text into reasoning, content and tool
//!   calls, the same way for every chat-like API.
//! - `sse`        - server-sent event framing.
//! - `error`      - every error leaves through here, in each API's shape.
//! - `serve`      - the connection loop: connection cap, header and body timeouts.
//! - `webui`      - the web page at `GET /` (chat playground, live dashboard).

pub mod answer;
pub mod anthropic;
pub mod error;
pub mod generation;
pub mod lora;
pub mod openai;
pub mod responses;
pub mod serve;
pub mod sse;
pub mod state;
pub mod tgi;
pub mod webui;
#[cfg(test)]
mod tests;

pub use state::{AppState, Info, LoraInfo, SpeculationInfo};

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Query, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::{Json, Router};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::{Deserialize, Serialize};
use tower_http::cors::{AllowOrigin, CorsLayer};
use utoipa::{OpenApi, ToSchema};

use crate::infer::{InferError, SchedulerFailure, SchedulerStats};
use error::{AnthropicError, ApiError, OpenAiError, TgiError};

/// Anthropic's API-key header.
const X_API_KEY: &str = "x-api-key";

/// Room for a multipart upload's headers and boundaries beyond the file.
const MULTIPART_SLACK: usize = 64 * 1024;

pub struct HttpOptions {
    /// `--payload-limit`, in bytes.
    pub payload_limit: usize,
    pub cors_allow_origin: Vec<String>,
    /// Serve the web page at `GET /` (`--web-ui`).
    pub web_ui: bool,
    /// `--metrics-auth`: /metrics asks for the API key as the API routes do.
    pub metrics_auth: bool,
}

pub fn app(state: Arc<AppState>, options: &HttpOptions) -> Router {
    let generation = Router::new()
        .route("/", post(tgi::compat_generate))
        .route("/generate", post(tgi::generate))
        .route("/generate_stream", post(tgi::generate_stream))
        .route("/v1/chat/completions", post(openai::chat::chat_completions))
        .route("/v1/completions", post(openai::completions::completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/messages", post(anthropic::messages))
        .layer(middleware::from_fn_with_state(state.clone(), reject_while_draining))
        // Outermost: one trace per generation request, including refusals.
        .layer(middleware::from_fn(crate::telemetry::trace_http));
    // Uploads may be larger than any other body (--batch-max-file-bytes).
    let file_limit = state.batches.as_ref().map_or(options.payload_limit, |b| b.config.max_file_bytes + MULTIPART_SLACK);
    let batch_api = Router::new()
        .route(
            "/v1/files",
            post(openai::files::upload).get(openai::files::list).layer(DefaultBodyLimit::max(file_limit)),
        )
        .route("/v1/files/{id}", get(openai::files::get).delete(openai::files::delete))
        .route("/v1/files/{id}/content", get(openai::files::content))
        .route("/v1/batches", post(openai::batches::create).get(openai::batches::list))
        .route("/v1/batches/{id}", get(openai::batches::get))
        .route("/v1/batches/{id}/cancel", post(openai::batches::cancel));
    let router = Router::new()
        .merge(generation)
        .merge(batch_api)
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/models", get(openai::models))
        .route("/v1/load_lora_adapter", post(lora::load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(lora::unload_lora_adapter))
        .route("/info", get(info))
        .route("/openapi.json", get(openapi))
        .layer(middleware::from_fn_with_state(state.clone(), require_api_key))
        // Reachable without the key: the web page, liveness and readiness
        // (probes), and by default the metrics (Prometheus and the Gateway
        // API Inference Extension's endpoint picker scrape them; they carry
        // no request content, but do show load and traffic).
        .merge(web_ui_routes(options.web_ui))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", metrics_route(&state, options.metrics_auth))
        // limit_body enforces --payload-limit instead of axum's default
        // limit, so that the 413 can name it.
        .layer(DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(options.payload_limit, limit_body))
        .with_state(state);
    if options.cors_allow_origin.is_empty() {
        return router;
    }
    router.layer(
        CorsLayer::new()
            .allow_origin(allowed_origins(&options.cors_allow_origin))
            .allow_methods([Method::GET, Method::POST, Method::DELETE])
            .allow_headers([
                header::CONTENT_TYPE,
                header::AUTHORIZATION,
                header::HeaderName::from_static(X_API_KEY),
                header::HeaderName::from_static("anthropic-version"),
            ]),
    )
}

/// The web page (without the key too: it holds no data, and asks for the
/// key when the API wants it). `GET /` shares its path with TGI's `POST /`.
fn web_ui_routes(enabled: bool) -> Router<Arc<AppState>> {
    if !enabled {
        return Router::new().route("/", get(webui::disabled));
    }
    Router::new().route("/", get(webui::index)).route("/ui/{name}", get(webui::asset))
}

/// `--cors-allow-origin`'s values: `*` allows any origin (tower-http
/// refuses a list that holds it), otherwise exactly those listed (the
/// config parser already refused values that cannot be a header).
fn allowed_origins(origins: &[String]) -> AllowOrigin {
    if origins.iter().any(|o| o == "*") {
        return AllowOrigin::any();
    }
    AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
}

/// `GET /metrics`, behind the API key when `auth` (`--metrics-auth`).
fn metrics_route(state: &Arc<AppState>, auth: bool) -> MethodRouter<Arc<AppState>> {
    let route = get(metrics);
    if auth {
        return route.layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    }
    route
}

/// `--payload-limit`: a body that says it is larger is refused before it is
/// read; one that grows past the limit while arriving (chunked) fails with
/// [`error::BodyTooLarge`], which the handler's `body_bytes` turns into the
/// same 413. Both name the limit in bytes and the flag.
///
/// File uploads have their own, larger limit (`--batch-max-file-bytes`, set
/// on their route), so this one leaves them alone.
async fn limit_body(State(limit): State<usize>, request: Request, next: Next) -> Response {
    if request.uri().path() == "/v1/files" {
        return next.run(request).await;
    }
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return api_error_for(request.uri().path(), ApiError::PayloadTooLarge { limit });
    }
    let request = request.map(|body| {
        Body::new(Limited::new(body, limit).map_err(move |error| -> axum::BoxError {
            if error.is::<LengthLimitError>() {
                Box::new(error::BodyTooLarge { limit })
            } else {
                error
            }
        }))
    });
    next.run(request).await
}

/// The key travels as `Authorization: Bearer KEY` (OpenAI's clients, TGI's)
/// or `x-api-key: KEY` (Anthropic's); either may carry it.
async fn require_api_key(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let headers = request.headers();
        let bearer = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer_token);
        let x_api_key = headers.get(X_API_KEY).and_then(|v| v.to_str().ok());
        if ![bearer, x_api_key].into_iter().flatten().any(|given| same_key(given, key)) {
            return api_error_for(request.uri().path(), ApiError::Unauthorized);
        }
    }
    next.run(request).await
}

/// Compares a client's key with ours in time that does not depend on where
/// they differ (a timing side channel would reveal the key byte by byte).
fn same_key(given: &str, key: &str) -> bool {
    let (given, key) = (given.as_bytes(), key.as_bytes());
    let difference = given.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(difference) == 0 && given.len() == key.len()
}

/// The token of `Authorization: Bearer TOKEN`. The scheme is
/// case-insensitive (RFC 9110 section 11.1), so `bearer` works too.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

async fn reject_while_draining(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if state.draining.load(Ordering::SeqCst) {
        return api_error_for(request.uri().path(), ApiError::Draining);
    }
    next.run(request).await
}

/// Errors raised before a handler runs, in the shape of the API asked.
fn api_error_for(path: &str, error: ApiError) -> Response {
    if path.starts_with("/v1/messages") {
        AnthropicError(error).into_response()
    } else if path.starts_with("/v1/") || path == "/detokenize" {
        OpenAiError(error).into_response()
    } else {
        TgiError(error).into_response()
    }
}

/// Liveness: the process answers and can still serve. `?ready` turns it
/// into readiness.
#[utoipa::path(get, path = "/health", params(("ready" = Option<String>, Query, description = "answer as /ready does")),
    responses((status = 200, description = "alive"),
        (status = 503, description = "the scheduler failed or a step is past its deadline (the server is about to exit); not ready (with ?ready)",
            body = error::TgiErrorBody)))]
async fn health(State(state): State<Arc<AppState>>, Query(query): Query<HealthQuery>) -> Response {
    if query.ready.is_some() {
        return ready(State(state)).await;
    }
    let stats = state.infer.stats().await;
    match liveness(state.infer.failure(), stats.as_ref(), Instant::now()) {
        Ok(()) => StatusCode::OK.into_response(),
        Err(error) => TgiError(ApiError::Infer(error)).into_response(),
    }
}

/// The liveness decision, separate from I/O so tests can give it clocks.
/// Dead: the scheduler failed (the router exits a moment later), or a step
/// is past its deadline (the scheduler is about to fail it). A draining
/// router stays alive, so a probe never cuts a drain short; a slow step
/// within its deadline is readiness's business, not a reason to restart.
pub(crate) fn liveness(
    failure: Option<SchedulerFailure>,
    stats: Option<&SchedulerStats>,
    now: Instant,
) -> Result<(), InferError> {
    if let Some(failure) = failure {
        return Err(failure.unavailable());
    }
    let Some(stats) = stats else {
        return Err(InferError::Unavailable("the scheduler is not running".into()));
    };
    if stats.step_deadline.is_some_and(|deadline| now >= deadline) {
        return Err(InferError::Unavailable("a step is past its deadline; the server is restarting".into()));
    }
    Ok(())
}

#[derive(Deserialize)]
struct HealthQuery {
    ready: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    pub ready: bool,
    pub reason: Option<String>,
    pub waiting: usize,
    pub running: usize,
}

/// Readiness: warmed up (the app exists only after Warmup), not draining,
/// and the shards make progress.
#[utoipa::path(get, path = "/ready", responses((status = 200, body = Readiness), (status = 503, body = Readiness)))]
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let stats = state.infer.stats().await;
    let verdict = readiness(&state, stats.as_ref(), Instant::now());
    let status = if verdict.ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(verdict)).into_response()
}

/// The readiness decision, separate from I/O so tests can give it clocks.
pub(crate) fn readiness(state: &AppState, stats: Option<&SchedulerStats>, now: Instant) -> Readiness {
    let not_ready = |reason: &str, stats: Option<&SchedulerStats>| Readiness {
        ready: false,
        reason: Some(reason.to_string()),
        waiting: stats.map_or(0, |s| s.waiting),
        running: stats.map_or(0, |s| s.running),
    };
    if state.draining.load(Ordering::SeqCst) {
        return not_ready("draining", stats);
    }
    let Some(stats) = stats else {
        return not_ready("the scheduler is not running", None);
    };
    let timeout = state.progress_timeout;
    if let Some(since) = stats.step_in_flight_since {
        if now.saturating_duration_since(since) > timeout {
            return not_ready("a step has been running for too long", Some(stats));
        }
    }
    let last_progress = stats.last_step_finished.unwrap_or(state.started).max(state.started);
    let pending = stats.waiting + stats.running > 0;
    if pending && stats.step_in_flight_since.is_none() && now.saturating_duration_since(last_progress) > timeout {
        return not_ready("requests are pending but no step finished recently", Some(stats));
    }
    Readiness {
        ready: true,
        reason: None,
        waiting: stats.waiting,
        running: stats.running,
    }
}

#[utoipa::path(get, path = "/info", responses((status = 200, body = Info)))]
async fn info(State(state): State<Arc<AppState>>) -> Json<Info> {
    Json(state.info.clone())
}

#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format", body = String)))]
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut text = state.metrics.render();
    // None when the scheduler is gone: the price is still shown, the window
    // gauges are left out.
    let window = state.infer.stats().await.map(|stats| stats.window);
    crate::metrics::render_window(&mut text, state.info.hourly_cost, window.as_ref());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    pub inputs: String,
    /// Accepted for TGI compatibility; ignored.
    #[schema(value_type = Option<Object>)]
    #[serde(rename = "parameters")]
    pub _parameters: Option<serde_json::Value>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SimpleToken {
    pub id: u32,
    pub text: String,
    /// Byte offset of the token's text in `inputs`: `[start, stop)`.
    pub start: usize,
    pub stop: usize,
}

/// Tokenizes `inputs` as /generate would (special tokens added).
#[utoipa::path(post, path = "/tokenize", request_body = TokenizeRequest,
    responses((status = 200, body = Vec<SimpleToken>), (status = 422, body = error::TgiErrorBody)))]
async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Json<Vec<SimpleToken>>, TgiError> {
    let body = error::body_bytes(body)?;
    Ok(Json(state.off_runtime(move |state| tokenize_body(state, &body)).await?))
}

fn tokenize_body(state: &AppState, body: &[u8]) -> Result<Vec<SimpleToken>, ApiError> {
    let request: TokenizeRequest = error::parse_json(body)?;
    if request.inputs.is_empty() {
        return Err(crate::validation::ValidationError::Empty { field: "inputs".into() }.into());
    }
    let tokens = state
        .validation
        .tokenizer
        .encode_with_offsets(&request.inputs, true)
        .map_err(|e| ApiError::Validation(crate::validation::ValidationError::Tokenizer(e.to_string())))?;
    Ok(tokens
        .into_iter()
        .map(|t| SimpleToken {
            id: t.id,
            text: t.text,
            start: t.start,
            stop: t.stop,
        })
        .collect())
}

/// vLLM's `/detokenize` request.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    /// Token ids, each below the vocabulary size.
    pub tokens: Vec<u64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    /// The tokens' text (special tokens included, as vLLM decodes them).
    pub prompt: String,
}

/// Decodes token ids back into text, in vLLM's shape; an id outside the
/// vocabulary is a 400 naming it.
#[utoipa::path(post, path = "/detokenize", request_body = DetokenizeRequest,
    responses((status = 200, body = DetokenizeResponse), (status = 400, body = error::OpenAiErrorBody)))]
async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Json<DetokenizeResponse>, OpenAiError> {
    let body = error::body_bytes(body)?;
    Ok(Json(state.off_runtime(move |state| detokenize_body(state, &body)).await?))
}

fn detokenize_body(state: &AppState, body: &[u8]) -> Result<DetokenizeResponse, ApiError> {
    let request: DetokenizeRequest = error::parse_json(body)?;
    let validation = &state.validation;
    validation.check_model(request.model.as_deref())?;
    let ids = validation.tokenize(&crate::validation::Prompt::Tokens(request.tokens), "tokens", false);
    // An empty list decodes to nothing (vLLM answers "" too).
    let ids = match ids {
        Err(crate::validation::ValidationError::Empty { .. }) => Vec::new(),
        other => other?,
    };
    let prompt = validation
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| ApiError::Validation(crate::validation::ValidationError::Tokenizer(e.to_string())))?;
    Ok(DetokenizeResponse { prompt })
}

#[derive(OpenApi)]
#[openapi(
    info(title = "Sluice", description = "LLM inference server: OpenAI-compatible (chat, completions, Responses), Anthropic Messages and TGI-native APIs"),
    paths(
        health, ready, info, metrics, tokenize, openai::models,
        tgi::generate, tgi::generate_stream, tgi::compat_generate,
        openai::chat::chat_completions, openai::completions::completions,
        openai::files::upload, openai::files::list, openai::files::get, openai::files::delete, openai::files::content,
        openai::batches::create, openai::batches::list, openai::batches::get, openai::batches::cancel,
        responses::create, responses::retrieve, responses::delete, responses::cancel,
        anthropic::messages, anthropic::count_tokens,
        detokenize,
        lora::load_lora_adapter, lora::unload_lora_adapter,
    )
)]
pub struct ApiDoc;

#[utoipa::path(get, path = "/openapi.json", responses((status = 200, description = "this document")))]
async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

//! The one place where errors become HTTP responses. Each API has its own
//! error body: OpenAI's `{"error": {"message", "type", "param", "code"}}`
//! (chat, completions, Responses), TGI's `{"error": "...", "error_type":
//! "..."}` and Anthropic's `{"type": "error", "error": {"type", "message"}}`;
//! the status codes follow each API's habits (validation is 400 for OpenAI
//! and Anthropic, 422 for TGI).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use crate::batch::BatchError;
use crate::infer::{AdapterError, InferError};
use crate::validation::ValidationError;

/// Everything a handler can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Validation(#[from] ValidationError),
    #[error(transparent)]
    Infer(#[from] InferError),
    /// Loading or unloading a LoRA adapter failed.
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    #[error("the request body is larger than the server's limit of {limit} bytes (--payload-limit)")]
    PayloadTooLarge { limit: usize },
    /// The body stopped arriving for longer than `--body-timeout`.
    #[error("the request body stopped arriving (--body-timeout)")]
    BodyTimeout,
    #[error("missing or invalid API key")]
    Unauthorized,
    /// The router is draining (SIGTERM) and takes no new requests.
    #[error("the server is shutting down")]
    Draining,
    /// The Batch API (`/v1/files`, `/v1/batches`).
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// A stored object (a response of /v1/responses) that is not there;
    /// `param`: the request field that named it.
    #[error("{message}")]
    NotFound { message: String, param: Option<String> },
}

/// How long a client told "overloaded" should wait, in seconds.
const RETRY_AFTER_SECS: &str = "1";

impl ApiError {
    pub(crate) fn openai_status(&self) -> StatusCode {
        match self {
            Self::Validation(ValidationError::ModelNotFound { .. }) => StatusCode::NOT_FOUND,
            Self::Validation(ValidationError::Tokenizer(_)) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Validation(_) | Self::Infer(InferError::Unschedulable(_)) => StatusCode::BAD_REQUEST,
            other => other.common_status(),
        }
    }

    fn tgi_status(&self) -> StatusCode {
        match self {
            Self::Validation(ValidationError::ModelNotFound { .. }) => StatusCode::NOT_FOUND,
            Self::Validation(ValidationError::Tokenizer(_)) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Validation(_) | Self::Infer(InferError::Unschedulable(_)) => StatusCode::UNPROCESSABLE_ENTITY,
            // TGI answers a failed generation with 424.
            Self::Infer(InferError::Generation(_)) => StatusCode::FAILED_DEPENDENCY,
            other => other.common_status(),
        }
    }

    fn common_status(&self) -> StatusCode {
        match self {
            Self::Batch(BatchError::NotFound { .. }) => StatusCode::NOT_FOUND,
            Self::Batch(BatchError::Invalid(_)) => StatusCode::BAD_REQUEST,
            Self::Batch(BatchError::TooLarge { .. }) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Batch(BatchError::Conflict(_)) => StatusCode::CONFLICT,
            Self::Batch(BatchError::Disabled) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Batch(BatchError::Store(_)) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Validation(_) => StatusCode::BAD_REQUEST,
            Self::Infer(InferError::Overloaded(_)) => StatusCode::TOO_MANY_REQUESTS,
            Self::Infer(InferError::ShuttingDown | InferError::Unavailable(_)) | Self::Draining => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::Infer(InferError::Generation(_)) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Infer(InferError::Unschedulable(_)) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Infer(InferError::UnknownAdapter(_)) | Self::Adapter(AdapterError::Unknown { .. }) => {
                StatusCode::NOT_FOUND
            }
            Self::Adapter(AdapterError::Shard { .. }) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Adapter(_) => StatusCode::BAD_REQUEST,
            Self::NotFound { .. } => StatusCode::NOT_FOUND,
        }
    }

    fn anthropic_status(&self) -> StatusCode {
        match self {
            Self::Validation(ValidationError::ModelNotFound { .. }) => StatusCode::NOT_FOUND,
            Self::Validation(ValidationError::Tokenizer(_)) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Validation(_) | Self::Infer(InferError::Unschedulable(_)) => StatusCode::BAD_REQUEST,
            other => other.common_status(),
        }
    }

    /// Anthropic's error `type` for this error.
    fn anthropic_kind(&self) -> &'static str {
        match self.anthropic_status() {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            status if status.is_server_error() => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// OpenAI's (type, code) for this error.
    fn openai_kind(&self) -> (&'static str, Option<&'static str>) {
        match self {
            Self::Validation(ValidationError::ModelNotFound { .. })
            | Self::Infer(InferError::UnknownAdapter(_))
            | Self::Adapter(AdapterError::Unknown { .. }) => ("invalid_request_error", Some("model_not_found")),
            Self::Adapter(AdapterError::Shard { .. }) => ("server_error", None),
            Self::Adapter(_) => ("invalid_request_error", None),
            Self::Validation(ValidationError::Tokenizer(_)) => ("server_error", None),
            Self::Validation(_) | Self::Infer(InferError::Unschedulable(_)) => ("invalid_request_error", None),
            Self::PayloadTooLarge { .. } => ("invalid_request_error", Some("payload_too_large")),
            Self::BodyTimeout => ("invalid_request_error", Some("request_timeout")),
            Self::Infer(InferError::Overloaded(_)) => ("rate_limit_error", Some("overloaded")),
            Self::Infer(InferError::ShuttingDown) | Self::Draining => ("service_unavailable", Some("shutting_down")),
            Self::Infer(InferError::Unavailable(_)) => ("service_unavailable", Some("server_restarting")),
            Self::Infer(InferError::Generation(_)) => ("server_error", Some("generation_failed")),
            Self::Unauthorized => ("authentication_error", Some("invalid_api_key")),
            Self::Batch(BatchError::NotFound { .. }) => ("invalid_request_error", Some("not_found")),
            Self::Batch(BatchError::Invalid(_)) => ("invalid_request_error", None),
            Self::Batch(BatchError::TooLarge { .. }) => ("invalid_request_error", Some("payload_too_large")),
            Self::Batch(BatchError::Conflict(_)) => ("invalid_request_error", Some("conflict")),
            Self::Batch(BatchError::Disabled) => ("service_unavailable", Some("batch_api_disabled")),
            Self::Batch(BatchError::Store(_)) => ("server_error", None),
            Self::NotFound { .. } => ("invalid_request_error", Some("not_found")),
        }
    }

    /// TGI's `error_type`; the names the `text-generation` client knows.
    fn tgi_error_type(&self) -> &'static str {
        match self {
            Self::Validation(ValidationError::Tokenizer(_)) => "tokenizer",
            Self::Validation(_) | Self::Infer(InferError::Unschedulable(_)) => "validation",
            Self::PayloadTooLarge { .. } => "payload_too_large",
            Self::BodyTimeout => "request_timeout",
            Self::Infer(InferError::Overloaded(_)) => "overloaded",
            Self::Infer(InferError::ShuttingDown | InferError::Unavailable(_)) | Self::Draining => "unhealthy",
            Self::Infer(InferError::Generation(_)) => "generation",
            Self::Unauthorized => "authentication",
            Self::Batch(BatchError::Store(_)) => "generation",
            Self::Batch(_) => "validation",
            Self::NotFound { .. } => "not_found",
            Self::Infer(InferError::UnknownAdapter(_)) | Self::Adapter(_) => "validation",
        }
    }

    pub fn openai_body(&self) -> OpenAiErrorBody {
        let (kind, code) = self.openai_kind();
        let param = match self {
            Self::Validation(e) => e.param().map(str::to_string),
            Self::NotFound { param, .. } => param.clone(),
            Self::Adapter(AdapterError::Invalid { field, .. }) => Some(field.to_string()),
            Self::Adapter(AdapterError::Unknown { .. }) => Some("lora_name".into()),
            Self::Infer(InferError::UnknownAdapter(_)) => Some("model".into()),
            _ => None,
        };
        OpenAiErrorBody {
            error: OpenAiErrorDetail {
                message: self.to_string(),
                r#type: kind.to_string(),
                param,
                code: code.map(str::to_string),
            },
        }
    }

    pub fn tgi_body(&self) -> TgiErrorBody {
        TgiErrorBody {
            error: self.to_string(),
            error_type: self.tgi_error_type().to_string(),
        }
    }

    pub fn anthropic_body(&self) -> AnthropicErrorBody {
        AnthropicErrorBody {
            kind: "error",
            error: AnthropicErrorDetail { kind: self.anthropic_kind().to_string(), message: self.to_string() },
        }
    }

    fn finish(&self, status: StatusCode, body: Response) -> Response {
        let mut response = (status, body).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECS));
        }
        if status.is_server_error() {
            tracing::warn!(error = %self, "request failed");
        }
        response
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiErrorBody {
    pub error: OpenAiErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub r#type: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TgiErrorBody {
    pub error: String,
    pub error_type: String,
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct AnthropicErrorBody {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub error: AnthropicErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AnthropicErrorDetail {
    /// `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `request_too_large`, `rate_limit_error`, `overloaded_error` or `api_error`.
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

/// An [`ApiError`] answered in Anthropic's shape.
#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl<E: Into<ApiError>> From<E> for AnthropicError {
    fn from(e: E) -> Self {
        Self(e.into())
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let body = Json(self.0.anthropic_body()).into_response();
        self.0.finish(self.0.anthropic_status(), body)
    }
}

/// An [`ApiError`] answered in OpenAI's shape.
#[derive(Debug)]
pub struct OpenAiError(pub ApiError);

/// An [`ApiError`] answered in TGI's shape.
#[derive(Debug)]
pub struct TgiError(pub ApiError);

impl<E: Into<ApiError>> From<E> for OpenAiError {
    fn from(e: E) -> Self {
        Self(e.into())
    }
}

impl<E: Into<ApiError>> From<E> for TgiError {
    fn from(e: E) -> Self {
        Self(e.into())
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let body = Json(self.0.openai_body()).into_response();
        self.0.finish(self.0.openai_status(), body)
    }
}

impl IntoResponse for TgiError {
    fn into_response(self) -> Response {
        let body = Json(self.0.tgi_body()).into_response();
        self.0.finish(self.0.tgi_status(), body)
    }
}

/// The body as bytes, with an oversized or stalled body reported in our
/// error shape.
pub fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if let Some(BodyTooLarge { limit }) = cause::<BodyTooLarge>(&rejection) {
            ApiError::PayloadTooLarge { limit: *limit }
        } else if cause::<tower_http::timeout::TimeoutError>(&rejection).is_some() {
            // The body stopped arriving: `--body-timeout` (http/serve.rs) ended it.
            ApiError::BodyTimeout
        } else {
            ApiError::Validation(ValidationError::Body {
                field: None,
                message: rejection.body_text(),
            })
        }
    })
}

/// The error a request body fails with once it grows past `--payload-limit`
/// (see `http::limit_body`); [`body_bytes`] finds it in the rejection.
#[derive(Debug, thiserror::Error)]
#[error("the request body is larger than {limit} bytes")]
pub struct BodyTooLarge {
    pub limit: usize,
}

/// The first error of type `E` down the rejection's chain of causes.
fn cause<E: std::error::Error + 'static>(rejection: &BytesRejection) -> Option<&E> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(rejection);
    while let Some(error) = cause {
        if let Some(found) = error.downcast_ref::<E>() {
            return Some(found);
        }
        cause = error.source();
    }
    None
}

/// A handler's body as `T`: [`body_bytes`], then [`parse_json`].
pub fn parse_body<T: serde::de::DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    parse_json(&body_bytes(body)?)
}

/// The most top-level keys a request body may have. Every API's body has a
/// few dozen fields; the cap bounds the one search below that is linear in
/// them, and tells a client sending junk what is wrong.
pub const MAX_TOP_LEVEL_KEYS: usize = 256;

/// Parses a JSON body, naming the offending field on failure
/// (`messages[0].content: invalid type: ...`).
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::Validation(ValidationError::Body {
            field: None,
            message: format!("the request body is not valid JSON: {e}"),
        })
    })?;
    if let Some(keys) = value.as_object().map(serde_json::Map::len).filter(|&n| n > MAX_TOP_LEVEL_KEYS) {
        return Err(ApiError::Validation(ValidationError::Body {
            field: None,
            message: format!("the request body has {keys} top-level fields; at most {MAX_TOP_LEVEL_KEYS} are accepted"),
        }));
    }
    serde_path_to_error::deserialize::<_, T>(&value).map_err(|e| {
        let path = e.path().to_string();
        let field = match path.as_str() {
            "." | "?" | "" => missing_field(&e.inner().to_string()).or_else(|| culprit_key::<T>(value)),
            _ => Some(path),
        };
        let message = match &field {
            Some(field) => format!("`{field}`: {}", e.inner()),
            None => e.inner().to_string(),
        };
        ApiError::Validation(ValidationError::Body { field, message })
    })
}

/// Parses one part of a body already read as JSON (an item of a list
/// whose kinds differ); `field` names the part in errors (`input[2].name`).
pub fn parse_part<T: serde::de::DeserializeOwned>(value: &serde_json::Value, field: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let field = match path.as_str() {
            "." | "" | "?" => match missing_field(&e.inner().to_string()) {
                Some(missing) => format!("{field}.{missing}"),
                None => field.to_string(),
            },
            _ => format!("{field}.{path}"),
        };
        ApiError::Validation(ValidationError::Body { message: format!("`{field}`: {}", e.inner()), field: Some(field) })
    })
}

/// The field serde names in "missing field `name`".
fn missing_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("missing field `")?;
    Some(rest[..rest.find('`')?].to_string())
}

/// `#[serde(flatten)]` fields lose their path inside serde: the top-level
/// key whose removal makes `value` deserialize, if exactly one does
/// (flattened fields are optional ones, so leaving one out is valid). Error
/// path only; each try deserializes the body once, and there are at most
/// [`MAX_TOP_LEVEL_KEYS`] of them (keys are taken out and put back, never
/// copied).
fn culprit_key<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Option<String> {
    let serde_json::Value::Object(object) = value else { return None };
    let keys: Vec<String> = object.keys().cloned().collect();
    let mut rest = serde_json::Value::Object(object);
    let mut found = None;
    for key in keys {
        let serde_json::Value::Object(map) = &mut rest else { unreachable!("rest stays an object") };
        let taken = map.remove(&key)?;
        let parses = T::deserialize(&rest).is_ok();
        let serde_json::Value::Object(map) = &mut rest else { unreachable!("rest stays an object") };
        map.insert(key.clone(), taken);
        if parses {
            if found.is_some() {
                return None;
            }
            found = Some(key);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Body {
        messages: Vec<Message>,
    }
    #[derive(Debug, serde::Deserialize)]
    struct Message {
        content: String,
    }

    #[test]
    fn json_errors_name_the_field() {
        let body = parse_json::<Body>(br#"{"messages": [{"content": "hi"}]}"#).unwrap();
        assert_eq!(body.messages[0].content, "hi");
        let err = parse_json::<Body>(br#"{"messages": [{"content": 3}]}"#).unwrap_err();
        let body = err.openai_body();
        assert_eq!(body.error.param.as_deref(), Some("messages[0].content"));
        assert!(body.error.message.contains("invalid type"), "{}", body.error.message);
        let err = parse_json::<Body>(b"{not json").unwrap_err();
        assert_eq!(err.openai_status(), StatusCode::BAD_REQUEST);
        assert_eq!(err.tgi_status(), StatusCode::UNPROCESSABLE_ENTITY);
    }

    #[derive(Debug, serde::Deserialize)]
    struct Flattened {
        model: String,
        #[serde(flatten)]
        sampling: Sampling,
    }
    #[derive(Debug, serde::Deserialize)]
    struct Sampling {
        temperature: Option<f32>,
        top_p: Option<f32>,
    }

    #[test]
    fn flattened_field_errors_name_the_field() {
        let ok = parse_json::<Flattened>(br#"{"model": "m", "top_p": 0.5}"#).unwrap();
        assert_eq!((ok.model.as_str(), ok.sampling.temperature, ok.sampling.top_p), ("m", None, Some(0.5)));
        let err = parse_json::<Flattened>(br#"{"model": "m", "temperature": "hot", "top_p": 1}"#).unwrap_err();
        let body = err.openai_body();
        assert_eq!(body.error.param.as_deref(), Some("temperature"));
        assert!(body.error.message.contains("`temperature`: invalid type"), "{}", body.error.message);
    }

    #[test]
    fn missing_fields_are_named_without_a_search() {
        let err = parse_json::<Flattened>(br#"{"temperature": 1}"#).unwrap_err();
        assert_eq!(err.openai_body().error.param.as_deref(), Some("model"));
    }

    #[test]
    fn junk_keys_are_capped_and_the_culprit_still_found() {
        let mut body = serde_json::Map::new();
        for i in 0..=MAX_TOP_LEVEL_KEYS {
            body.insert(format!("junk{i}"), serde_json::Value::from(i));
        }
        let err = parse_json::<Flattened>(&serde_json::to_vec(&body).unwrap()).unwrap_err();
        let message = err.openai_body().error.message;
        assert!(message.contains(&format!("{} top-level fields", MAX_TOP_LEVEL_KEYS + 1)), "{message}");

        // Just under the cap, the flattened culprit is still named.
        body.retain(|k, _| k != "junk0" && k != "junk1" && k != "junk2");
        body.insert("model".into(), "m".into());
        body.insert("temperature".into(), "hot".into());
        let err = parse_json::<Flattened>(&serde_json::to_vec(&body).unwrap()).unwrap_err();
        assert_eq!(err.openai_body().error.param.as_deref(), Some("temperature"));
    }

    #[test]
    fn malformed_json_says_so() {
        let err = parse_json::<Body>(b"{not json").unwrap_err();
        assert!(err.openai_body().error.message.contains("not valid JSON"));
    }

    #[test]
    fn statuses_per_api() {
        let overloaded = ApiError::Infer(InferError::Overloaded("full".into()));
        let response = OpenAiError(overloaded).into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let generation = ApiError::Infer(InferError::Generation("nan".into()));
        assert_eq!(generation.tgi_status(), StatusCode::FAILED_DEPENDENCY);
        assert_eq!(generation.openai_status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(generation.tgi_body().error_type, "generation");
        let restarting = ApiError::Infer(InferError::Unavailable("the shards did not finish a step".into()));
        let response = TgiError(restarting).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "a failed server is 503, not 424");
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let restarting = ApiError::Infer(InferError::Unavailable("the shards did not finish a step".into()));
        assert_eq!(restarting.openai_status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(restarting.openai_body().error.code.as_deref(), Some("server_restarting"));
        assert_eq!(restarting.tgi_body().error_type, "unhealthy");
        let missing = ApiError::Validation(ValidationError::ModelNotFound { name: "x".into(), known: vec!["`m`".into()] });
        assert_eq!(missing.openai_status(), StatusCode::NOT_FOUND);
        assert_eq!(missing.openai_body().error.code.as_deref(), Some("model_not_found"));
    }
}

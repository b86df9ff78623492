//! vLLM's LoRA adapter endpoints, behind the API key:
//!
//! - `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`: the shards
//!   check the PEFT folder (inside `--lora-root`) and the name becomes a
//!   model requests can ask for (OpenAI `model`, TGI `adapter_id`);
//! - `POST /v1/unload_lora_adapter {"lora_name"}`: new requests can no
//!   longer name it; those already running finish with it.
//!
//! Both answer 200 with vLLM's text, or an OpenAI error object: 400 for a
//! bad name or an adapter the shards refused (their reason in the message),
//! 404 for an unknown name.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use serde::Deserialize;
use utoipa::ToSchema;

use super::error::{body_bytes, parse_json, OpenAiError};
use super::state::AppState;
use crate::infer::AdapterError;

/// The longest adapter name, in bytes.
const MAX_NAME_BYTES: usize = 256;

#[derive(Debug, Deserialize, ToSchema)]
pub struct LoadLoraAdapterRequest {
    /// The name requests use (`model` / `adapter_id`).
    pub lora_name: String,
    /// The adapter's folder (adapter_config.json, adapter_model.safetensors).
    pub lora_path: String,
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct UnloadLoraAdapterRequest {
    pub lora_name: String,
}

#[utoipa::path(post, path = "/v1/load_lora_adapter", request_body = LoadLoraAdapterRequest,
    responses(
        (status = 200, description = "loaded", body = String),
        (status = 400, body = crate::http::error::OpenAiErrorBody),
    ))]
pub async fn load_lora_adapter(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<String, OpenAiError> {
    let request: LoadLoraAdapterRequest = parse_json(&body_bytes(body)?)?;
    check_name(&state, &request.lora_name)?;
    if request.lora_path.trim().is_empty() {
        return Err(invalid("lora_path", "must not be empty".into()).into());
    }
    let name = request.lora_name;
    state.infer.load_adapter(name.clone(), request.lora_path).await?;
    Ok(format!("Success: LoRA adapter '{name}' added successfully."))
}

#[utoipa::path(post, path = "/v1/unload_lora_adapter", request_body = UnloadLoraAdapterRequest,
    responses(
        (status = 200, description = "unloaded", body = String),
        (status = 404, body = crate::http::error::OpenAiErrorBody),
    ))]
pub async fn unload_lora_adapter(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<String, OpenAiError> {
    let request: UnloadLoraAdapterRequest = parse_json(&body_bytes(body)?)?;
    let name = request.lora_name;
    state.infer.unload_adapter(name.clone()).await?;
    Ok(format!("Success: LoRA adapter '{name}' removed successfully."))
}

/// A name a request could ask for without meaning something else.
fn check_name(state: &AppState, name: &str) -> Result<(), AdapterError> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES || name.chars().any(char::is_control) {
        return Err(invalid("lora_name", format!("must be 1 to {MAX_NAME_BYTES} bytes of printable text")));
    }
    if state.validation.is_base_name(name) {
        return Err(invalid("lora_name", format!("`{name}` names the base model")));
    }
    Ok(())
}

fn invalid(field: &'static str, message: String) -> AdapterError {
    AdapterError::Invalid { field, message }
}

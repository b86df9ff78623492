//! OpenAI's Batch API: `POST /v1/batches`, `GET /v1/batches` (paged),
//! `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`. Thin: the
//! batch module checks, stores and runs (see batch/mod.rs).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::Json;
use serde::Deserialize;
use utoipa::IntoParams;

use crate::batch::types::{BatchObject, Page};
use crate::batch::{BatchError, Batches, CreateBatch, DEFAULT_PAGE, MAX_PAGE};
use crate::http::error::{parse_body, ApiError, OpenAiError};
use crate::http::state::AppState;
use crate::validation::ValidationError;

#[utoipa::path(post, path = "/v1/batches", operation_id = "create_batch", request_body = CreateBatch,
    responses((status = 200, body = BatchObject), (status = 400, body = crate::http::error::OpenAiErrorBody),
              (status = 404, body = crate::http::error::OpenAiErrorBody)))]
pub async fn create(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<BatchObject>, OpenAiError> {
    let request: CreateBatch = parse_body(body)?;
    Ok(Json(batches_of(&state)?.create(request).await?))
}

#[utoipa::path(get, path = "/v1/batches", operation_id = "list_batches", params(PageQuery), responses((status = 200, body = Page<BatchObject>)))]
pub async fn list(
    State(state): State<Arc<AppState>>,
    query: Result<Query<PageQuery>, QueryRejection>,
) -> Result<Json<Page<BatchObject>>, OpenAiError> {
    let (after, limit) = page_limit(query)?;
    Ok(Json(batches_of(&state)?.batches(after, limit).await?))
}

#[utoipa::path(get, path = "/v1/batches/{id}", operation_id = "retrieve_batch", params(("id" = String, Path, description = "the batch's id")), responses((status = 200, body = BatchObject), (status = 404, body = crate::http::error::OpenAiErrorBody)))]
pub async fn get(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<BatchObject>, OpenAiError> {
    Ok(Json(batches_of(&state)?.batch(&id).await?))
}

#[utoipa::path(post, path = "/v1/batches/{id}/cancel", operation_id = "cancel_batch", params(("id" = String, Path, description = "the batch's id")), responses((status = 200, body = BatchObject),
    (status = 404, body = crate::http::error::OpenAiErrorBody), (status = 409, body = crate::http::error::OpenAiErrorBody)))]
pub async fn cancel(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<BatchObject>, OpenAiError> {
    Ok(Json(batches_of(&state)?.cancel(&id).await?))
}

/// A list's paging: `after` (an id from the previous page's `last_id`) and
/// `limit` (1 to 100, default 20).
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    pub after: Option<String>,
    pub limit: Option<usize>,
}

pub(crate) fn page_limit(query: Result<Query<PageQuery>, QueryRejection>) -> Result<(Option<String>, usize), ApiError> {
    let Query(query) = query.map_err(|e| ValidationError::Body { field: None, message: e.body_text() })?;
    let limit = query.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(BatchError::Invalid(format!("`limit` must be in [1, {MAX_PAGE}], got {limit}")).into());
    }
    Ok((query.after, limit))
}

pub(crate) fn batches_of(state: &AppState) -> Result<&Batches, ApiError> {
    state.batches.as_deref().ok_or(ApiError::Batch(BatchError::Disabled))
}

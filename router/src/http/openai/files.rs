//! OpenAI's Files API, for batch input: `POST /v1/files` (multipart:
//! `file`, `purpose=batch`), `GET /v1/files` (paged), `GET` and `DELETE
//! /v1/files/{id}`, `GET /v1/files/{id}/content`. Uploads are checked and
//! stored by `batch::Batches`; a batch's output and error files are read
//! back here too.

use std::sync::Arc;

use axum::extract::multipart::{Multipart, MultipartRejection};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::batches::{batches_of, page_limit, PageQuery};
use crate::batch::types::{DeletedFile, FileObject, Page};
use crate::batch::BatchError;
use crate::http::error::{ApiError, OpenAiError};
use crate::http::state::AppState;

#[utoipa::path(post, path = "/v1/files", operation_id = "upload_file", request_body(content_type = "multipart/form-data", description = "`file` (JSONL) and `purpose` (batch)"),
    responses((status = 200, body = FileObject), (status = 400, body = crate::http::error::OpenAiErrorBody),
              (status = 413, body = crate::http::error::OpenAiErrorBody)))]
pub async fn upload(
    State(state): State<Arc<AppState>>,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<Json<FileObject>, OpenAiError> {
    let batches = batches_of(&state)?;
    let limit = batches.config.max_file_bytes;
    let mut multipart = multipart.map_err(|e| BatchError::Invalid(format!("expected a multipart/form-data body: {e}")))?;
    let (mut file, mut purpose) = (None, None);
    loop {
        let field = multipart.next_field().await.map_err(|e| unreadable(e, limit))?;
        let Some(field) = field else { break };
        match field.name() {
            Some("file") => {
                let filename = field.file_name().unwrap_or("upload.jsonl").to_string();
                file = Some((filename, field.bytes().await.map_err(|e| unreadable(e, limit))?));
            }
            Some("purpose") => purpose = Some(field.text().await.map_err(|e| unreadable(e, limit))?),
            _ => {} // OpenAI's clients send no others; ignored like unknown JSON fields
        }
    }
    let (filename, content) = file.ok_or_else(|| BatchError::Invalid("the `file` field is missing".into()))?;
    let purpose = purpose.ok_or_else(|| BatchError::Invalid("the `purpose` field is missing".into()))?;
    Ok(Json(batches.upload(filename, &purpose, content.to_vec()).await?))
}

/// A multipart body that could not be read: past the size limit (413), or
/// malformed (400).
fn unreadable(error: axum::extract::multipart::MultipartError, limit: usize) -> ApiError {
    if error.status() == StatusCode::PAYLOAD_TOO_LARGE {
        BatchError::TooLarge { limit }.into()
    } else {
        BatchError::Invalid(format!("the multipart body cannot be read: {}", error.body_text())).into()
    }
}

#[utoipa::path(get, path = "/v1/files", operation_id = "list_files", params(PageQuery), responses((status = 200, body = Page<FileObject>)))]
pub async fn list(
    State(state): State<Arc<AppState>>,
    query: Result<Query<PageQuery>, QueryRejection>,
) -> Result<Json<Page<FileObject>>, OpenAiError> {
    let (after, limit) = page_limit(query)?;
    Ok(Json(batches_of(&state)?.files(after, limit).await?))
}

#[utoipa::path(get, path = "/v1/files/{id}", operation_id = "retrieve_file", params(("id" = String, Path, description = "the file's id")), responses((status = 200, body = FileObject), (status = 404, body = crate::http::error::OpenAiErrorBody)))]
pub async fn get(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<FileObject>, OpenAiError> {
    Ok(Json(batches_of(&state)?.file(&id).await?))
}

#[utoipa::path(delete, path = "/v1/files/{id}", operation_id = "delete_file", params(("id" = String, Path, description = "the file's id")), responses((status = 200, body = DeletedFile), (status = 404, body = crate::http::error::OpenAiErrorBody)))]
pub async fn delete(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<DeletedFile>, OpenAiError> {
    Ok(Json(batches_of(&state)?.delete_file(&id).await?))
}

#[utoipa::path(get, path = "/v1/files/{id}/content", operation_id = "file_content", params(("id" = String, Path, description = "the file's id")), responses((status = 200, description = "the file's bytes"), (status = 404, body = crate::http::error::OpenAiErrorBody)))]
pub async fn content(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Response, OpenAiError> {
    let content = batches_of(&state)?.file_content(&id).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], content).into_response())
}

//! How the batch runner (batch/runner.rs) runs a request line: as its
//! endpoint's handler would, through the same generation driver, in the
//! scheduler's batch class. So a line's answer is what the same request
//! sent online gets (greedy: token for token), errors included.

use std::sync::Arc;

use axum::body::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use serde::Serialize;

use super::{chat, completions};
use crate::batch::runner::{LineExecutor, LineRun};
use crate::batch::store::LineUsage;
use crate::batch::types::Endpoint;
use crate::http::error::ApiError;
use crate::http::generation::TokenUsage;
use crate::http::state::AppState;
use crate::infer::InferError;

pub struct OpenAiLines(pub Arc<AppState>);

impl LineExecutor for OpenAiLines {
    fn run(&self, endpoint: Endpoint, body: String) -> BoxFuture<'static, LineRun> {
        let state = self.0.clone();
        async move {
            let body = Bytes::from(body);
            let answer = match endpoint {
                Endpoint::ChatCompletions => answered(chat::batch_line(&state, body).await),
                Endpoint::Completions => answered(completions::batch_line(&state, body).await),
            };
            match answer {
                Ok(run) => run,
                // The server is going away: the line runs again after the
                // restart.
                Err(ApiError::Infer(InferError::ShuttingDown) | ApiError::Draining) => LineRun::Retry,
                Err(ApiError::Infer(InferError::Generation(_))) if state.infer.failure().is_some() => LineRun::Retry,
                Err(error) => LineRun::Answered {
                    status_code: error.openai_status().as_u16(),
                    body: serde_json::to_value(error.openai_body()).expect("an error body serializes"),
                    usage: LineUsage::default(),
                },
            }
        }
        .boxed()
    }
}

fn answered<B: Serialize>(result: Result<(B, TokenUsage, std::time::Duration), ApiError>) -> Result<LineRun, ApiError> {
    let (body, usage, compute) = result?;
    Ok(LineRun::Answered {
        status_code: 200,
        body: serde_json::to_value(body).expect("a response serializes"),
        usage: LineUsage {
            input_tokens: u64::from(usage.prompt_tokens),
            cached_tokens: u64::from(usage.cached_tokens),
            output_tokens: u64::from(usage.completion_tokens),
            compute_seconds: compute.as_secs_f64(),
        },
    })
}

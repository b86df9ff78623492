//! Server-sent events as OpenAI and TGI clients read them: one
//! `data: <json>\n\n` frame per event, OpenAI's chat and completions streams
//! ending with `data: [DONE]\n\n`. No `event:` names there and no keep-alive
//! comments, which some clients choke on; the Responses and Anthropic
//! streams name each event (`event: <type>`), as their clients expect.

use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde::Serialize;

pub fn json_event(payload: &impl Serialize) -> Event {
    Event::default().data(serde_json::to_string(payload).unwrap_or_else(|e| {
        // Our own types always serialize; say so instead of panicking.
        format!(r#"{{"error":"cannot serialize event: {e}"}}"#)
    }))
}

/// `event: NAME` and the JSON data.
pub fn named_event(name: &str, payload: &impl Serialize) -> Event {
    let data = serde_json::to_string(payload).unwrap_or_else(|e| format!(r#"{{"error":"cannot serialize event: {e}"}}"#));
    Event::default().event(name).data(data)
}

pub fn done_event() -> Event {
    Event::default().data("[DONE]")
}

pub fn sse_response<S>(events: S) -> Response
where
    S: Stream<Item = Event> + Send + 'static,
{
    use futures::StreamExt;
    Sse::new(events.map(Ok::<_, Infallible>)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_are_data_lines_ended_by_a_blank_line() {
        let events = futures::stream::iter(vec![
            json_event(&serde_json::json!({"text": "a\nb"})),
            json_event(&serde_json::json!({"n": 1})),
            done_event(),
        ]);
        let response = sse_response(events);
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            "data: {\"text\":\"a\\nb\"}\n\ndata: {\"n\":1}\n\ndata: [DONE]\n\n"
        );
    }
}

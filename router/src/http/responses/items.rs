//! A response's output items built from the answer's pieces, with the
//! stream events that announce them. Buffered responses use the same
//! builder and drop the events, so both agree on every item.
//!
//! One item is open at a time; a piece of another kind closes it:
//!
//! ```text
//!   Reasoning ─► reasoning item     Content ─► message item     CallStart ─► function_call item
//!   (pieces of the open item's kind extend it; CallArguments extend the open call)
//! ```

use axum::response::sse::Event;
use serde_json::{json, Value};

use super::types::{OutputItem, TextPart};
use crate::chat_template::TemplateMessage;
use crate::http::answer::Piece;
use crate::http::generation::Finish;
use crate::http::sse::named_event;

pub struct OutputBuilder {
    response_id: String,
    items: Vec<OutputItem>,
    /// The last item is still being written.
    open: bool,
    sequence_number: u64,
    /// How the generation ended (streamed responses learn it before `finish`).
    pub finish: Option<Finish>,
}

impl OutputBuilder {
    pub fn new(response_id: String) -> Self {
        Self { response_id, items: Vec::new(), open: false, sequence_number: 0, finish: None }
    }

    /// The items so far.
    pub fn items(&self) -> Vec<OutputItem> {
        self.items.clone()
    }

    /// The output as the assistant's chat message (for the stored conversation).
    pub fn message(&self) -> Option<TemplateMessage> {
        let mut message = TemplateMessage::text("assistant", "");
        let mut any = false;
        for item in &self.items {
            any = true;
            match item {
                OutputItem::Reasoning { content, .. } => {
                    message.reasoning_content = Some(content.iter().map(|p| p.text.as_str()).collect())
                }
                OutputItem::Message { content, .. } => message.content.extend(content.iter().map(|p| p.text.as_str())),
                OutputItem::FunctionCall { call_id, name, arguments, .. } => {
                    let arguments: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
                    message.tool_calls.get_or_insert_with(Vec::new).push(json!({
                        "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments},
                    }));
                }
            }
        }
        any.then_some(message)
    }

    /// One SSE event of the stream: `event: TYPE`, data `{"type", "sequence_number", ...fields}`.
    pub fn event(&mut self, kind: &str, fields: Value) -> Event {
        let mut data = json!({"type": kind, "sequence_number": self.sequence_number});
        self.sequence_number += 1;
        if let (Value::Object(data), Value::Object(fields)) = (&mut data, fields) {
            data.extend(fields);
        }
        named_event(kind, &data)
    }

    /// Adds a piece; the events that announce it.
    pub fn push(&mut self, piece: Piece) -> Vec<Event> {
        let mut events = Vec::new();
        match piece {
            Piece::Reasoning(text) => {
                if !matches!((self.open, self.items.last()), (true, Some(OutputItem::Reasoning { .. }))) {
                    events.extend(self.close());
                    events.extend(self.open_item(OutputItem::Reasoning {
                        id: self.item_id("rs"),
                        summary: Vec::new(),
                        content: Vec::new(),
                        status: "in_progress".into(),
                    }));
                }
                events.push(self.text_delta("response.reasoning_text.delta", text));
            }
            Piece::Content(text) => {
                if !matches!((self.open, self.items.last()), (true, Some(OutputItem::Message { .. }))) {
                    events.extend(self.close());
                    events.extend(self.open_item(OutputItem::Message {
                        id: self.item_id("msg"),
                        role: "assistant".into(),
                        status: "in_progress".into(),
                        content: Vec::new(),
                    }));
                }
                events.push(self.text_delta("response.output_text.delta", text));
            }
            Piece::CallStart { id, name, .. } => {
                events.extend(self.close());
                events.extend(self.open_item(OutputItem::FunctionCall {
                    id: self.item_id("fc"),
                    call_id: id,
                    name,
                    arguments: String::new(),
                    status: "in_progress".into(),
                }));
            }
            Piece::CallArguments { fragment, .. } => {
                let output_index = self.items.len().saturating_sub(1);
                if let Some(OutputItem::FunctionCall { id, arguments, .. }) = self.items.last_mut() {
                    arguments.push_str(&fragment);
                    let item_id = id.clone();
                    events.push(self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": item_id, "output_index": output_index, "delta": fragment}),
                    ));
                }
            }
        }
        events
    }

    fn item_id(&self, prefix: &str) -> String {
        format!("{prefix}_{}_{}", &self.response_id["resp_".len().min(self.response_id.len())..], self.items.len())
    }

    /// `output_item.added` (and the text part a reasoning or message item writes into).
    fn open_item(&mut self, item: OutputItem) -> Vec<Event> {
        let output_index = self.items.len();
        let part = match &item {
            OutputItem::Reasoning { .. } => Some(TextPart::reasoning(String::new())),
            OutputItem::Message { .. } => Some(TextPart::output(String::new())),
            OutputItem::FunctionCall { .. } => None,
        };
        let item_id = item_id(&item).to_string();
        let mut events = vec![self.event("response.output_item.added", json!({"output_index": output_index, "item": item}))];
        self.items.push(item);
        self.open = true;
        if let Some(part) = part {
            events.push(self.event(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "part": part}),
            ));
            if let Some(OutputItem::Reasoning { content, .. } | OutputItem::Message { content, .. }) = self.items.last_mut() {
                content.push(part);
            }
        }
        events
    }

    /// Appends `text` to the open item's text part; its delta event.
    fn text_delta(&mut self, kind: &str, text: String) -> Event {
        let output_index = self.items.len() - 1;
        let item_id = self.items.last().map(item_id).unwrap_or_default().to_string();
        if let Some(OutputItem::Reasoning { content, .. } | OutputItem::Message { content, .. }) = self.items.last_mut() {
            content[0].text.push_str(&text);
        }
        let mut fields = json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "delta": text});
        if kind == "response.output_text.delta" {
            fields["logprobs"] = json!([]);
        }
        self.event(kind, fields)
    }

    /// Closes the open item: its `done` events.
    pub fn close(&mut self) -> Vec<Event> {
        if !self.open {
            return Vec::new();
        }
        self.open = false;
        let output_index = self.items.len() - 1;
        let mut events = Vec::new();
        let Some(item) = self.items.last_mut() else { return events };
        match item {
            OutputItem::Reasoning { status, .. } | OutputItem::Message { status, .. } | OutputItem::FunctionCall { status, .. } => {
                *status = "completed".into();
            }
        }
        let item = item.clone();
        let item_id = item_id(&item).to_string();
        match &item {
            OutputItem::Reasoning { content, .. } | OutputItem::Message { content, .. } => {
                let part = &content[0];
                let (done, mut fields) = if part.kind == "reasoning_text" {
                    ("response.reasoning_text.done", json!({}))
                } else {
                    ("response.output_text.done", json!({"logprobs": []}))
                };
                fields["item_id"] = json!(item_id);
                fields["output_index"] = json!(output_index);
                fields["content_index"] = json!(0);
                fields["text"] = json!(part.text);
                events.push(self.event(done, fields));
                events.push(self.event(
                    "response.content_part.done",
                    json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "part": part}),
                ));
            }
            OutputItem::FunctionCall { arguments, .. } => events.push(self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": output_index, "arguments": arguments}),
            )),
        }
        events.push(self.event("response.output_item.done", json!({"output_index": output_index, "item": item})));
        events
    }
}

fn item_id(item: &OutputItem) -> &str {
    match item {
        OutputItem::Reasoning { id, .. } | OutputItem::Message { id, .. } | OutputItem::FunctionCall { id, .. } => id,
    }
}

//! An Anthropic message's content blocks built from the answer's pieces,
//! with the stream events that announce them. Buffered messages use the
//! same builder and drop the events.
//!
//! One block is open at a time; a piece of another kind closes it:
//! `Reasoning` writes a `thinking` block, `Content` a `text` block,
//! `CallStart` opens a `tool_use` block whose `CallArguments` stream as
//! `input_json_delta`s (its `input` is parsed when it closes).

use axum::response::sse::Event;
use serde_json::{json, Value};

use super::types::ContentBlock;
use crate::http::answer::Piece;
use crate::http::sse::named_event;

#[derive(Default)]
pub struct BlockBuilder {
    blocks: Vec<ContentBlock>,
    /// The last block is still being written.
    open: bool,
    /// The open tool_use block's arguments, as JSON text so far.
    arguments: String,
}

impl BlockBuilder {
    pub fn blocks(&self) -> Vec<ContentBlock> {
        self.blocks.clone()
    }

    /// Adds a piece; the events that announce it.
    pub fn push(&mut self, piece: Piece) -> Vec<Event> {
        let mut events = Vec::new();
        match piece {
            Piece::Reasoning(text) => {
                if !matches!((self.open, self.blocks.last()), (true, Some(ContentBlock::Thinking { .. }))) {
                    events.extend(self.close());
                    events.push(self.start(ContentBlock::Thinking { thinking: String::new(), signature: String::new() }));
                }
                if let Some(ContentBlock::Thinking { thinking, .. }) = self.blocks.last_mut() {
                    thinking.push_str(&text);
                }
                events.push(self.delta(json!({"type": "thinking_delta", "thinking": text})));
            }
            Piece::Content(text) => {
                if !matches!((self.open, self.blocks.last()), (true, Some(ContentBlock::Text { .. }))) {
                    events.extend(self.close());
                    events.push(self.start(ContentBlock::Text { text: String::new() }));
                }
                if let Some(ContentBlock::Text { text: all, .. }) = self.blocks.last_mut() {
                    all.push_str(&text);
                }
                events.push(self.delta(json!({"type": "text_delta", "text": text})));
            }
            Piece::CallStart { id, name, .. } => {
                events.extend(self.close());
                events.push(self.start(ContentBlock::ToolUse { id, name, input: json!({}) }));
            }
            Piece::CallArguments { fragment, .. } => {
                if self.open && matches!(self.blocks.last(), Some(ContentBlock::ToolUse { .. })) {
                    self.arguments.push_str(&fragment);
                    events.push(self.delta(json!({"type": "input_json_delta", "partial_json": fragment})));
                }
            }
        }
        events
    }

    fn start(&mut self, block: ContentBlock) -> Event {
        let index = self.blocks.len();
        let event = named_event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        );
        self.blocks.push(block);
        self.open = true;
        self.arguments.clear();
        event
    }

    fn delta(&self, delta: Value) -> Event {
        let index = self.blocks.len() - 1;
        named_event("content_block_delta", &json!({"type": "content_block_delta", "index": index, "delta": delta}))
    }

    /// Closes the open block: `content_block_stop`.
    pub fn close(&mut self) -> Vec<Event> {
        if !self.open {
            return Vec::new();
        }
        self.open = false;
        let index = self.blocks.len() - 1;
        if let Some(ContentBlock::ToolUse { input, .. }) = self.blocks.last_mut() {
            // A call cut short (max_tokens) keeps an empty input.
            *input = serde_json::from_str(&self.arguments).unwrap_or_else(|_| json!({}));
        }
        vec![named_event("content_block_stop", &json!({"type": "content_block_stop", "index": index}))]
    }
}

//! One request as the scheduler tracks it.
//!
//! ```text
//!  tokens:  [ p0 p1 ... p(P-1) | g0 g1 ... g(G-1) ]     P = num_prompt_tokens
//!           [0, num_computed_tokens)    have KV in `blocks`
//!           [num_computed_tokens, len)  still to compute; in decode, only g(G-1)
//!                                (sampled last step, its KV not written yet)
//!  blocks:  block i holds the KV of tokens [i * bs, (i + 1) * bs)
//! ```
//!
//! States: waiting (no blocks) -> running (shard holds state once its first
//! step ran: `on_shard`) -> finished, or back to waiting when preempted (it
//! then starts over with `num_computed_tokens = 0` and resumes by recomputation,
//! sent as a new request whose `num_prompt_tokens` marks the boundary).

use std::time::Instant;

use super::adapters::AdapterId;
use super::kv::BlockTable;
use super::radix::Namespace;
use super::speculation::Adaptive;
use crate::infer::{Entry, InferError, InferEvent, RequestClass, ValidRequest};
use crate::pb;

pub(crate) struct Request {
    pub id: u64,
    pub request: ValidRequest,
    events: tokio::sync::mpsc::UnboundedSender<Result<InferEvent, InferError>>,
    pub tokens: Vec<u32>,
    pub num_prompt_tokens: usize,
    pub num_computed_tokens: usize,
    /// Its blocks go back to the cache when the request is dropped.
    pub blocks: BlockTable,
    /// The shard holds this request's state (it ran at least one step since
    /// its last admission).
    pub on_shard: bool,
    /// `InferEvent::Prefill` was sent (never again, even after preemption).
    pub prefill_sent: bool,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: u32,
    pub queued: Instant,
    pub started: Option<Instant>,
    /// Order of (re-)admission: the highest is preempted first.
    pub admitted: u64,
    /// Steps in which a later request was admitted ahead of this one.
    pub passed_over: u32,
    /// Came back from preemption: admitted before anything else.
    pub resumed: bool,
    /// The request's span (telemetry.rs); steps hang off it or link to it.
    pub span: tracing::Span,
    /// Open from submission to the first step that computes this request.
    pub queue_span: Option<tracing::Span>,
    /// How many draft tokens it proposes (speculative decoding).
    pub speculation: Adaptive,
    /// Its share of the time of the steps it took part in (apply.rs).
    pub compute: std::time::Duration,
    /// The LoRA adapter it generates with (None: the base model).
    pub adapter: Option<AdapterId>,
}

impl Request {
    pub fn new(id: u64, entry: Entry, blocks: BlockTable, adapter: Option<AdapterId>) -> Self {
        let Entry { request, events, span } = entry;
        let queue_span = Some(tracing::debug_span!(parent: &span, "queue"));
        Self {
            id,
            tokens: request.input_ids.clone(),
            num_prompt_tokens: request.input_ids.len(),
            request,
            events,
            num_computed_tokens: 0,
            blocks,
            on_shard: false,
            prefill_sent: false,
            cached_tokens: 0,
            queued: Instant::now(),
            started: None,
            admitted: 0,
            passed_over: 0,
            resumed: false,
            span,
            queue_span,
            speculation: Adaptive::default(),
            compute: std::time::Duration::ZERO,
            adapter,
        }
    }

    pub fn class(&self) -> RequestClass {
        self.request.class
    }

    /// Whose weights compute its KV: its prefix-cache namespace.
    pub fn namespace(&self) -> Namespace {
        self.adapter.unwrap_or(0)
    }

    pub fn generated(&self) -> u32 {
        (self.tokens.len() - self.num_prompt_tokens) as u32
    }

    /// Tokens without KV yet.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed_tokens
    }

    /// The client is gone (its stream was dropped).
    pub fn is_cancelled(&self) -> bool {
        self.events.is_closed()
    }

    /// Prompt logprobs need every prompt token computed, so such a request
    /// may not start from cached blocks (until its Prefill was sent: a
    /// resumed request does not ask for them again).
    pub fn wants_prompt_logprobs(&self) -> bool {
        self.request.prompt_logprobs && !self.prefill_sent
    }

    /// The error a client gets when the shard failed this request (or the
    /// step it was in): a stable text with its id. What the shard said may
    /// hold Python exception text and internals, so it goes to the log and
    /// the request's trace only, under the same id.
    pub fn shard_failure(&self, detail: &str) -> InferError {
        tracing::warn!(parent: &self.span, id = self.id, detail, "the shard failed the request");
        InferError::Generation(format!(
            "the model server could not complete request {}; the server log has the details",
            self.id
        ))
    }

    /// Returns false when the client is gone.
    pub fn send(&self, event: Result<InferEvent, InferError>) -> bool {
        self.events.send(event).is_ok()
    }

    /// Tokens whose KV is in `blocks`: what may enter the prefix tree.
    pub fn computed_tokens(&self) -> &[u32] {
        &self.tokens[..self.num_computed_tokens]
    }

    /// `adapter_slot`: the slot its adapter is in (0: the base model).
    pub fn to_new_request(&self, num_new_tokens: usize, adapter_slot: u32) -> pb::NewRequest {
        let r = &self.request;
        let p = &r.params;
        pb::NewRequest {
            id: self.id,
            token_ids: self.tokens.clone(),
            num_prompt_tokens: self.num_prompt_tokens as u32,
            num_computed_tokens: self.num_computed_tokens as u32,
            num_new_tokens: num_new_tokens as u32,
            block_ids: self.blocks.to_vec(),
            params: Some(pb::SamplingParams {
                temperature: p.temperature,
                top_k: p.top_k,
                top_p: p.top_p,
                min_p: p.min_p,
                typical_p: p.typical_p,
                repetition_penalty: p.repetition_penalty,
                frequency_penalty: p.frequency_penalty,
                presence_penalty: p.presence_penalty,
                seed: p.seed,
                logit_bias: p.logit_bias.iter().map(|&(token_id, bias)| pb::LogitBias { token_id, bias }).collect(),
                logprobs: r.logprobs,
                top_n_tokens: r.top_n_tokens,
                prompt_logprobs: self.wants_prompt_logprobs(),
                // EOS is masked by the shard until this many were generated,
                // counted from num_prompt_tokens (so a resumed request
                // continues the count).
                min_tokens: r.min_tokens,
            }),
            // Every admission carries it: a resumed request rebuilds its
            // matcher on the shard from it and the generated tokens.
            grammar: r.grammar.as_ref().map(|g| g.0.to_string()).unwrap_or_default(),
            adapter_slot,
        }
    }
}

//! The generation driver, shared by every generation endpoint (OpenAI's and
//! TGI's): a handler hands it validated requests and gets back either the
//! collected results or an SSE stream in its API's shape.
//!
//! ```text
//!  handler ── Vec<Validated>, n ──► Choices::submit: n sequences per prompt (seeds s, s+1, ..),
//!                                   all queued before answering (overload is a 429, not a
//!                                   broken stream)
//!           ◄── collect() ───────── Vec<Collected> + TokenUsage          (buffered responses)
//!           ◄── sse(shape) ──────── merged (choice, GenEvent) ─► StreamShape ─► SSE events
//! ```
//!
//! Each sequence is a [`Generation`]: it reads the scheduler's
//! [`InferEvent`]s, detokenizes, cuts stop sequences and yields
//! [`GenEvent`]s. Dropping a `Generation` drops its `InferStream`, which
//! cancels the request in the scheduler (client gone, stop sequence hit).
//!
//! Usage is counted once, here, for every API, as OpenAI and vLLM count it
//! ([`TokenUsage`]): a prompt's tokens (and its cached tokens) count once
//! however many choices (`n`) it has; completion tokens are summed over every
//! choice.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::Event;
use axum::response::Response;
use futures::StreamExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::batch::BatchError;
use crate::detokenize::Detokenizer;
use crate::http::error::{body_bytes, ApiError};
use crate::http::sse::sse_response;
use crate::http::state::AppState;
use crate::infer::{
    FinishReason, GeneratedToken, InferError, InferEvent, InferStream, RequestClass, TokenLogprob, ValidRequest,
};
use crate::metrics;
use crate::stop::{StopMatcher, StopOutcome};
use crate::tokenizer::Tokenizer;
use crate::validation::Validated;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Eos,
    Length,
    StopSequence,
}

impl Finish {
    pub fn openai(self) -> &'static str {
        match self {
            Self::Eos | Self::StopSequence => "stop",
            Self::Length => "length",
        }
    }
}

#[derive(Debug, Clone)]
pub enum GenEvent {
    Prefill {
        cached_tokens: u32,
        prompt_logprobs: Vec<TokenLogprob>,
    },
    Token {
        token: GeneratedToken,
        /// This token's share of the decoded text (empty while a character
        /// is incomplete).
        text: String,
        /// What may be shown to the client now: `text` after stop-sequence
        /// holding and cutting.
        visible: String,
    },
    End {
        finish: Finish,
        /// The stop sequence that ended it (with `Finish::StopSequence`).
        stop: Option<String>,
        generated_tokens: u32,
        /// Visible text released only at the end (held-back stop-sequence
        /// prefixes, a truncated final character).
        trailing: String,
        /// The scheduler's `InferEvent::End::compute`; zero when a stop
        /// sequence ended the request (it was cancelled, not finished).
        compute: Duration,
    },
}

pub struct Generation {
    /// `None` once a stop sequence matched: dropping it cancels the request.
    stream: Option<InferStream>,
    detokenizer: Detokenizer,
    stop: StopMatcher,
    generated: u32,
    arrived: Instant,
    last_token: Option<Instant>,
    /// A stop sequence matched (this one); the next call reports the end.
    stopped: Option<String>,
    finished: bool,
    /// The request's `generation` span: gets the usage and outcome
    /// attributes (telemetry.rs).
    span: tracing::Span,
}

impl Generation {
    pub fn new(stream: InferStream, tokenizer: Tokenizer, stop: Vec<String>, arrived: Instant) -> Self {
        Self {
            stream: Some(stream),
            detokenizer: Detokenizer::new(tokenizer),
            stop: StopMatcher::new(stop),
            generated: 0,
            arrived,
            last_token: None,
            stopped: None,
            finished: false,
            span: tracing::Span::none(),
        }
    }

    /// Records usage and outcome on `span` (see [`generation_span`]).
    pub fn traced(mut self, span: tracing::Span) -> Self {
        self.span = span;
        self
    }

    fn record_end(&self, finish: Finish) {
        let elapsed_ms = self.arrived.elapsed().as_millis() as u64;
        tracing::info!(parent: &self.span, generated_tokens = self.generated, finish = ?finish, elapsed_ms, "generation finished");
        if crate::telemetry::enabled() {
            let reasons = opentelemetry::Array::String(vec![finish.openai().into()]);
            self.span.set_attribute("gen_ai.usage.output_tokens", i64::from(self.generated));
            self.span.set_attribute("gen_ai.response.finish_reasons", opentelemetry::Value::Array(reasons));
            self.span.set_attribute("sluice.finish_reason", format!("{finish:?}").to_lowercase());
        }
    }

    /// The next event; `None` after `End` or an error.
    pub async fn next(&mut self) -> Option<Result<GenEvent, ApiError>> {
        if self.finished {
            return None;
        }
        if let Some(stop) = self.stopped.take() {
            self.finished = true;
            self.record_end(Finish::StopSequence);
            return Some(Ok(GenEvent::End {
                finish: Finish::StopSequence,
                stop: Some(stop),
                generated_tokens: self.generated,
                trailing: String::new(),
                compute: Duration::ZERO,
            }));
        }
        let event = match self.stream.as_mut()?.recv().await {
            Some(event) => event,
            None => Err(InferError::Generation(
                "the scheduler dropped the request without finishing it".into(),
            )),
        };
        let result = match event {
            Ok(event) => self.on_event(event),
            Err(e) => Err(e.into()),
        };
        if result.is_err() {
            self.finished = true;
        }
        Some(result)
    }

    fn on_event(&mut self, event: InferEvent) -> Result<GenEvent, ApiError> {
        let tokenizer_failed = |e: crate::tokenizer::TokenizerError| InferError::Generation(e.to_string());
        match event {
            InferEvent::Prefill {
                cached_tokens,
                prompt_logprobs,
                queued,
                started,
            } => {
                metrics::queue_wait(started.saturating_duration_since(queued));
                if crate::telemetry::enabled() {
                    self.span.set_attribute("gen_ai.usage.cached_input_tokens", i64::from(cached_tokens));
                    let queued_s = started.saturating_duration_since(queued).as_secs_f64();
                    self.span.set_attribute("sluice.queue_duration_s", queued_s);
                }
                Ok(GenEvent::Prefill {
                    cached_tokens,
                    prompt_logprobs,
                })
            }
            InferEvent::Token(token) => {
                let now = Instant::now();
                match self.last_token {
                    None => {
                        metrics::time_to_first_token(now - self.arrived);
                        if crate::telemetry::enabled() {
                            let ttft = (now - self.arrived).as_secs_f64();
                            self.span.set_attribute("sluice.time_to_first_token_s", ttft);
                        }
                    }
                    Some(last) => metrics::inter_token_latency(now - last),
                }
                self.last_token = Some(now);
                self.generated += 1;
                let text = self.detokenizer.push(token.token_id).map_err(tokenizer_failed)?;
                let visible = match self.stop.push(&text) {
                    StopOutcome::Continue(visible) => visible,
                    StopOutcome::Stopped { text, stop } => {
                        self.stopped = Some(stop);
                        self.stream = None;
                        text
                    }
                };
                Ok(GenEvent::Token { token, text, visible })
            }
            InferEvent::End { reason, compute, .. } => {
                self.finished = true;
                let rest = self.detokenizer.finish().map_err(tokenizer_failed)?;
                let (finish, stop, trailing) = match self.stop.push(&rest) {
                    StopOutcome::Stopped { text, stop } => (Finish::StopSequence, Some(stop), text),
                    StopOutcome::Continue(text) => {
                        let finish = match reason {
                            FinishReason::Eos => Finish::Eos,
                            FinishReason::Length => Finish::Length,
                        };
                        (finish, None, text + &self.stop.flush())
                    }
                };
                self.record_end(finish);
                Ok(GenEvent::End {
                    finish,
                    stop,
                    generated_tokens: self.generated,
                    trailing,
                    compute,
                })
            }
        }
    }

    /// Runs to the end (non-streaming responses).
    pub async fn collect(mut self) -> Result<Collected, ApiError> {
        let mut out = Collected::default();
        while let Some(event) = self.next().await {
            match event? {
                GenEvent::Prefill {
                    cached_tokens,
                    prompt_logprobs,
                } => {
                    out.cached_tokens = cached_tokens;
                    out.prompt_logprobs = prompt_logprobs;
                }
                GenEvent::Token { token, text, visible } => {
                    out.text.push_str(&visible);
                    out.tokens.push((token, text));
                }
                GenEvent::End {
                    finish,
                    stop,
                    generated_tokens,
                    trailing,
                    compute,
                } => {
                    out.text.push_str(&trailing);
                    out.finish = Some(finish);
                    out.stop = stop;
                    out.generated_tokens = generated_tokens;
                    out.compute = compute;
                }
            }
        }
        if out.finish.is_none() {
            return Err(InferError::Generation("the request ended without a finish reason".into()).into());
        }
        Ok(out)
    }

    /// As a stream of events, for SSE handlers.
    pub fn into_stream(self) -> futures::stream::BoxStream<'static, Result<GenEvent, ApiError>> {
        use futures::StreamExt;
        futures::stream::unfold(self, |mut generation| async move {
            generation.next().await.map(|event| (event, generation))
        })
        .boxed()
    }
}

#[derive(Debug, Default)]
pub struct Collected {
    pub text: String,
    pub tokens: Vec<(GeneratedToken, String)>,
    pub finish: Option<Finish>,
    /// The stop sequence that ended it.
    pub stop: Option<String>,
    pub generated_tokens: u32,
    pub cached_tokens: u32,
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// Machine time (see `GenEvent::End::compute`).
    pub compute: Duration,
}

/// Token counts of one HTTP request, as OpenAI and vLLM count them:
///
/// | field | counts |
/// |---|---|
/// | `prompt_tokens` | every prompt's tokens, once per prompt, whatever its `n` |
/// | `cached_tokens` | every prompt's tokens served from the prefix cache, once per prompt (as its first choice found them) |
/// | `completion_tokens` | the generated tokens of every choice |
/// | `reasoning_tokens` | of those, the ones spent thinking (filled in by the API's shape, which reads the text) |
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenUsage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
    pub reasoning_tokens: u32,
}

/// Every sequence one HTTP request asked for: `n` choices of each prompt, in
/// choice order (choice index = prompt index * n + j, as OpenAI numbers them).
pub struct Choices {
    generations: Vec<Generation>,
    /// Per choice: whether it is its prompt's first (its Prefill's cached
    /// count is the prompt's).
    first_of_prompt: Vec<bool>,
    prompt_tokens: u32,
    /// With adapters on: the request's LoRA adapter (`""`: the base model),
    /// whose usage series count it.
    adapter_label: Option<String>,
}

impl Choices {
    /// Submits `n` copies of every prompt (copy j samples with seed + j), all
    /// in one command, so overload is an HTTP 429 and not an error inside a
    /// stream, and a request is admitted whole or not at all.
    pub async fn submit(state: &AppState, prompts: Vec<Validated>) -> Result<Self, ApiError> {
        let count = prompts.iter().map(|p| p.n as usize).sum();
        let prompt_tokens = prompts.iter().map(|p| p.request.input_ids.len() as u32).sum();
        let mut requests = Vec::with_capacity(count);
        let mut shapes = Vec::with_capacity(count);
        for prompt in prompts {
            for j in 0..prompt.n {
                let mut request = prompt.request.clone();
                request.params.seed = prompt.request.params.seed.wrapping_add(u64::from(j));
                let span = generation_span(request.adapter.as_deref().unwrap_or(state.served_model_name()), &request);
                shapes.push((request.arrived, prompt.stop.clone(), span.clone(), j == 0));
                requests.push((request, span));
            }
        }
        let adapter_label = state.info.lora.as_ref().map(|_| {
            requests.first().and_then(|(r, _)| r.adapter.clone()).unwrap_or_default()
        });
        let streams = state.infer.generate_all(requests).await?;
        let mut choices = Self {
            generations: Vec::with_capacity(count),
            first_of_prompt: Vec::with_capacity(count),
            prompt_tokens,
            adapter_label,
        };
        for (stream, (arrived, stop, span, first)) in streams.into_iter().zip(shapes) {
            let generation = Generation::new(stream, state.validation.tokenizer.clone(), stop, arrived);
            choices.generations.push(generation.traced(span));
            choices.first_of_prompt.push(first);
        }
        Ok(choices)
    }

    /// Runs every choice to its end (buffered responses); counts the request
    /// as a success in `record`.
    pub async fn collect(self, record: &mut RequestRecord) -> Result<(Vec<Collected>, TokenUsage), ApiError> {
        record.adapter_label = self.adapter_label;
        let mut usage = TokenUsage { prompt_tokens: self.prompt_tokens, ..Default::default() };
        let results = futures::future::try_join_all(self.generations.into_iter().map(Generation::collect)).await?;
        for (result, first) in results.iter().zip(&self.first_of_prompt) {
            usage.completion_tokens += result.generated_tokens;
            if *first {
                usage.cached_tokens += result.cached_tokens;
            }
        }
        record.succeeded(usage);
        Ok((results, usage))
    }

    /// Streams every choice's events, merged as they come, through `shape`
    /// into an SSE response; `record` counts the request when the stream ends.
    pub fn sse(self, mut shape: impl StreamShape, mut record: RequestRecord) -> Response {
        record.adapter_label = self.adapter_label;
        let mut usage = TokenUsage { prompt_tokens: self.prompt_tokens, ..Default::default() };
        let first_of_prompt = self.first_of_prompt;
        let mut merged = futures::stream::select_all(
            self.generations
                .into_iter()
                .enumerate()
                .map(|(i, g)| g.into_stream().map(move |event| (i, event))),
        );
        let events = async_stream::stream! {
            for event in shape.start() {
                yield event;
            }
            while let Some((index, event)) = merged.next().await {
                match event {
                    Ok(event) => {
                        match &event {
                            GenEvent::Prefill { cached_tokens, .. } if first_of_prompt[index] => {
                                usage.cached_tokens += cached_tokens;
                            }
                            GenEvent::End { generated_tokens, .. } => usage.completion_tokens += generated_tokens,
                            _ => {}
                        }
                        for event in shape.event(index, event) {
                            yield event;
                        }
                    }
                    Err(error) => {
                        record.failed(&error);
                        for event in shape.fail(&error) {
                            yield event;
                        }
                        return;
                    }
                }
            }
            record.succeeded(usage);
            for event in shape.finish(usage) {
                yield event;
            }
        };
        sse_response(events)
    }
}

/// What an endpoint's request work (run off the async runtime) hands the
/// driver: the prompts to submit, how to shape the answer, whether to stream.
pub struct Prepared<S> {
    pub prompts: Vec<Validated>,
    pub shape: S,
    pub stream: bool,
}

/// The path every OpenAI endpoint shares after routing: `prepare` parses and
/// validates the body on a blocking thread ([`AppState::off_runtime`]), the
/// choices are submitted, and the answer is an SSE stream, or whatever
/// `buffered` builds from the finished choices.
pub async fn drive<S: StreamShape>(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    record: &mut RequestRecord,
    prepare: fn(&AppState, &[u8]) -> Result<Prepared<S>, ApiError>,
    buffered: impl FnOnce(S, Vec<Collected>, TokenUsage) -> Response,
) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let Prepared { prompts, shape, stream } = state.off_runtime(move |state| prepare(state, &body)).await?;
    let choices = Choices::submit(&state, prompts).await?;
    if stream {
        return Ok(choices.sse(shape, record.take()));
    }
    let (results, usage) = choices.collect(record).await?;
    Ok(buffered(shape, results, usage))
}

/// One request run to its end away from HTTP (a Batch API line): the
/// endpoint's own `prepare`, the same submission, in `class`, and its
/// buffered answer (`stream` is ignored). Returns the answer, its usage and
/// its machine time (summed over its choices).
pub async fn run_collected<S: StreamShape, B>(
    state: &Arc<AppState>,
    body: Bytes,
    class: RequestClass,
    prepare: fn(&AppState, &[u8]) -> Result<Prepared<S>, ApiError>,
    buffered: fn(S, Vec<Collected>, TokenUsage) -> B,
) -> Result<(B, TokenUsage, Duration), ApiError> {
    let Prepared { mut prompts, shape, .. } = state.off_runtime(move |state| prepare(state, &body)).await?;
    for prompt in &mut prompts {
        prompt.request.class = class;
    }
    let choices = Choices::submit(state, prompts).await?;
    let (results, usage) = choices.collect(&mut RequestRecord::unrecorded("batch")).await?;
    let compute = results.iter().map(|r| r.compute).sum();
    Ok((buffered(shape, results, usage), usage, compute))
}

/// How an API turns the merged events of its choices into SSE events.
pub trait StreamShape: Send + 'static {
    /// Sent before any token (completions' echoed prompts).
    fn start(&mut self) -> Vec<Event> {
        Vec::new()
    }

    /// The events (often one, or none) for one event of choice `index`.
    fn event(&mut self, index: usize, event: GenEvent) -> Vec<Event>;

    /// After every choice ended.
    fn finish(&mut self, usage: TokenUsage) -> Vec<Event>;

    /// A choice failed: the stream ends after these.
    fn fail(&mut self, error: &ApiError) -> Vec<Event>;
}

/// The span of one generated sequence, with the GenAI request attributes;
/// `model` is the LoRA adapter the request named, if any (then also
/// `sluice.lora_adapter`), else the base model.
/// Usage and outcome attributes are added by its [`Generation`] as events
/// arrive (see telemetry.rs for the span tree).
pub fn generation_span(model: &str, request: &ValidRequest) -> tracing::Span {
    let span = tracing::info_span!("generation", otel.name = %format!("chat {model}"));
    if crate::telemetry::enabled() {
        span.set_attribute("gen_ai.operation.name", "chat");
        span.set_attribute("gen_ai.request.model", model.to_string());
        span.set_attribute("gen_ai.request.max_tokens", i64::from(request.max_new_tokens));
        span.set_attribute("gen_ai.request.temperature", f64::from(request.params.temperature));
        span.set_attribute("gen_ai.request.top_p", f64::from(request.params.top_p));
        span.set_attribute("gen_ai.request.seed", request.params.seed as i64);
        span.set_attribute("gen_ai.usage.input_tokens", request.input_ids.len() as i64);
        if let Some(adapter) = &request.adapter {
            span.set_attribute("sluice.lora_adapter", adapter.clone());
        }
    }
    span
}

/// Counts a request in `sluice_requests_total` when dropped: an HTTP
/// request whose stream the client abandoned is recorded as "cancelled".
pub struct RequestRecord {
    endpoint: &'static str,
    start: Instant,
    outcome: &'static str,
    prompt_tokens: usize,
    generated_tokens: u32,
    /// False for the inert record `take` leaves behind: it counts nothing.
    armed: bool,
    /// With adapters on: the LoRA adapter whose usage series count the
    /// request (`""`: the base model), set once it was submitted.
    adapter_label: Option<String>,
}

impl RequestRecord {
    pub fn new(endpoint: &'static str) -> Self {
        Self {
            endpoint,
            start: Instant::now(),
            outcome: "cancelled",
            prompt_tokens: 0,
            generated_tokens: 0,
            armed: true,
            adapter_label: None,
        }
    }

    /// A record that counts nothing: batch lines are counted by the batch
    /// runner, apart from HTTP requests (`metrics::batch_line`).
    pub fn unrecorded(endpoint: &'static str) -> Self {
        let mut record = Self::new(endpoint);
        record.armed = false;
        record
    }

    /// Moves the record out (into a response stream that outlives the
    /// handler), leaving an inert one behind: the request is counted once,
    /// when the stream ends, not also as "cancelled" when the handler returns.
    pub fn take(&mut self) -> Self {
        // Built field by field: `..Self::new()` would drop an armed
        // temporary, which counts.
        let inert = Self {
            endpoint: self.endpoint,
            start: self.start,
            outcome: "cancelled",
            prompt_tokens: 0,
            generated_tokens: 0,
            armed: false,
            adapter_label: None,
        };
        std::mem::replace(self, inert)
    }

    pub fn succeeded(&mut self, usage: TokenUsage) {
        self.outcome = "success";
        self.prompt_tokens += usage.prompt_tokens as usize;
        self.generated_tokens += usage.completion_tokens;
    }

    /// Passes `result` through, counting an error as this request's outcome.
    pub fn settle<T>(&mut self, result: Result<T, ApiError>) -> Result<T, ApiError> {
        if let Err(error) = &result {
            self.failed(error);
        }
        result
    }

    pub fn failed(&mut self, error: &ApiError) {
        self.outcome = match error {
            ApiError::Validation(_)
            | ApiError::PayloadTooLarge { .. }
            | ApiError::BodyTimeout
            | ApiError::Unauthorized
            | ApiError::NotFound { .. } => "invalid",
            ApiError::Infer(InferError::Overloaded(_)) => "overloaded",
            ApiError::Infer(InferError::ShuttingDown | InferError::Unavailable(_)) | ApiError::Draining => "unavailable",
            ApiError::Infer(InferError::Unschedulable(_) | InferError::UnknownAdapter(_)) => "invalid",
            ApiError::Adapter(_) => "invalid",
            ApiError::Infer(InferError::Generation(_)) => "error",
            ApiError::Batch(BatchError::Store(_)) => "error",
            ApiError::Batch(_) => "invalid",
        };
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        metrics::request_finished(self.endpoint, self.outcome, self.start.elapsed());
        if self.outcome == "success" {
            metrics::tokens(self.prompt_tokens, self.generated_tokens);
            if let Some(adapter) = &self.adapter_label {
                metrics::adapter_usage(adapter, self.prompt_tokens, self.generated_tokens);
            }
        }
    }
}

//! Drives one request: reads the scheduler's [`InferEvent`]s, detokenizes,
//! cuts stop sequences and yields [`GenEvent`]s that both APIs shape into
//! their responses. Dropping a `Generation` drops its `InferStream`, which
//! cancels the request in the scheduler (client gone, stop sequence hit).

use std::time::Instant;

use crate::detokenize::Detokenizer;
use crate::http::error::ApiError;
use crate::infer::{FinishReason, GeneratedToken, InferError, InferEvent, InferStream, TokenLogprob};
use crate::metrics;
use crate::stop::{StopMatcher, StopOutcome};
use crate::tokenizer::Tokenizer;
use tracing_opentelemetry::OpenTelemetrySpanExt;

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
        generated_tokens: u32,
        /// Visible text released only at the end (held-back stop-sequence
        /// prefixes, a truncated final character).
        trailing: String,
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
    /// A stop sequence matched; the next call reports the end.
    stopped: bool,
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
            stopped: false,
            finished: false,
            span: tracing::Span::none(),
        }
    }

    /// Records usage and outcome on `span` (see `telemetry::generation_span`).
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
        if self.stopped {
            self.finished = true;
            self.record_end(Finish::StopSequence);
            return Some(Ok(GenEvent::End {
                finish: Finish::StopSequence,
                generated_tokens: self.generated,
                trailing: String::new(),
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
                    StopOutcome::Stopped { text, .. } => {
                        self.stopped = true;
                        self.stream = None;
                        text
                    }
                };
                Ok(GenEvent::Token { token, text, visible })
            }
            InferEvent::End { reason, .. } => {
                self.finished = true;
                let rest = self.detokenizer.finish().map_err(tokenizer_failed)?;
                let (finish, trailing) = match self.stop.push(&rest) {
                    StopOutcome::Stopped { text, .. } => (Finish::StopSequence, text),
                    StopOutcome::Continue(text) => {
                        let finish = match reason {
                            FinishReason::Eos => Finish::Eos,
                            FinishReason::Length => Finish::Length,
                        };
                        (finish, text + &self.stop.flush())
                    }
                };
                self.record_end(finish);
                Ok(GenEvent::End {
                    finish,
                    generated_tokens: self.generated,
                    trailing,
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
                    generated_tokens,
                    trailing,
                } => {
                    out.text.push_str(&trailing);
                    out.finish = Some(finish);
                    out.generated_tokens = generated_tokens;
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
    pub generated_tokens: u32,
    pub cached_tokens: u32,
    pub prompt_logprobs: Vec<TokenLogprob>,
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
        }
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
        };
        std::mem::replace(self, inert)
    }

    pub fn succeeded(&mut self, prompt_tokens: usize, generated_tokens: u32) {
        self.outcome = "success";
        self.prompt_tokens += prompt_tokens;
        self.generated_tokens += generated_tokens;
    }

    pub fn failed(&mut self, error: &ApiError) {
        self.outcome = match error {
            ApiError::Validation(_) | ApiError::PayloadTooLarge(_) | ApiError::Unauthorized => "invalid",
            ApiError::Infer(InferError::Overloaded(_)) => "overloaded",
            ApiError::Infer(InferError::ShuttingDown) | ApiError::Draining => "unavailable",
            ApiError::Infer(InferError::Unschedulable(_)) => "invalid",
            ApiError::Infer(InferError::Generation(_)) => "error",
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
        }
    }
}

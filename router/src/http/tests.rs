//! Handler tests: the axum app called in-process (`tower::ServiceExt`)
//! over the real scheduler and an in-process `FakeShard`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::{app, liveness, readiness, AppState, HttpOptions, Info};
use crate::testing::fake_shard::{FakeShard, FakeShardConfig, FakeShardHandle};
use crate::infer::{InferError, SchedulerFailure, SchedulerStats, ShardInfo, TokenCounts};
use crate::reasoning::{Reasoning, ReasoningParserKind};
use crate::scheduler::{spawn, SchedulerConfig, StepDeadline};

struct Setup {
    fake: FakeShardConfig,
    max_concurrent_requests: u32,
    payload_limit: usize,
    hourly_cost: Option<f64>,
    api_key: Option<String>,
    /// Replaces the test validation's limits.
    limits: Option<crate::validation::RequestLimits>,
    cors_allow_origin: Vec<String>,
    web_ui: bool,
    /// The model thinks like this (`--reasoning-parser`).
    reasoning: Option<ReasoningParserKind>,
    step_deadline: StepDeadline,
    metrics_auth: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            // The test tokenizer (validation::tests) has 267 tokens; </s> is 2.
            fake: FakeShardConfig { vocab_size: 267, eos_token_id: 2, num_blocks: 64, block_size: 4, ..Default::default() },
            max_concurrent_requests: 64,
            payload_limit: 4096,
            hourly_cost: None,
            api_key: None,
            limits: None,
            cors_allow_origin: vec![],
            web_ui: true,
            reasoning: None,
            step_deadline: StepDeadline::default(),
            metrics_auth: false,
        }
    }
}

fn build(setup: Setup) -> (Router, Arc<AppState>) {
    let (app, state, _) = build_with_shard(setup);
    (app, state)
}

/// As `build`, with the fake shard's handle (what reached it).
fn build_with_shard(setup: Setup) -> (Router, Arc<AppState>, FakeShardHandle) {
    let fake = setup.fake;
    let config = SchedulerConfig {
        max_batch_prefill_tokens: 64,
        max_batch_total_tokens: fake.num_blocks * fake.block_size,
        max_batch_size: 16,
        max_concurrent_requests: setup.max_concurrent_requests,
        block_size: fake.block_size,
        num_blocks: fake.num_blocks,
        prefix_caching: true,
        eos_token_ids: vec![fake.eos_token_id],
        metrics_window: Duration::from_secs(60),
        step_deadline: setup.step_deadline,
        panic_at_step: None,
        speculation: None,
        batch_min_share: 0.1,
        batch_step_slack: 0.1,
        hourly_cost: setup.hourly_cost,
        // Several tokens per step wherever a test's requests all decode:
        // every HTTP path below streams bursts as the real server does.
        decode_steps: 4,
        decode_stall: None,
    };
    let info = ShardInfo {
        max_loras: fake.max_loras,
        model_type: "llama".into(),
        dtype: "float32".into(),
        device_type: "cpu".into(),
        world_size: 1,
        block_size: fake.block_size,
        vocab_size: fake.vocab_size,
        eos_token_ids: vec![fake.eos_token_id],
        max_position_embeddings: 64,
        num_blocks: fake.num_blocks,
        attention_backend: "torch".into(),
        total_parameters: 1000,
        active_parameters: 400,
    };
    let max_loras = fake.max_loras;
    let (shard, handle) = FakeShard::new(fake);
    let infer = spawn(shard, config, info);
    // gpt-oss needs harmony's special tokens and template.
    let mut validation = match setup.reasoning {
        Some(ReasoningParserKind::GptOss) => crate::harmony::tests::validation(),
        kind => {
            let mut validation = crate::validation::tests::validation();
            validation.reasoning = kind.map(|kind| Reasoning::new(kind, &validation.tokenizer).expect("a tagged parser"));
            validation
        }
    };
    validation.adapters = infer.adapters.clone();
    if let Some(limits) = setup.limits {
        validation.limits = limits;
    }
    let limits = validation.limits.clone();
    let state = Arc::new(AppState {
        infer,
        validation,
        info: Info {
            model_id: "org/tiny".into(),
            model_dtype: "float32".into(),
            model_device_type: "cpu".into(),
            model_type: "llama".into(),
            max_input_tokens: limits.max_input_tokens,
            max_total_tokens: limits.max_total_tokens,
            max_concurrent_requests: setup.max_concurrent_requests,
            max_best_of: 1,
            max_stop_sequences: limits.max_stop_sequences,
            max_top_n_tokens: limits.max_top_n_tokens,
            max_batch_total_tokens: 256,
            max_batch_prefill_tokens: 64,
            max_batch_size: 16,
            block_size: 4,
            num_blocks: 64,
            world_size: 1,
            prefix_caching: true,
            attention_backend: "torch".into(),
            kv_cache_dtype: "float32".into(),
            cpu_matmuls: Some("dense float32 weights (oneDNN)".into()),
            cpu_kernels: "portable".into(),
            weight_bytes: 1 << 20,
            dense_copy_bytes: 1 << 18,
            max_weight_memory: Some(1 << 21),
            total_parameters: 1000,
            active_parameters: 400,
            expert_parallel: false,
            router: "sluice".into(),
            version: "test".into(),
            hourly_cost: setup.hourly_cost,
            speculation: None,
            batch_min_share: 0.1,
            batch_step_slack: 0.1,
            decode_steps: 4,
            decode_stall_ms: Some(1000),
            reasoning_parser: setup.reasoning.map(|kind| kind.name().to_string()),
            lora: (max_loras > 0).then_some(super::LoraInfo {
                max_loras,
                max_lora_rank: 16,
                lora_bytes: 1024,
                lora_dtype: "bfloat16".into(),
            }),
        },
        metrics: crate::metrics::install(),
        draining: Arc::new(AtomicBool::new(false)),
        progress_timeout: Duration::from_secs(5),
        api_key: setup.api_key,
        started: Instant::now(),
        cpu_work: AppState::cpu_workers(),
        batches: None,
        responses: Arc::new(crate::http::responses::store::ResponseStore::new(8, Duration::from_secs(60))),
    });
    let options = HttpOptions {
        payload_limit: setup.payload_limit,
        cors_allow_origin: setup.cors_allow_origin,
        web_ui: setup.web_ui,
        metrics_auth: setup.metrics_auth,
    };
    (app(state.clone(), &options), state, handle)
}

async fn call(app: &Router, method: &str, path: &str, body: Option<Value>) -> (StatusCode, axum::http::HeaderMap, String) {
    let body = body.map_or(Body::empty(), |b| Body::from(b.to_string()));
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body)
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 24).await.unwrap();
    (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
}

async fn post(app: &Router, path: &str, body: Value) -> (StatusCode, Value) {
    let (status, _, text) = call(app, "POST", path, Some(body)).await;
    (status, serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}")))
}

mod apis;
mod lora;
mod harmony;
mod structured;
mod webui;

/// The JSON payloads of an SSE body, checking the framing on the way.
fn sse_payloads(text: &str) -> Vec<String> {
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.split_terminator("\n\n")
        .map(|frame| frame.strip_prefix("data: ").unwrap_or_else(|| panic!("bad frame {frame:?}")).to_string())
        .collect()
}

#[tokio::test]
async fn tgi_generate_returns_text_and_details() {
    let (app, _) = build(Setup::default());
    let body = json!({"inputs": "Hello", "parameters": {"max_new_tokens": 5, "details": true, "decoder_input_details": true}});
    let (status, response) = post(&app, "/generate", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let details = &response["details"];
    assert_eq!(details["finish_reason"], "length");
    assert_eq!(details["generated_tokens"], 5);
    assert_eq!(details["tokens"].as_array().unwrap().len(), 5);
    assert!(details["seed"].is_null(), "greedy requests report no seed");
    let prefill = details["prefill"].as_array().unwrap();
    assert_eq!(prefill[0]["id"], 1, "BOS first");
    // The compat route answers a one-element list with the same text.
    let (status, list) = post(&app, "/", body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list[0]["generated_text"], response["generated_text"]);
}

#[tokio::test]
async fn tgi_stream_carries_text_on_the_last_event() {
    let (app, _) = build(Setup::default());
    let body = json!({"inputs": "Hello", "parameters": {"max_new_tokens": 4, "do_sample": true, "seed": 3}});
    let (status, headers, text) = call(&app, "POST", "/generate_stream", Some(body)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "text/event-stream");
    let events: Vec<Value> = sse_payloads(&text).iter().map(|p| serde_json::from_str(p).unwrap()).collect();
    assert_eq!(events.len(), 4);
    let concatenated: String = events.iter().map(|e| e["token"]["text"].as_str().unwrap()).collect();
    let last = events.last().unwrap();
    assert_eq!(last["generated_text"].as_str().unwrap(), concatenated);
    assert_eq!(last["details"]["finish_reason"], "length");
    assert_eq!(last["details"]["seed"], 3);
    assert!(events[..3].iter().all(|e| e["generated_text"].is_null()));
}

#[tokio::test]
async fn chat_completion_with_n_choices_and_usage() {
    let (app, _) = build(Setup::default());
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
                      "temperature": 0, "top_p": 1.0, "some_vendor_field": {"x": 1}});
    let (status, response) = post(&app, "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_eq!(response["object"], "chat.completion");
    let choices = response["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[1]["index"], 1);
    assert_eq!(choices[0]["finish_reason"], "length");
    assert_eq!(choices[0]["message"]["role"], "assistant");
    assert_eq!(response["usage"]["completion_tokens"], 6);
    assert!(response["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
}

#[tokio::test]
async fn chat_stream_ends_with_usage_and_done() {
    let (app, _) = build(Setup::default());
    let body = json!({"model": "org/tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                      "max_completion_tokens": 3, "stream": true, "stream_options": {"include_usage": true},
                      "logprobs": true, "top_logprobs": 2});
    let (status, _, text) = call(&app, "POST", "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let payloads = sse_payloads(&text);
    assert_eq!(payloads.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = payloads[..payloads.len() - 1].iter().map(|p| serde_json::from_str(p).unwrap()).collect();
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    let finish: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0]["finish_reason"].is_string()).collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");
    let with_logprobs = chunks.iter().filter(|c| c["choices"][0]["logprobs"]["content"].is_array()).count();
    assert_eq!(with_logprobs, 3);
}

#[tokio::test]
async fn completions_index_prompts_times_n() {
    let (app, _) = build(Setup::default());
    let body = json!({"model": "tiny", "prompt": ["Hello", "world"], "n": 2, "max_tokens": 2, "seed": 5, "temperature": 0.8});
    let (status, response) = post(&app, "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let indexes: Vec<u64> = response["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(indexes, [0, 1, 2, 3]);
    assert_eq!(response["usage"]["completion_tokens"], 8);
}

/// The usage chunk of an SSE body (`stream_options.include_usage`).
fn streamed_usage(sse: &str) -> Value {
    let payloads = sse_payloads(sse);
    assert_eq!(payloads.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&payloads[payloads.len() - 2]).unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0, "{last}");
    last["usage"].clone()
}

#[tokio::test]
async fn usage_counts_each_prompt_once_and_every_choice() {
    let (app, _) = build(Setup::default());
    // Prompts of 9 and 5 tokens (block size 4), two choices each.
    let prompts = json!([[1, 263, 264, 265, 266, 263, 264, 265, 266], [1, 266, 265, 264, 263]]);
    let body = json!({"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": true});
    let (status, cold) = post(&app, "/v1/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{cold}");
    assert_eq!(cold["usage"]["prompt_tokens"], 14, "each prompt once, not once per choice: {cold}");
    assert_eq!(cold["usage"]["completion_tokens"], 12, "every choice's tokens");
    assert_eq!(cold["usage"]["total_tokens"], 26);
    // Warm: each prompt's first choice finds (9 - 1) / 4 = 2 and (5 - 1) / 4 = 1
    // full blocks cached; the other choices' hits are not counted again.
    let (_, warm) = post(&app, "/v1/completions", body.clone()).await;
    assert_eq!(warm["usage"]["prompt_tokens_details"]["cached_tokens"], 12, "{warm}");
    let mut streamed = body;
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, _, sse) = call(&app, "POST", "/v1/completions", Some(streamed)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(streamed_usage(&sse), warm["usage"], "streamed and buffered usage agree");

    // Chat counts the same way: n = 2 costs the prompt once.
    let chat = |n: u32, stream: bool| {
        json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": n,
               "temperature": 0, "ignore_eos": true, "stream": stream, "stream_options": {"include_usage": true}})
    };
    let _ = post(&app, "/v1/chat/completions", chat(1, false)).await; // fills the cache
    let (_, one) = post(&app, "/v1/chat/completions", chat(1, false)).await;
    let (_, two) = post(&app, "/v1/chat/completions", chat(2, false)).await;
    assert_eq!(two["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"], "{two}");
    assert_eq!(two["usage"]["completion_tokens"], 4);
    assert_eq!(two["usage"]["prompt_tokens_details"], one["usage"]["prompt_tokens_details"], "warm: the first choice's hit");
    let (_, _, sse) = call(&app, "POST", "/v1/chat/completions", Some(chat(2, true))).await;
    assert_eq!(streamed_usage(&sse), two["usage"]);
}

#[tokio::test]
async fn stop_sequence_cuts_the_text_and_finishes_with_stop() {
    let (app, _) = build(Setup::default());
    let base = json!({"model": "tiny", "prompt": [1, 263, 264], "max_tokens": 12, "temperature": 0});
    let (_, full) = post(&app, "/v1/completions", base.clone()).await;
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop sequence from the middle of the greedy output.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 6, "{text:?}");
    let stop: String = chars[3..5].iter().collect();
    let expected_prefix = &text[..text.find(&stop).unwrap()];
    let mut body = base;
    body["stop"] = json!(stop);
    let (status, cut) = post(&app, "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(cut["choices"][0]["text"], expected_prefix);
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn streamed_stop_sequence_is_cut_across_tokens() {
    let (app, _) = build(Setup::default());
    let base = json!({"model": "tiny", "prompt": [1, 263, 264], "max_tokens": 12, "temperature": 0});
    let (_, full) = post(&app, "/v1/completions", base.clone()).await;
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    // Three characters: with the byte-fallback test tokenizer a character
    // is one or more tokens, so the stop sequence spans token boundaries.
    let stop: String = chars[4..7].iter().collect();
    let expected = &text[..text.find(&stop).unwrap()];
    let mut body = base;
    body["stop"] = json!([stop]);
    body["stream"] = json!(true);
    let (status, _, sse) = call(&app, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK);
    let payloads = sse_payloads(&sse);
    assert_eq!(payloads.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = payloads[..payloads.len() - 1].iter().map(|p| serde_json::from_str(p).unwrap()).collect();
    let streamed: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(streamed, expected);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn bad_requests_get_precise_errors() {
    let (app, _) = build(Setup::default());
    let (status, body) = post(&app, "/v1/chat/completions", json!({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["code"], "model_not_found");
    let (status, body) = post(&app, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": 5}]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body["error"]["param"].as_str().unwrap().starts_with("messages[0]"), "{body}");
    let (status, body) = post(&app, "/v1/chat/completions", json!({"messages": []})).await;
    assert_eq!((status, body["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("messages")));
    let (status, body) = post(&app, "/v1/completions", json!({"prompt": "x", "max_tokens": 2, "temperature": 3})).await;
    assert_eq!((status, body["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("temperature")));
    let (status, body) = post(&app, "/v1/completions", json!({"prompt": [1, 5000]})).await;
    assert_eq!((status, body["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("prompt")));
    let (status, body) = post(&app, "/v1/completions", json!({"prompt": "x", "max_tokens": 2, "logit_bias": {"7": 200}})).await;
    assert_eq!((status, body["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("logit_bias.7")));
    let (status, body) = post(&app, "/v1/completions", json!({"prompt": "x", "max_tokens": 100})).await;
    assert_eq!((status, body["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("max_tokens")));
    let (status, body) = post(&app, "/generate", json!({"inputs": ""})).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["error_type"], "validation");
    let (status, body) = post(&app, "/generate", json!({"inputs": "x", "parameters": {"temperature": 0.0}})).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let (status, _, text) = call(&app, "POST", "/generate", Some(json!({"inputs": "x".repeat(5000)}))).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{text}");
    assert!(text.contains("payload_too_large"));
}

/// A body over --payload-limit is a 413 that names the limit in bytes and
/// the flag, in each API's shape, whether its length was declared (refused
/// before a byte is read) or it grew past the limit while arriving.
#[tokio::test]
async fn an_oversized_body_is_413_naming_the_limit_and_the_flag() {
    let (app, _) = build(Setup::default());
    let names_the_limit = |message: &str| message.contains("limit of 4096 bytes (--payload-limit)");
    let big = json!({"inputs": "x".repeat(5000), "messages": [{"role": "user", "content": "x"}]});
    // No Content-Length: the limit cuts the body off as it is read.
    let (status, tgi) = post(&app, "/generate", big.clone()).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{tgi}");
    assert_eq!(tgi["error_type"], "payload_too_large");
    assert!(names_the_limit(tgi["error"].as_str().unwrap()), "{tgi}");
    let (status, openai) = post(&app, "/v1/chat/completions", big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{openai}");
    assert_eq!(openai["error"]["code"], "payload_too_large");
    assert!(names_the_limit(openai["error"]["message"].as_str().unwrap()), "{openai}");
    // A declared length over the limit: answered without reading a body
    // that would never arrive.
    for path in ["/generate", "/v1/completions"] {
        let never = Body::from_stream(futures::stream::pending::<Result<axum::body::Bytes, std::io::Error>>());
        let request = Request::post(path).header("content-type", "application/json").header("content-length", "5000");
        let response = tokio::time::timeout(Duration::from_secs(10), app.clone().oneshot(request.body(never).unwrap()))
            .await
            .expect("the declared length was not checked first")
            .unwrap();
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE, "{path}");
        let text = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
        let text = String::from_utf8_lossy(&text);
        assert!(names_the_limit(&text), "{path}: {text}");
        assert_eq!(text.contains("\"error_type\""), path == "/generate", "{path}: {text}");
    }
    // Just under the limit is read as usual.
    let (status, body) = post(&app, "/generate", json!({"inputs": "x", "parameters": {"max_new_tokens": 1}})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// Sends a request of 12 steps and returns once the scheduler holds it (not
/// after a guessed pause); its answer is the returned task's.
async fn hold_a_slot(app: &Router, state: &AppState) -> tokio::task::JoinHandle<(StatusCode, Value)> {
    let slow = {
        let app = app.clone();
        tokio::spawn(async move { post(&app, "/generate", json!({"inputs": "a", "parameters": {"max_new_tokens": 12}})).await })
    };
    let admitted = async {
        while state.infer.stats().await.map_or(0, |s| s.waiting + s.running) == 0 {
            assert!(!slow.is_finished(), "the slow request ended before the scheduler had it");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), admitted).await.expect("the slow request never reached the scheduler");
    slow
}

#[tokio::test]
async fn overload_is_429_with_retry_after() {
    let mut setup = Setup { max_concurrent_requests: 1, ..Default::default() };
    // The slow request holds the only slot for 12 steps of 200 ms.
    setup.fake.latency = Duration::from_millis(200);
    let (app, state) = build(setup);
    let slow = hold_a_slot(&app, &state).await;
    let (status, headers, text) = call(&app, "POST", "/generate", Some(json!({"inputs": "b"}))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{text}");
    assert_eq!(headers["retry-after"], "1");
    assert!(text.contains("\"error_type\":\"overloaded\""));
    assert_eq!(slow.await.unwrap().0, StatusCode::OK);
}

#[tokio::test]
async fn fan_out_is_bounded_before_anything_is_built() {
    let (app, state) = build(Setup::default());
    let limits = state.validation.limits.clone();
    let prompts: Vec<String> = (0..=limits.max_client_batch_size).map(|i| format!("p{i}")).collect();
    let (status, body) = post(&app, "/v1/completions", json!({"prompt": prompts})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "prompt", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("--max-client-batch-size"), "{body}");

    // 3 prompts x n = 3 is more sequences than the server ever runs at once.
    assert!(3 * 3 > limits.max_sequences && 3 <= limits.max_client_batch_size && 3 <= limits.max_n);
    let (status, body) = post(&app, "/v1/completions", json!({"prompt": ["a", "b", "c"], "n": 3})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "n", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("9 sequences"), "{body}");
}

#[tokio::test]
async fn a_request_is_admitted_whole_or_not_at_all() {
    let mut setup = Setup { max_concurrent_requests: 4, ..Default::default() };
    setup.fake.latency = Duration::from_millis(100);
    let (app, state) = build(setup);
    let slow = hold_a_slot(&app, &state).await;
    // 2 prompts x n = 2: four sequences, three free slots.
    let four = json!({"prompt": ["x", "y"], "n": 2, "max_tokens": 2});
    let (status, body) = post(&app, "/v1/completions", four.clone()).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let stats = state.infer.stats().await.unwrap();
    assert_eq!(stats.waiting + stats.running, 1, "none of the refused request's sequences was queued");
    // Five sequences never fit: not "retry", but why.
    let (status, body) = post(&app, "/v1/completions", json!({"prompt": ["x", "y", "z"], "n": 2, "max_tokens": 2})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("6 sequences"), "{body}");
    assert_eq!(slow.await.unwrap().0, StatusCode::OK);
    let (status, body) = post(&app, "/v1/completions", four).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"].as_array().unwrap().len(), 4);
}

#[tokio::test]
async fn cors_allows_listed_origins_or_any() {
    let preflight = |app: Router, origin: &'static str| async move {
        let request = Request::builder()
            .method("OPTIONS")
            .uri("/v1/models")
            .header("origin", origin)
            .header("access-control-request-method", "GET")
            .body(Body::empty())
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        response.headers().get("access-control-allow-origin").map(|v| v.to_str().unwrap().to_string())
    };
    let (any, _) = build(Setup { cors_allow_origin: vec!["*".into()], ..Default::default() });
    assert_eq!(preflight(any, "https://anywhere.example").await.as_deref(), Some("*"));
    let (listed, _) = build(Setup { cors_allow_origin: vec!["https://app.example".into()], ..Default::default() });
    assert_eq!(preflight(listed.clone(), "https://app.example").await.as_deref(), Some("https://app.example"));
    assert_eq!(preflight(listed, "https://evil.example").await, None);
}

#[tokio::test]
async fn draining_refuses_new_requests_and_readiness() {
    let (app, state) = build(Setup::default());
    let (status, _, _) = call(&app, "GET", "/ready", None).await;
    assert_eq!(status, StatusCode::OK);
    state.draining.store(true, Ordering::SeqCst);
    let (status, body) = post(&app, "/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["error"]["code"], "shutting_down");
    let (status, _, _) = call(&app, "GET", "/health?ready", None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, _, _) = call(&app, "GET", "/health", None).await;
    assert_eq!(status, StatusCode::OK, "liveness stays up while draining");
}

#[tokio::test]
async fn liveness_fails_once_a_step_is_past_its_deadline_or_the_scheduler_failed() {
    let now = Instant::now() + Duration::from_secs(60);
    let idle = SchedulerStats::default();
    assert_eq!(liveness(None, Some(&idle), now), Ok(()));
    let slow = SchedulerStats { running: 1, step_deadline: Some(now + Duration::from_secs(1)), ..Default::default() };
    assert_eq!(liveness(None, Some(&slow), now), Ok(()), "a slow step within its deadline is alive");
    let overdue = SchedulerStats { running: 1, step_deadline: Some(now - Duration::from_millis(1)), ..Default::default() };
    let says = |result: Result<(), InferError>, words: &str| matches!(result, Err(InferError::Unavailable(m)) if m.contains(words));
    assert!(says(liveness(None, Some(&overdue), now), "past its deadline"));
    let failed = SchedulerFailure::StepDeadline(Duration::from_secs(10));
    assert!(says(liveness(Some(failed), None, now), "did not finish a step within 10s"));
    assert!(liveness(None, None, now).is_err(), "scheduler gone");
}

/// A shard that stops answering: at the step deadline every request in
/// flight ends in its API's shape (an error event that closes a stream, a
/// 503 for a buffered request), then liveness fails and new requests get 503.
#[tokio::test]
async fn a_stuck_shard_fails_every_request_in_flight_and_liveness() {
    let step_deadline = StepDeadline { steady: Duration::from_secs(1), first_steps: None };
    let mut setup = Setup { step_deadline, ..Default::default() };
    // Long enough steps that all four are still running when the hang is set.
    setup.fake.latency = Duration::from_millis(300);
    let (app, state, shard) = build_with_shard(setup);
    let requests = [
        ("/generate_stream", json!({"inputs": "a", "parameters": {"max_new_tokens": 12}})),
        ("/generate", json!({"inputs": "b", "parameters": {"max_new_tokens": 12}})),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "c"}], "max_tokens": 6, "stream": true})),
        ("/v1/completions", json!({"prompt": "d", "max_tokens": 12})),
    ];
    let calls: Vec<_> = requests
        .into_iter()
        .map(|(path, body)| {
            let app = app.clone();
            tokio::spawn(async move { call(&app, "POST", path, Some(body)).await })
        })
        .collect();
    let all_running = async {
        while state.infer.stats().await.map_or(0, |s| s.running) < 4 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), all_running).await.expect("the four requests never ran together");
    shard.hang_next_steps(1);
    let started = Instant::now();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(tokio::time::timeout(Duration::from_secs(30), call).await.expect("a request hung").unwrap());
    }
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    let says_why = |text: &str| text.contains("did not finish a step within 1s");

    let (status, _, tgi_stream) = &answers[0];
    assert_eq!(*status, StatusCode::OK, "the stream had started");
    let last: Value = serde_json::from_str(sse_payloads(tgi_stream).last().unwrap()).unwrap();
    assert_eq!(last["error_type"], "unhealthy", "{tgi_stream}");
    assert!(says_why(last["error"].as_str().unwrap()), "{last}");
    let (status, headers, tgi) = &answers[1];
    assert_eq!(*status, StatusCode::SERVICE_UNAVAILABLE, "{tgi}");
    assert_eq!(headers["retry-after"], "1");
    assert!(says_why(tgi) && tgi.contains("\"error_type\":\"unhealthy\""), "{tgi}");
    let (status, _, chat_stream) = &answers[2];
    assert_eq!(*status, StatusCode::OK);
    let payloads = sse_payloads(chat_stream);
    assert_eq!(payloads.last().unwrap(), "[DONE]");
    let error: Value = serde_json::from_str(&payloads[payloads.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], "server_restarting", "{chat_stream}");
    assert!(says_why(error["error"]["message"].as_str().unwrap()), "{error}");
    let (status, _, completion) = &answers[3];
    assert_eq!(*status, StatusCode::SERVICE_UNAVAILABLE, "{completion}");
    let completion: Value = serde_json::from_str(completion).unwrap();
    assert_eq!(completion["error"]["type"], "service_unavailable");

    let (status, _, health) = call(&app, "GET", "/health", None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{health}");
    assert!(says_why(&health), "{health}");
    let (status, body) = post(&app, "/generate", json!({"inputs": "e"})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
}

#[tokio::test]
async fn readiness_requires_progress() {
    let (_, state) = build(Setup::default());
    let now = Instant::now() + Duration::from_secs(60);
    let idle = SchedulerStats::default();
    assert!(readiness(&state, Some(&idle), now).ready, "nothing pending: ready");
    let stuck_step = SchedulerStats { running: 1, step_in_flight_since: Some(now - Duration::from_secs(10)), ..Default::default() };
    assert!(!readiness(&state, Some(&stuck_step), now).ready);
    let starving = SchedulerStats { waiting: 2, last_step_finished: Some(now - Duration::from_secs(10)), ..Default::default() };
    assert!(!readiness(&state, Some(&starving), now).ready);
    let busy = SchedulerStats { waiting: 2, last_step_finished: Some(now - Duration::from_millis(100)), ..Default::default() };
    assert!(readiness(&state, Some(&busy), now).ready);
    assert!(!readiness(&state, None, now).ready, "scheduler gone");
}

#[tokio::test]
async fn info_models_tokenize_metrics_and_openapi() {
    let (app, _) = build(Setup::default());
    let (status, _, info) = call(&app, "GET", "/info", None).await;
    assert_eq!(status, StatusCode::OK);
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!((info["model_id"].as_str(), info["router"].as_str(), info["max_best_of"].as_u64()), (Some("org/tiny"), Some("sluice"), Some(1)));
    assert!(info["hourly_cost"].is_null(), "no price configured: {info}");
    // What the shard decided, as the shard's Info reported it.
    assert_eq!(
        (info["kv_cache_dtype"].as_str(), info["cpu_kernels"].as_str(), info["weight_bytes"].as_u64()),
        (Some("float32"), Some("portable"), Some(1 << 20))
    );
    assert_eq!(info["cpu_matmuls"], "dense float32 weights (oneDNN)");
    assert_eq!(info["dense_copy_bytes"].as_u64(), Some(1 << 18));
    assert_eq!(info["max_weight_memory"].as_u64(), Some(1 << 21));
    assert_eq!((info["total_parameters"].as_u64(), info["active_parameters"].as_u64()), (Some(1000), Some(400)));
    assert_eq!(info["expert_parallel"], false);
    let (_, _, models) = call(&app, "GET", "/v1/models", None).await;
    assert_eq!(serde_json::from_str::<Value>(&models).unwrap()["data"][0]["id"], "tiny");
    let (status, tokens) = post(&app, "/tokenize", json!({"inputs": "Hello"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(tokens[0]["id"], 1);
    let (_, _, _) = call(&app, "POST", "/generate", Some(json!({"inputs": "x", "parameters": {"max_new_tokens": 1}}))).await;
    let (status, _, metrics) = call(&app, "GET", "/metrics", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(metrics.contains("sluice_requests_total"), "{metrics}");
    // The recorder is the process's: other tests' per-adapter spending
    // (sluice_lora_spent_dollars, set with a price) may show in it.
    let priced = metrics.lines().filter(|l| l.contains("dollars") && !l.contains("sluice_lora_spent_dollars"));
    assert_eq!(priced.count(), 0, "no price, no cost gauges");
    let (status, _, doc) = call(&app, "GET", "/openapi.json", None).await;
    assert_eq!(status, StatusCode::OK);
    let doc: Value = serde_json::from_str(&doc).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for path in ["/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions", "/tokenize", "/info"] {
        assert!(doc["paths"][path].is_object(), "{path} missing");
    }
    assert!(doc["components"]["schemas"]["Info"]["properties"]["hourly_cost"].is_object());
}

#[tokio::test]
async fn the_api_key_guards_the_api_but_not_probes_or_metrics() {
    let (app, _) = build(Setup { api_key: Some("k".into()), ..Default::default() });
    let (status, _, _) = call(&app, "GET", "/v1/models", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let keyed = Request::builder().uri("/v1/models").header("authorization", "Bearer k").body(Body::empty()).unwrap();
    assert_eq!(app.clone().oneshot(keyed).await.unwrap().status(), StatusCode::OK);
    // Probes, Prometheus and an endpoint picker send no key.
    for path in ["/health", "/ready", "/metrics"] {
        let (status, _, body) = call(&app, "GET", path, None).await;
        assert_eq!(status, StatusCode::OK, "{path}: {body}");
    }
    // The picker's KV gauge exists before any request (the recorder is
    // shared by every test here, so only its range is certain).
    let (_, _, metrics) = call(&app, "GET", "/metrics", None).await;
    let ratio = sample(&metrics, "sluice_kv_cache_usage_ratio").unwrap_or_else(|| panic!("{metrics}"));
    assert!((0.0..=1.0).contains(&ratio), "{ratio}");
}

#[tokio::test]
async fn metrics_auth_puts_metrics_behind_the_key_and_leaves_the_probes_open() {
    let (app, _) = build(Setup { api_key: Some("k".into()), metrics_auth: true, ..Default::default() });
    let (status, _, body) = call(&app, "GET", "/metrics", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert!(body.contains("\"error_type\":\"authentication\""), "{body}");
    let wrong = Request::get("/metrics").header("authorization", "Bearer x").body(Body::empty()).unwrap();
    assert_eq!(app.clone().oneshot(wrong).await.unwrap().status(), StatusCode::UNAUTHORIZED);
    let keyed = Request::get("/metrics").header("authorization", "Bearer k").body(Body::empty()).unwrap();
    let response = app.clone().oneshot(keyed).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let text = axum::body::to_bytes(response.into_body(), 1 << 24).await.unwrap();
    assert!(String::from_utf8_lossy(&text).contains("sluice_kv_cache_usage_ratio"));
    for path in ["/health", "/ready"] {
        let (status, _, body) = call(&app, "GET", path, None).await;
        assert_eq!(status, StatusCode::OK, "{path}: {body}");
    }
}

/// One unlabelled sample of an exposition.
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn price_in_info_and_window_gauges_in_metrics() {
    let before_build = Instant::now();
    let (app, state) = build(Setup { hourly_cost: Some(2.5), ..Default::default() });
    let built = Instant::now();
    let (_, _, info) = call(&app, "GET", "/info", None).await;
    assert_eq!(serde_json::from_str::<Value>(&info).unwrap()["hourly_cost"], 2.5);

    // No traffic yet: the price, and no made-up cost or ratio.
    let (_, _, metrics) = call(&app, "GET", "/metrics", None).await;
    assert_eq!(sample(&metrics, "sluice_hourly_cost_dollars"), Some(2.5), "{metrics}");
    assert_eq!(sample(&metrics, "sluice_cost_dollars_per_million_output_tokens"), None);
    assert_eq!(sample(&metrics, "sluice_prefix_cache_hit_ratio"), None);

    // The same 9-token prompt twice: the second reuses its 2 full blocks.
    let body = json!({"model": "tiny", "prompt": [1, 263, 264, 265, 266, 263, 264, 265, 266], "max_tokens": 3, "temperature": 0});
    let mut usages = Vec::new();
    for _ in 0..2 {
        let (status, response) = post(&app, "/v1/completions", body.clone()).await;
        assert_eq!(status, StatusCode::OK, "{response}");
        usages.push(response["usage"].clone());
    }
    let sum = |pick: &dyn Fn(&Value) -> &Value| usages.iter().map(|u| pick(u).as_u64().unwrap()).sum::<u64>();
    let output = sum(&|u| &u["completion_tokens"]);
    let prompt = sum(&|u| &u["prompt_tokens"]);
    let cached = sum(&|u| &u["prompt_tokens_details"]["cached_tokens"]);
    assert_eq!((prompt, cached), (18, 8), "{usages:?}");
    let window = state.infer.stats().await.unwrap().window;
    assert_eq!(window.counts, TokenCounts { output, prompt, cached_prompt: cached });

    let least_covered = built.elapsed();
    let (_, _, metrics) = call(&app, "GET", "/metrics", None).await;
    let most_covered = before_build.elapsed();
    assert_eq!(sample(&metrics, "sluice_prefix_cache_hit_ratio"), Some(8.0 / 18.0), "{metrics}");
    // The window (60 s) covers the whole test: the cost is the price of the
    // time since the scheduler started, spread over the tokens generated.
    let cost = sample(&metrics, "sluice_cost_dollars_per_million_output_tokens").expect("tokens were generated");
    let cost_of = |covered: Duration| 2.5 * covered.as_secs_f64() / 3600.0 / output as f64 * 1e6;
    assert!(cost_of(least_covered) <= cost && cost <= cost_of(most_covered), "{cost}");
}

#[test]
fn bearer_scheme_is_case_insensitive_the_token_is_not() {
    use super::bearer_token;
    assert_eq!(bearer_token("Bearer k1"), Some("k1"));
    assert_eq!(bearer_token("bearer k1"), Some("k1"));
    assert_eq!(bearer_token("BEARER K1"), Some("K1"));
    assert_eq!(bearer_token("Basic k1"), None);
    assert_eq!(bearer_token("k1"), None);
    assert_eq!(bearer_token("Bearer"), None);
}

#[test]
fn keys_compare_whole() {
    use super::same_key;
    assert!(same_key("sk-1234", "sk-1234"));
    assert!(!same_key("sk-1235", "sk-1234"));
    assert!(!same_key("sk-123", "sk-1234"));
    assert!(!same_key("sk-12345", "sk-1234"));
    assert!(!same_key("", "sk-1234"));
}

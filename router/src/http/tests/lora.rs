//! LoRA adapters through the handlers: loading and unloading by HTTP, the
//! `model` (OpenAI chat, completions and responses; Anthropic messages) and
//! `adapter_id` (TGI) fields picking one, /v1/models,
//! the errors, and the per-adapter series of /metrics. The fake shard
//! generates other tokens for every adapter path, so a request served by
//! the wrong weights shows.

use serde_json::{json, Value};

use super::{build, build_with_shard, call, post, Setup};
use crate::testing::fake_shard::{adapter_seed, next_token_from};
use axum::http::StatusCode;

fn setup(max_loras: u32) -> Setup {
    let mut setup = Setup { hourly_cost: Some(36.0), ..Default::default() };
    setup.fake.max_loras = max_loras;
    setup
}

async fn load(app: &axum::Router, name: &str, path: &str) -> (StatusCode, String) {
    let (status, _, text) =
        call(app, "POST", "/v1/load_lora_adapter", Some(json!({"lora_name": name, "lora_path": path}))).await;
    (status, text)
}

/// The token ids a greedy completion of `model` returns for prompt "ab".
async fn completion_tokens(app: &axum::Router, model: &str) -> (StatusCode, Value) {
    let body = json!({"model": model, "prompt": "ab", "max_tokens": 4, "temperature": 0, "logprobs": 0});
    post(app, "/v1/completions", body).await
}

/// The token ids and text of a greedy TGI generation of 4 tokens for "ab",
/// with `adapter_id` when given.
async fn generated(app: &axum::Router, adapter: Option<&str>) -> (Vec<u32>, String) {
    let body = json!({"inputs": "ab", "parameters": {"max_new_tokens": 4, "details": true, "adapter_id": adapter}});
    let (status, response) = post(app, "/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let ids = response["details"]["tokens"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap() as u32);
    (ids.collect(), response["generated_text"].as_str().unwrap().to_string())
}

/// What the fake shard generates after `prompt` with the adapter at `path`.
fn expected_text_ids(setup: &Setup, path: Option<&str>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    for _ in 0..n {
        let (t, _) = next_token_from(&setup.fake, adapter_seed(path), &tokens, true);
        tokens.push(t);
    }
    tokens[prompt.len()..].to_vec()
}

#[tokio::test]
async fn adapters_load_serve_list_and_unload() {
    let (app, state, shard) = build_with_shard(setup(2));
    assert_eq!(load(&app, "sql", "/adapters/sql").await, (StatusCode::OK, "Success: LoRA adapter 'sql' added successfully.".into()));
    assert_eq!(load(&app, "chat", "/adapters/chat").await.0, StatusCode::OK);

    let (status, models) = post_get(&app, "/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let cards: Vec<(String, Value, Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap().to_string(), m["parent"].clone(), m["root"].clone()))
        .collect();
    assert_eq!(
        cards,
        [
            ("tiny".to_string(), Value::Null, json!("org/tiny")),
            ("chat".to_string(), json!("tiny"), json!("/adapters/chat")),
            ("sql".to_string(), json!("tiny"), json!("/adapters/sql")),
        ]
    );

    // Each model answers with its own tokens (TGI: `adapter_id`; OpenAI:
    // `model`, answered under its own name).
    let prompt = state.validation.tokenizer.encode("ab", true).unwrap();
    let mut outputs = Vec::new();
    for (model, path) in [("tiny", None), ("sql", Some("/adapters/sql")), ("chat", Some("/adapters/chat"))] {
        let (ids, text) = generated(&app, path.map(|_| model)).await;
        assert_eq!(ids, expected_text_ids(&setup(2), path, &prompt, 4), "{model}");
        let (status, response) = completion_tokens(&app, model).await;
        assert_eq!(status, StatusCode::OK, "{response}");
        assert_eq!((&response["model"], response["choices"][0]["text"].as_str().unwrap()), (&json!(model), text.as_str()));
        outputs.push(ids);
    }
    assert!(outputs[0] != outputs[1] && outputs[1] != outputs[2], "{outputs:?}");

    // Unloaded: gone from the list, and a 404 that lists what exists.
    let (status, _, text) = call(&app, "POST", "/v1/unload_lora_adapter", Some(json!({"lora_name": "sql"}))).await;
    assert_eq!((status, text.as_str()), (StatusCode::OK, "Success: LoRA adapter 'sql' removed successfully."));
    let (status, response) = completion_tokens(&app, "sql").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(response["error"]["code"], "model_not_found");
    assert_eq!(
        response["error"]["message"],
        "The model `sql` does not exist; this server serves: `tiny` (the base model), `chat`"
    );
    let body = json!({"inputs": "ab", "parameters": {"adapter_id": "sql"}});
    assert_eq!(post(&app, "/generate", body).await.0, StatusCode::NOT_FOUND);
    let (status, response) = post(&app, "/v1/unload_lora_adapter", json!({"lora_name": "sql"})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(response["error"]["message"], "there is no LoRA adapter `sql`; loaded: `chat`");

    // The shard saw every adapter go into a slot of its own.
    let slots = shard.adapter_slots();
    assert!(slots.contains(&Some("/adapters/chat".into())), "{slots:?}");
    assert!(shard.violations().is_empty(), "{:?}", shard.violations());
}

async fn post_get(app: &axum::Router, path: &str) -> (StatusCode, Value) {
    let (status, _, text) = call(app, "GET", path, None).await;
    (status, serde_json::from_str(&text).unwrap())
}

#[tokio::test]
async fn bad_loads_are_refused_with_the_reason_and_the_server_keeps_serving() {
    let (app, _) = build(setup(2));
    let cases = [
        (json!({"lora_name": "x", "lora_path": "/adapters/bad"}), StatusCode::BAD_REQUEST,
         "the adapter `x` cannot be loaded: /adapters/bad is not a PEFT folder"),
        (json!({"lora_name": "tiny", "lora_path": "/adapters/a"}), StatusCode::BAD_REQUEST,
         "`lora_name`: `tiny` names the base model"),
        (json!({"lora_name": "", "lora_path": "/adapters/a"}), StatusCode::BAD_REQUEST,
         "`lora_name`: must be 1 to 256 bytes of printable text"),
        (json!({"lora_name": "y", "lora_path": " "}), StatusCode::BAD_REQUEST, "`lora_path`: must not be empty"),
    ];
    for (body, status, message) in cases {
        let (got, response) = post(&app, "/v1/load_lora_adapter", body.clone()).await;
        assert_eq!((got, response["error"]["message"].as_str().unwrap()), (status, message), "{body}");
    }
    let (status, response) = post(&app, "/v1/load_lora_adapter", json!({"lora_name": "x"})).await;
    assert_eq!((status, response["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("lora_path")));
    assert_eq!(load(&app, "a", "/adapters/a").await.0, StatusCode::OK);
    let (status, response) = post(&app, "/v1/load_lora_adapter", json!({"lora_name": "a", "lora_path": "/b"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(response["error"]["message"], "`lora_name`: an adapter named `a` is already loaded; unload it first");
    // A refused adapter left nothing behind: the name is free, the server serves.
    assert_eq!(completion_tokens(&app, "x").await.0, StatusCode::NOT_FOUND);
    assert_eq!(completion_tokens(&app, "a").await.0, StatusCode::OK);
    assert_eq!(completion_tokens(&app, "tiny").await.0, StatusCode::OK);
}

#[tokio::test]
async fn adapters_off_and_the_api_key() {
    let (app, _) = build(setup(0));
    let (status, response) = post(&app, "/v1/load_lora_adapter", json!({"lora_name": "a", "lora_path": "/a"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(response["error"]["message"].as_str().unwrap().contains("LoRA adapters are off"), "{response}");
    let (_, info) = post_get(&app, "/info").await;
    assert!(info["lora"].is_null());

    let (app, _) = build(Setup { api_key: Some("k".into()), ..setup(2) });
    for path in ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"] {
        let (status, _) = post(&app, path, json!({"lora_name": "a", "lora_path": "/a"})).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}");
    }
}

/// More adapters than slots: each request's adapter is loaded when it is
/// admitted, in place of an idle one, and every answer is its adapter's.
#[tokio::test]
async fn more_adapters_than_slots_take_turns() {
    let (app, state, shard) = build_with_shard(setup(1));
    let prompt = state.validation.tokenizer.encode("ab", true).unwrap();
    for name in ["p", "q", "r"] {
        assert_eq!(load(&app, name, &format!("/adapters/{name}")).await.0, StatusCode::OK);
    }
    let (_, info) = post_get(&app, "/info").await;
    assert_eq!(info["lora"]["max_loras"], 1);
    assert_eq!(info["lora"]["lora_dtype"], "bfloat16", "the shard's stack dtype, passed through");
    let models = [Some("p"), Some("q"), Some("r"), None, Some("q"), Some("p")];
    let answers = futures::future::join_all(models.map(|model| generated(&app, model))).await;
    for (model, (ids, _)) in models.iter().zip(answers) {
        let path = model.map(|m| format!("/adapters/{m}"));
        assert_eq!(ids, expected_text_ids(&setup(1), path.as_deref(), &prompt, 4), "{model:?}");
    }
    assert!(shard.violations().is_empty(), "{:?}", shard.violations());
    let stats = state.infer.stats().await.unwrap();
    assert_eq!((stats.adapters.slots, stats.adapters.loaded, stats.adapters.registered), (1, 1, 3));
    assert!(stats.adapters.evictions >= 2, "{:?}", stats.adapters);

    // Per-adapter usage and cost in /metrics (`adapter=""`: the base model).
    let (_, _, metrics) = call(&app, "GET", "/metrics", None).await;
    for line in ["sluice_lora_requests_total{adapter=\"r\"} 1", "sluice_lora_generated_tokens_total{adapter=\"p\"} 8"] {
        assert!(metrics.lines().any(|l| l == line), "{line} missing:\n{metrics}");
    }
    // (Gauges are process-wide and other tests set them too: present is all.)
    for series in ["sluice_lora_spent_dollars{adapter=\"q\"} ", "sluice_lora_slots_capacity ", "sluice_lora_slots_active "] {
        assert!(metrics.lines().any(|l| l.starts_with(series)), "{series} missing:\n{metrics}");
    }
}

#[tokio::test]
async fn responses_and_messages_pick_the_adapter_by_model() {
    // Room for the chat template's tokens.
    let mut setup = super::structured::setup();
    setup.fake.max_loras = 2;
    let (app, _, shard) = build_with_shard(setup);
    assert_eq!(load(&app, "sql", "/adapters/sql").await.0, StatusCode::OK);
    // The adapter slots the shard was asked to run the requests sent since `seen` steps with.
    let slots_since = |seen: usize| -> Vec<u32> {
        shard.steps()[seen..].iter().flat_map(|s| s.new_requests.iter().map(|r| r.adapter_slot)).collect()
    };
    for model in ["tiny", "sql"] {
        let on_adapter = model == "sql";
        let seen = shard.steps().len();
        let body = json!({"model": model, "input": "Hello", "max_output_tokens": 4, "temperature": 0});
        let (status, response) = post(&app, "/v1/responses", body).await;
        assert_eq!((status, &response["model"]), (StatusCode::OK, &json!(model)), "{response}");
        let slots = slots_since(seen);
        assert!(slots.len() == 1 && (slots[0] > 0) == on_adapter, "/v1/responses as {model}: slots {slots:?}");

        let seen = shard.steps().len();
        let body = json!({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]});
        let (status, message) = post(&app, "/v1/messages", body).await;
        assert_eq!((status, &message["model"]), (StatusCode::OK, &json!(model)), "{message}");
        let slots = slots_since(seen);
        assert!(slots.len() == 1 && (slots[0] > 0) == on_adapter, "/v1/messages as {model}: slots {slots:?}");
    }
    let body = json!({"model": "sqll", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]});
    let (status, error) = post(&app, "/v1/messages", body).await;
    assert_eq!((status, &error["error"]["type"]), (StatusCode::NOT_FOUND, &json!("not_found_error")), "{error}");
    let (status, error) = post(&app, "/v1/responses", json!({"model": "sqll", "input": "Hello"})).await;
    assert_eq!((status, &error["error"]["code"]), (StatusCode::NOT_FOUND, &json!("model_not_found")), "{error}");
}

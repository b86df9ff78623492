//! Structured output and tool calling through the handlers: the fake shard
//! picks its tokens among those the request's llguidance matcher allows (as
//! a real shard masks them), so every output here is valid by construction
//! of the grammar, whatever it would rather write.

use std::sync::Arc;

use serde_json::{json, Value};

use super::{build_with_shard, call, post, sse_payloads, Setup};
use crate::detokenize::tests::byte_fallback_tokenizer;
use crate::grammar::GrammarCompiler;
use crate::validation::RequestLimits;
use axum::http::StatusCode;

/// Byte-level tokens: a tool listing in the system prompt is ~600 of them.
pub(super) fn setup() -> Setup {
    let mut setup = Setup::default();
    setup.fake.grammar = Some(Arc::new(GrammarCompiler::new(&byte_fallback_tokenizer(), 267, &[2]).unwrap()));
    setup.fake.num_blocks = 1024;
    setup.limits = Some(RequestLimits {
        max_input_tokens: 2048,
        max_total_tokens: 2200,
        max_stop_sequences: 4,
        max_top_n_tokens: 5,
        max_n: 4,
        max_client_batch_size: 3,
        max_sequences: 8,
    });
    setup
}

const SCHEMA: &str = r#"{
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"},
                   "color": {"enum": ["red", "blue"]}},
    "required": ["name", "n", "color"], "additionalProperties": false
}"#;

fn schema() -> Value {
    serde_json::from_str(SCHEMA).unwrap()
}

/// Checks `text` against SCHEMA by hand (no JSON-schema validator here).
fn assert_valid(text: &str) {
    let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let object = value.as_object().unwrap_or_else(|| panic!("{text}"));
    assert_eq!(object.len(), 3, "{text}");
    assert!(object["name"].as_str().is_some_and(|s| s.chars().count() <= 8), "{text}");
    assert!(object["n"].is_i64() || object["n"].is_u64(), "{text}");
    assert!(["red", "blue"].contains(&object["color"].as_str().unwrap_or_default()), "{text}");
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 200});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// The streamed chunks' choice-0 deltas.
pub(super) fn deltas(text: &str) -> Vec<Value> {
    sse_payloads(text)
        .iter()
        .filter(|p| p.as_str() != "[DONE]")
        .map(|p| serde_json::from_str::<Value>(p).unwrap())
        .filter_map(|chunk| chunk["choices"].get(0).cloned())
        .collect()
}

#[tokio::test]
async fn json_schema_output_validates_buffered_and_streamed() {
    let (app, _, shard) = build_with_shard(setup());
    let format = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema()}}});
    let (status, response) = post(&app, "/v1/chat/completions", chat(format.clone())).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    let content = choice["message"]["content"].as_str().unwrap().to_string();
    assert_valid(&content);

    let mut body = chat(format);
    body["stream"] = json!(true);
    let (status, _, text) = call(&app, "POST", "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let streamed: String = deltas(&text).iter().filter_map(|d| d["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, content);

    // The shard got the compiled grammar with the request; an unconstrained
    // request carries none.
    post(&app, "/v1/chat/completions", chat(json!({}))).await;
    let grammars: Vec<bool> =
        shard.steps().iter().flat_map(|s| s.new_requests.iter().map(|r| !r.grammar.is_empty())).collect();
    assert_eq!(grammars, [true, true, false]);
}

#[tokio::test]
async fn regex_choice_grammar_and_json_object_on_completions() {
    let (app, _, _) = build_with_shard(setup());
    let complete = |extra: Value| {
        let mut body = json!({"prompt": "Hello", "max_tokens": 100, "temperature": 1.0, "seed": 7, "n": 3});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let texts = |response: &Value| -> Vec<String> {
        response["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_string()).collect()
    };
    let (status, response) = post(&app, "/v1/completions", complete(json!({"guided_regex": "[ab]{2}-[0-9]{3}"}))).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    for text in texts(&response) {
        let b = text.as_bytes();
        assert!(b.len() == 6 && b[..2].iter().all(|c| b"ab".contains(c)) && b[2] == b'-', "{text}");
        assert!(b[3..].iter().all(u8::is_ascii_digit), "{text}");
    }
    let (_, response) = post(&app, "/v1/completions", complete(json!({"guided_choice": ["yes", "no way"]}))).await;
    assert!(texts(&response).iter().all(|t| t == "yes" || t == "no way"), "{response}");
    let gbnf = json!({"guided_grammar": "root ::= \"x\" (\"y\" | \"z\")"});
    let (_, response) = post(&app, "/v1/completions", complete(gbnf)).await;
    assert!(texts(&response).iter().all(|t| t == "xy" || t == "xz"), "{response}");
    let (_, response) = post(&app, "/v1/completions", complete(json!({"response_format": {"type": "json_object"}}))).await;
    for text in texts(&response) {
        assert!(serde_json::from_str::<Value>(&text).is_ok_and(|v| v.is_object()), "{text}");
    }
    let (_, response) = post(&app, "/v1/completions", complete(json!({"structured_outputs": {"json": schema()}}))).await;
    texts(&response).iter().for_each(|t| assert_valid(t));
}

#[tokio::test]
async fn tgi_grammar_on_generate_and_generate_stream() {
    let (app, _, _) = build_with_shard(setup());
    let grammar = json!({"type": "regex", "value": "[0-9]{4}-[0-9]{2}"});
    let body = json!({"inputs": "Hello", "parameters": {"max_new_tokens": 20, "grammar": grammar}});
    let (status, response) = post(&app, "/generate", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let text = response["generated_text"].as_str().unwrap();
    assert!(text.len() == 7 && text.as_bytes()[4] == b'-', "{text}");
    let (_, _, stream) = call(&app, "POST", "/generate_stream", Some(body)).await;
    let last: Value = serde_json::from_str(sse_payloads(&stream).last().unwrap()).unwrap();
    assert_eq!(last["generated_text"].as_str().unwrap(), text);

    let schema = json!({"type": "json", "value": schema()});
    let body = json!({"inputs": "Hello", "parameters": {"max_new_tokens": 100, "grammar": schema}});
    let (_, response) = post(&app, "/generate", body).await;
    assert_valid(response["generated_text"].as_str().unwrap());
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": schema()}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
    ])
}

/// (name, arguments) of a message's tool calls, each checked.
fn calls(message: &Value) -> Vec<(String, String)> {
    let calls = message["tool_calls"].as_array().unwrap_or_else(|| panic!("no calls: {message}"));
    let mut ids: Vec<&str> = calls.iter().map(|c| c["id"].as_str().unwrap()).collect();
    ids.dedup();
    assert_eq!(ids.len(), calls.len(), "{message}");
    calls
        .iter()
        .map(|c| {
            assert_eq!(c["type"], "function");
            let name = c["function"]["name"].as_str().unwrap().to_string();
            let arguments = c["function"]["arguments"].as_str().unwrap().to_string();
            match name.as_str() {
                "get_weather" => assert_valid(&arguments),
                "now" => assert!(serde_json::from_str::<Value>(&arguments).unwrap().is_object()),
                other => panic!("undeclared {other}"),
            }
            (name, arguments)
        })
        .collect()
}

#[tokio::test]
async fn tool_choices_required_named_and_none() {
    let (app, _, _) = build_with_shard(setup());
    let (status, response) = post(&app, "/v1/chat/completions", chat(json!({"tools": tools(), "tool_choice": "required"}))).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{response}");
    assert!(!calls(&choice["message"]).is_empty());
    assert!(choice["message"]["content"].is_null(), "{response}");

    let named = json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let (_, response) = post(&app, "/v1/chat/completions", chat(named)).await;
    let got = calls(&response["choices"][0]["message"]);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, "get_weather");

    let (_, response) = post(&app, "/v1/chat/completions", chat(json!({"tools": tools(), "tool_choice": "none"}))).await;
    let message = &response["choices"][0]["message"];
    assert!(message.get("tool_calls").is_none() && message["content"].is_string(), "{response}");
    assert_ne!(response["choices"][0]["finish_reason"], "tool_calls");

    let single = json!({"tools": tools(), "tool_choice": "required", "parallel_tool_calls": false});
    let (_, response) = post(&app, "/v1/chat/completions", chat(single)).await;
    assert_eq!(calls(&response["choices"][0]["message"]).len(), 1);
}

#[tokio::test]
async fn streamed_tool_calls_send_id_and_name_first_then_arguments() {
    let (app, _, _) = build_with_shard(setup());
    let body = chat(json!({"tools": tools(), "tool_choice": "required"}));
    let (_, whole) = post(&app, "/v1/chat/completions", body.clone()).await;
    let expected = calls(&whole["choices"][0]["message"]);

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (status, _, text) = call(&app, "POST", "/v1/chat/completions", Some(streamed)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let mut got: Vec<(String, String)> = Vec::new();
    let mut finish = None;
    for delta in deltas(&text) {
        finish = delta["finish_reason"].as_str().map(str::to_string).or(finish);
        for piece in delta["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let index = piece["index"].as_u64().unwrap() as usize;
            if index == got.len() {
                assert!(piece["id"].is_string() && piece["type"] == "function", "{piece}");
                got.push((piece["function"]["name"].as_str().unwrap().to_string(), String::new()));
            } else {
                assert!(piece.get("id").is_none() && piece["function"].get("name").is_none(), "{piece}");
            }
            got[index].1.push_str(piece["function"]["arguments"].as_str().unwrap());
        }
    }
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(got, expected);
}

#[tokio::test]
async fn tool_results_go_back_into_the_prompt() {
    let (app, state, shard) = build_with_shard(setup());
    let messages = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]);
    let body = json!({"messages": messages, "tools": tools(), "max_tokens": 5});
    let (status, response) = post(&app, "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let prompt = &shard.steps()[0].new_requests[0].token_ids;
    let prompt = state.validation.tokenizer.decode(prompt, false).unwrap();
    assert!(prompt.contains("You can call these functions"), "{prompt}");
    assert!(prompt.contains("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\ntool: noon"), "{prompt}");
}

#[tokio::test]
async fn bad_constraints_and_tools_are_400s_that_never_reach_the_shard() {
    let (app, _, shard) = build_with_shard(setup());
    let cases = [
        ("/v1/chat/completions", chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})), "response_format.json_schema.schema"),
        ("/v1/chat/completions", chat(json!({"response_format": {"type": "yaml"}})), "response_format.type"),
        ("/v1/completions", json!({"prompt": "a", "guided_regex": "[a-"}), "guided_regex"),
        ("/v1/completions", json!({"prompt": "a", "guided_grammar": "start: missing"}), "guided_grammar"),
        ("/v1/completions", json!({"prompt": "a", "guided_choice": []}), "guided_choice"),
        ("/v1/completions", json!({"prompt": "a", "guided_json": {"type": "object"}, "guided_regex": "a"}), "guided_regex"),
        ("/v1/chat/completions", chat(json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]})), "tools[0].function.parameters"),
        ("/v1/chat/completions", chat(json!({"tools": [{"type": "function", "function": {"name": "a b"}}]})), "tools[0].function.name"),
        ("/v1/chat/completions", chat(json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}})), "tool_choice.function.name"),
        ("/v1/chat/completions", chat(json!({"tool_choice": "required"})), "tools"),
        ("/v1/chat/completions", chat(json!({"tools": tools(), "tool_choice": "sometimes"})), "tool_choice"),
        ("/v1/chat/completions", chat(json!({"tools": tools(), "response_format": {"type": "json_object"}})), "response_format"),
    ];
    for (path, body, param) in cases {
        let (status, response) = post(&app, path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{param}: {response}");
        assert_eq!(response["error"]["param"], param, "{response}");
    }
    let body = json!({"inputs": "a", "parameters": {"grammar": {"type": "regex", "value": "(a"}}});
    let (status, response) = post(&app, "/generate", body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{response}");
    assert_eq!(response["error_type"], "validation");
    assert!(shard.steps().is_empty());
}

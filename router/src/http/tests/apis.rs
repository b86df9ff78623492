//! The Responses and Anthropic APIs and /detokenize through the handlers,
//! over the fake shard (with its llguidance matcher, so tool calls are
//! valid by construction), and their item and block builders on the exact
//! pieces a reasoning model's answer makes.

use axum::http::StatusCode;
use serde_json::{json, Value};

use super::structured::setup;
use super::{build, build_with_shard, call, post, Setup};
use crate::http::anthropic::blocks::BlockBuilder;
use crate::http::answer::Piece;
use crate::http::responses::items::OutputBuilder;
use crate::http::responses::types::OutputItem;

/// The (event name, JSON data) frames of a named-event SSE body.
pub(super) fn named_events(text: &str) -> Vec<(String, Value)> {
    text.split_terminator("\n\n")
        .map(|frame| {
            let (event, data) = frame.split_once('\n').unwrap_or_else(|| panic!("bad frame {frame:?}"));
            let name = event.strip_prefix("event: ").unwrap_or_else(|| panic!("no event name in {frame:?}"));
            let data = data.strip_prefix("data: ").unwrap_or_else(|| panic!("no data in {frame:?}"));
            (name.to_string(), serde_json::from_str(data).unwrap())
        })
        .collect()
}

fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_string()))
        .collect()
}

#[tokio::test]
async fn a_response_buffered_and_streamed_agree() {
    let (app, _) = build(setup());
    let body = json!({"model": "tiny", "input": "Hello", "max_output_tokens": 5, "temperature": 0});
    let (status, response) = post(&app, "/v1/responses", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_eq!((response["object"].as_str(), response["status"].as_str()), (Some("response"), Some("incomplete")));
    assert_eq!(response["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(response["usage"]["output_tokens"], 5);

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (status, headers, text) = call(&app, "POST", "/v1/responses", Some(streamed)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(headers["content-type"], "text/event-stream");
    let events = named_events(&text);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..4], ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]);
    assert_eq!(names[names.len() - 4..], ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]);
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!((data["type"].as_str(), data["sequence_number"].as_u64()), (Some(name.as_str()), Some(i as u64)));
    }
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    let last = &events.last().unwrap().1["response"];
    assert_eq!(deltas, output_text(last));
    assert_eq!(output_text(last), output_text(&response), "greedy: the same text both ways");
}

#[tokio::test]
async fn stored_responses_chain_and_go() {
    let (app, _) = build(setup());
    let (_, first) = post(&app, "/v1/responses", json!({"input": "Hi", "max_output_tokens": 2, "temperature": 0})).await;
    let id = first["id"].as_str().unwrap();
    let (status, _, got) = call(&app, "GET", &format!("/v1/responses/{id}"), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(serde_json::from_str::<Value>(&got).unwrap()["id"], id);
    let follow = json!({"input": "Again", "max_output_tokens": 2, "temperature": 0, "previous_response_id": id});
    let (status, second) = post(&app, "/v1/responses", follow.clone()).await;
    assert_eq!(status, StatusCode::OK, "{second}");
    assert!(second["usage"]["input_tokens"].as_u64() > first["usage"]["input_tokens"].as_u64(), "{second}");
    let (status, _, deleted) = call(&app, "DELETE", &format!("/v1/responses/{id}"), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(serde_json::from_str::<Value>(&deleted).unwrap()["deleted"], true);
    let (status, gone) = post(&app, "/v1/responses", follow).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{gone}");
    assert_eq!(gone["error"]["param"], "previous_response_id");
    let (status, _, _) = call(&app, "GET", &format!("/v1/responses/{id}"), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // Not a background response: cancel is a 400.
    let second_id = second["id"].as_str().unwrap();
    let (status, _, _) = call(&app, "POST", &format!("/v1/responses/{second_id}/cancel"), None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

const WEATHER: &str = r#"{"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"], "additionalProperties": false}"#;

#[tokio::test]
async fn a_response_calls_a_function_and_streams_its_arguments() {
    let (app, _, _) = build_with_shard(setup());
    let weather: Value = serde_json::from_str(WEATHER).unwrap();
    let body = json!({
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": weather}],
        "tool_choice": "required", "parallel_tool_calls": false, "max_output_tokens": 200,
    });
    let (status, response) = post(&app, "/v1/responses", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let call_item = &response["output"][0];
    assert_eq!((call_item["type"].as_str(), call_item["name"].as_str()), (Some("function_call"), Some("get_weather")));
    let arguments: Value = serde_json::from_str(call_item["arguments"].as_str().unwrap()).unwrap();
    assert!(arguments["city"].is_string(), "{arguments}");

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (_, _, text) = call(&app, "POST", "/v1/responses", Some(streamed)).await;
    let events = named_events(&text);
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    let done = events.iter().find(|(n, _)| n == "response.function_call_arguments.done").unwrap();
    assert_eq!(done.1["arguments"].as_str().unwrap(), deltas);

    // Its result goes back as a function_call_output item.
    let call_id = call_item["call_id"].as_str().unwrap();
    let round = json!({"input": [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": call_item["arguments"]},
        {"type": "function_call_output", "call_id": call_id, "output": "sunny"},
    ], "max_output_tokens": 3});
    let (status, answer) = post(&app, "/v1/responses", round).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
}

#[tokio::test]
async fn responses_refuse_what_they_do_not_honour() {
    let (app, _) = build(setup());
    for (body, param) in [
        (json!({"input": "x", "frobnicate": true}), "frobnicate"),
        (json!({"input": ""}), "input"),
        (json!({"input": [{"type": "item_reference", "id": "x"}]}), "input[0].type"),
        (json!({"input": [{"role": "user", "content": "x", "extra": 1}]}), "input[0].extra"),
        (json!({"input": "x", "truncation": "auto"}), "truncation"),
        (json!({"input": "x", "text": {"format": {"type": "yaml"}}}), "text.format.type"),
        (json!({"input": "x", "tools": [{"type": "function", "name": "a b"}]}), "tools[0].name"),
        (json!({"input": "x", "background": true, "store": false}), "background"),
    ] {
        let (status, error) = post(&app, "/v1/responses", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {error}");
        assert_eq!(error["error"]["param"], param, "{body}: {error}");
    }
}

#[tokio::test]
async fn a_message_buffered_and_streamed_agree() {
    let (app, _) = build(setup());
    let body = json!({"model": "tiny", "max_tokens": 5, "temperature": 0, "system": [{"type": "text", "text": "Be brief"}],
                      "messages": [{"role": "user", "content": "Hello"}]});
    let (status, message) = post(&app, "/v1/messages", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{message}");
    assert_eq!((message["type"].as_str(), message["stop_reason"].as_str()), (Some("message"), Some("max_tokens")));
    assert_eq!(message["usage"]["output_tokens"], 5);

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (status, _, text) = call(&app, "POST", "/v1/messages", Some(streamed)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let events = named_events(&text);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "ping", "content_block_start"]);
    assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    let streamed_text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed_text, message["content"][0]["text"].as_str().unwrap());
    let delta = &events[events.len() - 2].1;
    assert_eq!((delta["delta"]["stop_reason"].as_str(), delta["usage"]["output_tokens"].as_u64()), (Some("max_tokens"), Some(5)));

    let (status, counted) = post(&app, "/v1/messages/count_tokens", json!({"model": "tiny", "system": "Be brief",
        "messages": [{"role": "user", "content": "Hello"}]})).await;
    assert_eq!(status, StatusCode::OK, "{counted}");
    assert_eq!(counted["input_tokens"], message["usage"]["input_tokens"]);
}

#[tokio::test]
async fn a_message_uses_a_tool_and_takes_its_result() {
    let (app, _, _) = build_with_shard(setup());
    let weather: Value = serde_json::from_str(WEATHER).unwrap();
    let tools = json!([{"name": "get_weather", "description": "Weather", "input_schema": weather}]);
    let ask = json!([{"role": "user", "content": "Weather?"}]);
    let body = json!({"model": "tiny", "max_tokens": 200, "tools": tools, "messages": ask,
                      "tool_choice": {"type": "tool", "name": "get_weather"}});
    let (status, message) = post(&app, "/v1/messages", body).await;
    assert_eq!(status, StatusCode::OK, "{message}");
    assert_eq!(message["stop_reason"], "tool_use");
    let tool_use = message["content"].as_array().unwrap().iter().find(|b| b["type"] == "tool_use").unwrap().clone();
    assert!(tool_use["input"]["city"].is_string(), "{tool_use}");
    let history = json!([
        ask[0],
        {"role": "assistant", "content": [tool_use.clone()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"], "content": [{"type": "text", "text": "sunny"}]}]},
    ]);
    let (status, answer) = post(&app, "/v1/messages", json!({"model": "tiny", "max_tokens": 3, "messages": history, "tools": tools})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
}

#[tokio::test]
async fn messages_errors_are_anthropic_shaped() {
    let (app, _) = build(setup());
    for (body, status, words) in [
        (json!({"model": "tiny", "max_tokens": 5, "messages": [], "x": 1}), StatusCode::BAD_REQUEST, "x"),
        (json!({"model": "tiny", "max_tokens": 5, "messages": []}), StatusCode::BAD_REQUEST, "messages"),
        (json!({"model": "gpt", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}), StatusCode::NOT_FOUND, "gpt"),
        (json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": 5}]}), StatusCode::BAD_REQUEST, "messages[0].content"),
        (json!({"model": "tiny", "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 2000},
                "messages": [{"role": "user", "content": "x"}]}), StatusCode::BAD_REQUEST, "--reasoning-parser"),
    ] {
        let (got, error) = post(&app, "/v1/messages", body.clone()).await;
        assert_eq!(got, status, "{body}: {error}");
        assert_eq!(error["type"], "error", "{error}");
        assert!(error["error"]["message"].as_str().unwrap().contains(words), "{body}: {error}");
        let kind = error["error"]["type"].as_str().unwrap();
        assert_eq!(kind, if status == StatusCode::NOT_FOUND { "not_found_error" } else { "invalid_request_error" });
    }
}

#[tokio::test]
async fn x_api_key_is_a_key_and_refusals_take_each_apis_shape() {
    let (app, _) = build(Setup { api_key: Some("k".into()), ..setup() });
    let message = json!({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]});
    let request = |key: (&str, &str)| {
        axum::http::Request::builder()
            .method("POST")
            .uri("/v1/messages")
            .header("content-type", "application/json")
            .header(key.0, key.1)
            .body(axum::body::Body::from(message.to_string()))
            .unwrap()
    };
    use tower::ServiceExt;
    assert_eq!(app.clone().oneshot(request(("x-api-key", "k"))).await.unwrap().status(), StatusCode::OK);
    assert_eq!(app.clone().oneshot(request(("authorization", "Bearer k"))).await.unwrap().status(), StatusCode::OK);
    let denied = app.clone().oneshot(request(("x-api-key", "nope"))).await.unwrap();
    assert_eq!(denied.status(), StatusCode::UNAUTHORIZED);
    let body: Value = serde_json::from_slice(&axum::body::to_bytes(denied.into_body(), 1 << 16).await.unwrap()).unwrap();
    assert_eq!((body["type"].as_str(), body["error"]["type"].as_str()), (Some("error"), Some("authentication_error")));
    let (status, _, text) = call(&app, "POST", "/v1/responses", Some(json!({"input": "x"}))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(serde_json::from_str::<Value>(&text).unwrap()["error"]["message"].is_string());
}

#[tokio::test]
async fn detokenize_inverts_token_ids() {
    let (app, _) = build(setup());
    // Byte tokens are 3 + byte in the test tokenizer.
    let ids: Vec<u32> = "Hi there".bytes().map(|b| 3 + u32::from(b)).collect();
    let (status, response) = post(&app, "/detokenize", json!({"tokens": ids})).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_eq!(response["prompt"], "Hi there");
    let (status, error) = post(&app, "/detokenize", json!({"tokens": [5, 267]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
    assert_eq!(error["error"]["param"], "tokens");
    let (status, error) = post(&app, "/detokenize", json!({"tokens": [5], "prompt": "x"})).await;
    assert_eq!((status, error["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("prompt")));
}

/// The pieces of "<think>\nhm\n</think>\n\nIt is <tool_call>...": thinking,
/// text, then a call.
fn thinking_then_call() -> Vec<Piece> {
    vec![
        Piece::Reasoning("hm".into()),
        Piece::Reasoning(", sunny?".into()),
        Piece::Content("Checking.".into()),
        Piece::CallStart { index: 0, id: "call_1".into(), name: "get_weather".into() },
        Piece::CallArguments { index: 0, fragment: "{\"city\": ".into() },
        Piece::CallArguments { index: 0, fragment: "\"Paris\"}".into() },
    ]
}

#[test]
fn responses_items_follow_the_pieces() {
    let mut builder = OutputBuilder::new("resp_x".into());
    let mut events = Vec::new();
    for piece in thinking_then_call() {
        events.extend(builder.push(piece));
    }
    events.extend(builder.close());
    let items = builder.items();
    assert!(matches!(&items[0], OutputItem::Reasoning { content, .. } if content[0].text == "hm, sunny?"));
    assert!(matches!(&items[1], OutputItem::Message { content, .. } if content[0].text == "Checking."));
    assert!(matches!(&items[2], OutputItem::FunctionCall { arguments, name, .. }
        if arguments == "{\"city\": \"Paris\"}" && name == "get_weather"));
    // reasoning: added, part added, 2 deltas, done, part done, item done;
    // message: the same with 1 delta; call: added, 2 deltas, done, item done.
    assert_eq!(events.len(), 7 + 6 + 5);
    let message = builder.message().unwrap();
    assert_eq!((message.reasoning_content.as_deref(), message.content.as_str()), (Some("hm, sunny?"), "Checking."));
    assert_eq!(message.tool_calls.unwrap()[0]["function"]["arguments"]["city"], "Paris");
}

#[test]
fn anthropic_blocks_follow_the_pieces() {
    let mut builder = BlockBuilder::default();
    let mut events = 0;
    for piece in thinking_then_call() {
        events += builder.push(piece).len();
    }
    events += builder.close().len();
    let blocks = serde_json::to_value(builder.blocks()).unwrap();
    assert_eq!(blocks, json!([
        {"type": "thinking", "thinking": "hm, sunny?", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]));
    // Per block: start, its deltas, stop.
    assert_eq!(events, (1 + 2 + 1) + (1 + 1 + 1) + (1 + 2 + 1));
}

#[tokio::test]
async fn reasoning_models_get_their_constraint_after_the_block() {
    let mut s = setup();
    s.reasoning = Some(crate::reasoning::ReasoningParserKind::Qwen3);
    let (app, _, shard) = build_with_shard(s);
    let body = json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40,
                      "response_format": {"type": "json_object"}});
    let (status, response) = post(&app, "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let grammar = &shard.steps()[0].new_requests[0].grammar;
    assert!(grammar.contains("think[lazy]") && grammar.contains("@answer"), "{grammar}");
    // The fake shard opens the block (the grammar allows it first) and
    // never closes it: all is thinking, nothing answer, every token counted.
    let choice = &response["choices"][0];
    let (content, reasoning) = (choice["message"]["content"].as_str().unwrap(), choice["message"]["reasoning_content"].as_str());
    match reasoning {
        Some(reasoning) => {
            assert!(content.is_empty() && !reasoning.contains("<think>"), "{response}");
            assert_eq!(response["usage"]["completion_tokens_details"]["reasoning_tokens"], response["usage"]["completion_tokens"]);
        }
        None => assert!(serde_json::from_str::<Value>(content).is_ok_and(|v| v.is_object()), "{response}"),
    }
    // enable_thinking=false (a template that closes the block in the
    // prompt) leaves the constraint alone.
    let closed = json!({"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "<think></think>"}],
                        "max_tokens": 40, "response_format": {"type": "json_object"}});
    let (status, response) = post(&app, "/v1/chat/completions", closed).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let grammars: Vec<String> =
        shard.steps().iter().flat_map(|s| s.new_requests.iter().map(|r| r.grammar.to_string())).collect();
    let last = grammars.last().unwrap();
    assert!(!last.is_empty() && !last.contains("think[lazy]"), "{last}");
}

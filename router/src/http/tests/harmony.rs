//! gpt-oss through every chat API: the fake shard writes the exact harmony
//! output a gpt-oss model would (special tokens and all), and each API must
//! show its analysis channel as reasoning, its commentary calls as tool
//! calls and its final channel as content; the tools' grammar and a
//! response format reach the shard as harmony messages.

use axum::http::StatusCode;
use serde_json::{json, Value};

use super::apis::named_events;
use super::structured::deltas;
use super::{build_with_shard, call, post, Setup};
use crate::harmony::tests::{token_ids, VOCAB};
use crate::harmony::{CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START};
use crate::reasoning::ReasoningParserKind;

const THOUGHT: &str = "The user asks 2+2.";
const ANSWER: &str = "2 + 2 = 4.";

/// Analysis, then the final answer.
fn answer() -> Vec<u32> {
    token_ids(&[CHANNEL, "analysis", MESSAGE, THOUGHT, END, START, "assistant", CHANNEL, "final", MESSAGE, ANSWER, RETURN])
}

/// Analysis, then a call of get_weather.
fn weather_call() -> Vec<u32> {
    token_ids(&[
        CHANNEL, "analysis", MESSAGE, "Need the weather.", END,
        START, "assistant", CHANNEL, "commentary to=functions.get_weather ", CONSTRAIN, "json", MESSAGE,
        "{\"city\": \"Paris\"}", CALL,
    ])
}

/// Tokens of the analysis message in both outputs' first message: its
/// header, text and `<|end|>`.
fn analysis_tokens(text: &str) -> usize {
    token_ids(&[CHANNEL, "analysis", MESSAGE, text, END]).len()
}

/// The structured-output tests' room for long prompts; the shard replays `script`.
fn setup(script: Vec<u32>) -> Setup {
    let mut setup = super::structured::setup();
    setup.reasoning = Some(ReasoningParserKind::GptOss);
    setup.fake.vocab_size = VOCAB;
    // The script is the output: no grammar picks the tokens.
    setup.fake.grammar = None;
    setup.fake.script = script;
    setup
}

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

fn ask(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 100});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test]
async fn chat_splits_analysis_from_the_final_channel_buffered_and_streamed() {
    let (app, _, _) = build_with_shard(setup(answer()));
    let (status, response) = post(&app, "/v1/chat/completions", ask(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["message"]["reasoning_content"], THOUGHT, "{response}");
    assert_eq!(choice["message"]["content"], ANSWER, "{response}");
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(response["usage"]["completion_tokens_details"]["reasoning_tokens"], analysis_tokens(THOUGHT));

    let (status, _, text) = call(&app, "POST", "/v1/chat/completions", Some(ask(json!({"stream": true})))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let deltas = deltas(&text);
    let streamed = |field: &str| -> String { deltas.iter().filter_map(|d| d["delta"][field].as_str()).collect() };
    assert_eq!((streamed("reasoning_content"), streamed("content")), (THOUGHT.to_string(), ANSWER.to_string()));
    // The answer streams: more than one delta carries it.
    assert!(deltas.iter().filter(|d| d["delta"]["content"].as_str().is_some_and(|c| !c.is_empty())).count() > 1);

    let (_, hidden) = post(&app, "/v1/chat/completions", ask(json!({"include_reasoning": false}))).await;
    let message = &hidden["choices"][0]["message"];
    assert!(message["reasoning_content"].is_null() && message["content"] == ANSWER, "{hidden}");
}

#[tokio::test]
async fn info_names_the_parser() {
    let (app, _, _) = build_with_shard(setup(answer()));
    let (status, _, text) = call(&app, "GET", "/info", None).await;
    assert_eq!(status, StatusCode::OK);
    let info: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(info["reasoning_parser"], "gpt_oss", "{info}");
}

#[tokio::test]
async fn a_commentary_call_is_a_tool_call_in_chat() {
    let (app, _, _) = build_with_shard(setup(weather_call()));
    let body = ask(json!({"tools": weather_tools()}));
    let (status, response) = post(&app, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{response}");
    assert_eq!(choice["message"]["reasoning_content"], "Need the weather.");
    assert!(choice["message"]["content"].is_null(), "{response}");
    let called = &choice["message"]["tool_calls"][0];
    assert_eq!(called["function"]["name"], "get_weather");
    assert_eq!(called["function"]["arguments"], "{\"city\":\"Paris\"}");

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (_, _, text) = call(&app, "POST", "/v1/chat/completions", Some(streamed)).await;
    let deltas = deltas(&text);
    let calls: Vec<&Value> = deltas.iter().filter_map(|d| d["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    let arguments: String = calls.iter().filter_map(|c| c["function"]["arguments"].as_str()).collect();
    assert_eq!(serde_json::from_str::<Value>(&arguments).unwrap(), json!({"city": "Paris"}));
    assert_eq!(deltas.last().unwrap()["finish_reason"], "tool_calls");

    // The call goes back with its result; the template renders the history.
    let history = json!({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [called]},
        {"role": "tool", "tool_call_id": called["id"], "content": "sunny"},
    ], "tools": weather_tools(), "max_tokens": 100});
    let (status, again) = post(&app, "/v1/chat/completions", history).await;
    assert_eq!(status, StatusCode::OK, "{again}");
}

#[tokio::test]
async fn responses_and_messages_read_the_channels_too() {
    let (app, _, _) = build_with_shard(setup(weather_call()));
    let body = json!({"input": "Weather in Paris?", "max_output_tokens": 100,
                      "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]});
    let (status, response) = post(&app, "/v1/responses", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let items = response["output"].as_array().unwrap();
    let kinds: Vec<&str> = items.iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["reasoning", "function_call"], "{response}");
    assert_eq!(items[0]["content"][0]["text"], "Need the weather.");
    assert_eq!(items[1]["name"], "get_weather");
    // The item's arguments are its streamed deltas joined: as the model wrote them.
    assert_eq!(serde_json::from_str::<Value>(items[1]["arguments"].as_str().unwrap()).unwrap(), json!({"city": "Paris"}));
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (_, _, text) = call(&app, "POST", "/v1/responses", Some(streamed)).await;
    let events = named_events(&text);
    assert!(events.iter().any(|(n, _)| n == "response.reasoning_text.delta"), "{text}");
    assert!(events.iter().any(|(n, _)| n == "response.function_call_arguments.done"), "{text}");

    let tools = json!([{"name": "get_weather", "input_schema": {"type": "object"}}]);
    let message = json!({"model": "tiny", "max_tokens": 100, "tools": tools,
                         "messages": [{"role": "user", "content": "Weather?"}]});
    let (status, answer) = post(&app, "/v1/messages", message).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["stop_reason"], "tool_use", "{answer}");
    let blocks = answer["content"].as_array().unwrap();
    assert_eq!((blocks[0]["type"].as_str(), blocks[0]["thinking"].as_str()), (Some("thinking"), Some("Need the weather.")));
    assert_eq!((blocks[1]["type"].as_str(), &blocks[1]["input"]), (Some("tool_use"), &json!({"city": "Paris"})));
}

#[tokio::test]
async fn messages_answer_in_a_text_block() {
    let (app, _, _) = build_with_shard(setup(answer()));
    let message = json!({"model": "tiny", "max_tokens": 100, "messages": [{"role": "user", "content": "2+2?"}]});
    let (status, answer) = post(&app, "/v1/messages", message).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["content"], json!([
        {"type": "thinking", "thinking": THOUGHT, "signature": ""},
        {"type": "text", "text": ANSWER},
    ]));
    assert_eq!(answer["stop_reason"], "end_turn");
}

#[tokio::test]
async fn named_calls_and_response_formats_reach_the_shard_as_harmony_grammars() {
    let (app, _, shard) = build_with_shard(setup(weather_call()));
    let named = ask(json!({"tools": weather_tools(), "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}));
    let (status, response) = post(&app, "/v1/chat/completions", named).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let (status, response) = post(&app, "/v1/chat/completions", ask(json!({"response_format": {"type": "json_object"}}))).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let (_, auto) = post(&app, "/v1/chat/completions", ask(json!({"tools": weather_tools()}))).await;
    assert_eq!(auto["choices"][0]["finish_reason"], "tool_calls");
    let grammars: Vec<String> =
        shard.steps().iter().flat_map(|s| s.new_requests.iter().map(|r| r.grammar.to_string())).collect();
    let [call, format, auto] = grammars.as_slice() else { panic!("{grammars:?}") };
    assert!(call.contains("commentary to=functions.get_weather ") && call.contains("<[271]>"), "{call}");
    assert!(format.contains("final") && format.contains("@answer") && !format.contains("think[lazy]"), "{format}");
    assert!(auto.is_empty(), "auto leaves the model to choose: {auto}");
}

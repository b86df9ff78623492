use super::stream::{ToolCallParser, ToolEvent};
use super::*;
use crate::detokenize::tests::byte_fallback_tokenizer;
use crate::grammar::GrammarCompiler;

fn format(kind: ToolParserKind) -> ToolFormat {
    ToolFormat::new(kind, &byte_fallback_tokenizer())
}

fn tools() -> Vec<FunctionDefinition> {
    vec![
        FunctionDefinition {
            name: "get_weather".into(),
            description: Some("Weather in a city".into()),
            parameters: Some(json!({
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            })),
            strict: None,
        },
        FunctionDefinition { name: "now".into(), description: None, parameters: None, strict: None },
    ]
}

/// Feeds `text` in pieces of `size` characters; returns (content, calls as
/// (name, arguments), every event).
fn parse(format: ToolFormat, text: &str, size: usize) -> (String, Vec<(String, String)>, Vec<ToolEvent>) {
    let mut parser = ToolCallParser::new(format);
    let chars: Vec<char> = text.chars().collect();
    let mut events = Vec::new();
    for piece in chars.chunks(size) {
        events.extend(parser.push(0, &piece.iter().collect::<String>()));
    }
    events.extend(parser.finish());
    let mut content = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    for event in &events {
        match event {
            ToolEvent::Content(text) => content.push_str(text),
            ToolEvent::Start { index, name, .. } => {
                assert_eq!(*index, calls.len(), "calls start in order");
                calls.push((name.clone(), String::new()));
            }
            ToolEvent::Arguments { index, fragment } => calls[*index].1.push_str(fragment),
        }
    }
    let parsed: Vec<(String, String)> = parser.calls().iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
    assert_eq!(parsed, calls, "events and calls() agree");
    (content, calls, events)
}

/// The same result whether the text comes whole, by character or by three.
fn parse_all_ways(kind: ToolParserKind, text: &str) -> (String, Vec<(String, String)>) {
    let (content, calls, _) = parse(format(kind), text, usize::MAX);
    for size in [1, 3] {
        let (c, k, _) = parse(format(kind), text, size);
        assert_eq!((&c, &k), (&content, &calls), "piece size {size}");
    }
    (content, calls)
}

#[test]
fn every_format_and_choice_compiles() {
    let compiler = GrammarCompiler::new(&byte_fallback_tokenizer(), 267, &[2]).unwrap();
    for kind in [ToolParserKind::Hermes, ToolParserKind::Llama3Json, ToolParserKind::Mistral] {
        let f = format(kind);
        for choice in [ToolChoice::Auto, ToolChoice::Required, ToolChoice::Named("now".into())] {
            for parallel in [true, false] {
                let grammar = f.grammar(&tools(), &choice, parallel).unwrap();
                compiler
                    .compile(&grammar)
                    .unwrap_or_else(|e| panic!("{kind:?} {choice:?} {parallel}: {e}\n{grammar:?}"));
            }
        }
        assert!(f.grammar(&tools(), &ToolChoice::None, true).is_none());
        // The call object is generated in schema order: name, then arguments.
        let Some(Constraint::Lark(lark)) = f.grammar(&tools(), &ToolChoice::Required, true) else { unreachable!() };
        let name = lark.find("\"name\":").unwrap();
        assert!(name < lark.find(&format!("\"{}\":", f.arguments_key)).unwrap(), "{lark}");
    }
    // The token opener (a real Mistral tokenizer's special [TOOL_CALLS]).
    let mut f = format(ToolParserKind::Mistral);
    f.opener = Opener::Token(2);
    compiler.compile(&f.grammar(&tools(), &ToolChoice::Auto, true).unwrap()).unwrap();
}

#[test]
fn hermes_calls_stream_name_first_then_arguments() {
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris \\\"}\\\"\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n";
    let (content, calls) = parse_all_ways(ToolParserKind::Hermes, text);
    assert_eq!(content, "Let me check.\n");
    assert_eq!(
        calls,
        [
            ("get_weather".to_string(), "{\"city\": \"Paris \\\"}\\\"\"}".to_string()),
            ("now".to_string(), "{}".to_string())
        ]
    );
    let (_, _, events) = parse(format(ToolParserKind::Hermes), text, 1);
    let first_call = events.iter().position(|e| matches!(e, ToolEvent::Start { .. })).unwrap();
    assert!(matches!(&events[first_call + 1], ToolEvent::Arguments { index: 0, .. }));
    match &events[first_call] {
        ToolEvent::Start { id, .. } => assert!(id.starts_with("call_") && id.len() == 29, "{id}"),
        _ => unreachable!(),
    }
}

#[test]
fn text_that_only_looks_like_an_opener_is_content() {
    let (content, calls) = parse_all_ways(ToolParserKind::Hermes, "a <tool_cal> b <tool_call");
    assert_eq!(content, "a <tool_cal> b <tool_call");
    assert!(calls.is_empty());
}

#[test]
fn llama3_calls_start_the_output() {
    let text = "{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
    let (content, calls) = parse_all_ways(ToolParserKind::Llama3Json, text);
    assert_eq!(content, "");
    assert_eq!(calls[1], ("get_weather".into(), "{\"city\": \"Oslo\"}".into()));
    let (content, calls) = parse_all_ways(ToolParserKind::Llama3Json, "It is {\"name\": 1}");
    assert_eq!((content.as_str(), calls.len()), ("It is {\"name\": 1}", 0));
}

#[test]
fn mistral_calls_are_a_list_after_the_opener() {
    let text = "[TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]";
    let (content, calls) = parse_all_ways(ToolParserKind::Mistral, text);
    assert_eq!(content, "");
    assert_eq!(calls.len(), 2);
    let mistral_id = format(ToolParserKind::Mistral).new_call_id();
    assert!(mistral_id.len() == 9 && mistral_id.chars().all(|c| c.is_ascii_alphanumeric()));

    // A special-token opener is recognised by id; it decodes to nothing.
    let mut f = format(ToolParserKind::Mistral);
    f.opener = Opener::Token(7);
    let mut parser = ToolCallParser::new(f);
    let mut events = parser.push(5, "Sure.");
    events.extend(parser.push(7, ""));
    events.extend(parser.push(8, "[{\"name\": \"now\", \"arguments\": {}}]"));
    events.extend(parser.finish());
    assert_eq!(events[0], ToolEvent::Content("Sure.".into()));
    assert_eq!(parser.calls()[0].name, "now");
}

#[test]
fn another_layout_is_parsed_whole() {
    let text = "<tool_call>\n{\"arguments\": {\"city\": \"Nice\"}, \"name\": \"get_weather\"}\n</tool_call>";
    let (content, calls) = parse_all_ways(ToolParserKind::Hermes, text);
    assert_eq!(content, "");
    assert_eq!(calls, [("get_weather".to_string(), "{\"city\":\"Nice\"}".to_string())]);
}

#[test]
fn a_truncated_call_keeps_its_start() {
    let (content, calls) = parse_all_ways(ToolParserKind::Hermes, "<tool_call>\n{\"name\": \"now\", \"arguments\": {\"a");
    assert_eq!(content, "");
    assert_eq!(calls, [("now".to_string(), "{\"a".to_string())]);
}

#[test]
fn earlier_calls_render_as_the_model_writes_them() {
    let calls = [("now".to_string(), "{}".to_string()), ("f".to_string(), "{\"x\": 1}".to_string())];
    assert_eq!(
        format(ToolParserKind::Hermes).render_calls(&calls),
        "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>"
    );
    assert_eq!(
        format(ToolParserKind::Llama3Json).render_calls(&calls),
        "{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"f\", \"parameters\": {\"x\": 1}}"
    );
    // What is rendered parses back.
    let (_, parsed) = parse_all_ways(ToolParserKind::Mistral, &format(ToolParserKind::Mistral).render_calls(&calls));
    assert_eq!(parsed, calls);
    let prompt = format(ToolParserKind::Hermes).system_prompt(&tools());
    assert!(prompt.contains("\"name\":\"get_weather\"") && prompt.contains("<tool_call>"), "{prompt}");
}

#[test]
fn the_parser_defaults_from_the_template() {
    assert_eq!(ToolParserKind::from_template("{{ '[TOOL_CALLS]' }}"), ToolParserKind::Mistral);
    assert_eq!(
        ToolParserKind::from_template("<|start_header_id|>{% if tools %}{% endif %}"),
        ToolParserKind::Llama3Json
    );
    assert_eq!(ToolParserKind::from_template("<tool_call>"), ToolParserKind::Hermes);
    assert_eq!(ToolParserKind::from_template("<|im_start|>"), ToolParserKind::Hermes);
}

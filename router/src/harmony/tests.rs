use serde_json::json;

use super::stream::{HarmonyEvent, HarmonyParser};
use super::*;
use crate::grammar::GrammarCompiler;
use crate::tool_calls::stream::ToolEvent;

const SPECIALS: [&str; 7] = [START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL];

/// The vocabulary of [`harmony_tokenizer`]; `<|return|>` and `<|call|>`
/// are its last two ids (gpt-oss's EOS tokens, with `</s>`).
pub(crate) const VOCAB: u32 = 274;
pub(crate) const EOS: [u32; 3] = [2, 272, 273];

/// A harmony chat template: what gpt-oss's writes, without its system
/// preamble and tool namespace.
pub(crate) const TEMPLATE: &str = "{% for m in messages %}<|start|>{{ m.role }}\
{% if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}\
{% if add_generation_prompt %}<|start|>assistant{% endif %}";

/// The detokenizer tests' byte-fallback vocabulary (267 tokens) with
/// harmony's seven special tokens after it (ids 267..274).
pub(crate) fn harmony_tokenizer() -> Tokenizer {
    let mut inner = crate::detokenize::tests::byte_fallback_inner();
    let added: Vec<tokenizers::AddedToken> =
        SPECIALS.iter().map(|t| tokenizers::AddedToken::from(t.to_string(), true)).collect();
    inner.add_special_tokens(&added);
    Tokenizer::new(inner)
}

fn tokens() -> HarmonyTokens {
    HarmonyTokens::new(&harmony_tokenizer()).expect("every harmony token is special")
}

/// The validation tests' validator for a gpt-oss model: harmony's tokens,
/// template and reasoning parser, room for a few hundred byte tokens.
pub(crate) fn validation() -> crate::validation::Validation {
    let tokenizer = harmony_tokenizer();
    let mut v = crate::validation::tests::validation();
    v.chat_template = Some(std::sync::Arc::new(
        crate::chat_template::ChatTemplate::new(TEMPLATE.into(), None, None).unwrap(),
    ));
    v.vocab_size = VOCAB;
    v.grammar = Some(std::sync::Arc::new(GrammarCompiler::new(&tokenizer, VOCAB, &EOS).unwrap()));
    v.reasoning = Some(crate::reasoning::Reasoning::new(crate::reasoning::ReasoningParserKind::GptOss, &tokenizer).unwrap());
    v.tokenizer = tokenizer;
    v
}

/// An output's token ids: special tokens by name, text as byte tokens (3 + byte).
pub(crate) fn token_ids(parts: &[&str]) -> Vec<u32> {
    let t = tokens();
    let ids = [t.start, t.end, t.message, t.channel, t.constrain, t.return_, t.call];
    parts
        .iter()
        .flat_map(|part| match SPECIALS.iter().position(|s| s == part) {
            Some(i) => vec![ids[i]],
            None => part.bytes().map(|b| 3 + u32::from(b)).collect(),
        })
        .collect()
}

/// An output as (token id, text) pieces: special tokens by name, text in
/// pieces of `size` characters (ids of text pieces do not matter here).
fn output(parts: &[&str], size: usize) -> Vec<(u32, String)> {
    let t = tokens();
    let ids = [t.start, t.end, t.message, t.channel, t.constrain, t.return_, t.call];
    let mut out = Vec::new();
    for part in parts {
        if let Some(i) = SPECIALS.iter().position(|s| s == part) {
            out.push((ids[i], String::new()));
        } else {
            let chars: Vec<char> = part.chars().collect();
            out.extend(chars.chunks(size).map(|c| (5, c.iter().collect())));
        }
    }
    out
}

/// (reasoning, content, calls as (name, arguments)), checking that the
/// events and `calls()` agree.
fn parse(parts: &[&str], size: usize) -> (String, String, Vec<(String, String)>) {
    let mut parser = HarmonyParser::new(tokens());
    let mut events = Vec::new();
    for (id, text) in output(parts, size) {
        events.extend(parser.push(id, &text));
    }
    events.extend(parser.finish());
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::<(String, String)>::new());
    for event in events {
        match event {
            HarmonyEvent::Reasoning(text) => reasoning.push_str(&text),
            HarmonyEvent::Tool(ToolEvent::Content(text)) => content.push_str(&text),
            HarmonyEvent::Tool(ToolEvent::Start { index, name, id }) => {
                assert_eq!(index, calls.len());
                assert!(id.starts_with("call_") && id.len() == 29, "{id}");
                calls.push((name, String::new()));
            }
            HarmonyEvent::Tool(ToolEvent::Arguments { index, fragment }) => calls[index].1.push_str(&fragment),
        }
    }
    let parsed: Vec<String> = parser.calls().iter().map(|c| c.name.clone()).collect();
    assert_eq!(parsed, calls.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>());
    (reasoning, content, calls)
}

fn parse_all_ways(parts: &[&str]) -> (String, String, Vec<(String, String)>) {
    let whole = parse(parts, usize::MAX);
    for size in [1, 3] {
        assert_eq!(parse(parts, size), whole, "pieces of {size}");
    }
    whole
}

#[test]
fn analysis_then_final_split_into_reasoning_and_content() {
    let (reasoning, content, calls) = parse_all_ways(&[
        CHANNEL, "analysis", MESSAGE, "The user asks 2+2. Easy.", END,
        START, "assistant", CHANNEL, "final", MESSAGE, "2 + 2 = 4.", RETURN,
    ]);
    assert_eq!(reasoning, "The user asks 2+2. Easy.");
    assert_eq!(content, "2 + 2 = 4.");
    assert!(calls.is_empty());
}

#[test]
fn a_commentary_message_to_a_function_is_a_call() {
    let (reasoning, content, calls) = parse_all_ways(&[
        CHANNEL, "analysis", MESSAGE, "Need the weather.", END,
        START, "assistant", CHANNEL, "commentary to=functions.get_weather ", CONSTRAIN, "json", MESSAGE,
        "{\"city\":\"Paris\"}", CALL,
    ]);
    assert_eq!(reasoning, "Need the weather.");
    assert_eq!(content, "");
    assert_eq!(calls, vec![("get_weather".to_string(), "{\"city\":\"Paris\"}".to_string())]);
}

#[test]
fn the_recipient_may_come_before_the_channel_and_a_preamble_is_content() {
    let (_, content, calls) = parse_all_ways(&[
        CHANNEL, "commentary", MESSAGE, "Checking two things.", END,
        START, "assistant to=functions.now", CHANNEL, "commentary json", MESSAGE, "{ }", CALL,
    ]);
    assert_eq!(content, "Checking two things.");
    let mut parser = HarmonyParser::new(tokens());
    for (id, text) in output(&[START, "assistant to=functions.now", CHANNEL, "commentary", MESSAGE, "{ }", CALL], 4) {
        parser.push(id, &text);
    }
    // Arguments are handed out as written and kept compact once the call ends.
    assert_eq!(calls, vec![("now".to_string(), "{ }".to_string())]);
    assert_eq!(parser.calls()[0].arguments, "{}");
}

#[test]
fn output_without_harmony_is_content() {
    let (reasoning, content, calls) = parse_all_ways(&["Just some text, no channels at all."]);
    assert_eq!((reasoning.as_str(), content.as_str()), ("", "Just some text, no channels at all."));
    assert!(calls.is_empty());
    // Long text without a header token is released before the end.
    let long = "x".repeat(300);
    let mut parser = HarmonyParser::new(tokens());
    let events = parser.push(5, &long);
    assert_eq!(events, vec![HarmonyEvent::Tool(ToolEvent::Content(long))]);
}

#[test]
fn a_cut_off_output_keeps_what_it_has() {
    let (reasoning, content, _) = parse_all_ways(&[CHANNEL, "analysis", MESSAGE, "I was thinking abo"]);
    assert_eq!((reasoning.as_str(), content.as_str()), ("I was thinking abo", ""));
    let (_, _, calls) = parse_all_ways(&[CHANNEL, "commentary to=functions.now", MESSAGE, "{\"a\": 1"]);
    assert_eq!(calls, vec![("now".to_string(), "{\"a\": 1".to_string())]);
}

#[test]
fn the_template_and_tokens_are_recognised() {
    assert!(is_harmony_template("{{ '<|start|>' + role + '<|channel|>' }}...<|message|>"));
    assert!(!is_harmony_template("<|im_start|>assistant"));
    assert!(HarmonyTokens::new(&crate::detokenize::tests::byte_fallback_tokenizer()).is_none());
}

#[test]
fn required_and_named_grammars_compile_and_auto_has_none() {
    let tokenizer = harmony_tokenizer();
    let compiler = GrammarCompiler::new(&tokenizer, 274, &[272, 273]).unwrap();
    let format = HarmonyFormat::new(&tokenizer).unwrap();
    let tools = vec![
        FunctionDefinition {
            name: "get_weather".into(),
            description: None,
            parameters: Some(json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})),
            strict: None,
        },
        FunctionDefinition { name: "now".into(), description: None, parameters: None, strict: None },
    ];
    for choice in [ToolChoice::Required, ToolChoice::Named("now".into())] {
        let grammar = format.grammar(&tools, &choice).unwrap();
        compiler.compile(&grammar).unwrap_or_else(|e| panic!("{choice:?}: {e}\n{grammar:?}"));
        let Constraint::Lark(lark) = &grammar else { unreachable!() };
        assert!(lark.contains("commentary to=functions.now "), "{lark}");
        assert_eq!(lark.contains("get_weather"), choice == ToolChoice::Required, "{lark}");
    }
    assert!(format.grammar(&tools, &ToolChoice::Auto).is_none());
    assert!(format.grammar(&tools, &ToolChoice::None).is_none());
}

/// Runs `ids` through `constraint`'s matcher: accepted, and may the output
/// end there.
fn matches(constraint: &Constraint, ids: &[u32]) -> (bool, bool) {
    let compiler = GrammarCompiler::new(&harmony_tokenizer(), VOCAB, &EOS).unwrap();
    let compiled = compiler.compile(constraint).unwrap_or_else(|e| panic!("{e}\n{constraint:?}"));
    let mut matcher = compiler.matcher(&compiled.0).unwrap();
    if matcher.consume_tokens(ids).is_err() {
        return (false, false);
    }
    let done = matcher.is_stopped() || matcher.compute_mask().map(|mask| mask.is_allowed(EOS[0])).unwrap_or(false);
    (true, done)
}

#[test]
fn the_named_grammar_takes_a_harmony_call_of_that_function_only() {
    let weather = FunctionDefinition {
        name: "get_weather".into(),
        description: None,
        parameters: Some(json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})),
        strict: None,
    };
    let format = HarmonyFormat::new(&harmony_tokenizer()).unwrap();
    let grammar = format.grammar(&[weather], &ToolChoice::Named("get_weather".into())).unwrap();
    let call = |name: &str, arguments: &str| {
        [CHANNEL, "commentary to=functions.", name, " ", CONSTRAIN, "json", MESSAGE, arguments, CALL].concat()
    };
    let thought = [CHANNEL, "analysis", MESSAGE, "Paris, then.", END, START, "assistant"].concat();
    let split = |text: &str| -> Vec<u32> {
        // Special tokens by name, the rest as bytes.
        let mut parts: Vec<&str> = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            match SPECIALS.iter().filter_map(|s| rest.find(s).map(|i| (i, *s))).min() {
                Some((0, special)) => {
                    parts.push(special);
                    rest = &rest[special.len()..];
                }
                Some((i, _)) => {
                    parts.push(&rest[..i]);
                    rest = &rest[i..];
                }
                None => {
                    parts.push(rest);
                    rest = "";
                }
            }
        }
        token_ids(&parts)
    };
    let good = call("get_weather", "{\"city\": \"Paris\"}");
    assert_eq!(matches(&grammar, &split(&good)), (true, true));
    assert_eq!(matches(&grammar, &split(&(thought.clone() + &good))), (true, true));
    assert!(!matches(&grammar, &split(&call("now", "{}"))).0, "an undeclared function");
    assert!(!matches(&grammar, &split(&call("get_weather", "{\"town\": 1}"))).0, "arguments off the schema");
    assert!(!matches(&grammar, &split(&[CHANNEL, "final", MESSAGE, "Hi"].concat())).0, "no call");

    // A response format is the final channel's message.
    let json = format.final_answer(Constraint::JsonObject);
    let answer = [thought.as_str(), CHANNEL, "final", MESSAGE, "{\"a\": 1}"].concat();
    assert_eq!(matches(&json, &split(&answer)), (true, true));
    assert_eq!(matches(&json, &split(&[CHANNEL, "final", MESSAGE, "{\"a\""].concat())), (true, false), "unfinished");
    assert!(!matches(&json, &split(&[CHANNEL, "final", MESSAGE, "plain"].concat())).0);
}

#[test]
fn analysis_tokens_are_reasoning_tokens() {
    let mut parser = HarmonyParser::new(tokens());
    let mut read = |parts: &[&str]| {
        let pieces = output(parts, 1);
        for (id, text) in &pieces {
            parser.push(*id, text);
        }
        (pieces.len() as u32, parser.reasoning_tokens())
    };
    // Tokens: <|channel|>, 8 of "analysis", <|message|>, 3 of "Hm.", <|end|>.
    let (first, counted) = read(&[CHANNEL, "analysis", MESSAGE, "Hm.", END]);
    assert_eq!((first, counted), (14, 14));
    let (second, counted) = read(&[START, "assistant", CHANNEL, "analysis", MESSAGE, "More"]);
    assert_eq!(counted, first + second, "an analysis message being read counts");
    let (_, counted) = read(&[END, START, "assistant", CHANNEL, "final", MESSAGE, "Yes", RETURN]);
    assert_eq!(counted, first + second + 1, "its <|end|> too; the final message does not");
}

#[test]
fn a_harmony_template_picks_the_gpt_oss_parser() {
    use crate::reasoning::ReasoningParserKind;
    assert_eq!(ReasoningParserKind::from_template(TEMPLATE), Some(ReasoningParserKind::GptOss));
    let plain = crate::detokenize::tests::byte_fallback_tokenizer();
    assert!(crate::reasoning::Reasoning::new(ReasoningParserKind::GptOss, &plain).is_err());
}

use std::sync::Arc;

use super::*;
use super::request::MAX_STOP_BYTES;
use super::sampling::MAX_LOGIT_BIAS;
use crate::chat_template::{ChatTemplate, TemplateMessage};
use crate::grammar::{Constraint, GrammarCompiler};
use crate::tool_calls::{FunctionDefinition, ToolChoice, ToolFormat};
use crate::detokenize::tests::byte_fallback_tokenizer;

pub(crate) fn validation() -> Validation {
    Validation {
        tokenizer: byte_fallback_tokenizer(),
        chat_template: Some(Arc::new(
            ChatTemplate::new(
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}".into(),
                Some("<s>".into()),
                Some("</s>".into()),
            )
            .unwrap(),
        )),
        limits: RequestLimits {
            max_input_tokens: 10,
            max_total_tokens: 16,
            max_stop_sequences: 2,
            max_top_n_tokens: 5,
            max_n: 4,
            max_client_batch_size: 3,
            max_sequences: 8,
        },
        vocab_size: 267,
        defaults: GenerationDefaults::default(),
        model_names: vec!["tiny".into(), "org/tiny".into()],
        grammar: Some(Arc::new(GrammarCompiler::new(&byte_fallback_tokenizer(), 267, &[2]).unwrap())),
        tool_format: ToolFormat::new(crate::tool_calls::ToolParserKind::Hermes, &byte_fallback_tokenizer()),
        reasoning: None,
        adapters: crate::infer::fixed_catalog(Vec::new()),
    }
}

fn check(ids: Vec<u32>, params: GenerateParameters) -> Result<Validated, ValidationError> {
    validation().validate(ids, "prompt", params)
}

#[test]
fn default_max_new_tokens_fills_the_sequence() {
    let v = check(vec![5; 6], GenerateParameters::default()).unwrap();
    assert_eq!(v.request.max_new_tokens, 10);
    let v = check(vec![5; 6], GenerateParameters { max_new_tokens: Some(10), ..Default::default() }).unwrap();
    assert_eq!(v.request.max_new_tokens, 10);
}

#[test]
fn lengths_are_enforced() {
    assert!(matches!(
        check(vec![5; 11], GenerateParameters::default()),
        Err(ValidationError::InputTooLong { tokens: 11, max: 10, .. })
    ));
    let err = check(vec![5; 6], GenerateParameters { max_new_tokens: Some(11), ..Default::default() }).unwrap_err();
    assert!(matches!(err, ValidationError::TotalTooLong { total: 17, max_total: 16, .. }));
    assert_eq!(err.param(), Some("max_tokens"));
    let err = check(vec![5; 6], GenerateParameters { max_new_tokens: Some(0), ..Default::default() }).unwrap_err();
    assert_eq!(err.param(), Some("max_tokens"));
}

#[test]
fn max_tokens_near_u64_max_is_a_clear_error() {
    let err = check(vec![5; 6], GenerateParameters { max_new_tokens: Some(u64::MAX), ..Default::default() })
        .unwrap_err();
    assert!(matches!(err, ValidationError::TotalTooLong { total: u64::MAX, max_new_tokens: u64::MAX, .. }), "{err}");
    assert!(err.to_string().contains(&u64::MAX.to_string()), "{err}");
}

#[test]
fn a_stop_sequence_has_a_length_limit() {
    let stop = |s: String| GenerateParameters { stop: vec!["ok".into(), s], ..Default::default() };
    assert!(check(vec![5; 2], stop("x".repeat(MAX_STOP_BYTES))).is_ok());
    let err = check(vec![5; 2], stop("x".repeat(MAX_STOP_BYTES + 1))).unwrap_err();
    assert_eq!(err.param(), Some("stop[1]"), "{err}");
}

#[test]
fn one_token_is_biased_once_and_the_count_is_capped() {
    let bias = |keys: &[&str]| GenerateParameters {
        logit_bias: keys.iter().map(|k| (format!("logit_bias.{k}"), k.to_string(), 50.0)).collect(),
        ..Default::default()
    };
    assert_eq!(check(vec![5; 2], bias(&["05"])).unwrap().request.params.logit_bias, [(5, 50.0)]);
    for keys in [["5", "05"], ["5", "+5"], ["05", "+5"]] {
        let err = check(vec![5; 2], bias(&keys)).unwrap_err();
        assert_eq!(err.param(), Some(format!("logit_bias.{}", keys[1]).as_str()), "{err}");
        assert!(err.to_string().contains("more than once"), "{err}");
    }
    let many: Vec<String> = (0..=MAX_LOGIT_BIAS).map(|i| i.to_string()).collect();
    let keys: Vec<&str> = many.iter().map(String::as_str).collect();
    let mut v = validation();
    v.vocab_size = 4096;
    let err = v.validate(vec![5; 2], "prompt", bias(&keys)).unwrap_err();
    assert_eq!(err.param(), Some("logit_bias"), "{err}");
    assert!(v.validate(vec![5; 2], "prompt", bias(&keys[..MAX_LOGIT_BIAS])).is_ok());
}

#[test]
fn truncate_keeps_the_last_tokens() {
    let ids: Vec<u32> = (1..=12).collect();
    let v = check(ids, GenerateParameters { truncate: Some(4), ..Default::default() }).unwrap();
    assert_eq!(v.request.input_ids, [9, 10, 11, 12]);
    let err = check(vec![1], GenerateParameters { truncate: Some(11), ..Default::default() }).unwrap_err();
    assert_eq!(err.param(), Some("truncate"));
}

#[test]
fn ranges_name_the_field() {
    let cases: Vec<(GenerateParameters, &str)> = vec![
        (GenerateParameters { temperature: Some(-0.5), ..Default::default() }, "temperature"),
        (GenerateParameters { temperature: Some(2.5), max_temperature: 2.0, ..Default::default() }, "temperature"),
        (GenerateParameters { temperature: Some(f32::NAN), ..Default::default() }, "temperature"),
        (GenerateParameters { top_p: Some(0.0), ..Default::default() }, "top_p"),
        (GenerateParameters { top_p: Some(1.5), ..Default::default() }, "top_p"),
        (GenerateParameters { top_k: Some(-2), ..Default::default() }, "top_k"),
        (GenerateParameters { min_p: Some(1.5), ..Default::default() }, "min_p"),
        (GenerateParameters { typical_p: Some(0.0), ..Default::default() }, "typical_p"),
        (GenerateParameters { repetition_penalty: Some(0.0), ..Default::default() }, "repetition_penalty"),
        (GenerateParameters { frequency_penalty: Some(3.0), ..Default::default() }, "frequency_penalty"),
        (GenerateParameters { presence_penalty: Some(-2.5), ..Default::default() }, "presence_penalty"),
        (GenerateParameters { top_n_tokens: 6, ..Default::default() }, "top_n_tokens"),
        (GenerateParameters { stop: vec!["".into()], ..Default::default() }, "stop"),
        (GenerateParameters { stop: vec!["a".into(), "b".into(), "c".into()], ..Default::default() }, "stop"),
        (GenerateParameters { min_tokens: 16, ..Default::default() }, "min_tokens"),
        (
            GenerateParameters { logit_bias: vec![("logit_bias.999".into(), "999".into(), 1.0)], ..Default::default() },
            "logit_bias.999",
        ),
        (
            GenerateParameters { logit_bias: vec![("logit_bias.5".into(), "5".into(), 101.0)], ..Default::default() },
            "logit_bias.5",
        ),
        (
            GenerateParameters { logit_bias: vec![("logit_bias.x".into(), "x".into(), 1.0)], ..Default::default() },
            "logit_bias.x",
        ),
    ];
    for (params, field) in cases {
        let err = check(vec![5], params.clone()).expect_err(&format!("{params:?}"));
        assert_eq!(err.param(), Some(field), "{err}");
    }
}

#[test]
fn accepted_values_reach_the_request() {
    let v = check(
        vec![5],
        GenerateParameters {
            temperature: Some(0.7),
            top_k: Some(-1),
            top_p: Some(1.0),
            seed: Some(42),
            logit_bias: vec![("logit_bias.7".into(), "7".into(), -100.0)],
            top_n_tokens: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let p = &v.request.params;
    assert_eq!((p.temperature, p.top_k, p.top_p, p.seed), (0.7, 0, 1.0, 42));
    assert_eq!(p.logit_bias, [(7, -100.0)]);
    assert!(v.request.logprobs);
}

#[test]
fn request_shape_is_checked_first() {
    let v = validation();
    let tgi = GenerateParameters { field_prefix: "parameters.", ..Default::default() };
    let cases: Vec<(GenerateParameters, &str)> = vec![
        (GenerateParameters { n: 0, ..Default::default() }, "n"),
        (GenerateParameters { n: 5, ..Default::default() }, "n"),
        (GenerateParameters { best_of: Some(2), ..Default::default() }, "best_of"),
        (GenerateParameters { best_of: Some(2), ..tgi.clone() }, "parameters.best_of"),
        (
            GenerateParameters {
                constraint: Some(("parameters.grammar.value".into(), Constraint::Regex("(a".into()))),
                ..tgi.clone()
            },
            "parameters.grammar.value",
        ),
        (
            GenerateParameters {
                top_n_tokens: 2,
                top_n_tokens_field: "top_logprobs",
                top_n_tokens_needs_logprobs: true,
                ..Default::default()
            },
            "top_logprobs",
        ),
        (
            GenerateParameters { temperature: Some(0.0), decoding: Decoding::GreedyUnless { do_sample: true }, ..tgi },
            "temperature",
        ),
    ];
    for (params, field) in cases {
        // An empty prompt would fail too: the request's shape is named first.
        let err = v.validate_prompts(&[Prompt::Text(String::new())], "prompt", &params).expect_err(field);
        assert_eq!(err.param(), Some(field), "{err}");
    }
    let fine = GenerateParameters { best_of: Some(1), n: 4, ..Default::default() };
    assert_eq!(v.validate_prompts(&[Prompt::Text("hi".into())], "prompt", &fine).unwrap()[0].n, 4);
}

#[test]
fn tgi_decoding_is_greedy_unless_asked_to_sample() {
    let v = validation();
    let temperature = |decoding: Decoding, temperature: Option<f32>, top_k: Option<i64>| {
        let params = GenerateParameters { decoding, temperature, top_k, ..Default::default() };
        v.validate_prompts(&[Prompt::Text("hi".into())], "inputs", &params).unwrap()[0].request.params.temperature
    };
    let greedy = Decoding::GreedyUnless { do_sample: false };
    assert_eq!(temperature(greedy, None, None), 0.0);
    assert_eq!(temperature(greedy, Some(1.0), None), 0.0, "temperature 1 is no warper");
    assert_eq!(temperature(greedy, Some(0.5), None), 0.5);
    assert_eq!(temperature(greedy, None, Some(5)), 1.0);
    assert_eq!(temperature(Decoding::GreedyUnless { do_sample: true }, None, None), 1.0);
    assert_eq!(temperature(Decoding::ByTemperature, Some(0.7), None), 0.7);
    assert_eq!(temperature(Decoding::ByTemperature, None, None), 0.0);
}

#[test]
fn prompt_lists_name_each_entry() {
    let v = validation();
    let params = GenerateParameters::default();
    let err = v.validate_prompts(&[], "prompt", &params).unwrap_err();
    assert!(matches!(err, ValidationError::Empty { .. }) && err.param() == Some("prompt"));
    let prompts = [Prompt::Tokens(vec![5]), Prompt::Tokens(vec![5, 300])];
    let err = v.validate_prompts(&prompts, "prompt", &params).unwrap_err();
    assert_eq!(err.param(), Some("prompt[1]"));
    // Chat-template output gets no BOS; raw text does.
    let chat = v.validate_prompts(&[Prompt::Chat("hi".into())], "messages", &params).unwrap();
    let text = v.validate_prompts(&[Prompt::Text("hi".into())], "prompt", &params).unwrap();
    assert_eq!(text[0].request.input_ids[1..], chat[0].request.input_ids[..]);
    assert_eq!(v.check_model(Some("gpt-4")).unwrap_err().param(), Some("model"));
    assert!(v.check_model(Some("org/tiny")).is_ok() && v.check_model(Some("tgi")).is_ok() && v.check_model(None).is_ok());
}

#[test]
fn the_model_field_picks_a_lora_adapter() {
    let mut v = validation();
    let adapter = |name: &str| crate::infer::AdapterInfo { name: name.into(), path: format!("/adapters/{name}") };
    v.adapters = crate::infer::fixed_catalog(vec![adapter("sql"), adapter("chat")]);
    assert_eq!(v.check_model(Some("sql")).unwrap().as_deref(), Some("sql"));
    assert_eq!(v.check_model(Some("tiny")).unwrap(), None);
    assert_eq!(v.check_model(None).unwrap(), None);
    let err = v.check_model(Some("sqll")).unwrap_err();
    assert_eq!(err.param(), Some("model"));
    assert_eq!(err.to_string(), "The model `sqll` does not exist; this server serves: `tiny` (the base model), `sql`, `chat`");
    let params = GenerateParameters { adapter: Some("sql".into()), max_new_tokens: Some(2), ..Default::default() };
    assert_eq!(check(vec![5, 6], params).unwrap().request.adapter.as_deref(), Some("sql"));
}

#[test]
fn tools_and_choices_are_checked() {
    let v = validation();
    let function = |name: &str, parameters: Option<serde_json::Value>| FunctionDefinition {
        name: name.into(),
        description: None,
        parameters,
        strict: None,
    };
    let declared = vec![function("get_weather", Some(serde_json::json!({"type": "object"}))), function("now", None)];
    let check = |functions: &[FunctionDefinition], choice: Option<ToolChoice>| {
        v.tools(&ToolRequest { functions: functions.to_vec(), choice, parallel: None })
    };
    let t = check(&declared, None).unwrap().unwrap();
    assert_eq!(t.choice, ToolChoice::Auto);
    assert_eq!(t.constraint.unwrap().0, "tools");
    let t = check(&declared, Some(ToolChoice::None)).unwrap().unwrap();
    assert!(t.constraint.is_none() && t.shown().is_none());
    assert_eq!(check(&[], None).unwrap(), None);
    assert_eq!(check(&[], Some(ToolChoice::None)).unwrap(), None);

    let field = |functions: &[FunctionDefinition], choice: Option<ToolChoice>| {
        check(functions, choice).unwrap_err().param().unwrap().to_string()
    };
    assert_eq!(field(&[], Some(ToolChoice::Required)), "tools");
    assert_eq!(field(&declared, Some(ToolChoice::Named("nope".into()))), "tool_choice.function.name");
    assert_eq!(field(&[function("a b", None)], None), "tools[0].function.name");
    assert_eq!(field(&[function("a", Some(serde_json::json!([1])))], None), "tools[0].function.parameters");
    let bad_schema = function("b", Some(serde_json::json!({"type": "nope"})));
    assert_eq!(field(&[function("a", None), bad_schema], None), "tools[1].function.parameters");
    assert_eq!(field(&[function("a", None), function("a", None)], None), "tools[1].function.name");
}

#[test]
fn tools_go_into_the_system_message_of_a_template_without_them() {
    let v = validation();
    let tools = [FunctionDefinition { name: "now".into(), description: None, parameters: None, strict: None }];
    let call = serde_json::json!({"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}});
    let messages = [
        TemplateMessage::text("user", "time?"),
        TemplateMessage { tool_calls: Some(vec![call]), ..TemplateMessage::text("assistant", "") },
        TemplateMessage { tool_call_id: Some("c1".into()), ..TemplateMessage::text("tool", "noon") },
    ];
    let rendered = v.render_chat_with_tools(&messages, Some(&tools), &Default::default()).unwrap();
    let lines: Vec<&str> = rendered.lines().collect();
    assert!(lines[0].starts_with("system: You can call these functions"), "{rendered}");
    assert!(rendered.contains("{\"type\":\"function\",\"function\":{\"name\":\"now\"}}"), "{rendered}");
    assert!(rendered.contains("assistant: <tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\ntool: noon"), "{rendered}");
    // Without tools (tool_choice none) the history still renders its calls.
    let rendered = v.render_chat_with_tools(&messages, None, &Default::default()).unwrap();
    assert!(rendered.starts_with("user: time?\nassistant: <tool_call>"), "{rendered}");
}

#[test]
fn prompts_are_checked() {
    let v = validation();
    assert_eq!(v.tokenize(&Prompt::Text(String::new()), "prompt", true).unwrap_err().param(), Some("prompt"));
    assert_eq!(v.tokenize(&Prompt::Tokens(vec![]), "prompt", true).unwrap_err().param(), Some("prompt"));
    assert!(matches!(
        v.tokenize(&Prompt::Tokens(vec![1, 267]), "prompt", true),
        Err(ValidationError::UnknownToken { id: 267, .. })
    ));
    // Raw text gets BOS (id 1) from the post-processor.
    assert_eq!(v.tokenize(&Prompt::Text("Hello".into()), "prompt", true).unwrap()[0], 1);
    assert!(matches!(v.render_chat(&[]), Err(ValidationError::Empty { .. })));
    let rendered = v
        .render_chat(&[TemplateMessage::text("user", "hi")])
        .unwrap();
    assert_eq!(rendered, "user: hi\n");
}

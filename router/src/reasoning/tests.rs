use proptest::prelude::*;
use serde_json::json;

use super::stream::{ReasoningParser, Split};
use super::*;
use crate::detokenize::tests::byte_fallback_tokenizer;
use crate::grammar::GrammarCompiler;

fn qwen3() -> ReasoningFormat {
    ReasoningFormat::new(ReasoningParserKind::Qwen3)
}

fn r1() -> ReasoningFormat {
    ReasoningFormat::new(ReasoningParserKind::DeepseekR1)
}

/// The output read in the given pieces: (reasoning, content, reasoning tokens).
fn split(format: ReasoningFormat, start: ThinkStart, pieces: &[&str]) -> (String, String, u32) {
    let mut parser = ReasoningParser::new(format, start);
    let mut all = Split::default();
    for piece in pieces {
        let s = parser.push(piece);
        all.reasoning.push_str(&s.reasoning);
        all.content.push_str(&s.content);
    }
    let s = parser.finish();
    all.reasoning.push_str(&s.reasoning);
    all.content.push_str(&s.content);
    (all.reasoning, all.content, parser.reasoning_tokens())
}

/// What Qwen3 and DeepSeek-R1 write, each with the start its prompt gives
/// and the expected (reasoning, content).
fn shapes() -> Vec<(ReasoningFormat, ThinkStart, &'static str, &'static str, &'static str)> {
    vec![
        // Qwen3, thinking on: the model opens the block.
        (qwen3(), ThinkStart::MayOpen, "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", "The user greets me.", "Hello! How can I help?"),
        // Qwen3, a tool call after thinking.
        (
            qwen3(),
            ThinkStart::MayOpen,
            "<think>\nI need the weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "I need the weather.",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        ),
        // Qwen3 deciding not to think, and an empty block.
        (qwen3(), ThinkStart::MayOpen, "Just an answer.", "", "Just an answer."),
        (qwen3(), ThinkStart::MayOpen, "<think>\n\n</think>\n\nQuick answer.", "", "Quick answer."),
        // Qwen3, enable_thinking=false: the empty block was in the prompt.
        (qwen3(), ThinkStart::Closed, "Answer with <think> in it.", "", "Answer with <think> in it."),
        // Qwen3 thinking-2507 / DeepSeek-R1: the prompt opened the block.
        (qwen3(), ThinkStart::Inside, "Let me see.\n</think>\n\n42", "Let me see.", "42"),
        (r1(), ThinkStart::Inside, "Okay, so 6 times 7... that's 42.\n</think>\n\nThe answer is **42**.", "Okay, so 6 times 7... that's 42.", "The answer is **42**."),
        // Older R1 templates: the model repeats the opening tag.
        (r1(), ThinkStart::Inside, "<think>\nHmm.\n</think>\n\nYes.", "Hmm.", "Yes."),
        // Cut off while thinking (max_tokens): all of it was thought.
        (r1(), ThinkStart::Inside, "Still thinking about </thi", "Still thinking about </thi", ""),
        (qwen3(), ThinkStart::MayOpen, "<think>\nStill", "Still", ""),
        // Unicode around the tags.
        (qwen3(), ThinkStart::MayOpen, "  <think>思考中…</think>答え", "思考中…", "答え"),
        // A "<" that is not the tag.
        (qwen3(), ThinkStart::MayOpen, "<b>bold</b>", "", "<b>bold</b>"),
    ]
}

#[test]
fn each_family_shape_splits() {
    for (format, start, text, reasoning, content) in shapes() {
        let (r, c, _) = split(format, start, &[text]);
        assert_eq!((r.as_str(), c.as_str()), (reasoning, content), "{text:?}");
    }
}

#[test]
fn reasoning_tokens_count_up_to_the_closing_tag() {
    let tokens = ["<think>", "\n", "Hmm", ".", "\n", "</think>", "\n\n", "Hi", "!"];
    assert_eq!(split(qwen3(), ThinkStart::MayOpen, &tokens).2, 6);
    assert_eq!(split(qwen3(), ThinkStart::MayOpen, &["Hi", "!"]).2, 0);
    assert_eq!(split(r1(), ThinkStart::Inside, &["a", "b"]).2, 2, "cut off inside: every token");
    assert_eq!(split(qwen3(), ThinkStart::Closed, &["<think>", "x"]).2, 0);
}

/// `text` cut at the given char positions.
fn cut(text: &str, mut cuts: Vec<usize>) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    cuts.iter_mut().for_each(|c| *c %= chars.len() + 1);
    cuts.sort_unstable();
    let mut pieces = Vec::new();
    let mut from = 0;
    for at in cuts.into_iter().chain([chars.len()]) {
        pieces.push(chars[from..at].iter().collect());
        from = at;
    }
    pieces
}

proptest! {
    /// However the stream is cut into pieces, the split is the one of the
    /// whole text.
    #[test]
    fn chunk_boundaries_do_not_matter(case in 0usize..12, cuts in proptest::collection::vec(0usize..200, 0..12)) {
        let (format, start, text, reasoning, content) = shapes().swap_remove(case);
        let pieces = cut(text, cuts);
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let (r, c, _) = split(format, start, &refs);
        prop_assert_eq!((r.as_str(), c.as_str()), (reasoning, content));
    }
}

#[test]
fn the_prompt_tells_where_the_output_starts() {
    let q = qwen3();
    assert_eq!(q.start("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), ThinkStart::MayOpen);
    assert_eq!(q.start("<|im_start|>assistant\n<think>\n\n</think>\n\n"), ThinkStart::Closed);
    assert_eq!(q.start("<|im_start|>assistant\n<think>\n"), ThinkStart::Inside);
    // An earlier turn's block does not count.
    assert_eq!(q.start("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n"), ThinkStart::MayOpen);
    assert_eq!(r1().start("<｜User｜>hi<｜Assistant｜>"), ThinkStart::Inside);
    assert_eq!(r1().start("<｜User｜>hi<｜Assistant｜><think>\n"), ThinkStart::Inside);
}

#[test]
fn templates_name_their_family() {
    assert_eq!(ReasoningParserKind::from_template("{{ '<|im_start|>' }}{{ '<think>\\n\\n</think>' }}"), Some(ReasoningParserKind::Qwen3));
    assert_eq!(ReasoningParserKind::from_template("{{'<｜Assistant｜><think>\\n'}}"), Some(ReasoningParserKind::DeepseekR1));
    assert_eq!(ReasoningParserKind::from_template("{{ m.content }}"), None);
}

/// Byte tokens of the test tokenizer: id 3 + byte.
fn byte_tokens(text: &str) -> Vec<u32> {
    text.bytes().map(|b| 3 + u32::from(b)).collect()
}

/// Whether `text` is a complete output under `constraint`.
fn accepts(constraint: &Constraint, text: &str) -> bool {
    accepts_tokens(&byte_fallback_tokenizer(), constraint, &byte_tokens(text))
}

/// Whether `tokens` are a complete output under `constraint`.
fn accepts_tokens(tokenizer: &Tokenizer, constraint: &Constraint, tokens: &[u32]) -> bool {
    let compiler = GrammarCompiler::new(tokenizer, tokenizer.vocab_size(), &[2]).unwrap();
    let compiled = compiler.compile(constraint).unwrap_or_else(|e| panic!("{e}"));
    let mut matcher = compiler.matcher(&compiled.0).unwrap();
    tokens.iter().all(|&t| matcher.consume_token(t).is_ok()) && !matcher.is_error() && matcher.is_accepting().unwrap_or(false)
}

/// The byte tokenizer with `<think>` and `</think>` added as tokens (not
/// special ones), as Qwen3's tokenizer has them: ids 267 and 268.
fn tokenizer_with_tags() -> Tokenizer {
    let mut inner = crate::detokenize::tests::byte_fallback_inner();
    inner.add_tokens(&[tokenizers::AddedToken::from(OPEN, false), tokenizers::AddedToken::from(CLOSE, false)]);
    let tokenizer = Tokenizer::new(inner);
    assert_eq!((tokenizer.token_to_id(OPEN), tokenizer.token_to_id(CLOSE)), (Some(267), Some(268)));
    tokenizer
}

#[test]
fn tags_that_are_added_tokens_open_and_close_the_block_as_tokens() {
    let tokenizer = tokenizer_with_tags();
    let schema = Constraint::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}));
    let format = ReasoningFormat::for_tokenizer(ReasoningParserKind::Qwen3, &tokenizer);
    let may = format.after_thinking(schema.clone(), ThinkStart::MayOpen);
    let json = byte_tokens("{\"a\": 1}");
    let thought = [vec![267], byte_tokens("free {text\n"), vec![268], byte_tokens("\n\n"), json.clone()].concat();
    assert!(accepts_tokens(&tokenizer, &may, &thought));
    assert!(accepts_tokens(&tokenizer, &may, &json), "thinking is optional");
    assert!(!accepts_tokens(&tokenizer, &may, &[vec![267], byte_tokens("x"), vec![268], byte_tokens("no")].concat()));
    let inside = ReasoningFormat::for_tokenizer(ReasoningParserKind::DeepseekR1, &tokenizer).after_thinking(schema.clone(), ThinkStart::Inside);
    assert!(accepts_tokens(&tokenizer, &inside, &[byte_tokens("no tag"), vec![268], json.clone()].concat()));
    assert!(!accepts_tokens(&tokenizer, &inside, &json), "the block must close first");
    // Without the added tokens the tags stay text (the plain byte tokenizer).
    let plain = ReasoningFormat::for_tokenizer(ReasoningParserKind::Qwen3, &byte_fallback_tokenizer());
    assert_eq!(plain, qwen3());
}

#[test]
fn the_grammar_applies_after_the_thinking_block() {
    let schema = Constraint::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}));
    let may = qwen3().after_thinking(schema.clone(), ThinkStart::MayOpen);
    assert!(accepts(&may, "<think>\nfree {text\n</think>\n\n{\"a\": 1}"));
    assert!(accepts(&may, "{\"a\": 1}"), "thinking is optional");
    assert!(!accepts(&may, "<think>x</think>\n\nnot json"));
    assert!(!accepts(&may, "prose {\"a\": 1}"));
    let inside = r1().after_thinking(schema.clone(), ThinkStart::Inside);
    assert!(accepts(&inside, "thinking, no tag\n</think>\n\n{\"a\": 2}"));
    assert!(accepts(&inside, "<think>\nwith the tag</think>{\"a\": 2}"));
    assert!(!accepts(&inside, "{\"a\": 2}"), "the block must close first");
    assert_eq!(qwen3().after_thinking(schema.clone(), ThinkStart::Closed), schema);
    // Every kind of answer grammar nests.
    for (answer, text) in [
        (Constraint::Regex("ab+".into()), "abbb"),
        (Constraint::Choice(vec!["yes".into(), "no".into()]), "no"),
        (Constraint::Lark("start: \"x\" NUM\nNUM: /[0-9]+/".into()), "x42"),
        (Constraint::JsonObject, "{}"),
    ] {
        let c = qwen3().after_thinking(answer, ThinkStart::MayOpen);
        assert!(accepts(&c, &format!("<think>hm</think>\n{text}")), "{c:?}");
    }
}

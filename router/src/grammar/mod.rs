//! Structured-output constraints, compiled with llguidance.
//!
//! Every API that restricts what the model may write (OpenAI
//! `response_format`, vLLM's `guided_*` / `structured_outputs`, TGI's
//! `grammar`, tool calling) first becomes a [`Constraint`]. Validation then
//! compiles it against the model's tokenizer with [`GrammarCompiler`], so a
//! bad schema, regex or grammar is a 400 before anything is queued. What the
//! shard receives (`NewRequest.grammar`) is the llguidance grammar as JSON
//! (a `TopLevelGrammar`); the shard builds its own matcher from it with the
//! same tokenizer.json, so both sides agree on every token.
//!
//! JSON is generated compactly (`", "` and `": "` separators, no free
//! whitespace): a weak model cannot then pad its output with endless blank
//! lines, and tool-call parsing can rely on the layout.

mod gbnf;

use std::sync::Arc;

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::toktrie::{InferenceCapabilities, TokEnv};
use llguidance::ParserFactory;
use serde_json::{json, Value};

use crate::tokenizer::Tokenizer;

pub use gbnf::{gbnf_to_lark, lark_literal, looks_like_gbnf};

/// What a request asked the output to match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// The output is one JSON value valid under this schema.
    JsonSchema(Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// The whole output matches this regular expression (Rust regex syntax).
    Regex(String),
    /// The output is exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect: `%json`, lazy lexemes, special
    /// tokens as `<[id]>`).
    Lark(String),
    /// `answer` after a reasoning model's thinking: `main` is a Lark
    /// grammar that refers to the answer's grammar as `@answer`
    /// (`reasoning::ReasoningFormat::after_thinking` and
    /// `harmony::HarmonyFormat::final_answer` write it).
    AfterThinking { main: String, answer: Box<Constraint> },
}

/// Compile options llguidance reads from a schema's `x-guidance` key; a
/// client's own `x-guidance` wins.
fn json_layout() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// A JSON schema with the compact layout applied (also used for the
/// `%json { ... }` blocks of tool-call grammars).
pub fn with_json_layout(schema: &Value) -> Value {
    match schema {
        Value::Object(map) => {
            let mut map = map.clone();
            map.entry("x-guidance").or_insert_with(json_layout);
            Value::Object(map)
        }
        // `true` / `{}`-like schemas: any JSON value.
        Value::Bool(true) => json!({"x-guidance": json_layout()}),
        other => other.clone(),
    }
}

impl Constraint {
    fn to_grammar(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            Self::JsonSchema(schema) => {
                if !(schema.is_object() || schema == &Value::Bool(true)) {
                    return Err("a JSON schema must be an object".into());
                }
                TopLevelGrammar::from_json_schema(with_json_layout(schema))
            }
            Self::JsonObject => TopLevelGrammar::from_json_schema(with_json_layout(&json!({"type": "object"}))),
            Self::Regex(regex) => TopLevelGrammar::from_grammar(GrammarWithLexer::from_regex(regex)),
            Self::Choice(choices) => {
                if choices.is_empty() {
                    return Err("must list at least one choice".into());
                }
                let alternatives: Vec<String> = choices.iter().map(|c| lark_literal(c)).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            Self::Lark(grammar) => {
                if grammar.trim().is_empty() {
                    return Err("the grammar is empty".into());
                }
                TopLevelGrammar::from_lark(grammar.clone())
            }
            Self::AfterThinking { main, answer } => {
                let mut answer = answer.to_grammar()?;
                if answer.grammars.len() != 1 {
                    return Err("the answer's grammar must be a single grammar".into());
                }
                answer.grammars[0].name = Some("answer".into());
                let mut grammar = TopLevelGrammar::from_lark(main.clone());
                grammar.grammars.extend(answer.grammars);
                grammar
            }
        })
    }
}

/// A constraint that compiled: the llguidance grammar, as the JSON the
/// shard's matcher is built from. Cheap to clone (`n > 1` fans out).
#[derive(Debug, Clone, PartialEq)]
pub struct CompiledGrammar(pub Arc<str>);

/// llguidance's parser factory for the model's tokenizer: compiles
/// constraints (validation only; the shard runs the matcher).
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// Builds the token trie of `tokenizer` (about a second for a 50k
    /// vocabulary: done once, at startup). `vocab_size` is the LM head's
    /// width (at least the tokenizer's size); `eos_token_ids` end a
    /// constrained output once the grammar accepts.
    pub fn new(tokenizer: &Tokenizer, vocab_size: u32, eos_token_ids: &[u32]) -> Result<Self, String> {
        let mut bytes = toktrie_hf_tokenizers::ByteTokenizer::from_tokenizer(tokenizer.hf().clone())
            .map_err(|e| format!("llguidance cannot read the tokenizer: {e}"))?;
        let n_tokens = bytes.token_bytes().len();
        let eos: Vec<u32> = eos_token_ids.iter().copied().filter(|&t| (t as usize) < n_tokens).collect();
        if !eos.is_empty() {
            bytes.set_eos_tokens(&eos);
        }
        let env: TokEnv = bytes
            .into_tok_env(Some(n_tokens.max(vocab_size as usize)))
            .map_err(|e| format!("llguidance cannot read the tokenizer: {e}"))?;
        // No slices: they speed up mask computation, which the router never
        // does, and cost startup time.
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &[])
            .map_err(|e| format!("llguidance: {e}"))?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// Compiles `constraint`; the error says what is wrong with it.
    pub fn compile(&self, constraint: &Constraint) -> Result<CompiledGrammar, String> {
        let grammar = constraint.to_grammar()?;
        let json = serde_json::to_string(&grammar).map_err(|e| e.to_string())?;
        self.factory.create_parser(grammar).map_err(|e| clean_error(&e.to_string()))?;
        Ok(CompiledGrammar(json.into()))
    }
}

impl GrammarCompiler {
    /// A matcher for a compiled grammar: what the shard runs, and the fake
    /// shard of the tests runs here.
    #[cfg(any(test, feature = "testing"))]
    pub fn matcher(&self, grammar: &str) -> Result<llguidance::Matcher, String> {
        let grammar: TopLevelGrammar = serde_json::from_str(grammar).map_err(|e| e.to_string())?;
        Ok(llguidance::Matcher::new(self.factory.create_parser(grammar)))
    }

    /// The tokenizer's token trie (the fake shard of the tests reads it).
    #[cfg(any(test, feature = "testing"))]
    pub fn tok_env(&self) -> &TokEnv {
        self.factory.tok_env()
    }
}

/// llguidance's messages end with a dump of the grammar; the first lines
/// say what is wrong.
fn clean_error(message: &str) -> String {
    let lines: Vec<&str> = message.lines().take(6).collect();
    lines.join("\n").trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detokenize::tests::byte_fallback_tokenizer;

    fn compiler() -> GrammarCompiler {
        GrammarCompiler::new(&byte_fallback_tokenizer(), 267, &[2]).unwrap()
    }

    #[test]
    fn good_constraints_compile_to_grammar_json() {
        let c = compiler();
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
        let compiled = c.compile(&Constraint::JsonSchema(schema)).unwrap();
        let grammar: Value = serde_json::from_str(&compiled.0).unwrap();
        assert_eq!(grammar["grammars"][0]["json_schema"]["x-guidance"]["key_separator"], ": ");
        for constraint in [
            Constraint::JsonObject,
            Constraint::JsonSchema(json!(true)),
            Constraint::Regex(r"\d{4}-\d{2}-\d{2}".into()),
            Constraint::Choice(vec!["yes".into(), "no \"quoted\"\n".into()]),
            Constraint::Lark("start: \"a\"+ NUM\nNUM: /[0-9]+/".into()),
        ] {
            c.compile(&constraint).unwrap_or_else(|e| panic!("{constraint:?}: {e}"));
        }
    }

    #[test]
    fn bad_constraints_say_what_is_wrong() {
        let c = compiler();
        let err = c.compile(&Constraint::Regex("[a-".into())).unwrap_err();
        assert!(err.contains("unclosed character class"), "{err}");
        let err = c.compile(&Constraint::JsonSchema(json!({"type": "foo"}))).unwrap_err();
        assert!(err.contains("foo"), "{err}");
        let err = c.compile(&Constraint::JsonSchema(json!([1]))).unwrap_err();
        assert!(err.contains("object"), "{err}");
        let err = c.compile(&Constraint::Lark("start: missing_rule".into())).unwrap_err();
        assert!(err.contains("missing_rule"), "{err}");
        assert!(c.compile(&Constraint::Choice(vec![])).is_err());
        assert!(c.compile(&Constraint::Lark("  ".into())).is_err());
    }

    #[test]
    fn a_client_layout_is_kept() {
        let schema = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        assert_eq!(with_json_layout(&schema), schema);
    }
}

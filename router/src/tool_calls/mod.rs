//! Tool calling: the declared functions become a grammar the output must
//! follow, and the output is parsed back into OpenAI `tool_calls`.
//!
//! Each model family writes its calls its own way; a [`ToolFormat`] knows
//! one of them (`--tool-call-parser`, default from the chat template):
//!
//! ```text
//!   hermes       <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>   (Qwen2.5, SmolLM2, Hermes)
//!                one block per call, separated by "\n"
//!   llama3_json  {"name": "f", "parameters": {...}}; {"name": "g", ...}          (Llama 3.1/3.2/3.3)
//!   mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]           (Mistral v0.3+)
//! ```
//!
//! `tool_choice` decides the grammar: `required` and a named function allow
//! only calls (so the output always parses); `auto` allows free text, but
//! once the model opens a call (`<tool_call>`, a leading `{`, `[TOOL_CALLS]`)
//! the call must name a declared function and match its parameter schema;
//! `none` sends no tools and no grammar. Inside a call "name" comes first,
//! then the arguments, compactly laid out: that is what lets
//! [`stream::ToolCallParser`] stream the name before the arguments.
//!
//! Templates that know no `tools` variable (SmolLM2's) get the tools
//! described in the system message instead, in the format's own words, and
//! earlier calls and tool results written into message content.

pub mod stream;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::grammar::{lark_literal, with_json_layout, Constraint};
use crate::tokenizer::Tokenizer;

/// One function the client declared (OpenAI `tools[i].function`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FunctionDefinition {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema of the arguments object; absent: any object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
    /// Accepted; every call is constrained to its schema anyway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// What the model may do with the tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No call: tools are not shown to the model.
    None,
    /// Text or calls, the model's choice.
    Auto,
    /// At least one call.
    Required,
    /// Exactly one call of this function.
    Named(String),
}

/// A call the model made, in OpenAI's shape (arguments as a JSON string).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// The model families' ways of writing calls (`--tool-call-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum ToolParserKind {
    Hermes,
    #[value(name = "llama3_json")]
    Llama3Json,
    Mistral,
}

impl ToolParserKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
        }
    }

    /// The family a chat template writes calls for; hermes when it does not
    /// say (SmolLM2's template knows no tools; hermes is what it was tuned on).
    pub fn from_template(source: &str) -> Self {
        if source.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if source.contains("<|start_header_id|>") && source.contains("tools") {
            Self::Llama3Json
        } else {
            Self::Hermes
        }
    }
}

/// How the tool-call section opens.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Opener {
    /// This text, anywhere in the output.
    Text(&'static str),
    /// The output starts with the call object itself.
    AtStart,
    /// This special token (by id), which decodes to no text.
    Token(u32),
}

/// One family's call syntax, resolved against the tokenizer.
#[derive(Debug, Clone)]
pub struct ToolFormat {
    pub kind: ToolParserKind,
    pub(crate) opener: Opener,
    /// Written after the opener, before the first call object.
    pub(crate) list_open: &'static str,
    /// Between two call objects of one section.
    pub(crate) separator: &'static str,
    /// After the last call object of a section.
    pub(crate) close: &'static str,
    /// The key of the arguments object ("arguments" or "parameters").
    pub(crate) arguments_key: &'static str,
}

const HERMES_OPEN: &str = "<tool_call>\n";
const HERMES_CLOSE: &str = "\n</tool_call>";
const MISTRAL_TOOL_CALLS: &str = "[TOOL_CALLS]";

impl ToolFormat {
    pub fn new(kind: ToolParserKind, tokenizer: &Tokenizer) -> Self {
        match kind {
            ToolParserKind::Hermes => Self {
                kind,
                opener: Opener::Text(HERMES_OPEN),
                list_open: "",
                // A section per call: the next one opens again.
                separator: "",
                close: HERMES_CLOSE,
                arguments_key: "arguments",
            },
            ToolParserKind::Llama3Json => Self {
                kind,
                opener: Opener::AtStart,
                list_open: "",
                separator: "; ",
                close: "",
                arguments_key: "parameters",
            },
            ToolParserKind::Mistral => {
                let special = tokenizer
                    .token_to_id(MISTRAL_TOOL_CALLS)
                    .filter(|&id| tokenizer.is_special(id));
                Self {
                    kind,
                    opener: special.map_or(Opener::Text(MISTRAL_TOOL_CALLS), Opener::Token),
                    list_open: "[",
                    separator: ", ",
                    close: "]",
                    arguments_key: "arguments",
                }
            }
        }
    }

    /// The schema of one call of `function`: its name, then its arguments.
    fn call_schema(&self, function: &FunctionDefinition) -> Value {
        let arguments = function.parameters.clone().unwrap_or_else(|| json!({"type": "object"}));
        json!({
            "type": "object",
            "properties": {"name": {"const": function.name}, self.arguments_key: arguments},
            "required": ["name", self.arguments_key],
            "additionalProperties": false,
        })
    }

    /// The Lark grammar the output must follow, or `None` for `tool_choice:
    /// none` (no constraint).
    ///
    /// ```text
    ///   hermes    required  start: call ("\n" call)*
    ///             auto      start: TEXT | lead body "\n</tool_call>" ("\n" call)*
    ///                       lead[lazy]: TEXT "<tool_call>\n"   (text ends at the opener)
    ///   llama3    required  start: body ("; " body)*
    ///             auto      start: TEXT | body ("; " body)*      TEXT does not start with "{"
    ///   mistral   required  start: OPEN "[" body (", " body)* "]"
    ///             auto      start: TEXT | OPEN "[" ...           OPEN: <[id]> or "[TOOL_CALLS]"
    /// ```
    /// Without `parallel_tool_calls` (and for a named function) the
    /// repetitions go: exactly one call.
    pub fn grammar(&self, tools: &[FunctionDefinition], choice: &ToolChoice, parallel: bool) -> Option<Constraint> {
        let declared: Vec<&FunctionDefinition> = match choice {
            ToolChoice::None => return None,
            ToolChoice::Named(name) => tools.iter().filter(|f| &f.name == name).collect(),
            ToolChoice::Auto | ToolChoice::Required => tools.iter().collect(),
        };
        let schemas: Vec<Value> = declared.iter().map(|f| self.call_schema(f)).collect();
        let schema = if schemas.len() == 1 { schemas[0].clone() } else { json!({"anyOf": schemas}) };
        let parallel = parallel && !matches!(choice, ToolChoice::Named(_));
        let auto = matches!(choice, ToolChoice::Auto);
        let repeat = |separator: &str, item: &str| {
            if parallel {
                format!(" ({} {item})*", lark_literal(separator))
            } else {
                String::new()
            }
        };
        let mut rules = Vec::new();
        let calls = match self.kind {
            ToolParserKind::Hermes => {
                rules.push(format!("call: {} body {}", lark_literal(HERMES_OPEN), lark_literal(HERMES_CLOSE)));
                if auto {
                    rules.push(format!("lead[lazy]: TEXT {}", lark_literal(HERMES_OPEN)));
                    rules.push("TEXT: /(?s:.*)/".into());
                    format!("lead body {}{}", lark_literal(HERMES_CLOSE), repeat("\n", "call"))
                } else {
                    format!("call{}", repeat("\n", "call"))
                }
            }
            ToolParserKind::Llama3Json => {
                if auto {
                    rules.push("TEXT: /([^{](?s:.*))?/".into());
                }
                format!("body{}", repeat(self.separator, "body"))
            }
            ToolParserKind::Mistral => {
                // Free text may not start like the opener when the opener is text.
                let (open, text) = match &self.opener {
                    Opener::Token(id) => (format!("<[{id}]>"), "TEXT: /(?s:.*)/"),
                    _ => (lark_literal(MISTRAL_TOOL_CALLS), "TEXT: /([^\\[](?s:.*))?/"),
                };
                if auto {
                    rules.push(text.into());
                }
                format!(
                    "{open} {} body{} {}",
                    lark_literal(self.list_open),
                    repeat(self.separator, "body"),
                    lark_literal(self.close)
                )
            }
        };
        let start = if auto { format!("start: TEXT | {calls}") } else { format!("start: {calls}") };
        rules.insert(0, start);
        rules.push(format!("body: %json {}", with_json_layout(&schema)));
        Some(Constraint::Lark(rules.join("\n") + "\n"))
    }

    /// The system-prompt text describing `tools`, for chat templates that
    /// do not render them.
    pub fn system_prompt(&self, tools: &[FunctionDefinition]) -> String {
        let listing: Vec<String> = tools
            .iter()
            .map(|f| json!({"type": "function", "function": f}).to_string())
            .collect();
        let example = self.render_calls(&[("function_name".into(), "{\"argument\": \"value\"}".into())]);
        format!(
            "You can call these functions (JSON schemas of their arguments):\n{}\n\
             To call functions, answer only with the calls, written exactly like this:\n{example}",
            listing.join("\n")
        )
    }

    /// Earlier calls (name, JSON arguments) written as the model writes
    /// them, for templates that do not render `tool_calls`.
    pub fn render_calls(&self, calls: &[(String, String)]) -> String {
        let objects: Vec<String> = calls
            .iter()
            .map(|(name, arguments)| {
                format!("{{\"name\": {}, \"{}\": {arguments}}}", Value::from(name.as_str()), self.arguments_key)
            })
            .collect();
        match self.kind {
            ToolParserKind::Hermes => objects
                .iter()
                .map(|o| format!("{HERMES_OPEN}{o}{HERMES_CLOSE}"))
                .collect::<Vec<_>>()
                .join("\n"),
            ToolParserKind::Llama3Json => objects.join("; "),
            ToolParserKind::Mistral => format!("{MISTRAL_TOOL_CALLS}[{}]", objects.join(", ")),
        }
    }

    /// A fresh call id. Mistral's templates insist on 9 alphanumerics.
    pub fn new_call_id(&self) -> String {
        let id = uuid::Uuid::new_v4().simple().to_string();
        match self.kind {
            ToolParserKind::Mistral => id[..9].to_string(),
            _ => format!("call_{}", &id[..24]),
        }
    }
}

#[cfg(test)]
mod tests;

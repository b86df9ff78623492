//! The fields of OpenAI's (and vLLM's) requests that constrain the output,
//! read into one API-neutral [`Constraint`] or [`ToolRequest`]; validation
//! compiles and checks them (`Validation::tools`, `Validation::compile`).
//!
//! | API | field | constraint |
//! |---|---|---|
//! | OpenAI | `response_format: {"type": "json_object"}` | any JSON object |
//! | OpenAI | `response_format: {"type": "json_schema", "json_schema": {"schema": ...}}` | the schema |
//! | TGI chat | `response_format: {"type": "json" \| "regex", "value": ...}` | the schema or regex |
//! | vLLM | `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` | schema, regex, choice, Lark or GBNF |
//! | vLLM | `structured_outputs: {"json" \| "regex" \| "choice" \| "grammar" \| "json_object"}` | the same |
//! | OpenAI chat | `tools`, `tool_choice`, `parallel_tool_calls` | the tool-call grammar (`tool_calls`) |
//!
//! TGI's own `parameters.grammar` is read in `http::tgi`. At most one
//! constraint per request: two are a 400 naming the second.

use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::grammar::{gbnf_to_lark, looks_like_gbnf};
use crate::grammar::Constraint;
use crate::tool_calls::{FunctionDefinition, ToolChoice};
use crate::validation::ToolRequest;
use crate::validation::ValidationError;

/// OpenAI `response_format` (and TGI's chat variant with `value`).
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ResponseFormat {
    /// `text`, `json_object` or `json_schema` (TGI: `json` or `regex` with `value`).
    #[serde(rename = "type")]
    pub kind: String,
    pub json_schema: Option<JsonSchemaFormat>,
    /// TGI's chat API: the JSON schema itself.
    #[schema(value_type = Option<Object>)]
    pub value: Option<Value>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct JsonSchemaFormat {
    #[serde(rename = "name")]
    pub _name: Option<String>,
    #[serde(rename = "description")]
    pub _description: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Value>,
    /// Accepted: the output always follows the schema.
    #[serde(rename = "strict")]
    pub _strict: Option<bool>,
}

/// vLLM's `structured_outputs` object.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StructuredOutputs {
    #[schema(value_type = Option<Object>)]
    pub json: Option<Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
}

/// vLLM's structured-output extras, flattened into both OpenAI requests.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct GuidedFields {
    /// A JSON schema (an object, or a string holding one).
    #[schema(value_type = Option<Object>)]
    pub guided_json: Option<Value>,
    /// The whole output matches this regex.
    pub guided_regex: Option<String>,
    /// The output is one of these strings.
    pub guided_choice: Option<Vec<String>>,
    /// A Lark (llguidance dialect) or GBNF grammar.
    pub guided_grammar: Option<String>,
    /// Accepted and ignored: llguidance is the one backend.
    #[serde(rename = "guided_decoding_backend")]
    pub _guided_decoding_backend: Option<String>,
    /// Accepted and ignored: JSON is generated compactly.
    #[serde(rename = "guided_whitespace_pattern")]
    pub _guided_whitespace_pattern: Option<String>,
    pub structured_outputs: Option<StructuredOutputs>,
}

/// One entry of OpenAI `tools`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct Tool {
    /// Only `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDefinition,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct NamedFunction {
    pub name: String,
}

/// OpenAI `tool_choice`: `none`, `auto`, `required`, or
/// `{"type": "function", "function": {"name": ...}}`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ToolChoiceSpec {
    Mode(String),
    Named {
        #[serde(rename = "type")]
        kind: String,
        function: NamedFunction,
    },
}

fn unsupported(field: impl Into<String>, message: impl Into<String>) -> ValidationError {
    ValidationError::Unsupported { field: field.into(), message: message.into() }
}

/// A schema given as an object, or as a string holding one (vLLM accepts
/// both; TGI's `grammar` too).
pub(crate) fn schema_value(field: &str, value: &Value) -> Result<Value, ValidationError> {
    match value {
        Value::String(text) => serde_json::from_str(text).map_err(|e| ValidationError::Grammar {
            field: field.into(),
            message: format!("not a JSON schema: {e}"),
        }),
        other => Ok(other.clone()),
    }
}

/// A grammar in Lark, or GBNF rewritten as Lark.
fn grammar_constraint(field: &str, source: &str) -> Result<Constraint, ValidationError> {
    if looks_like_gbnf(source) {
        let lark = gbnf_to_lark(source).map_err(|message| ValidationError::Grammar { field: field.into(), message })?;
        Ok(Constraint::Lark(lark))
    } else {
        Ok(Constraint::Lark(source.to_string()))
    }
}

/// Collects the constraints a request gave; more than one is an error.
#[derive(Default)]
struct Found(Option<(String, Constraint)>);

impl Found {
    fn add(&mut self, field: &str, constraint: Constraint) -> Result<(), ValidationError> {
        if let Some((first, _)) = &self.0 {
            return Err(unsupported(field, format!("give one output constraint per request; `{first}` is given too")));
        }
        self.0 = Some((field.to_string(), constraint));
        Ok(())
    }
}

/// The output constraint of an OpenAI request (`response_format` and vLLM's
/// extras), with the field it came from.
pub fn openai_constraint(
    response_format: Option<&ResponseFormat>,
    guided: &GuidedFields,
) -> Result<Option<(String, Constraint)>, ValidationError> {
    let mut found = Found::default();
    if let Some(format) = response_format {
        match (format.kind.as_str(), &format.json_schema, &format.value) {
            ("text", _, _) => {}
            ("json_object", _, None) => found.add("response_format", Constraint::JsonObject)?,
            ("json_schema", Some(spec), _) => {
                let schema = spec.schema.as_ref().ok_or_else(|| ValidationError::Empty {
                    field: "response_format.json_schema.schema".into(),
                })?;
                let field = "response_format.json_schema.schema";
                found.add(field, Constraint::JsonSchema(schema_value(field, schema)?))?;
            }
            ("json_schema", None, None) => {
                return Err(ValidationError::Empty { field: "response_format.json_schema".into() });
            }
            ("regex", _, Some(Value::String(regex))) => found.add("response_format.value", Constraint::Regex(regex.clone()))?,
            ("json" | "json_object" | "json_schema", _, Some(value)) => {
                let field = "response_format.value";
                found.add(field, Constraint::JsonSchema(schema_value(field, value)?))?;
            }
            (other, _, _) => {
                return Err(unsupported(
                    "response_format.type",
                    format!("`{other}` is not one of `text`, `json_object`, `json_schema`"),
                ))
            }
        }
    }
    if let Some(schema) = &guided.guided_json {
        found.add("guided_json", Constraint::JsonSchema(schema_value("guided_json", schema)?))?;
    }
    if let Some(regex) = &guided.guided_regex {
        found.add("guided_regex", Constraint::Regex(regex.clone()))?;
    }
    if let Some(choice) = &guided.guided_choice {
        found.add("guided_choice", Constraint::Choice(choice.clone()))?;
    }
    if let Some(grammar) = &guided.guided_grammar {
        found.add("guided_grammar", grammar_constraint("guided_grammar", grammar)?)?;
    }
    if let Some(s) = &guided.structured_outputs {
        if let Some(schema) = &s.json {
            let field = "structured_outputs.json";
            found.add(field, Constraint::JsonSchema(schema_value(field, schema)?))?;
        }
        if let Some(regex) = &s.regex {
            found.add("structured_outputs.regex", Constraint::Regex(regex.clone()))?;
        }
        if let Some(choice) = &s.choice {
            found.add("structured_outputs.choice", Constraint::Choice(choice.clone()))?;
        }
        if let Some(grammar) = &s.grammar {
            found.add("structured_outputs.grammar", grammar_constraint("structured_outputs.grammar", grammar)?)?;
        }
        if s.json_object == Some(true) {
            found.add("structured_outputs.json_object", Constraint::JsonObject)?;
        }
    }
    Ok(found.0)
}

/// The tools of a chat request as declared; `Validation::tools` checks
/// names, choices and schemas.
pub fn tool_request(
    tools: Option<&[Tool]>,
    choice: Option<&ToolChoiceSpec>,
    parallel: Option<bool>,
) -> Result<ToolRequest, ValidationError> {
    let tools = tools.unwrap_or_default();
    let mut functions = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        if tool.kind != "function" {
            return Err(unsupported(format!("tools[{i}].type"), format!("`{}` is not `function`", tool.kind)));
        }
        functions.push(tool.function.clone());
    }
    let choice = match choice {
        None => None,
        Some(ToolChoiceSpec::Mode(mode)) => Some(match mode.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(unsupported(
                    "tool_choice",
                    format!("`{other}` is not one of `none`, `auto`, `required` or a named function"),
                ))
            }
        }),
        Some(ToolChoiceSpec::Named { kind, function }) => {
            if kind != "function" {
                return Err(unsupported("tool_choice.type", format!("`{kind}` is not `function`")));
            }
            Some(ToolChoice::Named(function.name.clone()))
        }
    };
    Ok(ToolRequest { functions, choice, parallel })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn guided(value: Value) -> GuidedFields {
        serde_json::from_value(value).unwrap()
    }

    fn format(value: Value) -> ResponseFormat {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn each_api_spelling_maps_to_one_constraint() {
        let schema = json!({"type": "object"});
        let cases: Vec<(Option<ResponseFormat>, GuidedFields, &str, Constraint)> = vec![
            (Some(format(json!({"type": "json_object"}))), GuidedFields::default(), "response_format", Constraint::JsonObject),
            (
                Some(format(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}))),
                GuidedFields::default(),
                "response_format.json_schema.schema",
                Constraint::JsonSchema(schema.clone()),
            ),
            (Some(format(json!({"type": "json", "value": schema}))), GuidedFields::default(), "response_format.value", Constraint::JsonSchema(schema.clone())),
            (Some(format(json!({"type": "regex", "value": "x+"}))), GuidedFields::default(), "response_format.value", Constraint::Regex("x+".into())),
            (None, guided(json!({"guided_json": "{\"type\": \"object\"}"})), "guided_json", Constraint::JsonSchema(schema.clone())),
            (None, guided(json!({"guided_regex": "a+"})), "guided_regex", Constraint::Regex("a+".into())),
            (None, guided(json!({"guided_choice": ["a", "b"]})), "guided_choice", Constraint::Choice(vec!["a".into(), "b".into()])),
            (None, guided(json!({"guided_grammar": "start: \"a\""})), "guided_grammar", Constraint::Lark("start: \"a\"".into())),
            (None, guided(json!({"guided_grammar": "root ::= \"a\""})), "guided_grammar", Constraint::Lark("start: \"a\"\n".into())),
            (None, guided(json!({"structured_outputs": {"json_object": true}})), "structured_outputs.json_object", Constraint::JsonObject),
            (None, guided(json!({"structured_outputs": {"regex": "b"}})), "structured_outputs.regex", Constraint::Regex("b".into())),
        ];
        for (rf, g, field, constraint) in cases {
            let (got_field, got) = openai_constraint(rf.as_ref(), &g).unwrap().expect(field);
            assert_eq!((got_field.as_str(), got), (field, constraint));
        }
        assert_eq!(openai_constraint(Some(&format(json!({"type": "text"}))), &GuidedFields::default()).unwrap(), None);
    }

    #[test]
    fn mistakes_name_their_field() {
        let err = |rf: Option<Value>, g: Value| {
            openai_constraint(rf.map(format).as_ref(), &guided(g)).unwrap_err().param().unwrap().to_string()
        };
        assert_eq!(err(Some(json!({"type": "yaml"})), json!({})), "response_format.type");
        assert_eq!(err(Some(json!({"type": "json_schema"})), json!({})), "response_format.json_schema");
        assert_eq!(err(Some(json!({"type": "json_schema", "json_schema": {"name": "x"}})), json!({})), "response_format.json_schema.schema");
        assert_eq!(err(None, json!({"guided_json": "{not json"})), "guided_json");
        assert_eq!(err(Some(json!({"type": "json_object"})), json!({"guided_regex": "a"})), "guided_regex");
        assert_eq!(err(None, json!({"guided_grammar": "root ::= [z-a]"})), "guided_grammar");
    }

    fn tools(v: Value) -> Vec<Tool> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn tools_and_choices_are_read() {
        let declared = tools(json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "now"}},
        ]));
        let choice = |v: Value| serde_json::from_value::<ToolChoiceSpec>(v).unwrap();
        let read = |c: Value| tool_request(Some(&declared), Some(&choice(c)), Some(false)).unwrap().choice.unwrap();
        assert_eq!(read(json!({"type": "function", "function": {"name": "now"}})), ToolChoice::Named("now".into()));
        assert_eq!(read(json!("required")), ToolChoice::Required);
        assert_eq!(read(json!("none")), ToolChoice::None);
        assert_eq!(read(json!("auto")), ToolChoice::Auto);
        let t = tool_request(Some(&declared), None, None).unwrap();
        assert_eq!((t.functions.len(), t.choice, t.parallel), (2, None, None));

        let field = |t: &[Tool], c: Option<Value>| {
            tool_request(Some(t), c.map(choice).as_ref(), None).unwrap_err().param().unwrap().to_string()
        };
        assert_eq!(field(&declared, Some(json!("sometimes"))), "tool_choice");
        assert_eq!(field(&declared, Some(json!({"type": "retrieval", "function": {"name": "now"}}))), "tool_choice.type");
        assert_eq!(field(&tools(json!([{"type": "retrieval", "function": {"name": "a"}}])), None), "tools[0].type");
    }
}

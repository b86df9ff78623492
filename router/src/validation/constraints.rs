//! Output constraints and tools: a constraint compiles against the
//! tokenizer (llguidance) or is a 400 naming its field; a chat request's
//! tools are checked and turned into the grammar every output follows.

use super::error::ValidationError;
use super::params::ToolRequest;
use super::validate::Validation;
use crate::grammar::{CompiledGrammar, Constraint};
use crate::tool_calls::{FunctionDefinition, ToolChoice};

/// Tools that passed validation.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidTools {
    pub functions: Vec<FunctionDefinition>,
    pub choice: ToolChoice,
    /// The grammar every output follows (`None` for `tool_choice: none`),
    /// with the field named when it does not compile.
    pub constraint: Option<(String, Constraint)>,
}

impl ValidTools {
    /// What the chat template shows the model: nothing for `none`.
    pub fn shown(&self) -> Option<&[FunctionDefinition]> {
        (self.choice != ToolChoice::None).then_some(self.functions.as_slice())
    }
}

/// A request's one output constraint: a response format (or a vLLM
/// `guided_*` field) and a tool-call grammar exclude each other.
pub fn one_constraint(
    format: Option<(String, Constraint)>,
    tools: Option<(String, Constraint)>,
) -> Result<Option<(String, Constraint)>, ValidationError> {
    match (format, tools) {
        (Some((field, _)), Some(_)) => Err(ValidationError::Unsupported {
            field,
            message: "cannot be combined with `tools` (unless `tool_choice` is `none`)".into(),
        }),
        (format, tools) => Ok(format.or(tools)),
    }
}

/// OpenAI's rule for function names.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Validation {
    /// Compiles `constraint` (from request field `field`): a 400 naming the
    /// field and the problem when it does not compile.
    pub fn compile(&self, field: &str, constraint: &Constraint) -> Result<CompiledGrammar, ValidationError> {
        let compiler = self.grammar.as_ref().ok_or_else(|| ValidationError::Unsupported {
            field: field.into(),
            message: "structured output is not available: llguidance cannot read this model's tokenizer".into(),
        })?;
        compiler.compile(constraint).map_err(|message| ValidationError::Grammar { field: field.into(), message })
    }
    /// Checks a chat request's tools: names (OpenAI's rule, no duplicates),
    /// each parameters schema (compiled alone, so a 400 names the tool), the
    /// choice. `None`: no tools, and no choice that needs them.
    pub fn tools(&self, t: &ToolRequest) -> Result<Option<ValidTools>, ValidationError> {
        for (i, f) in t.functions.iter().enumerate() {
            let field = |name: &str| format!("tools[{i}].function.{name}");
            if !valid_function_name(&f.name) {
                return Err(ValidationError::Unsupported {
                    field: field("name"),
                    message: "must be 1 to 64 letters, digits, `_` or `-`".into(),
                });
            }
            if t.functions[..i].iter().any(|g| g.name == f.name) {
                return Err(ValidationError::Unsupported {
                    field: field("name"),
                    message: format!("`{}` is declared twice", f.name),
                });
            }
            if let Some(parameters) = &f.parameters {
                self.compile(&field("parameters"), &Constraint::JsonSchema(parameters.clone()))?;
            }
        }
        let choice = match &t.choice {
            None if t.functions.is_empty() => ToolChoice::None,
            None => ToolChoice::Auto,
            Some(ToolChoice::Named(name)) if !t.functions.iter().any(|f| &f.name == name) => {
                return Err(ValidationError::Unsupported {
                    field: "tool_choice.function.name".into(),
                    message: format!("`{name}` is not one of the declared tools"),
                });
            }
            Some(choice) => choice.clone(),
        };
        if t.functions.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(ValidationError::Empty { field: "tools".into() }),
            };
        }
        let constraint = self
            .tool_format
            .grammar(&t.functions, &choice, t.parallel.unwrap_or(true))
            .map(|grammar| ("tools".to_string(), grammar));
        Ok(Some(ValidTools { functions: t.functions.clone(), choice, constraint }))
    }
}

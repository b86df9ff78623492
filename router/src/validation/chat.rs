//! Chat requests of every API (OpenAI chat, Responses, Anthropic Messages):
//! messages rendered with the request's template variables, the output's
//! one constraint (a response format or the tools' grammar) applied after a
//! reasoning model's thinking (for harmony: a response format constrains
//! the final channel, the tools' grammar is harmony's own), then the usual
//! checks.

use super::constraints::{one_constraint, ValidTools};
use super::error::ValidationError;
use super::params::{GenerateParameters, Prompt};
use super::validate::{Validated, Validation};
use crate::chat_template::{TemplateKwargs, TemplateMessage, STANDARD_VARIABLES};
use crate::grammar::Constraint;
use crate::reasoning::{PromptReasoning, Reasoning};

/// A chat request as its handler read it.
pub struct ChatInput<'a> {
    pub messages: &'a [TemplateMessage],
    /// Checked by [`Validation::tools`].
    pub tools: Option<&'a ValidTools>,
    /// `chat_template_kwargs` (or what an API's own fields mean for the
    /// template, e.g. Anthropic's `thinking`).
    pub kwargs: &'a TemplateKwargs,
    /// The response format, with the field it came from.
    pub format: Option<(String, Constraint)>,
}

/// A chat request that passed validation.
pub struct ValidChat {
    pub prompt: Validated,
    /// With a reasoning parser: how this prompt's output is read.
    pub reasoning: Option<PromptReasoning>,
}

impl Validation {
    /// Renders, constrains and validates one chat request; `params` carry
    /// everything but the constraint.
    pub fn validate_chat(&self, input: ChatInput<'_>, mut params: GenerateParameters) -> Result<ValidChat, ValidationError> {
        check_kwargs(input.kwargs)?;
        let shown = input.tools.and_then(ValidTools::shown);
        let rendered = self.render_chat_with_tools(input.messages, shown, input.kwargs)?;
        let reasoning = self.reasoning.as_ref().map(|r| r.for_prompt(&rendered));
        let format = match (&self.reasoning, input.format) {
            (Some(Reasoning::Harmony(harmony)), Some((field, answer))) => Some((field, harmony.final_answer(answer))),
            (_, format) => format,
        };
        let constraint = one_constraint(format, input.tools.and_then(|t| t.constraint.clone()))?;
        params.constraint = match (&reasoning, constraint) {
            (Some(PromptReasoning::Tags(format, start)), Some((field, answer))) => {
                Some((field, format.after_thinking(answer, *start)))
            }
            (_, constraint) => constraint,
        };
        let mut prompts = self.validate_prompts(&[Prompt::Chat(rendered)], "messages", &params)?;
        Ok(ValidChat { prompt: prompts.remove(0), reasoning })
    }
}

/// Template variables may be any JSON values, under names of their own.
fn check_kwargs(kwargs: &TemplateKwargs) -> Result<(), ValidationError> {
    match kwargs.keys().find(|k| STANDARD_VARIABLES.contains(&k.as_str())) {
        Some(name) => Err(ValidationError::Unsupported {
            field: format!("chat_template_kwargs.{name}"),
            message: "is set by the server; pass it in the request's own fields".into(),
        }),
        None => Ok(()),
    }
}

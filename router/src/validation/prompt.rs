//! The prompt: text tokenized (with BOS for raw text), token ids checked
//! against the vocabulary, chat messages rendered by the model's template
//! (with the request's tools shown to the model).

use super::error::ValidationError;
use super::params::Prompt;
use super::validate::Validation;
use crate::chat_template::{ChatTemplateError, TemplateKwargs, TemplateMessage};
use crate::tool_calls::FunctionDefinition;

impl Validation {
    #[cfg(test)]
    pub fn render_chat(&self, messages: &[TemplateMessage]) -> Result<String, ValidationError> {
        if messages.is_empty() {
            return Err(ValidationError::Empty {
                field: "messages".into(),
            });
        }
        self.render_chat_with_tools(messages, None, &TemplateKwargs::new())
    }

    /// The chat prompt with `tools` shown to the model (None: no tools,
    /// or `tool_choice: none`). A template that renders a `tools` variable
    /// gets them, and the messages' `tool_calls`, as they are; for one that
    /// does not, the tools are described in the system message and earlier
    /// calls written into their message's content, in the model's tool-call
    /// format.
    pub fn render_chat_with_tools(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&[FunctionDefinition]>,
        kwargs: &TemplateKwargs,
    ) -> Result<String, ValidationError> {
        if messages.is_empty() {
            return Err(ValidationError::Empty {
                field: "messages".into(),
            });
        }
        let template = self.chat_template.as_ref().ok_or(ValidationError::NoChatTemplate)?;
        let rendered = if template.supports_tools() {
            let listing: Option<Vec<serde_json::Value>> =
                tools.map(|t| t.iter().map(|f| serde_json::json!({"type": "function", "function": f})).collect());
            template.apply_with_tools(messages, listing.as_deref(), true, kwargs)
        } else if tools.is_some() || messages.iter().any(|m| m.tool_calls.is_some()) {
            template.apply_with_tools(&self.tools_in_text(messages, tools), None, true, kwargs)
        } else {
            template.apply_with_tools(messages, None, true, kwargs)
        };
        rendered.map_err(|e| match e {
            ChatTemplateError::Render(message) => ValidationError::ChatTemplate(message),
            other => ValidationError::ChatTemplate(other.to_string()),
        })
    }

    /// `messages` for a template that knows no tools: the tools described
    /// in the system message (merged into the client's, or a new first one),
    /// earlier calls appended to their assistant message's content.
    fn tools_in_text(&self, messages: &[TemplateMessage], tools: Option<&[FunctionDefinition]>) -> Vec<TemplateMessage> {
        let format = &self.tool_format;
        let mut out: Vec<TemplateMessage> = messages
            .iter()
            .map(|m| {
                let Some(calls) = &m.tool_calls else { return m.clone() };
                let calls: Vec<(String, String)> = calls
                    .iter()
                    .map(|c| {
                        let name = c["function"]["name"].as_str().unwrap_or_default().to_string();
                        (name, c["function"]["arguments"].to_string())
                    })
                    .collect();
                let text = format.render_calls(&calls);
                let content = if m.content.is_empty() { text } else { format!("{}\n{text}", m.content) };
                TemplateMessage { content, tool_calls: None, ..m.clone() }
            })
            .collect();
        if let Some(tools) = tools {
            let description = format.system_prompt(tools);
            match out.first_mut() {
                Some(first) if first.role == "system" => first.content = format!("{}\n\n{description}", first.content),
                _ => out.insert(0, TemplateMessage::text("system", description)),
            }
        }
        out
    }

    /// Prompt token ids. Raw text gets the tokenizer's special tokens (BOS)
    /// when `add_special_tokens`; chat-template output never does (it spells
    /// them already).
    #[tracing::instrument(level = "debug", name = "tokenize", skip_all)]
    pub fn tokenize(
        &self,
        prompt: &Prompt,
        field: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ValidationError> {
        let ids = match prompt {
            Prompt::Text(text) | Prompt::Chat(text) => {
                if text.is_empty() {
                    return Err(ValidationError::Empty { field: field.into() });
                }
                let add_special_tokens = add_special_tokens && matches!(prompt, Prompt::Text(_));
                self.tokenizer
                    .encode(text, add_special_tokens)
                    .map_err(|e| ValidationError::Tokenizer(e.to_string()))?
            }
            Prompt::Tokens(ids) => ids
                .iter()
                .map(|&id| self.check_token(field, id))
                .collect::<Result<_, _>>()?,
        };
        if ids.is_empty() {
            return Err(ValidationError::Empty { field: field.into() });
        }
        Ok(ids)
    }

    pub(super) fn check_token(&self, field: &str, id: u64) -> Result<u32, ValidationError> {
        if id >= u64::from(self.vocab_size) {
            return Err(ValidationError::UnknownToken {
                field: field.into(),
                id,
                vocab_size: self.vocab_size,
            });
        }
        Ok(id as u32)
    }
}

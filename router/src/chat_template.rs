//! Chat templates: Hugging Face Jinja templates rendered with minijinja the
//! way `transformers`' `apply_chat_template` renders them: `trim_blocks` and
//! `lstrip_blocks` on, Python string methods (`.strip()`, `.upper()`, ...)
//! through minijinja-contrib's pycompat, `raise_exception`, `strftime_now`,
//! a `tojson` that does not HTML-escape, and the variables `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token` and, for tool calling,
//! `tools` (OpenAI's list of `{"type": "function", "function": {...}}`).
//! Messages carry `tool_calls` (arguments as objects, as transformers passes
//! them), `tool_call_id` and `name` when the client sent them.
//!
//! Tested against renderings by `transformers` itself:
//! router/fixtures/chat_templates.json, made by
//! scripts/gen_chat_template_fixtures.py.

use std::path::Path;

use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// The template does not compile (at startup).
    #[error("invalid chat template: {0}")]
    Invalid(String),
    /// The template refused these messages (`raise_exception`) or failed on
    /// them: the client's fault, HTTP 4xx.
    #[error("{0}")]
    Render(String),
    #[error("cannot read {path}: {message}")]
    Read { path: String, message: String },
}

/// One chat message as templates see it: content already flattened to a
/// string (OpenAI's list of `{"type": "text"}` parts joined by newlines).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct TemplateMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls: `{"id", "type": "function", "function":
    /// {"name", "arguments"}}` with the arguments as a JSON value.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(default)]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool result: the call it answers.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub name: Option<String>,
    /// An assistant turn's thinking (Qwen3's template shows the last turn's).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reasoning_content: Option<String>,
}

/// Extra template variables a request passes (`chat_template_kwargs`).
pub type TemplateKwargs = serde_json::Map<String, serde_json::Value>;

/// The variables every rendering sets; `chat_template_kwargs` may not name them.
pub const STANDARD_VARIABLES: [&str; 5] = ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

impl TemplateMessage {
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), ..Default::default() }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

const TEMPLATE_NAME: &str = "chat";

/// Instructions one rendering may execute. Templates come from model
/// repositories and GGUF files, and run on every chat request: a loop
/// there must end in an error, not hold a worker. Real templates use a few
/// hundred per message; this leaves room for thousands of messages.
pub const RENDER_FUEL: u64 = 2_000_000;

impl ChatTemplate {
    pub fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| ChatTemplateError::Invalid(format!("{e:#}")))?;
        Ok(Self {
            env,
            source,
            bos_token,
            eos_token,
        })
    }

    /// Finds the model folder's template: `override_template` (a file path
    /// or the template itself) first, then `chat_template.jinja`, then
    /// `tokenizer_config.json`'s `chat_template` (a string, or a list of
    /// named templates of which "default" is used). `Ok(None)`: the model
    /// has no template, chat completions answer 400.
    pub fn from_model_dir(
        dir: &Path,
        override_template: Option<&str>,
    ) -> Result<Option<Self>, ChatTemplateError> {
        let config = read_json(&dir.join("tokenizer_config.json"))?;
        let special = |name: &str| -> Option<String> {
            match config.as_ref()?.get(name)? {
                serde_json::Value::String(s) => Some(s.clone()),
                other => other.get("content")?.as_str().map(str::to_string),
            }
        };
        let (bos, eos) = (special("bos_token"), special("eos_token"));
        let source = if let Some(template) = override_template {
            let path = Path::new(template);
            if path.is_file() {
                read_text(path)?
            } else {
                template.to_string()
            }
        } else if dir.join("chat_template.jinja").is_file() {
            read_text(&dir.join("chat_template.jinja"))?
        } else {
            match config.as_ref().and_then(|c| c.get("chat_template")) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Array(named)) => {
                    let default = named.iter().find(|t| t["name"] == "default");
                    match default.and_then(|t| t["template"].as_str()) {
                        Some(s) => s.to_string(),
                        None => return Ok(None),
                    }
                }
                _ => return Ok(None),
            }
        };
        Self::new(source, bos, eos).map(Some)
    }

    #[cfg(test)]
    pub fn apply(
        &self,
        messages: &[TemplateMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.apply_with_tools(messages, None, add_generation_prompt, &TemplateKwargs::new())
    }

    /// Whether the template renders a `tools` variable (Qwen2.5's, Llama
    /// 3.1's, Mistral's do; SmolLM2's does not).
    pub fn supports_tools(&self) -> bool {
        self.env
            .get_template(TEMPLATE_NAME)
            .is_ok_and(|t| t.undeclared_variables(false).contains("tools"))
    }

    /// The template's source (the tool-call parser defaults from it).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// `kwargs`: the request's `chat_template_kwargs` (e.g. Qwen3's
    /// `enable_thinking`), variables beside the standard ones, which they
    /// cannot replace (validation refuses those names).
    pub fn apply_with_tools(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        kwargs: &TemplateKwargs,
    ) -> Result<String, ChatTemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatTemplateError::Invalid(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                ..Value::from_serialize(kwargs)
            })
            .map_err(|e| match e.kind() {
                // raise_exception's message is for the user as is.
                ErrorKind::InvalidOperation => {
                    ChatTemplateError::Render(e.detail().unwrap_or("invalid messages").to_string())
                }
                ErrorKind::OutOfFuel => ChatTemplateError::Render(format!(
                    "the chat template did not finish rendering these messages within {RENDER_FUEL} steps"
                )),
                _ => ChatTemplateError::Render(format!("chat template failed: {e}")),
            })
    }
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> String {
    // No chrono dependency: templates use this for "today's date" banners;
    // formatting from the system clock in UTC covers %d %m %Y %b %B.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format_date(secs, &format)
}

/// Formats the UTC date of `unix_secs` with the strftime directives chat
/// templates use (%d, %m, %Y, %y, %b, %B, %%); others are kept verbatim.
fn format_date(unix_secs: u64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January", "February", "March", "April", "May", "June", "July", "August", "September",
        "October", "November", "December",
    ];
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let days = (unix_secs / 86_400) as i64 + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Python's `json.dumps(x, ensure_ascii=False)` (with `indent` when given),
/// unlike minijinja's built-in `tojson` which escapes HTML characters.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let text = match indent {
        Some(n) => {
            let indent = " ".repeat(n);
            let formatter = serde_json::ser::PrettyFormatter::with_indent(indent.as_bytes());
            let mut out = Vec::new();
            let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
            serde::Serialize::serialize(&json, &mut serializer)
                .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            String::from_utf8(out).unwrap_or_default()
        }
        // Python's default separators put a space after ',' and ':'.
        None => python_json(&json),
    };
    Ok(Value::from_safe_string(text))
}

fn python_json(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::Array(items) => {
            let items: Vec<String> = items.iter().map(python_json).collect();
            format!("[{}]", items.join(", "))
        }
        serde_json::Value::Object(map) => {
            let items: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", serde_json::Value::from(k.as_str()), python_json(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        other => other.to_string(),
    }
}

fn read_text(path: &Path) -> Result<String, ChatTemplateError> {
    std::fs::read_to_string(path).map_err(|e| ChatTemplateError::Read {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>, ChatTemplateError> {
    if !path.is_file() {
        return Ok(None);
    }
    serde_json::from_str(&read_text(path)?)
        .map(Some)
        .map_err(|e| ChatTemplateError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Fixture {
        name: String,
        template: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
        cases: Vec<Case>,
    }

    #[derive(serde::Deserialize)]
    struct Case {
        messages: Vec<TemplateMessageIn>,
        add_generation_prompt: bool,
        ok: Option<String>,
        error: Option<String>,
    }

    #[derive(serde::Deserialize)]
    struct TemplateMessageIn {
        role: String,
        content: String,
    }

    /// Every fixture case renders exactly as transformers rendered it.
    #[test]
    fn renders_like_transformers() {
        let text = include_str!("../fixtures/chat_templates.json");
        let fixtures: Vec<Fixture> = serde_json::from_str(text).unwrap();
        let names: Vec<&str> = fixtures.iter().map(|f| f.name.as_str()).collect();
        assert!(names.contains(&"smollm2") && names.contains(&"llama3") && names.contains(&"qwen2"));
        let mut checked = 0;
        for fixture in &fixtures {
            let template = ChatTemplate::new(
                fixture.template.clone(),
                fixture.bos_token.clone(),
                fixture.eos_token.clone(),
            )
            .unwrap();
            for case in &fixture.cases {
                let messages: Vec<TemplateMessage> =
                    case.messages.iter().map(|m| TemplateMessage::text(&m.role, &m.content)).collect();
                let got = template.apply(&messages, case.add_generation_prompt);
                match (&case.ok, &case.error, got) {
                    (Some(expected), _, Ok(got)) => assert_eq!(&got, expected, "{}", fixture.name),
                    (_, Some(expected), Err(ChatTemplateError::Render(got))) => {
                        assert_eq!(&got, expected, "{}", fixture.name)
                    }
                    (ok, err, got) => panic!("{}: expected {ok:?}/{err:?}, got {got:?}", fixture.name),
                }
                checked += 1;
            }
        }
        assert!(checked >= 24);
    }

    #[derive(serde::Deserialize)]
    struct ToolsFixture {
        template: String,
        eos_token: Option<String>,
        cases: Vec<ToolsCase>,
    }

    #[derive(serde::Deserialize)]
    struct ToolsCase {
        messages: Vec<TemplateMessage>,
        tools: Option<Vec<serde_json::Value>>,
        add_generation_prompt: bool,
        ok: String,
    }

    #[test]
    fn kwargs_are_template_variables_beside_the_standard_ones() {
        let template = ChatTemplate::new(
            "{{ messages[0].content }}{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{{ add_generation_prompt }}".into(),
            None,
            None,
        )
        .unwrap();
        let messages = [TemplateMessage::text("user", "hi")];
        let mut kwargs = TemplateKwargs::new();
        // Booleans print as Python's, as transformers renders them.
        assert_eq!(template.apply_with_tools(&messages, None, true, &kwargs).unwrap(), "hiTrue");
        kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(false));
        assert_eq!(template.apply_with_tools(&messages, None, true, &kwargs).unwrap(), "hi<think></think>True");
        // The standard variables win over a kwarg of the same name.
        kwargs.insert("add_generation_prompt".into(), serde_json::Value::Bool(false));
        assert_eq!(template.apply_with_tools(&messages, None, true, &kwargs).unwrap(), "hi<think></think>True");
    }

    /// Tools, assistant tool calls and tool results render as transformers
    /// renders them (router/fixtures/chat_templates_tools.json).
    #[test]
    fn tools_render_like_transformers() {
        let fixture: ToolsFixture = serde_json::from_str(include_str!("../fixtures/chat_templates_tools.json")).unwrap();
        let template = ChatTemplate::new(fixture.template, None, fixture.eos_token).unwrap();
        assert!(template.supports_tools());
        for case in &fixture.cases {
            let got =
                template.apply_with_tools(&case.messages, case.tools.as_deref(), case.add_generation_prompt, &TemplateKwargs::new());
            assert_eq!(got.unwrap(), case.ok);
        }
        assert!(fixture.cases.iter().any(|c| c.messages.iter().any(|m| m.tool_calls.is_some())));
        let plain = ChatTemplate::new("{{ messages[0].content }}".into(), None, None).unwrap();
        assert!(!plain.supports_tools());
    }

    #[test]
    fn model_dir_prefers_jinja_file_and_reads_special_tokens() {
        let dir = std::env::temp_dir().join(format!("sluice-tpl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": "config"}"#,
        )
        .unwrap();
        let render = |t: &ChatTemplate| t.apply(&[], false).unwrap();
        let from_config = ChatTemplate::from_model_dir(&dir, None).unwrap().unwrap();
        assert_eq!(render(&from_config), "config");
        std::fs::write(dir.join("chat_template.jinja"), "{{ bos_token }}file{{ eos_token }}").unwrap();
        let from_file = ChatTemplate::from_model_dir(&dir, None).unwrap().unwrap();
        assert_eq!(render(&from_file), "<s>file</s>");
        let inline = ChatTemplate::from_model_dir(&dir, Some("inline")).unwrap().unwrap();
        assert_eq!(render(&inline), "inline");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tojson_and_dates_follow_python() {
        let t = ChatTemplate::new(
            "{{ {'a': [1, 'é<'], 'b': none} | tojson }}".into(),
            None,
            None,
        )
        .unwrap();
        assert_eq!(t.apply(&[], false).unwrap(), r#"{"a": [1, "é<"], "b": null}"#);
        // 2024-02-29 is day 19782 since the epoch.
        assert_eq!(format_date(19_782 * 86_400, "%d %b %Y"), "29 Feb 2024");
        assert_eq!(format_date(0, "%Y-%m-%d %%"), "1970-01-01 %");
    }

    #[test]
    fn broken_template_is_rejected_at_load() {
        assert!(matches!(
            ChatTemplate::new("{% for %}".into(), None, None),
            Err(ChatTemplateError::Invalid(_))
        ));
    }

    /// A template that loops (from a hostile or broken model repository)
    /// ends in an error instead of holding a worker.
    #[test]
    fn a_looping_template_runs_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for i in range(50000) %}{% for j in range(50000) %}{{ i }}{% endfor %}{% endfor %}".into(),
            None,
            None,
        )
        .unwrap();
        match t.apply(&[], false) {
            Err(ChatTemplateError::Render(message)) => assert!(message.contains("did not finish"), "{message}"),
            Err(other) => panic!("unexpected error: {other}"),
            Ok(text) => panic!("rendered {} bytes", text.len()),
        }
    }
}

//! What the launcher prints: its own lines (through `tracing`) and every line
//! its children print, all on stdout.
//!
//! With `--json-output` every printed line is one JSON object: the launcher's
//! own lines come from tracing's JSON format; a child line that already is a
//! JSON object passes through unchanged, any other child line is wrapped in an
//! object of the same shape as tracing's:
//! `{"timestamp":..,"level":"INFO","fields":{"message":LINE},"target":CHILD}`.

use std::io::Write;

use tracing_subscriber::EnvFilter;

/// Installs the launcher's own logger (level from RUST_LOG, default info).
pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// How child lines are printed; copied into every forwarding task.
#[derive(Clone, Copy, Debug)]
pub struct ChildLines {
    pub json: bool,
}

impl ChildLines {
    /// Prints one line of child `source` (`shard-0`, `router`, ...).
    pub fn print(self, source: &str, line: &str) {
        let text = self.format(source, line);
        // One write per line, under stdout's lock, so lines of concurrent
        // children never interleave.
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(text.as_bytes());
        let _ = out.flush();
    }

    /// The printed form of a child line, newline included.
    pub fn format(self, source: &str, line: &str) -> String {
        if !self.json {
            return format!("[{source}] {line}\n");
        }
        let trimmed = line.trim();
        let is_object = trimmed.starts_with('{')
            && serde_json::from_str::<serde_json::Value>(trimmed).is_ok_and(|v| v.is_object());
        if is_object {
            return format!("{trimmed}\n");
        }
        let wrapped = serde_json::json!({
            "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
            "level": "INFO",
            "fields": { "message": line },
            "target": source,
        });
        format!("{wrapped}\n")
    }
}

/// The message of a child's log line, for a one-line error: the `message`
/// (or tracing's `fields.message`) of a JSON line, else the line itself.
pub fn message_of(line: &str) -> String {
    let line = line.trim();
    if let Ok(serde_json::Value::Object(entry)) = serde_json::from_str(line) {
        let message = entry.get("message").or_else(|| entry.get("fields").and_then(|f| f.get("message")));
        if let Some(serde_json::Value::String(message)) = message {
            return message.clone();
        }
    }
    line.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_lines_are_prefixed_with_their_child() {
        let out = ChildLines { json: false }.format("shard-1", "Loading weights");
        assert_eq!(out, "[shard-1] Loading weights\n");
    }

    #[test]
    fn json_lines_pass_through_and_others_are_wrapped() {
        let lines = ChildLines { json: true };
        let passed = lines.format("router", r#"  {"level":"INFO","fields":{"message":"hi"}}"#);
        assert_eq!(passed, "{\"level\":\"INFO\",\"fields\":{\"message\":\"hi\"}}\n");

        for raw in ["Traceback (most recent call last):", "[1, 2]", "{not json", "\"quoted\" \\ tab\t"] {
            let out = lines.format("shard-0", raw);
            assert!(out.ends_with('\n') && out.matches('\n').count() == 1, "{out:?}");
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["fields"]["message"], raw);
            assert_eq!(v["target"], "shard-0");
            assert_eq!(v["level"], "INFO");
            assert!(v["timestamp"].as_str().unwrap().ends_with('Z'));
        }
    }

    #[test]
    fn messages_are_taken_out_of_json_lines() {
        assert_eq!(message_of(r#"{"level":"ERROR","message":"boom"}"#), "boom");
        assert_eq!(message_of(r#"{"fields":{"message":"bang"}}"#), "bang");
        assert_eq!(message_of(r#"{"other":1}"#), r#"{"other":1}"#);
        assert_eq!(message_of("  plain text "), "plain text");
    }
}

//! Reading a batch input file: JSONL, one request per line,
//!
//! ```text
//!  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
//! ```
//!
//! checked twice. At upload ([`check_upload`]): UTF-8 text, at most
//! `max_lines` request lines, no `custom_id` given twice (a 400 naming it:
//! results are matched to requests by it). At batch creation ([`parse`]):
//! every line again, now against the batch's endpoint; a line that is not
//! such an object, or names another endpoint, becomes an error-file line of
//! its own and the rest of the batch runs. Blank lines are skipped; line
//! numbers count from 1, blank lines included.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;

use super::types::Endpoint;

/// One line of an input file, checked.
#[derive(Debug, Clone, PartialEq)]
pub enum InputLine {
    /// A request for the batch's endpoint; `body` is its JSON text.
    Request { line: u64, custom_id: String, body: String },
    /// A line that cannot run: why, for the error file.
    Invalid { line: u64, custom_id: Option<String>, message: String },
}

impl InputLine {
    pub fn line(&self) -> u64 {
        match self {
            Self::Request { line, .. } | Self::Invalid { line, .. } => *line,
        }
    }

    pub fn custom_id(&self) -> Option<&str> {
        match self {
            Self::Request { custom_id, .. } => Some(custom_id),
            Self::Invalid { custom_id, .. } => custom_id.as_deref(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLine {
    custom_id: Value,
    method: Value,
    url: Value,
    body: Value,
}

/// Why a file cannot be a batch's input (a 400: `BatchError::Invalid`).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidInput(pub String);

/// Checks an upload; returns its number of request lines.
pub fn check_upload(content: &[u8], max_lines: usize) -> Result<usize, InvalidInput> {
    Ok(parse(content, None, max_lines)?.len())
}

/// Every request line of `content`; `endpoint` None accepts any supported
/// endpoint (an upload does not know its batch yet).
pub fn parse(content: &[u8], endpoint: Option<Endpoint>, max_lines: usize) -> Result<Vec<InputLine>, InvalidInput> {
    let text = std::str::from_utf8(content).map_err(|e| {
        InvalidInput(format!("the file is not UTF-8 text (invalid byte at offset {})", e.valid_up_to()))
    })?;
    let mut lines = Vec::new();
    let mut seen: HashMap<String, u64> = HashMap::new();
    for (i, raw) in text.split('\n').enumerate() {
        let raw = raw.strip_suffix('\r').unwrap_or(raw);
        if raw.trim().is_empty() {
            continue;
        }
        if lines.len() == max_lines {
            return Err(InvalidInput(format!(
                "the file has more than {max_lines} request lines (--batch-max-lines)"
            )));
        }
        let line = parse_line(i as u64 + 1, raw, endpoint);
        if let Some(custom_id) = line.custom_id() {
            if let Some(first) = seen.insert(custom_id.to_string(), line.line()) {
                return Err(InvalidInput(format!(
                    "custom_id {custom_id:?} is used by lines {first} and {}: each request needs its own",
                    line.line()
                )));
            }
        }
        lines.push(line);
    }
    Ok(lines)
}

fn parse_line(line: u64, raw: &str, endpoint: Option<Endpoint>) -> InputLine {
    let value: Value = match serde_json::from_str(raw) {
        Ok(value) => value,
        Err(e) => return InputLine::Invalid { line, custom_id: None, message: format!("line {line}: not valid JSON: {e}") },
    };
    // The custom_id, when there is one, names the line in the error file
    // even if the rest of it is wrong.
    let custom_id = value.get("custom_id").and_then(Value::as_str).filter(|c| !c.is_empty()).map(str::to_string);
    let invalid = |message: String| InputLine::Invalid { line, custom_id: custom_id.clone(), message: format!("line {line}: {message}") };
    let raw_line: RawLine = match serde_json::from_value(value) {
        Ok(raw_line) => raw_line,
        Err(e) => return invalid(format!("expected {{\"custom_id\", \"method\", \"url\", \"body\"}}: {e}")),
    };
    let Some(custom_id) = raw_line.custom_id.as_str().filter(|c| !c.is_empty()).map(str::to_string) else {
        return invalid("`custom_id` must be a non-empty string".into());
    };
    if raw_line.method.as_str() != Some("POST") {
        return invalid(format!("`method` must be \"POST\", got {}", raw_line.method));
    }
    let Some(url) = raw_line.url.as_str() else {
        return invalid(format!("`url` must be a string, got {}", raw_line.url));
    };
    match (Endpoint::from_path(url), endpoint) {
        (None, _) => {
            let known: Vec<&str> = Endpoint::ALL.iter().map(|e| e.path()).collect();
            return invalid(format!("`url` {url:?} is not one of {known:?}"));
        }
        (Some(given), Some(expected)) if given != expected => {
            return invalid(format!("`url` {url:?} differs from the batch's endpoint {:?}", expected.path()));
        }
        _ => {}
    }
    if !raw_line.body.is_object() {
        return invalid(format!("`body` must be a JSON object, got {}", raw_line.body));
    }
    InputLine::Request { line, custom_id, body: raw_line.body.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(custom_id: &str, url: &str) -> String {
        format!(r#"{{"custom_id": "{custom_id}", "method": "POST", "url": "{url}", "body": {{"prompt": "hi"}}}}"#)
    }

    #[test]
    fn good_lines_parse_and_blank_lines_are_skipped() {
        let content = format!("{}\r\n\n{}\n", request("a", "/v1/completions"), request("b", "/v1/completions"));
        let lines = parse(content.as_bytes(), Some(Endpoint::Completions), 10).unwrap();
        assert_eq!(
            lines,
            vec![
                InputLine::Request { line: 1, custom_id: "a".into(), body: r#"{"prompt":"hi"}"#.into() },
                InputLine::Request { line: 3, custom_id: "b".into(), body: r#"{"prompt":"hi"}"#.into() },
            ]
        );
    }

    #[test]
    fn malformed_lines_are_reported_one_by_one() {
        let content = [
            "{not json".to_string(),
            r#"{"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}"#.into(),
            request("y", "/v1/chat/completions"),
            request("z", "/v1/embeddings"),
            r#"{"custom_id": "w", "method": "POST", "url": "/v1/completions", "body": [1]}"#.into(),
            r#"{"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}"#.into(),
            r#"{"custom_id": "v", "method": "POST", "url": "/v1/completions", "body": {}, "extra": 1}"#.into(),
            request("ok", "/v1/completions"),
        ]
        .join("\n");
        let lines = parse(content.as_bytes(), Some(Endpoint::Completions), 100).unwrap();
        let messages: Vec<(Option<&str>, String)> = lines
            .iter()
            .map(|l| match l {
                InputLine::Invalid { custom_id, message, .. } => (custom_id.as_deref(), message.clone()),
                InputLine::Request { custom_id, .. } => (Some(custom_id.as_str()), "ok".into()),
            })
            .collect();
        assert!(messages[0].1.starts_with("line 1: not valid JSON"), "{messages:?}");
        assert_eq!(messages[0].0, None);
        assert!(messages[1].1.contains("`method` must be \"POST\""), "{messages:?}");
        assert!(messages[2].1.contains("differs from the batch's endpoint"), "{messages:?}");
        assert!(messages[3].1.contains("is not one of"), "{messages:?}");
        assert!(messages[4].1.contains("`body` must be a JSON object"), "{messages:?}");
        assert!(messages[5].1.contains("`custom_id` must be a non-empty string"), "{messages:?}");
        assert!(messages[6].1.contains("unknown field `extra`"), "{messages:?}");
        assert_eq!(messages[7], (Some("ok"), "ok".into()));
    }

    #[test]
    fn a_duplicate_custom_id_is_refused_by_name() {
        let content = [request("same", "/v1/completions"), request("other", "/v1/completions"), request("same", "/v1/completions")]
            .join("\n");
        let err = parse(content.as_bytes(), None, 10).unwrap_err().to_string();
        assert!(err.contains("\"same\"") && err.contains("lines 1 and 3"), "{err}");
    }

    #[test]
    fn limits_and_encoding() {
        let content = [request("a", "/v1/completions"), request("b", "/v1/completions")].join("\n");
        assert_eq!(check_upload(content.as_bytes(), 2).unwrap(), 2);
        let err = check_upload(content.as_bytes(), 1).unwrap_err().to_string();
        assert!(err.contains("more than 1 request lines"), "{err}");
        let err = check_upload(b"{\"a\": \"\xff\xfe\"}", 10).unwrap_err().to_string();
        assert!(err.contains("not UTF-8") && err.contains("offset 7"), "{err}");
        assert_eq!(check_upload(b"\n\n", 10).unwrap(), 0);
    }
}

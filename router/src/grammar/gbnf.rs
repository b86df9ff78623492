//! GBNF (llama.cpp's grammar format, which vLLM's `guided_grammar` also
//! takes) rewritten as an llguidance Lark grammar.
//!
//! ```text
//!   GBNF                          Lark
//!   root ::= "a" item+ | [0-9]    start: "a" item+ | /[0-9]/
//!   item ::= [^"\n] .             item: /[^"\n]/ /(?s:.)/
//! ```
//!
//! Rules become one Lark line each (GBNF continues a rule across lines,
//! Lark does not); strings are re-quoted with JSON escapes, character classes
//! become regexes with every non-alphanumeric character escaped; `{m,n}`,
//! `?`, `*`, `+`, groups and `|` are the same in both. A rule named `start`
//! is renamed so that `root` can take the name.

/// A Lark string literal for `text` (JSON's escapes are Lark's).
pub fn lark_literal(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

/// Whether `source` reads as GBNF (has a `name ::=` rule) rather than Lark.
pub fn looks_like_gbnf(source: &str) -> bool {
    source.contains("::=")
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Define,
    Literal(String),
    /// (negated, ranges)
    Class(bool, Vec<(char, char)>),
    Any,
    /// `(`, `)`, `|`, `*`, `+`, `?` or a `{m,n}` repetition, kept verbatim.
    Punct(String),
}

/// The Lark form of a GBNF grammar, or what is wrong with it.
pub fn gbnf_to_lark(source: &str) -> Result<String, String> {
    let tokens = tokenize(source)?;
    let mut rules: Vec<(String, Vec<Token>)> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        match (&tokens[i], tokens.get(i + 1)) {
            (Token::Ident(name), Some(Token::Define)) => {
                rules.push((name.clone(), Vec::new()));
                i += 2;
            }
            (token, _) => {
                let Some((_, body)) = rules.last_mut() else {
                    return Err("a GBNF grammar must start with a rule (`name ::= ...`)".into());
                };
                body.push(token.clone());
                i += 1;
            }
        }
    }
    if !rules.iter().any(|(name, _)| name == "root") {
        return Err("a GBNF grammar needs a `root` rule".into());
    }
    let rename = |name: &str| match name {
        "root" => "start".to_string(),
        "start" => "start_".to_string(),
        other => other.to_string(),
    };
    let mut out = String::new();
    for (name, body) in &rules {
        if body.is_empty() {
            return Err(format!("rule `{name}` is empty"));
        }
        out.push_str(&rename(name));
        out.push(':');
        for token in body {
            let postfix = matches!(token, Token::Punct(p) if p != "(" && p != ")" && p != "|");
            if !postfix {
                out.push(' ');
            }
            match token {
                Token::Ident(name) => out.push_str(&rename(name)),
                Token::Literal(text) => out.push_str(&lark_literal(text)),
                Token::Class(negated, ranges) => out.push_str(&class_regex(*negated, ranges)),
                Token::Any => out.push_str("/(?s:.)/"),
                Token::Punct(p) => out.push_str(p),
                Token::Define => unreachable!("rules were split at `::=`"),
            }
        }
        out.push('\n');
    }
    Ok(out)
}

fn class_regex(negated: bool, ranges: &[(char, char)]) -> String {
    let escape = |c: char| {
        if c.is_ascii_alphanumeric() {
            c.to_string()
        } else {
            format!("\\u{{{:x}}}", c as u32)
        }
    };
    let mut out = String::from(if negated { "/[^" } else { "/[" });
    for &(lo, hi) in ranges {
        out.push_str(&escape(lo));
        if hi != lo {
            out.push('-');
            out.push_str(&escape(hi));
        }
    }
    out.push_str("]/");
    out
}

fn tokenize(source: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = source.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            c if c.is_whitespace() => i += 1,
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                tokens.push(Token::Define);
                i += 3;
            }
            '"' => {
                let mut text = String::new();
                i += 1;
                loop {
                    match chars.get(i) {
                        None => return Err("unterminated string literal".into()),
                        Some('"') => break,
                        Some('\\') => {
                            let (ch, next) = escape(&chars, i)?;
                            text.push(ch);
                            i = next;
                        }
                        Some(&ch) => {
                            text.push(ch);
                            i += 1;
                        }
                    }
                }
                i += 1;
                tokens.push(Token::Literal(text));
            }
            '[' => {
                i += 1;
                let negated = chars.get(i) == Some(&'^');
                if negated {
                    i += 1;
                }
                let mut ranges = Vec::new();
                loop {
                    let lo = match chars.get(i) {
                        None => return Err("unterminated character class".into()),
                        Some(']') => break,
                        Some('\\') => {
                            let (ch, next) = escape(&chars, i)?;
                            i = next;
                            ch
                        }
                        Some(&ch) => {
                            i += 1;
                            ch
                        }
                    };
                    let mut hi = lo;
                    if chars.get(i) == Some(&'-') && chars.get(i + 1).is_some_and(|&c| c != ']') {
                        i += 1;
                        hi = if chars[i] == '\\' {
                            let (ch, next) = escape(&chars, i)?;
                            i = next;
                            ch
                        } else {
                            i += 1;
                            chars[i - 1]
                        };
                        if hi < lo {
                            return Err(format!("character range {lo:?}-{hi:?} is out of order"));
                        }
                    }
                    ranges.push((lo, hi));
                }
                i += 1;
                tokens.push(Token::Class(negated, ranges));
            }
            '.' => {
                tokens.push(Token::Any);
                i += 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                tokens.push(Token::Punct(c.to_string()));
                i += 1;
            }
            '{' => {
                let end = chars[i..].iter().position(|&c| c == '}').ok_or("unterminated `{m,n}` repetition")?;
                let inner: String = chars[i + 1..i + end].iter().filter(|c| !c.is_whitespace()).collect();
                if inner.is_empty() || !inner.chars().all(|c| c.is_ascii_digit() || c == ',') {
                    return Err(format!("bad repetition `{{{inner}}}`"));
                }
                tokens.push(Token::Punct(format!("{{{inner}}}")));
                i += end + 1;
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '-' || chars[i] == '_') {
                    i += 1;
                }
                tokens.push(Token::Ident(chars[start..i].iter().collect()));
            }
            other => return Err(format!("unexpected character {other:?} in the grammar")),
        }
    }
    Ok(tokens)
}

/// The character of the escape at `chars[i]` (a backslash) and the index
/// after it: `\n \r \t \\ \" \[ \] \- \xHH \uHHHH \UHHHHHHHH`, as llama.cpp.
fn escape(chars: &[char], i: usize) -> Result<(char, usize), String> {
    let hex = |len: usize| -> Result<(char, usize), String> {
        let digits: String = chars.get(i + 2..i + 2 + len).ok_or("truncated escape")?.iter().collect();
        let code = u32::from_str_radix(&digits, 16).map_err(|_| format!("bad escape `\\{digits}`"))?;
        let ch = char::from_u32(code).ok_or(format!("escape {code:#x} is not a character"))?;
        Ok((ch, i + 2 + len))
    };
    match chars.get(i + 1) {
        Some('n') => Ok(('\n', i + 2)),
        Some('r') => Ok(('\r', i + 2)),
        Some('t') => Ok(('\t', i + 2)),
        Some('x') => hex(2),
        Some('u') => hex(4),
        Some('U') => hex(8),
        Some(&c @ ('\\' | '"' | '[' | ']' | '-' | '/')) => Ok((c, i + 2)),
        Some(other) => Err(format!("unknown escape `\\{other}`")),
        None => Err("a grammar cannot end with `\\`".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_become_lark_lines() {
        let gbnf = "# a comment\nroot ::= (\n  \"yes\" | \"no\"\n) tail{1,3}\ntail ::= [a-z0-9_/] | [^\\n\"] .\nstart ::= \"x\"\n";
        assert!(looks_like_gbnf(gbnf));
        let lark = gbnf_to_lark(gbnf).unwrap();
        assert_eq!(
            lark,
            "start: ( \"yes\" | \"no\" ) tail{1,3}\n\
             tail: /[a-z0-9\\u{5f}\\u{2f}]/ | /[^\\u{a}\\u{22}]/ /(?s:.)/\n\
             start_: \"x\"\n"
        );
    }

    #[test]
    fn mistakes_are_named() {
        assert!(gbnf_to_lark("item ::= \"a\"").unwrap_err().contains("root"));
        assert!(gbnf_to_lark("root ::= \"a").unwrap_err().contains("unterminated"));
        assert!(gbnf_to_lark("root ::= [z-a]").unwrap_err().contains("out of order"));
        assert!(gbnf_to_lark("root ::= \"\\q\"").unwrap_err().contains("escape"));
        assert!(gbnf_to_lark("\"a\" ::= root").is_err());
    }
}

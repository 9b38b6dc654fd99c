//! `ConfigError`: one line that names the file, the JSON path and the problem,
//! e.g. `configs/x.json: model.layers[4].stride: must be ≥ 1, got 0`.
//!
//! Validation knows the JSON path of what it checks. serde only reports a line
//! and column, so [`json_path_at`] re-scans the text up to that position to
//! recover the path too: `configs/x.json:9:18: train.lr: invalid type: …`.
//! Anything that came from the file (names, unknown words) is escaped so the
//! message stays on one line.

use std::fmt;

/// Why a config could not be loaded. Displays as one line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The file (or whatever name the text was given).
    pub origin: String,
    /// 1-based line and column, for errors found while parsing the JSON.
    pub position: Option<(usize, usize)>,
    /// JSON path of the offending value (`model.layers[4].stride`); empty
    /// when the problem is with the file as a whole.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl ConfigError {
    pub(crate) fn at(origin: &str, invalid: Invalid) -> Self {
        ConfigError {
            origin: origin.to_string(),
            position: None,
            path: invalid.path,
            message: invalid.message,
        }
    }

    /// A parse or type error from serde_json, with the JSON path recovered
    /// from its position in `text`.
    pub(crate) fn from_serde(origin: &str, text: &str, err: &serde_json::Error) -> Self {
        let full = err.to_string();
        if err.line() == 0 {
            return ConfigError {
                origin: origin.to_string(),
                position: None,
                path: String::new(),
                message: full,
            };
        }
        let suffix = format!(" at line {} column {}", err.line(), err.column());
        let message = full.strip_suffix(&suffix).unwrap_or(&full).to_string();
        let mut offset = byte_offset(text, err.line(), err.column());
        if err.classify() == serde_json::error::Category::Data {
            offset = before_array_step(text, offset);
        }
        ConfigError {
            origin: origin.to_string(),
            position: Some(line_column(text, offset)),
            path: json_path_at(text, offset),
            message,
        }
    }
}

impl ConfigError {
    /// A problem with the character at byte `offset` of `text`, reported with
    /// its line and column like serde_json's errors.
    pub(crate) fn at_char(origin: &str, text: &str, offset: usize, message: &str) -> Self {
        ConfigError {
            origin: origin.to_string(),
            position: Some(line_column(text, offset + 1)),
            path: String::new(),
            message: message.to_string(),
        }
    }
}

/// After a failed array element serde_json has already stepped over the
/// `,` (or `]`) that follows it before it records the position, which
/// would name the next element. Step back to the end of the failed element.
fn before_array_step(text: &str, offset: usize) -> usize {
    let bytes = text.as_bytes();
    let skip_space = |mut i: usize| {
        while i > 0 && bytes[i - 1].is_ascii_whitespace() {
            i -= 1;
        }
        i
    };
    let i = skip_space(offset.min(bytes.len()));
    match i.checked_sub(1).map(|j| bytes[j]) {
        Some(b',' | b']') => skip_space(i - 1),
        _ => offset,
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = self.origin.clone();
        if let Some((l, c)) = self.position {
            line.push_str(&format!(":{l}:{c}"));
        }
        line.push_str(": ");
        if !self.path.is_empty() {
            line.push_str(&self.path);
            line.push_str(": ");
        }
        line.push_str(&self.message);
        f.write_str(&one_line(&line))
    }
}

impl std::error::Error for ConfigError {}

/// A validation failure before the file name is attached: the JSON path and
/// what is wrong there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Invalid {
    pub path: String,
    pub message: String,
}

/// `Err(Invalid)` at `path`.
pub(crate) fn invalid<T>(
    path: impl Into<String>,
    message: impl Into<String>,
) -> Result<T, Invalid> {
    Err(Invalid {
        path: path.into(),
        message: message.into(),
    })
}

/// `value` must be finite and `ok`; otherwise "must be {range}, got {value}".
pub(crate) fn require(path: &str, value: f32, ok: bool, range: &str) -> Result<(), Invalid> {
    if value.is_finite() && ok {
        return Ok(());
    }
    invalid(path, format!("must be {range}, got {value}"))
}

/// Escapes control characters (newlines above all) so the text is one line.
fn one_line(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

/// serde_json counts lines from 1 and columns as bytes since the line start.
fn byte_offset(text: &str, line: usize, column: usize) -> usize {
    let line_start = if line <= 1 {
        0
    } else {
        text.match_indices('\n')
            .nth(line - 2)
            .map_or(text.len(), |(i, _)| i + 1)
    };
    (line_start + column).min(text.len())
}

/// The inverse of [`byte_offset`].
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text.as_bytes()[..offset.min(text.len())];
    let line = 1 + before.iter().filter(|&&b| b == b'\n').count();
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    (line, before.len() - line_start)
}

/// One level of nesting while scanning JSON.
enum Frame {
    /// Inside an object; the key whose value is being read, if any.
    Object(Option<String>),
    /// Inside an array, at this element index.
    Array(usize),
}

/// The JSON path (`model.layers[4].stride`) of the value being read at byte
/// `offset` of `text`. A lenient scan: it only tracks brackets, commas and
/// keys, so it also works on text that fails to parse further on.
pub(crate) fn json_path_at(text: &str, offset: usize) -> String {
    let bytes = &text.as_bytes()[..offset.min(text.len())];
    let mut stack: Vec<Frame> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' => stack.push(Frame::Object(None)),
            b'[' => stack.push(Frame::Array(0)),
            b'}' | b']' => {
                stack.pop();
            }
            b',' => match stack.last_mut() {
                Some(Frame::Object(key)) => *key = None,
                Some(Frame::Array(index)) => *index += 1,
                None => {}
            },
            b'"' => {
                let start = i + 1;
                i = start;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                if let Some(Frame::Object(key @ None)) = stack.last_mut() {
                    let end = i.min(bytes.len());
                    *key = Some(String::from_utf8_lossy(&bytes[start..end]).into_owned());
                }
            }
            _ => {}
        }
        i += 1;
    }
    let mut path = String::new();
    for frame in &stack {
        match frame {
            Frame::Object(Some(key)) => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
            }
            Frame::Object(None) => {}
            Frame::Array(index) => path.push_str(&format!("[{index}]")),
        }
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_of_a_nested_value() {
        let text = r#"{"model": {"layers": [{"a": 1}, {"name": "x", "stride": 0}]}}"#;
        let at = text.find("0}").unwrap();
        assert_eq!(json_path_at(text, at), "model.layers[1].stride");
        let after_layer = text.find("}]").unwrap() + 1;
        assert_eq!(json_path_at(text, after_layer), "model.layers[1]");
    }

    #[test]
    fn keys_with_escapes_and_brackets_inside_strings() {
        let text = r#"{"a\"b": "[{", "c": [1, 2, 3"#;
        assert_eq!(json_path_at(text, text.len()), "c[2]");
    }

    #[test]
    fn steps_back_over_a_consumed_comma_or_bracket() {
        let text = "[1, \"x\",\n 3]";
        let after_comma = text.find('3').unwrap();
        assert_eq!(
            before_array_step(text, after_comma),
            text.find(",\n").unwrap()
        );
        let end = text.len();
        assert_eq!(before_array_step(text, end), text.find('3').unwrap() + 1);
        assert_eq!(
            json_path_at(text, before_array_step(text, after_comma)),
            "[1]"
        );
        assert_eq!(before_array_step(text, 2), 2);
    }

    #[test]
    fn line_and_column_to_offset() {
        let text = "ab\ncde\nf";
        assert_eq!(byte_offset(text, 1, 2), 2);
        assert_eq!(byte_offset(text, 2, 1), 4);
        assert_eq!(byte_offset(text, 3, 0), 7);
        for offset in 0..=text.len() {
            let (line, column) = line_column(text, offset);
            assert_eq!(byte_offset(text, line, column), offset);
        }
    }

    #[test]
    fn display_is_one_line() {
        let e = ConfigError {
            origin: "x.json".into(),
            position: Some((3, 4)),
            path: "model.layers[0].name".into(),
            message: "bad name \"a\nb\"".into(),
        };
        assert_eq!(
            e.to_string(),
            "x.json:3:4: model.layers[0].name: bad name \"a\\nb\""
        );
    }
}

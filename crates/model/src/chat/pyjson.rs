//! `json.dumps` as Python writes it, for the `tojson` filter Hugging Face installs in chat templates
//! (`ensure_ascii=False`, default separators `", "` / `": "`, no HTML escaping) and for the native Kimi renderer.
//!
//! Works on minijinja values so that map order is the template's own (insertion order; serde_json objects arrive in
//! their iteration order). Floats are written like Python's `repr` (`1.0`, `1e-05`, `1e+16`).

use std::fmt::Write as _;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// The keyword arguments of `json.dumps` that chat templates use.
#[derive(Debug, Clone)]
pub struct DumpOptions {
    /// `indent`: `None` for one line; a number of spaces or a string otherwise.
    pub indent: Option<String>,
    /// `separators[0]`.
    pub item_sep: String,
    /// `separators[1]`.
    pub key_sep: String,
    /// `sort_keys`.
    pub sort_keys: bool,
    /// `ensure_ascii` (Hugging Face's default is `False`).
    pub ensure_ascii: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        Self { indent: None, item_sep: ", ".into(), key_sep: ": ".into(), sort_keys: false, ensure_ascii: false }
    }
}

impl DumpOptions {
    /// Python's defaults for a given indent: `(",", ": ")` when indenting, `(", ", ": ")` otherwise.
    pub fn with_indent(indent: Option<String>) -> Self {
        let item_sep = if indent.is_some() { "," } else { ", " };
        Self { indent, item_sep: item_sep.into(), ..Self::default() }
    }

    /// Compact separators `(",", ":")`, as Kimi's `tool_declare` uses.
    pub fn compact() -> Self {
        Self { item_sep: ",".into(), key_sep: ":".into(), ..Self::default() }
    }
}

/// Serializes `value` like `json.dumps(value, **opts)`.
pub fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, opts, 0)?;
    Ok(out)
}

fn newline(out: &mut String, opts: &DumpOptions, level: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_value(out: &mut String, value: &Value, opts: &DumpOptions, level: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                write!(out, "{value}").ok();
            } else {
                let f = f64::try_from(value.clone())?;
                out.push_str(&py_float_repr(f));
            }
        }
        ValueKind::String => write_str(out, value.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key_string(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                write_str(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_value(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                write_value(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push(']');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

/// Python converts str, int, float, bool and None keys to strings; anything else is a TypeError.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number if key.is_integer() => Ok(key.to_string()),
        ValueKind::Number => Ok(py_float_repr(f64::try_from(key.clone())?)),
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

/// A JSON string literal as Python's encoder writes it.
pub fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                write!(out, "\\u{:04x}", c as u32).ok();
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    write!(out, "\\u{unit:04x}").ok();
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for exponents in -4..16, else `d.ddde+XX`.
pub fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let sci = format!("{f:e}"); // e.g. "-1.5e-5", "1e16", "0e0"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if (point as usize) >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let frac = if digits.len() > 1 { format!(".{}", &digits[1..]) } else { String::new() };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{}{frac}e{esign}{:02}", &digits[..1], exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::value::Serde;

    fn v(json: serde_json::Value) -> Value {
        Value::from(Serde(&json))
    }

    #[test]
    fn floats_like_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-0.0, "-0.0"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123.456, "123.456"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (3.14e-100, "3.14e-100"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn default_separators_and_no_html_escaping() {
        let value = v(serde_json::json!({"a": [1, 2.5, true, null], "b": "<x> & \"y\"\n", "c": {}}));
        assert_eq!(
            dumps(&value, &DumpOptions::default()).unwrap(),
            r#"{"a": [1, 2.5, true, null], "b": "<x> & \"y\"\n", "c": {}}"#
        );
        assert_eq!(
            dumps(&value, &DumpOptions::compact()).unwrap(),
            r#"{"a":[1,2.5,true,null],"b":"<x> & \"y\"\n","c":{}}"#
        );
    }

    #[test]
    fn indent_and_ascii() {
        let value = v(serde_json::json!({"k": ["é", "🦀"]}));
        let opts = DumpOptions { ensure_ascii: true, ..DumpOptions::with_indent(Some("  ".into())) };
        assert_eq!(dumps(&value, &opts).unwrap(), "{\n  \"k\": [\n    \"\\u00e9\",\n    \"\\ud83e\\udd80\"\n  ]\n}");
        let value = v(serde_json::json!("\u{1}\u{7f}"));
        assert_eq!(dumps(&value, &DumpOptions::default()).unwrap(), "\"\\u0001\u{7f}\"");
    }

    #[test]
    fn undefined_is_an_error() {
        assert!(dumps(&Value::UNDEFINED, &DumpOptions::default()).is_err());
    }
}

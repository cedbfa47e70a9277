//! Hugging Face chat templates on minijinja, configured as transformers configures jinja2.
//!
//! transformers renders with `trim_blocks=True, lstrip_blocks=True`, the `loopcontrols` extension, a `tojson` that
//! is `json.dumps(x, ensure_ascii=False, ...)` (no HTML escaping, Python separators), the globals
//! `raise_exception` and `strftime_now`, and passes `messages`, `tools`, `documents`, `add_generation_prompt`, the
//! special-token strings (`bos_token`, `eos_token`, ...) and any extra kwargs. Python string and dict methods
//! (`.strip()`, `.get()`, `.items()`, ...) come from minijinja-contrib's pycompat. Messages get a `thinking` copy of
//! `reasoning_content`, as transformers adds one.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Serde, Value as JValue};
use minijinja::{AutoEscape, Environment, Error, ErrorKind};
use serde_json::Value;

use super::pyjson::{DumpOptions, dumps};
use super::{ChatError, ChatMessage, RenderOptions, Result};
use crate::tokenizer::TokenizerConfig;

const TEMPLATE_NAME: &str = "chat";

/// The special-token strings a template can read (`bos_token`, ...), from `tokenizer_config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateTokens {
    /// `bos_token`.
    pub bos_token: Option<String>,
    /// `eos_token`.
    pub eos_token: Option<String>,
    /// `pad_token`.
    pub pad_token: Option<String>,
    /// `unk_token`.
    pub unk_token: Option<String>,
}

impl TemplateTokens {
    /// The token names of a tokenizer config.
    pub fn from_config(config: &TokenizerConfig) -> Self {
        Self {
            bos_token: config.bos_token.clone(),
            eos_token: config.eos_token.clone(),
            pad_token: config.pad_token.clone(),
            unk_token: config.unk_token.clone(),
        }
    }
}

/// A compiled Jinja chat template.
#[derive(Debug)]
pub struct JinjaTemplate {
    env: Environment<'static>,
    origin: String,
    tokens: TemplateTokens,
}

impl JinjaTemplate {
    /// Compiles `source`; `origin` (a path or `<string>`) labels errors.
    pub fn new(source: impl Into<String>, origin: &str, tokens: TemplateTokens) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|source| ChatError::Syntax { origin: origin.to_owned(), source })?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let source: String = source.into();
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|source| ChatError::Syntax { origin: origin.to_owned(), source })?;
        Ok(Self { env, origin: origin.to_owned(), tokens })
    }

    /// Renders a conversation (see the module docs for the variables the template sees).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        options: &RenderOptions,
    ) -> Result<String> {
        let mut ctx = serde_json::Map::new();
        let named = [
            ("bos_token", &self.tokens.bos_token),
            ("eos_token", &self.tokens.eos_token),
            ("pad_token", &self.tokens.pad_token),
            ("unk_token", &self.tokens.unk_token),
        ];
        for (key, value) in named {
            if let Some(v) = value {
                ctx.insert(key.into(), Value::String(v.clone()));
            }
        }
        if let Some(thinking) = options.thinking {
            ctx.insert("thinking".into(), Value::Bool(thinking));
        }
        // Extra kwargs override the special tokens, as in transformers.
        for (k, v) in &options.extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Value::Array(messages.iter().map(message_value).collect()));
        ctx.insert("tools".into(), tools.map_or(Value::Null, |t| Value::Array(t.to_vec())));
        ctx.insert("documents".into(), Value::Null);
        ctx.insert("add_generation_prompt".into(), Value::Bool(add_generation_prompt));

        let template = self.env.get_template(TEMPLATE_NAME).map_err(|source| self.render_error(source))?;
        template.render(JValue::from(Serde(&ctx))).map_err(|source| self.render_error(source))
    }

    fn render_error(&self, source: Error) -> ChatError {
        let message = source.detail().map_or_else(|| source.to_string(), str::to_owned);
        ChatError::Render { origin: self.origin.clone(), message, source }
    }
}

/// A message as the template sees it: the OpenAI JSON, plus `thinking` mirroring `reasoning_content`.
fn message_value(m: &ChatMessage) -> Value {
    let mut v = serde_json::to_value(m).unwrap_or(Value::Null);
    if let (Some(reasoning), Value::Object(obj)) = (&m.reasoning_content, &mut v) {
        obj.entry("thinking").or_insert_with(|| Value::String(reasoning.clone()));
    }
    v
}

/// `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, as transformers defines it.
fn tojson(value: JValue, kwargs: Kwargs) -> std::result::Result<JValue, Error> {
    let indent: Option<JValue> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.is_integer() => Some(" ".repeat(usize::try_from(v.as_i64().unwrap_or(0)).unwrap_or(0))),
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or a string")),
        },
    };
    let mut opts = DumpOptions::with_indent(indent);
    let separators: Option<JValue> = kwargs.get("separators")?;
    if let Some(seps) = separators.filter(|s| !s.is_none()) {
        let parts: Vec<JValue> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                opts.item_sep = item.as_str().unwrap_or_default().to_owned();
                opts.key_sep = key.as_str().unwrap_or_default().to_owned();
            }
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
        }
    }
    if let Some(sort) = kwargs.get::<Option<bool>>("sort_keys")? {
        opts.sort_keys = sort;
    }
    if let Some(ascii) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        opts.ensure_ascii = ascii;
    }
    kwargs.assert_all_used()?;
    dumps(&value, &opts).map(JValue::from)
}

fn raise_exception(message: String) -> std::result::Result<JValue, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `datetime.now().strftime(format)`, in UTC (the machine's zone is not consulted).
fn strftime_now(format: String) -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    strftime(secs, &format)
}

/// A small `strftime` for UTC timestamps: `%Y %y %m %d %e %H %I %M %S %p %j %a %A %b %B %%` and glibc's `%-d`,
/// `%-m`, `%-H`, `%-I`, `%-M`, `%-S` (no padding). Unknown directives are copied as they are.
pub(crate) fn strftime(secs: i64, format: &str) -> String {
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Monday = 0)
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |v: i64, width: usize| if no_pad { v.to_string() } else { format!("{v:0width$}") };
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(month, 2)),
            Some('d') => out.push_str(&num(day, 2)),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num(hour12, 2)),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 -> (year, month 1..=12, day 1..=31), proleptic Gregorian (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage]) -> Result<String> {
        let t = JinjaTemplate::new(source, "<test>", TemplateTokens::default())?;
        t.render(messages, None, true, &RenderOptions::default())
    }

    #[test]
    fn strftime_matches_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday
        let secs = 1_709_211_909;
        assert_eq!(strftime(secs, "%Y-%m-%d %H:%M:%S"), "2024-02-29 13:05:09");
        assert_eq!(strftime(secs, "%d %b %Y, %A %-d %B %j %I%p %%"), "29 Feb 2024, Thursday 29 February 060 01PM %");
        assert_eq!(strftime(0, "%a %Y-%m-%d"), "Thu 1970-01-01");
        assert_eq!(strftime(-86_400, "%Y-%m-%d"), "1969-12-31");
        assert_eq!(strftime(0, "%Q"), "%Q");
    }

    #[test]
    fn raise_exception_reaches_the_caller() {
        let err = render("{{ raise_exception('bad roles') }}", &[]).unwrap_err();
        assert!(matches!(&err, ChatError::Render { message, .. } if message == "bad roles"), "{err}");
        assert!(err.to_string().contains("bad roles"));
    }

    #[test]
    fn syntax_errors_name_the_origin() {
        let err = JinjaTemplate::new("{% if %}", "dir/chat_template.jinja", TemplateTokens::default()).unwrap_err();
        assert!(matches!(err, ChatError::Syntax { .. }));
        assert!(err.to_string().contains("dir/chat_template.jinja"), "{err}");
    }

    #[test]
    fn python_methods_tojson_and_thinking_alias() {
        let m = ChatMessage { reasoning_content: Some("r".into()), ..ChatMessage::new("assistant", "  Hi <b>  ") };
        let out = render(
            "{% for m in messages %}{{ m.content.strip() }}|{{ m.get('thinking') }}|{{ m.get('name', 'anon') }}|\
             {{ {'b': 1, 'a': [1.0, none]} | tojson }}|{{ 'x' | tojson(indent=2) }}{% endfor %}",
            &[m],
        )
        .unwrap();
        assert_eq!(out, r#"Hi <b>|r|anon|{"b": 1, "a": [1.0, null]}|"x""#);
        let err = render("{{ 1 | tojson(bogus=1) }}", &[]).unwrap_err();
        assert!(err.to_string().contains("bogus"), "{err}");
    }

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        let out = render(
            "{% for m in messages %}\n  {% if true %}\n[{{ m.role }}]\n  {% endif %}\n{% endfor %}",
            &[ChatMessage::new("user", "a")],
        )
        .unwrap();
        assert_eq!(out, "[user]\n");
    }
}

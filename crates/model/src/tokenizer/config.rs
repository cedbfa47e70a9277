//! `tokenizer_config.json`: added/special tokens, bos/eos names and the chat template, as Hugging Face writes it.
//!
//! Only the fields Eyrie uses are read; each is checked by hand so that an error names the field. Token fields may
//! be a plain string or an `AddedToken` object (`{"content": "...", ...}`); `chat_template` may be a string or a
//! list of `{"name", "template"}` (the one named `default` is used, else the first).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::{Result, TokenizerError};

/// One entry of `added_tokens_decoder`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddedTokenSpec {
    /// The token's text, e.g. `<|im_end|>`.
    pub content: String,
    /// Whether it is a special token (skipped by `decode(.., skip_special = true)`).
    pub special: bool,
}

/// The parts of `tokenizer_config.json` that Eyrie reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// The file this was read from (empty for a default config).
    pub path: PathBuf,
    /// `added_tokens_decoder`, by id.
    pub added_tokens: BTreeMap<u32, AddedTokenSpec>,
    /// `bos_token`.
    pub bos_token: Option<String>,
    /// `eos_token`.
    pub eos_token: Option<String>,
    /// `pad_token`.
    pub pad_token: Option<String>,
    /// `unk_token`.
    pub unk_token: Option<String>,
    /// `chat_template` (the `default` one when the file holds several).
    pub chat_template: Option<String>,
}

impl TokenizerConfig {
    /// Reads `path`; a missing file is an [`TokenizerError::Io`] naming it.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
        let value: Value =
            serde_json::from_str(&text).map_err(|source| TokenizerError::Json { path: path.into(), source })?;
        Self::from_value(path, &value)
    }

    /// Reads `dir/tokenizer_config.json` when it exists, else returns an empty config.
    pub fn load_optional(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer_config.json");
        if path.is_file() { Self::load(&path) } else { Ok(Self::default()) }
    }

    /// Parses an already-read JSON value; `path` only labels errors.
    pub fn from_value(path: &Path, value: &Value) -> Result<Self> {
        let obj = value.as_object().ok_or_else(|| TokenizerError::bad_config(path, "<root>", "expected an object"))?;
        let mut cfg = TokenizerConfig { path: path.to_path_buf(), ..Default::default() };
        if let Some(added) = obj.get("added_tokens_decoder") {
            let added = added
                .as_object()
                .ok_or_else(|| TokenizerError::bad_config(path, "added_tokens_decoder", "expected an object"))?;
            for (key, spec) in added {
                let field = format!("added_tokens_decoder.{key}");
                let id: u32 =
                    key.parse().map_err(|_| TokenizerError::bad_config(path, &field, "key is not a token id"))?;
                let content = spec
                    .get("content")
                    .and_then(Value::as_str)
                    .ok_or_else(|| TokenizerError::bad_config(path, &field, "missing string `content`"))?;
                let special = match spec.get("special") {
                    None => false,
                    Some(v) => v
                        .as_bool()
                        .ok_or_else(|| TokenizerError::bad_config(path, format!("{field}.special"), "not a boolean"))?,
                };
                cfg.added_tokens.insert(id, AddedTokenSpec { content: content.to_owned(), special });
            }
        }
        cfg.bos_token = token_field(path, obj, "bos_token")?;
        cfg.eos_token = token_field(path, obj, "eos_token")?;
        cfg.pad_token = token_field(path, obj, "pad_token")?;
        cfg.unk_token = token_field(path, obj, "unk_token")?;
        cfg.chat_template = match obj.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => Some(pick_named_template(path, list)?),
            Some(_) => {
                return Err(TokenizerError::bad_config(path, "chat_template", "expected a string or a list"));
            }
        };
        Ok(cfg)
    }
}

/// A token field: absent or null -> `None`; a string; or an `AddedToken` object with `content`.
fn token_field(path: &Path, obj: &serde_json::Map<String, Value>, field: &str) -> Result<Option<String>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(TokenizerError::bad_config(path, field, "object without string `content`")),
        },
        Some(_) => Err(TokenizerError::bad_config(path, field, "expected a string or an AddedToken object")),
    }
}

fn pick_named_template(path: &Path, list: &[Value]) -> Result<String> {
    let mut first = None;
    for (i, item) in list.iter().enumerate() {
        let field = format!("chat_template[{i}]");
        let name = item.get("name").and_then(Value::as_str);
        let template = item
            .get("template")
            .and_then(Value::as_str)
            .ok_or_else(|| TokenizerError::bad_config(path, &field, "missing string `template`"))?;
        if name == Some("default") {
            return Ok(template.to_owned());
        }
        first.get_or_insert_with(|| template.to_owned());
    }
    first.ok_or_else(|| TokenizerError::bad_config(path, "chat_template", "empty list"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_tokens_as_strings_or_objects() {
        let v = json!({
            "added_tokens_decoder": {"7": {"content": "<|im_end|>", "special": true}},
            "bos_token": "[BOS]",
            "eos_token": {"__type": "AddedToken", "content": "[EOS]"},
            "pad_token": null,
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
        });
        let cfg = TokenizerConfig::from_value(Path::new("c.json"), &v).unwrap();
        assert_eq!(cfg.added_tokens[&7], AddedTokenSpec { content: "<|im_end|>".into(), special: true });
        assert_eq!(cfg.bos_token.as_deref(), Some("[BOS]"));
        assert_eq!(cfg.eos_token.as_deref(), Some("[EOS]"));
        assert_eq!(cfg.pad_token, None);
        assert_eq!(cfg.chat_template.as_deref(), Some("D"));
    }

    #[test]
    fn errors_name_the_field() {
        let v = json!({"added_tokens_decoder": {"x": {"content": "a"}}});
        let err = TokenizerConfig::from_value(Path::new("c.json"), &v).unwrap_err().to_string();
        assert!(err.contains("c.json") && err.contains("added_tokens_decoder.x"), "{err}");
        let v = json!({"added_tokens_decoder": {"3": {"special": true}}});
        let err = TokenizerConfig::from_value(Path::new("c.json"), &v).unwrap_err().to_string();
        assert!(err.contains("added_tokens_decoder.3") && err.contains("content"), "{err}");
        let v = json!({"eos_token": 3});
        let err = TokenizerConfig::from_value(Path::new("c.json"), &v).unwrap_err().to_string();
        assert!(err.contains("eos_token"), "{err}");
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = TokenizerConfig::load(Path::new("/nonexistent/tokenizer_config.json")).unwrap_err();
        assert!(matches!(err, TokenizerError::Io { .. }));
        assert!(err.to_string().contains("/nonexistent/tokenizer_config.json"));
    }
}

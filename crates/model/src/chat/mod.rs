//! Chat templates: OpenAI-style messages to the prompt text a model was trained on.
//!
//! Two renderers behind [`ChatTemplate`]: the native Kimi-K2 / K2.5 format ([`kimi`], no template engine, checked
//! against the real Kimi-K2-Thinking `chat_template.jinja`), and any Hugging Face Jinja template through minijinja
//! ([`jinja`], with the globals and the Python-flavoured `tojson` transformers provides). Golden tests compare both
//! with transformers' `apply_chat_template(tokenize=False)` in `tests/chat_golden.rs`.

pub mod jinja;
pub mod kimi;
pub mod pyjson;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use jinja::{JinjaTemplate, TemplateTokens};

use crate::tokenizer::{TokenizerConfig, TokenizerError};

/// Result alias for the chat module.
pub type Result<T, E = ChatError> = std::result::Result<T, E>;

/// Everything that can go wrong while loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// An I/O error while reading a template file.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// `tokenizer_config.json` could not be read.
    #[error(transparent)]
    Config(#[from] TokenizerError),

    /// The directory has neither `chat_template.jinja` nor a `chat_template` in `tokenizer_config.json`.
    #[error("{dir}: no chat_template.jinja and no chat_template in tokenizer_config.json")]
    NoTemplate {
        /// The directory searched.
        dir: PathBuf,
    },

    /// The template does not parse.
    #[error("chat template {origin}: {source}")]
    Syntax {
        /// Where the template came from (a file, or `<string>`).
        origin: String,
        /// The template engine's error, with line information.
        #[source]
        source: minijinja::Error,
    },

    /// Rendering failed; a template's own `raise_exception(message)` lands here with its message.
    #[error("chat template {origin}: render failed: {message}")]
    Render {
        /// Where the template came from.
        origin: String,
        /// The error message (for `raise_exception`, the template's text).
        message: String,
        /// The template engine's error.
        #[source]
        source: minijinja::Error,
    },

    /// A message cannot be rendered by the native renderer.
    #[error("message {index}: {message}")]
    InvalidMessage {
        /// The message's position in the conversation.
        index: usize,
        /// What is wrong with it.
        message: String,
    },
}

/// A message's content: plain text or a list of typed parts (`{"type": "text", "text": ...}`, images, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// A plain string.
    Text(String),
    /// Typed parts.
    Parts(Vec<ContentPart>),
}

impl From<&str> for MessageContent {
    fn from(s: &str) -> Self {
        MessageContent::Text(s.to_owned())
    }
}

impl From<String> for MessageContent {
    fn from(s: String) -> Self {
        MessageContent::Text(s)
    }
}

/// One part of a multi-part content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    /// `type`: `text`, `image_url`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// `text` for text parts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Any other fields (`image_url`, ...), passed to templates as they are.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// A function call made by the assistant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call id (Kimi: `functions.{name}:{idx}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Always `function` today.
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    /// What is called.
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".into()
}

/// The function and arguments of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function name.
    pub name: String,
    /// The arguments: a JSON string as the OpenAI API sends them, or a JSON object.
    pub arguments: Value,
}

/// One message of a conversation, in the OpenAI chat format (with `reasoning_content` for thinking models).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, or anything a template knows.
    pub role: String,
    /// The content; `None` serializes as `null` (assistant turns that only call tools).
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// An optional participant name (Kimi writes it instead of the role).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Calls made by an assistant turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For `tool` messages: which call this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The assistant's reasoning (the text between `<think>` and `</think>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message with string content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: Some(MessageContent::Text(content.into())), ..Self::default() }
    }

    /// The text of the content: the string, or the `text` of every part concatenated (other parts skipped).
    pub fn text(&self) -> String {
        match &self.content {
            None => String::new(),
            Some(MessageContent::Text(s)) => s.clone(),
            Some(MessageContent::Parts(parts)) => parts.iter().filter_map(|p| p.text.as_deref()).collect(),
        }
    }
}

/// Rendering switches.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderOptions {
    /// Kimi K2.5 style thinking switch: `Some(true)` opens `<think>` in the generation prompt, `Some(false)` writes
    /// `<think></think>` (instant mode) and drops reasoning from recent turns; `None` renders as the template
    /// does without the variable. Passed to Jinja templates as `thinking` when set.
    pub thinking: Option<bool>,
    /// Extra variables for Jinja templates (HF's `**kwargs` of `apply_chat_template`), e.g. `enable_thinking`.
    pub extra: serde_json::Map<String, Value>,
}

/// A chat template: the native Kimi renderer or a Jinja template.
#[derive(Debug)]
pub enum ChatTemplate {
    /// Kimi-K2 / K2.5, rendered natively.
    Kimi,
    /// A Hugging Face Jinja template.
    Jinja(Box<JinjaTemplate>),
}

impl ChatTemplate {
    /// The native Kimi renderer.
    pub fn kimi() -> Self {
        ChatTemplate::Kimi
    }

    /// A Jinja template from source.
    pub fn jinja(source: impl Into<String>, tokens: TemplateTokens) -> Result<Self> {
        Ok(ChatTemplate::Jinja(Box::new(JinjaTemplate::new(source, "<string>", tokens)?)))
    }

    /// The Jinja template of a model directory: `chat_template.jinja` when present, else the `chat_template` of
    /// `tokenizer_config.json`; bos/eos/pad/unk names from `tokenizer_config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = TokenizerConfig::load_optional(dir)?;
        let tokens = TemplateTokens::from_config(&config);
        let file = dir.join("chat_template.jinja");
        if file.is_file() {
            let source =
                std::fs::read_to_string(&file).map_err(|source| ChatError::Io { path: file.clone(), source })?;
            let origin = file.display().to_string();
            return Ok(ChatTemplate::Jinja(Box::new(JinjaTemplate::new(source, &origin, tokens)?)));
        }
        match config.chat_template {
            Some(source) => {
                let origin = format!("{}: chat_template", config.path.display());
                Ok(ChatTemplate::Jinja(Box::new(JinjaTemplate::new(source, &origin, tokens)?)))
            }
            None => Err(ChatError::NoTemplate { dir: dir.to_path_buf() }),
        }
    }

    /// Renders a conversation. `tools` are OpenAI tool declarations (`{"type": "function", "function": {...}}`).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        options: &RenderOptions,
    ) -> Result<String> {
        match self {
            ChatTemplate::Kimi => kimi::render(messages, tools, add_generation_prompt, options.thinking),
            ChatTemplate::Jinja(t) => t.render(messages, tools, add_generation_prompt, options),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_round_trip_openai_json() {
        let raw = json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            "reasoning_content": "hmm"
        });
        let m: ChatMessage = serde_json::from_value(raw.clone()).unwrap();
        assert_eq!(m.tool_calls.as_ref().unwrap()[0].function.name, "f");
        assert_eq!(serde_json::to_value(&m).unwrap(), raw);
        let parts: ChatMessage =
            serde_json::from_value(json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}))
                .unwrap();
        assert_eq!(parts.text(), "a");
        let Some(MessageContent::Parts(p)) = &parts.content else { panic!("parts") };
        assert_eq!(p[1].extra["image_url"], json!({"url": "x"}));
    }

    #[test]
    fn from_dir_without_template_names_the_dir() {
        let dir = std::env::temp_dir().join(format!("eyrie-chat-none-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = ChatTemplate::from_dir(&dir).unwrap_err();
        assert!(matches!(err, ChatError::NoTemplate { .. }));
        assert!(err.to_string().contains(&dir.display().to_string()));
        std::fs::remove_dir_all(&dir).ok();
    }
}

//! The Kimi-K2 / K2.5 chat format, rendered natively (no template engine on the hot path).
//!
//! Reproduces Moonshot's Kimi-K2-Thinking `chat_template.jinja` (fixture `fixtures/tokenizer/kimi/`) string for
//! string, plus K2.5's `thinking` switch:
//! - tools: `<|im_system|>tool_declare<|im_middle|>{tools as compact JSON}<|im_end|>` first;
//! - a default system message when the first message is not a system one;
//! - each message `<|im_{user|assistant|system}|>{name or role}<|im_middle|>...<|im_end|>` (tool and unknown roles
//!   use `<|im_system|>`); tool results `## Return of {tool_call_id}\n{content}`;
//! - the conversation splits after the last assistant turn without tool calls: assistant turns up to it render
//!   `<think></think>{content}`, later ones (the current agentic turn) `<think>{reasoning}</think>{content}`
//!   (`thinking = false`: `<think></think>` there too);
//! - assistant tool calls: `<|tool_calls_section_begin|>` + per call `<|tool_call_begin|>{id}
//!   <|tool_call_argument_begin|>{arguments}<|tool_call_end|>` + `<|tool_calls_section_end|>`;
//! - generation prompt `<|im_assistant|>assistant<|im_middle|>`, then `<think>` (thinking on) or `<think></think>`
//!   (thinking off); nothing more when the switch is unset, as K2-Thinking's template.

use minijinja::value::{Serde, Value as JValue};
use serde_json::Value;

use super::pyjson::{DumpOptions, dumps};
use super::{ChatError, ChatMessage, ContentPart, MessageContent, Result};

/// The system prompt Kimi's template inserts when the conversation does not start with one.
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are Kimi, an AI assistant created by Moonshot AI.";

const MEDIA_PLACEHOLDER: &str = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>\n";

/// Renders `messages` in Kimi's format (see the module docs).
pub fn render(
    messages: &[ChatMessage],
    tools: Option<&[Value]>,
    add_generation_prompt: bool,
    thinking: Option<bool>,
) -> Result<String> {
    let mut out = String::with_capacity(256 + messages.iter().map(|m| m.text().len() + 64).sum::<usize>());
    // Messages after this index keep their reasoning.
    let last_plain_assistant =
        messages.iter().rposition(|m| m.role == "assistant" && !has_tool_calls(m)).map_or(-1, |i| i as isize);

    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        let json = dumps(&JValue::from(Serde(tools)), &DumpOptions::compact())
            .map_err(|e| ChatError::InvalidMessage { index: 0, message: format!("tools: {e}") })?;
        out.push_str("<|im_system|>tool_declare<|im_middle|>");
        out.push_str(&json);
        out.push_str("<|im_end|>");
    }
    if messages.first().is_none_or(|m| m.role != "system") {
        out.push_str("<|im_system|>system<|im_middle|>");
        out.push_str(DEFAULT_SYSTEM_PROMPT);
        out.push_str("<|im_end|>");
    }

    for (i, m) in messages.iter().enumerate() {
        let role_token = match m.role.as_str() {
            "user" => "<|im_user|>",
            "assistant" => "<|im_assistant|>",
            _ => "<|im_system|>",
        };
        out.push_str(role_token);
        out.push_str(m.name.as_deref().filter(|n| !n.is_empty()).unwrap_or(&m.role));
        out.push_str("<|im_middle|>");
        match m.role.as_str() {
            "assistant" => {
                let keeps_reasoning = i as isize > last_plain_assistant && thinking != Some(false);
                out.push_str("<think>");
                if keeps_reasoning {
                    out.push_str(m.reasoning_content.as_deref().unwrap_or(""));
                }
                out.push_str("</think>");
                render_content(&mut out, m.content.as_ref());
                if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
                    out.push_str("<|tool_calls_section_begin|>");
                    for call in calls {
                        out.push_str("<|tool_call_begin|>");
                        out.push_str(call.id.as_deref().unwrap_or(""));
                        out.push_str("<|tool_call_argument_begin|>");
                        match &call.function.arguments {
                            Value::String(s) => out.push_str(s),
                            other => {
                                let json = dumps(&JValue::from(Serde(other)), &DumpOptions::default())
                                    .map_err(|e| ChatError::InvalidMessage { index: i, message: e.to_string() })?;
                                out.push_str(&json);
                            }
                        }
                        out.push_str("<|tool_call_end|>");
                    }
                    out.push_str("<|tool_calls_section_end|>");
                }
            }
            "tool" => {
                out.push_str("## Return of ");
                out.push_str(m.tool_call_id.as_deref().unwrap_or(""));
                out.push('\n');
                render_content(&mut out, m.content.as_ref());
            }
            _ => render_content(&mut out, m.content.as_ref()),
        }
        out.push_str("<|im_end|>");
    }

    if add_generation_prompt {
        out.push_str("<|im_assistant|>assistant<|im_middle|>");
        match thinking {
            None => {}
            Some(true) => out.push_str("<think>"),
            Some(false) => out.push_str("<think></think>"),
        }
    }
    Ok(out)
}

fn has_tool_calls(m: &ChatMessage) -> bool {
    m.tool_calls.as_ref().is_some_and(|c| !c.is_empty())
}

/// The template's `render_content`: a string as is; parts as their text, images as the media placeholder.
fn render_content(out: &mut String, content: Option<&MessageContent>) {
    match content {
        None => {}
        Some(MessageContent::Text(s)) => out.push_str(s),
        Some(MessageContent::Parts(parts)) => {
            for part in parts {
                if is_image(part) {
                    out.push_str(MEDIA_PLACEHOLDER);
                } else {
                    out.push_str(part.text.as_deref().unwrap_or(""));
                }
            }
        }
    }
}

/// `content['type'] == 'image' or 'image' in content or 'image_url' in content`.
fn is_image(part: &ContentPart) -> bool {
    part.kind == "image" || part.extra.contains_key("image") || part.extra.contains_key("image_url")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::{FunctionCall, ToolCall};

    fn assistant(content: &str, reasoning: &str) -> ChatMessage {
        ChatMessage { reasoning_content: Some(reasoning.into()), ..ChatMessage::new("assistant", content) }
    }

    #[test]
    fn default_system_and_generation_prompt() {
        let out = render(&[ChatMessage::new("user", "Hi")], None, true, None).unwrap();
        assert_eq!(
            out,
            "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\
             <|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
        );
        let on = render(&[ChatMessage::new("user", "Hi")], None, true, Some(true)).unwrap();
        assert!(on.ends_with("<|im_middle|><think>"));
        let off = render(&[ChatMessage::new("user", "Hi")], None, true, Some(false)).unwrap();
        assert!(off.ends_with("<|im_middle|><think></think>"));
    }

    #[test]
    fn only_the_current_agentic_turn_keeps_reasoning() {
        let call = ToolCall {
            id: Some("functions.f:0".into()),
            kind: "function".into(),
            function: FunctionCall { name: "f".into(), arguments: serde_json::json!({"x": 1}) },
        };
        let messages = vec![
            ChatMessage::new("system", "S"),
            ChatMessage::new("user", "q1"),
            assistant("a1", "old"),
            ChatMessage::new("user", "q2"),
            ChatMessage { tool_calls: Some(vec![call]), content: None, ..assistant("", "new") },
            ChatMessage { tool_call_id: Some("functions.f:0".into()), ..ChatMessage::new("tool", "r") },
        ];
        let out = render(&messages, None, true, None).unwrap();
        assert!(out.contains("<|im_assistant|>assistant<|im_middle|><think></think>a1<|im_end|>"), "{out}");
        assert!(out.contains(
            "<think>new</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0\
             <|tool_call_argument_begin|>{\"x\": 1}<|tool_call_end|><|tool_calls_section_end|>"
        ));
        assert!(out.contains("<|im_system|>tool<|im_middle|>## Return of functions.f:0\nr<|im_end|>"));
        assert!(!out.contains("You are Kimi"));
        let off = render(&messages, None, true, Some(false)).unwrap();
        assert!(!off.contains("new") && off.ends_with("<think></think>"));
    }
}

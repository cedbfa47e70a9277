//! Golden tests: chat templates rendered by Eyrie (minijinja and the native Kimi renderer) against transformers'
//! `apply_chat_template(tokenize=False)` on the committed fixtures (`python3 scripts/fixtures_tokenizer.py`).
//!
//! `kimi`: the real Kimi-K2-Thinking template; `kimi_k25`: the same with K2.5's `thinking` switch; `generic`: a
//! Qwen2.5-style ChatML template with tools (read from `tokenizer_config.json`); `strict`: bos/eos globals,
//! `raise_exception`, Python string methods and extra kwargs.

use std::path::PathBuf;

use eyrie_model::chat::{ChatError, ChatMessage, ChatTemplate, JinjaTemplate, RenderOptions, TemplateTokens};
use eyrie_model::tokenizer::Tokenizer;
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tokenizer")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).expect("fixtures/tokenizer/expected.json");
    serde_json::from_str(&text).expect("expected.json parses")
}

struct Case {
    name: String,
    messages: Vec<ChatMessage>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: bool,
    options: RenderOptions,
    expected: Result<String, String>,
}

fn cases(section: &Value) -> Vec<Case> {
    let list = section.as_array().expect("case list");
    assert!(!list.is_empty());
    list.iter()
        .map(|c| {
            let raw_messages = c["messages"].as_array().unwrap();
            let messages: Vec<ChatMessage> =
                raw_messages.iter().map(|m| serde_json::from_value(m.clone()).expect("message parses")).collect();
            // The messages Python rendered are exactly what Eyrie serializes.
            for (m, raw) in messages.iter().zip(raw_messages) {
                assert_eq!(&serde_json::to_value(m).unwrap(), raw, "round trip in {}", c["name"]);
            }
            let mut options = RenderOptions::default();
            for (k, v) in c["kwargs"].as_object().unwrap() {
                if k == "thinking" {
                    options.thinking = v.as_bool();
                } else {
                    options.extra.insert(k.clone(), v.clone());
                }
            }
            let expected = match (&c["expected"], &c["error"]) {
                (Value::String(s), _) => Ok(s.clone()),
                (_, Value::String(e)) => Err(e.clone()),
                _ => panic!("case without expected or error"),
            };
            Case {
                name: c["name"].as_str().unwrap().to_owned(),
                messages,
                tools: c["tools"].as_array().cloned(),
                add_generation_prompt: c["add_generation_prompt"].as_bool().unwrap(),
                options,
                expected,
            }
        })
        .collect()
}

fn render(t: &ChatTemplate, c: &Case) -> Result<String, ChatError> {
    t.render(&c.messages, c.tools.as_deref(), c.add_generation_prompt, &c.options)
}

#[test]
fn real_kimi_template_on_minijinja_and_native_match_transformers() {
    let exp = expected();
    let jinja = ChatTemplate::from_dir(fixtures().join("kimi")).unwrap();
    assert!(matches!(jinja, ChatTemplate::Jinja(_)));
    let native = ChatTemplate::kimi();
    for c in cases(&exp["chat"]["kimi"]) {
        let want = c.expected.as_ref().unwrap();
        assert_eq!(&render(&jinja, &c).unwrap(), want, "minijinja: {}", c.name);
        assert_eq!(&render(&native, &c).unwrap(), want, "native: {}", c.name);
    }
}

#[test]
fn kimi_k25_thinking_switch_matches_transformers() {
    let exp = expected();
    let source = std::fs::read_to_string(fixtures().join("kimi/chat_template_k25_thinking.jinja")).unwrap();
    let jinja = ChatTemplate::jinja(source, TemplateTokens::default()).unwrap();
    let native = ChatTemplate::kimi();
    let mut native_checked = 0;
    for c in cases(&exp["chat"]["kimi_k25"]) {
        let want = c.expected.as_ref().unwrap();
        assert_eq!(&render(&jinja, &c).unwrap(), want, "minijinja: {}", c.name);
        // Unset, the native renderer follows K2-Thinking (no `<think>` in the prompt); set, it is K2.5.
        if c.options.thinking.is_some() {
            assert_eq!(&render(&native, &c).unwrap(), want, "native: {}", c.name);
            native_checked += 1;
        }
    }
    assert!(native_checked >= 10);
}

#[test]
fn generic_chatml_template_with_tools_matches_transformers() {
    let exp = expected();
    let template = ChatTemplate::from_dir(fixtures().join("hf")).unwrap();
    for c in cases(&exp["chat"]["generic"]) {
        assert_eq!(&render(&template, &c).unwrap(), c.expected.as_ref().unwrap(), "{}", c.name);
    }
}

#[test]
fn strict_template_globals_kwargs_and_raise_exception() {
    let exp = expected();
    let tokens = TemplateTokens {
        bos_token: Some("<|endoftext|>".into()),
        eos_token: Some("<|im_end|>".into()),
        ..TemplateTokens::default()
    };
    let source = exp["strict_template"].as_str().unwrap();
    let template = ChatTemplate::Jinja(Box::new(JinjaTemplate::new(source, "strict", tokens).unwrap()));
    for c in cases(&exp["chat"]["strict"]) {
        match (&c.expected, render(&template, &c)) {
            (Ok(want), Ok(got)) => assert_eq!(&got, want, "{}", c.name),
            (Err(want), Err(ChatError::Render { message, .. })) => assert_eq!(&message, want, "{}", c.name),
            (want, got) => panic!("{}: expected {want:?}, got {got:?}", c.name),
        }
    }
}

#[test]
fn rendered_kimi_prompt_tokenizes_to_special_ids() {
    let tok = Tokenizer::from_dir(fixtures().join("kimi")).unwrap();
    let prompt = ChatTemplate::kimi()
        .render(
            &[ChatMessage::new("user", "Hi")],
            None,
            true,
            &RenderOptions { thinking: Some(true), ..Default::default() },
        )
        .unwrap();
    let ids = tok.encode(&prompt, true).unwrap();
    let id = |name: &str| tok.special_token_id(name).unwrap();
    assert_eq!(ids.first(), Some(&id("<|im_system|>")));
    assert_eq!(ids.last(), Some(&id("<think>")));
    assert_eq!(ids.iter().filter(|&&i| i == id("<|im_middle|>")).count(), 3);
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
}

//! The OpenAI wire format: request bodies of `/v1/chat/completions` and `/v1/completions` (the fields vLLM and
//! SGLang accept, unknown ones ignored as OpenAI does), their validation into engine parameters, and the response
//! and streaming-chunk bodies.
//!
//! Validation errors name the parameter (`param` in the error body) and are 400s; nothing here panics on user data.

use eyrie_model::chat::{ChatMessage, ToolCall};
use eyrie_model::sampling::SamplingParams;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::ApiError;

/// Stop sequences: one string or a list (OpenAI allows up to 4; we allow 16).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// `"stop": "\n"`.
    One(String),
    /// `"stop": ["\n", "END"]`.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and empty `choices`) before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and length fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    /// Served model name; must match (404 otherwise).
    pub model: Option<String>,
    /// Stream SSE chunks.
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    /// vLLM/SGLang extension: token ids that end generation.
    pub stop_token_ids: Option<Vec<i64>>,
    /// vLLM/SGLang extension: keep generating past end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    pub n: Option<i64>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: CommonParams,
    /// Chat: `logprobs: true` and `top_logprobs: 0..=20`.
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// OpenAI tool declarations, passed to the chat template.
    pub tools: Option<Vec<Value>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name": ...}}`.
    pub tool_choice: Option<Value>,
    /// Extra template variables (`{"thinking": false}`, `{"enable_thinking": true}`), as vLLM and SGLang.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Continue the last assistant message instead of opening a new one.
    #[serde(default)]
    pub continue_final_message: bool,
    /// Open the assistant turn (the default).
    pub add_generation_prompt: Option<bool>,
    pub response_format: Option<Value>,
}

/// A completion prompt: text, a list with one text, token ids, or a list with one token-id list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: CommonParams,
    /// Completions: the number of top log-probabilities per token (0..=20).
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
}

/// What the engine needs to run one request, validated.
#[derive(Debug, Clone)]
pub struct GenerationParams {
    pub sampling: SamplingParams,
    /// Requested limit; `None` = up to the context length.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// `Some(k)`: report each token's log-probability and the `k` most likely alternatives.
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
}

const MAX_TOP_LOGPROBS: i64 = 20;
const MAX_STOP_SEQUENCES: usize = 16;

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(message, Some(param))
}

fn finite(param: &str, v: f64) -> Result<f32, ApiError> {
    if v.is_finite() { Ok(v as f32) } else { Err(bad(param, format!("{param} must be a finite number"))) }
}

impl CommonParams {
    /// Validates the shared fields; `logprobs` is the endpoint's already-validated top-k count.
    pub fn validate(&self, logprobs: Option<usize>, vocab_size: usize) -> Result<GenerationParams, ApiError> {
        if let Some(n) = self.n
            && n != 1
        {
            return Err(bad("n", format!("n = {n} is not supported: only n = 1 (send separate requests)")));
        }
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => Some(("max_completion_tokens", v)),
            (None, Some(v)) => Some(("max_tokens", v)),
            (None, None) => None,
        };
        let max_tokens = match max_tokens {
            Some((name, v)) if v < 1 => return Err(bad(name, format!("{name} must be at least 1, got {v}"))),
            Some((_, v)) => Some(usize::try_from(v).unwrap_or(usize::MAX)),
            None => None,
        };
        let temperature = self.temperature.map(|t| finite("temperature", t)).transpose()?;
        if let Some(t) = temperature
            && !(0.0..=2.0).contains(&t)
        {
            return Err(bad("temperature", format!("temperature must be in [0, 2], got {t}")));
        }
        let top_p = self.top_p.map(|p| finite("top_p", p)).transpose()?;
        if let Some(p) = top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(bad("top_p", format!("top_p must be in (0, 1], got {p}")));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => None,
            Some(k) if k < -1 => return Err(bad("top_k", format!("top_k must be -1 (off) or >= 1, got {k}"))),
            Some(k) => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        };
        let min_p = self.min_p.map(|p| finite("min_p", p)).transpose()?;
        if let Some(p) = min_p
            && !(0.0..=1.0).contains(&p)
        {
            return Err(bad("min_p", format!("min_p must be in [0, 1], got {p}")));
        }
        let mut penalties = [0.0f32; 2];
        for (slot, (name, v)) in penalties
            .iter_mut()
            .zip([("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)])
        {
            if let Some(v) = v {
                let v = finite(name, v)?;
                if !(-2.0..=2.0).contains(&v) {
                    return Err(bad(name, format!("{name} must be in [-2, 2], got {v}")));
                }
                *slot = v;
            }
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP_SEQUENCES {
            return Err(bad("stop", format!("at most {MAX_STOP_SEQUENCES} stop sequences, got {}", stop.len())));
        }
        if stop.iter().any(String::is_empty) {
            return Err(bad("stop", "stop sequences must not be empty"));
        }
        let stop_token_ids = token_ids("stop_token_ids", self.stop_token_ids.as_deref().unwrap_or(&[]), vocab_size)?;
        // Without a seed, sampled requests still differ from one another: the engine draws a seed per request.
        let seed = self.seed.map(|s| s as u64);
        let sampling = SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            presence_penalty: penalties[0],
            frequency_penalty: penalties[1],
            seed: seed.unwrap_or_else(random_seed),
        };
        sampling.validate().map_err(|e| bad("temperature", e.to_string()))?;
        Ok(GenerationParams {
            sampling,
            max_tokens,
            stop,
            stop_token_ids,
            ignore_eos: self.ignore_eos,
            logprobs,
            stream: self.stream,
            include_usage: self.stream_options.as_ref().is_some_and(|o| o.include_usage),
        })
    }
}

/// Token ids from JSON integers, each checked against the vocabulary.
pub fn token_ids(param: &str, ids: &[i64], vocab_size: usize) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            if id < 0 || id as u64 >= vocab_size as u64 {
                Err(bad(param, format!("{param}[{i}] = {id} is outside the vocabulary (size {vocab_size})")))
            } else {
                Ok(id as u32)
            }
        })
        .collect()
}

/// Validates `top_logprobs` (chat) or `logprobs` (completions) counts.
pub fn top_logprobs(param: &str, value: Option<i64>) -> Result<usize, ApiError> {
    match value {
        None => Ok(0),
        Some(k) if (0..=MAX_TOP_LOGPROBS).contains(&k) => Ok(k as usize),
        Some(k) => Err(bad(param, format!("{param} must be in [0, {MAX_TOP_LOGPROBS}], got {k}"))),
    }
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// `usage`.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details`: tokens served from the prefix cache.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }
}

/// One alternative in chat `top_logprobs`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One generated token in chat `logprobs.content`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// Chat `choices[].logprobs`.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

/// A tool call in a response message (`arguments` is a JSON string, as OpenAI sends it).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ResponseToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: ResponseFunction,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ResponseFunction {
    pub name: String,
    pub arguments: String,
}

impl From<&ResponseToolCall> for ToolCall {
    fn from(c: &ResponseToolCall) -> Self {
        ToolCall {
            id: Some(c.id.clone()),
            kind: "function".into(),
            function: eyrie_model::chat::FunctionCall {
                name: c.function.name.clone(),
                arguments: Value::String(c.function.arguments.clone()),
            },
        }
    }
}

/// The assistant message of a non-streaming chat response.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ResponseMessage {
    pub role: &'static str,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ResponseToolCall>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ResponseMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

/// A streamed tool-call fragment: the first carries id, type and name; later ones append to `arguments`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// Completions `choices[].logprobs` (the legacy format).
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<serde_json::Map<String, Value>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// Seconds since the Unix epoch (`created`).
pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn common(v: Value) -> CommonParams {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn validation_names_the_parameter() {
        let cases = [
            (json!({"temperature": 3.0}), "temperature"),
            (json!({"top_p": 0.0}), "top_p"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"min_p": 1.5}), "min_p"),
            (json!({"presence_penalty": 2.5}), "presence_penalty"),
            (json!({"frequency_penalty": -9}), "frequency_penalty"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"max_completion_tokens": -1}), "max_completion_tokens"),
            (json!({"n": 2}), "n"),
            (json!({"stop": ["a", ""]}), "stop"),
            (json!({"stop_token_ids": [5, 1000]}), "stop_token_ids"),
        ];
        for (body, param) in cases {
            let err = common(body.clone()).validate(None, 100).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {err:?}");
            assert_eq!(err.status, axum::http::StatusCode::BAD_REQUEST);
        }
        assert_eq!(top_logprobs("top_logprobs", Some(21)).unwrap_err().param.as_deref(), Some("top_logprobs"));
    }

    #[test]
    fn defaults_and_aliases() {
        let p = common(json!({"max_tokens": 5, "max_completion_tokens": 7, "stop": "x", "top_k": -1, "seed": 3}))
            .validate(Some(2), 100)
            .unwrap();
        assert_eq!(p.max_tokens, Some(7), "max_completion_tokens wins");
        assert_eq!(p.stop, vec!["x".to_string()]);
        assert_eq!(p.sampling.top_k, None);
        assert_eq!(p.sampling.seed, 3);
        assert_eq!(p.logprobs, Some(2));
        assert!(p.sampling.is_greedy());
        let prompt: Prompt = serde_json::from_value(json!([[1, 2], [3]])).unwrap();
        assert!(matches!(prompt, Prompt::TokenLists(_)));
        let prompt: Prompt = serde_json::from_value(json!([1, 2])).unwrap();
        assert!(matches!(prompt, Prompt::Tokens(_)));
    }
}

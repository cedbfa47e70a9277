//! From generated ids to what the client sees, incrementally: UTF-8-safe detokenization, `<think>` reasoning split
//! into `reasoning_content`, Kimi-K2 tool calls parsed into `tool_calls` (streamed as OpenAI deltas), and stop
//! strings (text held back while it may still become a stop string, cut where one ends).
//!
//! Kimi-K2's tool-call syntax (its chat template and vLLM's `kimi_k2` tool parser):
//! `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
//! <|tool_call_end|>...<|tool_calls_section_end|>`; each marker is one special token, so the parser switches state
//! on token ids and never on text a model could emit by accident.

use std::sync::Arc;

use eyrie_model::tokenizer::{StreamDecoder, Tokenizer};

use super::protocol::{FunctionDelta, ResponseFunction, ResponseToolCall, ToolCallDelta};

/// Ids of the structural special tokens (absent ones disable that parsing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Markers {
    pub think_start: Option<u32>,
    pub think_end: Option<u32>,
    pub section_begin: Option<u32>,
    pub section_end: Option<u32>,
    pub call_begin: Option<u32>,
    pub argument_begin: Option<u32>,
    pub call_end: Option<u32>,
}

impl Markers {
    /// The markers a tokenizer defines.
    pub fn of(tokenizer: &Tokenizer) -> Self {
        let id = |name: &str| tokenizer.special_token_id(name).or_else(|| tokenizer.token_to_id(name));
        Self {
            think_start: id("<think>"),
            think_end: id("</think>"),
            section_begin: id("<|tool_calls_section_begin|>"),
            section_end: id("<|tool_calls_section_end|>"),
            call_begin: id("<|tool_call_begin|>"),
            argument_begin: id("<|tool_call_argument_begin|>"),
            call_end: id("<|tool_call_end|>"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    /// Inside the tool-calls section, between calls.
    Section,
    /// Reading a call's id (`functions.NAME:IDX`).
    CallId,
    /// Streaming a call's JSON arguments.
    Arguments,
}

/// Text and tool-call fragments produced by one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCallDelta>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.reasoning.is_empty() && self.tool_calls.is_empty()
    }
}

/// The incremental parser of one choice.
#[derive(Debug)]
pub struct OutputParser {
    decoder: StreamDecoder<Arc<Tokenizer>>,
    markers: Markers,
    mode: Mode,
    parse_tools: bool,
    stop: Vec<String>,
    /// Content not yet sent because it may be the start of a stop string.
    held: String,
    call_id: String,
    calls: Vec<ResponseToolCall>,
    stopped: bool,
}

impl OutputParser {
    /// A parser; `reasoning` starts in reasoning mode (the prompt opened `<think>`), `parse_reasoning` and
    /// `parse_tools` enable the splits (chat only), `stop` are the stop strings.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        starts_in_reasoning: bool,
        parse_reasoning: bool,
        parse_tools: bool,
        stop: Vec<String>,
    ) -> Self {
        let mut markers = Markers::of(&tokenizer);
        if !parse_reasoning {
            markers.think_start = None;
            markers.think_end = None;
        }
        let mode = if starts_in_reasoning && parse_reasoning { Mode::Reasoning } else { Mode::Content };
        Self {
            decoder: StreamDecoder::new(tokenizer, true),
            markers,
            mode,
            parse_tools: parse_tools && markers.section_begin.is_some() && markers.call_begin.is_some(),
            stop,
            held: String::new(),
            call_id: String::new(),
            calls: Vec::new(),
            stopped: false,
        }
    }

    /// Whether a stop string ended the text (the caller stops generation).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The complete tool calls parsed so far.
    pub fn tool_calls(&self) -> &[ResponseToolCall] {
        &self.calls
    }

    /// Feeds one generated id.
    pub fn push(&mut self, id: u32) -> Delta {
        let mut delta = Delta::default();
        if self.stopped {
            return delta;
        }
        let m = self.markers;
        let is = |marker: Option<u32>| marker == Some(id);
        let next = match self.mode {
            Mode::Content if is(m.think_start) => Some(Mode::Reasoning),
            Mode::Reasoning if is(m.think_end) => Some(Mode::Content),
            Mode::Content | Mode::Reasoning if self.parse_tools && is(m.section_begin) => Some(Mode::Section),
            // A call outside a section (some fine-tunes skip the section markers).
            Mode::Content | Mode::Section if self.parse_tools && is(m.call_begin) => Some(Mode::CallId),
            Mode::Section if is(m.section_end) => Some(Mode::Content),
            Mode::CallId if is(m.argument_begin) => Some(Mode::Arguments),
            Mode::Arguments if is(m.call_end) => Some(Mode::Section),
            _ => None,
        };
        if let Some(next) = next {
            let rest = self.decoder.flush().unwrap_or_default();
            self.route(&rest, &mut delta);
            if next == Mode::CallId {
                self.call_id.clear();
            }
            if self.mode == Mode::CallId && next == Mode::Arguments {
                self.open_call(&mut delta);
            }
            self.mode = next;
            return delta;
        }
        let text = self.decoder.step(id).unwrap_or_default();
        self.route(&text, &mut delta);
        delta
    }

    /// Ends the stream: flushes the decoder and any held-back text.
    pub fn finish(&mut self) -> Delta {
        let mut delta = Delta::default();
        if !self.stopped {
            let rest = self.decoder.flush().unwrap_or_default();
            self.route(&rest, &mut delta);
            delta.content.push_str(&std::mem::take(&mut self.held));
        }
        delta
    }

    fn open_call(&mut self, delta: &mut Delta) {
        let id = self.call_id.trim().to_string();
        // `functions.NAME:IDX` -> NAME (vLLM's kimi_k2 parser does the same).
        let name = id.strip_prefix("functions.").unwrap_or(&id);
        let name = name.rsplit_once(':').map_or(name, |(n, _)| n).to_string();
        let index = self.calls.len();
        self.calls.push(ResponseToolCall {
            id: id.clone(),
            kind: "function",
            function: ResponseFunction { name: name.clone(), arguments: String::new() },
        });
        delta.tool_calls.push(ToolCallDelta {
            index,
            id: Some(id),
            kind: Some("function"),
            function: FunctionDelta { name: Some(name), arguments: String::new() },
        });
    }

    fn route(&mut self, text: &str, delta: &mut Delta) {
        if text.is_empty() {
            return;
        }
        match self.mode {
            Mode::Content => self.content(text, delta),
            Mode::Reasoning => delta.reasoning.push_str(text),
            Mode::Section => {}
            Mode::CallId => self.call_id.push_str(text),
            Mode::Arguments => {
                let index = self.calls.len() - 1;
                self.calls[index].function.arguments.push_str(text);
                match delta.tool_calls.last_mut().filter(|d| d.index == index) {
                    Some(d) => d.function.arguments.push_str(text),
                    None => delta.tool_calls.push(ToolCallDelta {
                        index,
                        id: None,
                        kind: None,
                        function: FunctionDelta { name: None, arguments: text.to_string() },
                    }),
                }
            }
        }
    }

    /// Content goes through the stop-string filter.
    fn content(&mut self, text: &str, delta: &mut Delta) {
        if self.stop.is_empty() {
            delta.content.push_str(text);
            return;
        }
        self.held.push_str(text);
        if let Some(cut) = self.stop.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            delta.content.push_str(&self.held[..cut]);
            self.held.clear();
            self.stopped = true;
            return;
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .stop
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(|&k| s.is_char_boundary(k)).map(move |k| &s[..k]))
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let emit = self.held.len() - keep;
        delta.content.push_str(&self.held[..emit]);
        self.held.drain(..emit);
    }
}

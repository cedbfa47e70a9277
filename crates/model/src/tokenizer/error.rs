//! The error type of the tokenizer module: every variant names the file, line, field or id at fault.

use std::path::PathBuf;

/// Result alias for the tokenizer module.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// Everything that can go wrong while loading a tokenizer, encoding or decoding.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// An I/O error while reading a file (a missing file lands here, with its path).
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The directory holds neither `tiktoken.model` nor `tokenizer.json`.
    #[error("{dir}: no tiktoken.model and no tokenizer.json found")]
    NoTokenizer {
        /// The directory searched.
        dir: PathBuf,
    },

    /// A line of a tiktoken ranks file is not `base64(bytes) rank`.
    #[error("{path}:{line}: {message}")]
    BadRanksLine {
        /// The ranks file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// What is wrong with it.
        message: String,
    },

    /// A JSON file does not parse.
    #[error("{path}: malformed JSON: {source}")]
    Json {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },

    /// A field of `tokenizer_config.json` (or of the ranks file as a whole) has an unusable value.
    #[error("{path}: {field}: {message}")]
    BadConfig {
        /// The file involved.
        path: PathBuf,
        /// The field at fault, e.g. `added_tokens_decoder.163586`.
        field: String,
        /// What is wrong with it.
        message: String,
    },

    /// The pre-tokenizer regular expression failed to compile or to run.
    #[error("pre-tokenizer regex: {message}")]
    Regex {
        /// The regex engine's message.
        message: String,
    },

    /// The Hugging Face `tokenizers` library reported an error.
    #[error("{context}: {source}")]
    Hf {
        /// What was being done: the file loaded, or `encode` / `decode`.
        context: String,
        /// The library's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A token id outside the vocabulary.
    #[error("unknown token id {id} (vocabulary size {vocab_size})")]
    UnknownId {
        /// The id asked for.
        id: u32,
        /// The number of ids the tokenizer knows (`0..vocab_size`, possibly with holes).
        vocab_size: usize,
    },
}

impl TokenizerError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }

    pub(crate) fn bad_config(path: impl Into<PathBuf>, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::BadConfig { path: path.into(), field: field.into(), message: message.into() }
    }
}

//! The one error type of `eyrie-spec-decode`: every variant names the file, field or tensor at fault.

use std::path::PathBuf;

use eyrie_model::ModelError;
use eyrie_model::quant::QuantError;

/// Result alias for this crate.
pub type Result<T, E = SpecError> = std::result::Result<T, E>;

/// Everything that can go wrong while loading a drafter, checking it against its target, or decoding with it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// An I/O error while reading a file.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The drafter's config.json is not valid JSON, or a field has the wrong type.
    #[error("{path}: malformed drafter config{}: {message}", field.as_ref().map(|f| format!(" in {f}")).unwrap_or_default())]
    Json {
        /// The config file.
        path: PathBuf,
        /// The (dotted) field, when known.
        field: Option<String>,
        /// What the parser said.
        message: String,
    },

    /// A required config field is absent.
    #[error("{path}: missing required field {field}")]
    MissingField {
        /// The config file.
        path: PathBuf,
        /// The dotted field name.
        field: String,
    },

    /// A config field holds a value this implementation does not support.
    #[error("{path}: unsupported {field} = {value}: {reason}")]
    Unsupported {
        /// The config file.
        path: PathBuf,
        /// The dotted field name.
        field: String,
        /// The value found, as JSON.
        value: String,
        /// Why, and what is supported.
        reason: String,
    },

    /// The drafter does not fit the target model it is meant to serve (sizes, vocabulary, aux layers).
    #[error("{path}: drafter does not match the target: {field}: {message}")]
    TargetMismatch {
        /// The drafter's config file or checkpoint directory.
        path: PathBuf,
        /// The config field or tensor involved.
        field: String,
        /// Expected vs found.
        message: String,
    },

    /// A tensor the drafter needs is absent.
    #[error("{checkpoint}: tensor {tensor:?} not found{}", if hint.is_empty() { String::new() } else { format!(" ({hint})") })]
    MissingTensor {
        /// The checkpoint directory.
        checkpoint: PathBuf,
        /// The tensor name.
        tensor: String,
        /// What the config implied (may be empty).
        hint: String,
    },

    /// A tensor's shape disagrees with the config.
    #[error("{checkpoint}: tensor {tensor:?} has shape {found:?}, expected {expected:?} from config.json")]
    TensorShape {
        /// The checkpoint directory.
        checkpoint: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape present.
        found: Vec<usize>,
    },

    /// The vocabulary maps `d2t` / `t2d` are inconsistent with each other or with the vocabulary sizes.
    #[error("{checkpoint}: vocabulary map {tensor}: {message}")]
    VocabMap {
        /// The checkpoint directory.
        checkpoint: PathBuf,
        /// `d2t` or `t2d`.
        tensor: String,
        /// What is wrong (the first offending index).
        message: String,
    },

    /// The checkpoint holds tensors the drafter did not consume.
    #[error("{checkpoint}: {} tensor(s) not used by the drafter: {}", tensors.len(), tensors.join(", "))]
    UnusedTensors {
        /// The checkpoint directory.
        checkpoint: PathBuf,
        /// Every unused tensor name, sorted.
        tensors: Vec<String>,
    },

    /// Invalid use of the decoding API (an empty batch, a sequence in the wrong state).
    #[error("invalid input: {message}")]
    Input {
        /// What is wrong.
        message: String,
    },

    /// An error from the target model (KV cache full, bad token, ...).
    #[error(transparent)]
    Model(#[from] ModelError),

    /// An error from the checkpoint reader.
    #[error(transparent)]
    Quant(#[from] QuantError),
}

impl SpecError {
    pub(crate) fn input(message: impl Into<String>) -> Self {
        Self::Input { message: message.into() }
    }
}

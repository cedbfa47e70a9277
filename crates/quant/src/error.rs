//! The one error type of `eyrie-quant`: every variant names the file, tensor or field at fault.

use std::path::PathBuf;

use crate::Dtype;

/// Result alias for this crate.
pub type Result<T, E = QuantError> = std::result::Result<T, E>;

/// Everything that can go wrong while reading a checkpoint or a quantization config.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QuantError {
    /// An I/O error while opening, reading or mapping a file.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The directory holds neither `model.safetensors.index.json` nor any `*.safetensors` file.
    #[error("{dir}: no model.safetensors.index.json and no *.safetensors file found")]
    NoCheckpoint {
        /// The directory searched.
        dir: PathBuf,
    },

    /// A shard named by the index does not exist.
    #[error("{index}: tensor {tensor:?} maps to shard {shard:?}, which does not exist")]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// One tensor that maps to the missing shard.
        tensor: String,
        /// The missing shard's file name.
        shard: String,
    },

    /// A JSON document (index, config, safetensors header) could not be parsed.
    #[error("{path}: malformed JSON{}: {message}", field.as_ref().map(|f| format!(" in {f}")).unwrap_or_default())]
    Json {
        /// The file.
        path: PathBuf,
        /// The field or section involved, when known.
        field: Option<String>,
        /// What the parser said.
        message: String,
    },

    /// The file is shorter than its own header says.
    #[error("{path}: truncated: {what} needs {needed} bytes but the file has {actual}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read (the header, or a tensor by name).
        what: String,
        /// Bytes required.
        needed: u64,
        /// Bytes present.
        actual: u64,
    },

    /// A safetensors header that is structurally invalid (bad length, overlapping or out-of-range offsets,
    /// byte count that disagrees with dtype x shape).
    #[error("{path}: invalid safetensors header{}: {message}", tensor.as_ref().map(|t| format!(" at tensor {t:?}")).unwrap_or_default())]
    BadHeader {
        /// The file.
        path: PathBuf,
        /// The tensor involved, when known.
        tensor: Option<String>,
        /// What is wrong.
        message: String,
    },

    /// A dtype string the reader does not know.
    #[error("{path}: tensor {tensor:?} has unsupported dtype {dtype:?}")]
    UnknownDtype {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype string as written.
        dtype: String,
    },

    /// A tensor was looked up by name and is not in the checkpoint.
    #[error("{checkpoint}: tensor {tensor:?} not found")]
    MissingTensor {
        /// The checkpoint directory or file.
        checkpoint: PathBuf,
        /// The tensor name.
        tensor: String,
    },

    /// The same tensor name appears in two shards (or twice in the index's view of the shards).
    #[error("tensor {tensor:?} appears in both {first} and {second}")]
    DuplicateTensor {
        /// The tensor name.
        tensor: String,
        /// The first file holding it.
        first: PathBuf,
        /// The second file holding it.
        second: PathBuf,
    },

    /// A tensor has a different dtype than the caller requires.
    #[error("{path}: tensor {tensor:?} has dtype {found}, expected {expected}")]
    DtypeMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype(s) accepted.
        expected: String,
        /// The dtype present.
        found: Dtype,
    },

    /// A tensor has a different shape than the caller requires.
    #[error("{path}: tensor {tensor:?} has shape {found:?}, expected {expected}")]
    ShapeMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shape accepted, in words (`[2048, 896]`, `[out, ceil(in/8)]`, ...).
        expected: String,
        /// The shape present.
        found: Vec<usize>,
    },

    /// A quantization config that is valid JSON but describes a scheme this crate does not support,
    /// or contradicts itself.
    #[error("quantization_config{}: {message}", field.as_ref().map(|f| format!(".{f}")).unwrap_or_default())]
    UnsupportedScheme {
        /// The config field at fault, as a dotted path (`config_groups.group_0.weights.num_bits`).
        field: Option<String>,
        /// What is wrong.
        message: String,
    },

    /// An `ignore` or `targets` entry with a `re:` prefix that is not a valid regular expression.
    #[error("quantization_config.{field}: invalid regular expression {pattern:?}: {message}")]
    BadPattern {
        /// The field (`ignore` or `config_groups.<name>.targets`).
        field: String,
        /// The pattern (without `re:`).
        pattern: String,
        /// What the regex compiler said.
        message: String,
    },

    /// Values that are individually well-formed but inconsistent (a scale count that does not fit the shape, a
    /// packed value out of range, ...).
    #[error("{what}: {message}")]
    Invalid {
        /// The tensor or parameter involved.
        what: String,
        /// What is wrong.
        message: String,
    },
}

impl QuantError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }

    /// An [`QuantError::Invalid`] error.
    pub fn invalid(what: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid { what: what.into(), message: message.into() }
    }
}

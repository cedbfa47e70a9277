//! The one error type of `eyrie-model`'s model code: every variant names the file, field or tensor at fault.

use std::path::PathBuf;

use eyrie_quant::QuantError;

/// Result alias for this crate's model code.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Everything that can go wrong while reading a model's config and weights or running it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// An I/O error while reading a file.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// config.json is not valid JSON, or a field has the wrong JSON type.
    #[error("{path}: malformed config{}: {message}", field.as_ref().map(|f| format!(" in {f}")).unwrap_or_default())]
    Json {
        /// The file.
        path: PathBuf,
        /// The (dotted) field involved, when known.
        field: Option<String>,
        /// What the parser said.
        message: String,
    },

    /// A required config field is absent (or null).
    #[error("{path}: missing required field {field}")]
    MissingField {
        /// The config file.
        path: PathBuf,
        /// The dotted field name (`text_config.hidden_size`).
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
        /// Why it is not supported, and what is.
        reason: String,
    },

    /// Config fields that are individually valid but inconsistent (a group count that does not divide the experts).
    #[error("{path}: invalid {field}: {message}")]
    InvalidConfig {
        /// The config file.
        path: PathBuf,
        /// The dotted field name.
        field: String,
        /// What is wrong.
        message: String,
    },

    /// An error from the checkpoint reader (missing shard, bad header, INT4 layout, ...).
    #[error(transparent)]
    Quant(#[from] QuantError),

    /// A tensor the model needs is not in the checkpoint.
    #[error("{checkpoint}: tensor {tensor:?} not found")]
    MissingTensor {
        /// The checkpoint directory.
        checkpoint: PathBuf,
        /// The checkpoint name of the tensor.
        tensor: String,
    },

    /// A checkpoint tensor's shape disagrees with the config.
    #[error("{checkpoint}: tensor {tensor:?} has shape {found:?}, expected {expected:?} from config.json")]
    TensorShape {
        /// The checkpoint directory.
        checkpoint: PathBuf,
        /// The checkpoint name of the tensor.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape present.
        found: Vec<usize>,
    },

    /// The checkpoint holds tensors the model did not consume (a naming or config mismatch).
    #[error("{checkpoint}: {} tensor(s) not used by the model: {}", tensors.len(), preview(tensors))]
    UnusedTensors {
        /// The checkpoint directory.
        checkpoint: PathBuf,
        /// Every unused tensor name, sorted.
        tensors: Vec<String>,
    },

    /// A weight is stored in a format this loader cannot use for that module.
    #[error("{checkpoint}: tensor {tensor:?}: {message}")]
    UnsupportedWeight {
        /// The checkpoint directory.
        checkpoint: PathBuf,
        /// The checkpoint name of the tensor.
        tensor: String,
        /// What is wrong.
        message: String,
    },

    /// A collective operation (all-reduce, all-gather, all-to-all) whose ranks disagree, or whose group broke.
    #[error("collective {op} on rank {rank}: {message}")]
    Collective {
        /// The operation.
        op: &'static str,
        /// The rank reporting it.
        rank: usize,
        /// What is wrong (the ranks and shapes involved).
        message: String,
    },

    /// Input that the model cannot run on (a token id outside the vocabulary, an empty batch).
    #[error("invalid input: {message}")]
    Input {
        /// What is wrong.
        message: String,
    },
}

/// The first few names of a long list, for error messages.
fn preview(names: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut s = names.iter().take(SHOWN).map(String::as_str).collect::<Vec<_>>().join(", ");
    if names.len() > SHOWN {
        s.push_str(&format!(", ... ({} more)", names.len() - SHOWN));
    }
    s
}

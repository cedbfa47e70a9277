//! A minimal safetensors writer for fixtures, tools and tests, plus the `model.safetensors.index.json` writer.
//!
//! Output matches the reference library's layout: header JSON padded with spaces to a multiple of 8 bytes, tensors
//! sorted by name and stored contiguously in that order.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use half::{bf16, f16};
use serde_json::{Map, Value, json};

use crate::safetensors::METADATA_KEY;
use crate::{Dtype, QuantError, Result};

/// File name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One tensor waiting to be written.
#[derive(Debug, Clone)]
struct Pending {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// Collects tensors and metadata in memory, then writes one `.safetensors` file.
#[derive(Debug, Clone, Default)]
pub struct SafetensorsWriter {
    tensors: BTreeMap<String, Pending>,
    metadata: BTreeMap<String, String>,
}

impl SafetensorsWriter {
    /// An empty writer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tensor from its raw little-endian bytes. [`QuantError::Invalid`] when the byte count disagrees with
    /// `dtype` x `shape`, when the name is already taken, or when it is the reserved `__metadata__`.
    pub fn add(&mut self, name: impl Into<String>, dtype: Dtype, shape: &[usize], bytes: Vec<u8>) -> Result<()> {
        let name = name.into();
        if name == METADATA_KEY {
            return Err(QuantError::invalid(name, "is reserved for the header's metadata"));
        }
        let expected = shape.iter().try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
        if expected != Some(bytes.len()) {
            return Err(QuantError::invalid(
                name,
                format!("{} bytes given for {dtype} x {shape:?}, which needs {expected:?}", bytes.len()),
            ));
        }
        if self.tensors.contains_key(&name) {
            return Err(QuantError::invalid(name, "added twice"));
        }
        self.tensors.insert(name, Pending { dtype, shape: shape.to_vec(), bytes });
        Ok(())
    }

    /// Adds an F32 tensor.
    pub fn add_f32(&mut self, name: impl Into<String>, shape: &[usize], values: &[f32]) -> Result<()> {
        self.add(name, Dtype::F32, shape, values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    /// Adds a BF16 tensor.
    pub fn add_bf16(&mut self, name: impl Into<String>, shape: &[usize], values: &[bf16]) -> Result<()> {
        self.add(name, Dtype::BF16, shape, values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    /// Adds an F16 tensor.
    pub fn add_f16(&mut self, name: impl Into<String>, shape: &[usize], values: &[f16]) -> Result<()> {
        self.add(name, Dtype::F16, shape, values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    /// Adds an I32 tensor.
    pub fn add_i32(&mut self, name: impl Into<String>, shape: &[usize], values: &[i32]) -> Result<()> {
        self.add(name, Dtype::I32, shape, values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    /// Adds an I64 tensor.
    pub fn add_i64(&mut self, name: impl Into<String>, shape: &[usize], values: &[i64]) -> Result<()> {
        self.add(name, Dtype::I64, shape, values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    /// Adds `u32` words stored as an I32 tensor (same bits), the way packed INT4 weights are saved.
    pub fn add_u32_as_i32(&mut self, name: impl Into<String>, shape: &[usize], words: &[u32]) -> Result<()> {
        self.add(name, Dtype::I32, shape, words.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    /// Adds a BOOL tensor (one byte per element, 0 or 1).
    pub fn add_bool(&mut self, name: impl Into<String>, shape: &[usize], values: &[bool]) -> Result<()> {
        self.add(name, Dtype::BOOL, shape, values.iter().map(|&v| u8::from(v)).collect())
    }

    /// Sets one `__metadata__` entry (replacing an earlier value for the same key).
    pub fn metadata(&mut self, key: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// Number of tensors added.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether no tensor was added.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Size of the data buffer that [`SafetensorsWriter::write`] will produce (sum of the tensors' bytes).
    pub fn data_len(&self) -> u64 {
        self.tensors.values().map(|t| t.bytes.len() as u64).sum()
    }

    /// The header: 8-byte length, then the JSON padded with spaces to a multiple of 8.
    fn header(&self) -> Vec<u8> {
        let mut map = Map::new();
        if !self.metadata.is_empty() {
            let meta: Map<String, Value> =
                self.metadata.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
            map.insert(METADATA_KEY.to_owned(), Value::Object(meta));
        }
        let mut offset = 0u64;
        for (name, t) in &self.tensors {
            let end = offset + t.bytes.len() as u64;
            map.insert(
                name.clone(),
                json!({ "dtype": t.dtype.as_str(), "shape": t.shape, "data_offsets": [offset, end] }),
            );
            offset = end;
        }
        let mut json = Value::Object(map).to_string().into_bytes();
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut out = Vec::with_capacity(8 + json.len());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        out
    }

    /// The whole file's bytes, as [`SafetensorsWriter::write`] would write them.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.header();
        out.reserve(usize::try_from(self.data_len()).unwrap_or(0));
        for t in self.tensors.values() {
            out.extend_from_slice(&t.bytes);
        }
        out
    }

    /// Writes the file to `path` (created or truncated).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let io = |e| QuantError::io(path, e);
        let mut w = BufWriter::new(File::create(path).map_err(io)?);
        w.write_all(&self.header()).map_err(io)?;
        for t in self.tensors.values() {
            w.write_all(&t.bytes).map_err(io)?;
        }
        w.flush().map_err(io)
    }
}

/// Writes `dir/model.safetensors.index.json`: `{"metadata": {"total_size": N}, "weight_map": {tensor: shard}}`.
pub fn write_index(dir: impl AsRef<Path>, weight_map: &BTreeMap<String, String>, total_size: u64) -> Result<()> {
    let path = dir.as_ref().join(INDEX_FILE);
    let index = json!({ "metadata": { "total_size": total_size }, "weight_map": weight_map });
    let text = serde_json::to_string_pretty(&index).map_err(|e| QuantError::Json {
        path: path.clone(),
        field: None,
        message: e.to_string(),
    })?;
    std::fs::write(&path, text + "\n").map_err(|e| QuantError::io(&path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::SafetensorsFile;

    #[test]
    fn add_validates_byte_count_and_names() {
        let mut w = SafetensorsWriter::new();
        assert!(matches!(w.add("x", Dtype::F32, &[2], vec![0; 7]), Err(QuantError::Invalid { .. })));
        assert!(matches!(w.add_f32("x", &[3], &[1.0, 2.0]), Err(QuantError::Invalid { .. })));
        assert!(matches!(w.add("x", Dtype::F32, &[usize::MAX, 2], vec![]), Err(QuantError::Invalid { .. })));
        assert!(matches!(w.add_i32("__metadata__", &[], &[1]), Err(QuantError::Invalid { .. })));
        w.add_i32("x", &[], &[1]).expect("scalar");
        let err = w.add_i32("x", &[], &[2]).expect_err("duplicate");
        assert_eq!(err.to_string(), "x: added twice");
        assert_eq!(w.len(), 1);
        assert!(!w.is_empty());
        assert_eq!(w.data_len(), 4);
    }

    #[test]
    fn to_bytes_equals_written_file() {
        let mut w = SafetensorsWriter::new();
        w.metadata("format", "pt");
        w.add_bool("m", &[3], &[true, false, true]).expect("add");
        w.add_f32("a", &[1], &[2.0]).expect("add");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("x.safetensors");
        w.write(&path).expect("write");
        let bytes = std::fs::read(&path).expect("read");
        assert_eq!(bytes, w.to_bytes());
        assert_eq!((bytes.len() - 7) % 8, 0, "header region is a multiple of 8");
        // Tensors are laid out by name: "a" then "m".
        assert_eq!(&bytes[bytes.len() - 7..], &[0, 0, 0, 64, 1, 0, 1]);
    }

    #[test]
    fn index_round_trips_through_serde_json() {
        let dir = tempfile::tempdir().expect("tempdir");
        let map: BTreeMap<String, String> =
            [("a".to_owned(), "s1.safetensors".to_owned()), ("b".to_owned(), "s2.safetensors".to_owned())].into();
        write_index(dir.path(), &map, 1234).expect("write index");
        let text = std::fs::read_to_string(dir.path().join(INDEX_FILE)).expect("read");
        let v: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["metadata"]["total_size"], 1234);
        assert_eq!(v["weight_map"]["b"], "s2.safetensors");
    }

    #[test]
    fn written_file_opens() {
        let mut w = SafetensorsWriter::new();
        w.add_f16("h", &[2], &[f16::ONE, f16::NEG_ONE]).expect("add");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("x.safetensors");
        w.write(&path).expect("write");
        let f = SafetensorsFile::open(&path).expect("open");
        assert_eq!(f.tensor("h").expect("h").to_f32_vec().expect("f32"), vec![1.0, -1.0]);
    }
}

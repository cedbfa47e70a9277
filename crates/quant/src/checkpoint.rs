//! A whole checkpoint: `model.safetensors.index.json` plus its shards, a directory of `*.safetensors` files, or one
//! `.safetensors` file, opened in parallel and indexed once by tensor name.
//!
//! Shard file names are not consistently zero-padded in published checkpoints, so with an index every shard is
//! resolved through `weight_map`, never by pattern. The index must describe the shards exactly: a tensor it maps to
//! a shard that lacks it, a tensor a shard holds that it maps elsewhere or not at all, are all errors.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::ErrorKind;
use std::path::{Component, Path, PathBuf};

use rayon::prelude::*;
use serde::Deserialize;

use crate::safetensors::{SafetensorsFile, TensorInfo, TensorView};
use crate::write::INDEX_FILE;
use crate::{QuantError, Result};

/// Where one tensor lives: shard number and position in that shard's sorted tensor table.
#[derive(Debug, Clone, Copy)]
struct Entry {
    shard: usize,
    tensor: usize,
}

/// The parts of `model.safetensors.index.json` this crate reads (`metadata` is ignored).
#[derive(Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

/// An opened checkpoint: every shard memory-mapped with its header validated, and a sorted name table.
pub struct Checkpoint {
    root: PathBuf,
    index: Option<PathBuf>,
    shards: Vec<SafetensorsFile>,
    /// One entry per tensor, sorted by tensor name (names are borrowed from the shards, not copied).
    entries: Vec<Entry>,
    total_bytes: u64,
}

impl fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkpoint")
            .field("root", &self.root)
            .field("index", &self.index)
            .field("shards", &self.shards.len())
            .field("tensors", &self.entries.len())
            .field("total_bytes", &self.total_bytes)
            .finish()
    }
}

impl Checkpoint {
    /// Opens a checkpoint. `path` is either a directory holding `model.safetensors.index.json` and the shards it
    /// names (or that index file itself), a directory without index (every `*.safetensors` file in it is opened),
    /// or one `.safetensors` file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let root = path.as_ref().to_path_buf();
        let meta = std::fs::metadata(&root).map_err(|e| QuantError::io(&root, e))?;
        if !meta.is_dir() && root.file_name().is_some_and(|n| n == INDEX_FILE) {
            let dir = root.parent().map(Path::to_path_buf).unwrap_or_default();
            return Self::with_index(dir, root);
        }
        if !meta.is_dir() {
            let shards = vec![SafetensorsFile::open(&root)?];
            return Self::without_index(root, shards);
        }
        let index = root.join(INDEX_FILE);
        match std::fs::metadata(&index) {
            Ok(m) if m.is_file() => return Self::with_index(root, index),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(QuantError::io(&index, e)),
        }
        let mut files = Vec::new();
        for item in std::fs::read_dir(&root).map_err(|e| QuantError::io(&root, e))? {
            let item = item.map_err(|e| QuantError::io(&root, e))?;
            let path = item.path();
            // `Path::is_file` follows symlinks, as in Hugging Face cache snapshots.
            if path.extension().is_some_and(|ext| ext == "safetensors") && path.is_file() {
                files.push(path);
            }
        }
        if files.is_empty() {
            return Err(QuantError::NoCheckpoint { dir: root });
        }
        files.sort();
        let shards = open_all(&files)?;
        Self::without_index(root, shards)
    }

    /// Indexes shards opened without an index file: every tensor name must be unique across them.
    fn without_index(root: PathBuf, shards: Vec<SafetensorsFile>) -> Result<Self> {
        let mut all: Vec<(&str, usize, usize)> = shards
            .iter()
            .enumerate()
            .flat_map(|(si, s)| s.tensors().enumerate().map(move |(ti, (name, _))| (name, si, ti)))
            .collect();
        all.sort_unstable();
        if let Some(pair) = all.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return Err(QuantError::DuplicateTensor {
                tensor: pair[0].0.to_owned(),
                first: shards[pair[0].1].path().to_path_buf(),
                second: shards[pair[1].1].path().to_path_buf(),
            });
        }
        let entries = all.into_iter().map(|(_, shard, tensor)| Entry { shard, tensor }).collect();
        Ok(Self::build(root, None, shards, entries))
    }

    /// Opens the shards named by `index` and checks that the index and the shard headers agree exactly.
    fn with_index(root: PathBuf, index: PathBuf) -> Result<Self> {
        let text = std::fs::read(&index).map_err(|e| QuantError::io(&index, e))?;
        let weight_map = serde_json::from_slice::<IndexFile>(&text)
            .map_err(|e| QuantError::Json { path: index.clone(), field: None, message: e.to_string() })?
            .weight_map;

        // Distinct shards, sorted by file name, each checked to be a plain file name that exists.
        let mut first_tensor: BTreeMap<&str, &str> = BTreeMap::new();
        for (tensor, shard) in &weight_map {
            first_tensor.entry(shard).or_insert(tensor);
        }
        let mut files = Vec::with_capacity(first_tensor.len());
        for (&shard, &tensor) in &first_tensor {
            let mut parts = Path::new(shard).components();
            if !matches!((parts.next(), parts.next()), (Some(Component::Normal(_)), None)) {
                return Err(QuantError::invalid(
                    format!("{}: tensor {tensor:?}", index.display()),
                    format!("shard {shard:?} is not a file name inside the checkpoint directory"),
                ));
            }
            let path = root.join(shard);
            match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => files.push(path),
                Err(e) if e.kind() != ErrorKind::NotFound => return Err(QuantError::io(&path, e)),
                _ => {
                    return Err(QuantError::MissingShard { index, tensor: tensor.to_owned(), shard: shard.to_owned() });
                }
            }
        }
        let shard_ids: HashMap<&str, usize> = first_tensor.keys().enumerate().map(|(i, &s)| (s, i)).collect();
        let shards = open_all(&files)?;

        // Every indexed tensor is in the shard the index names. `weight_map` iterates in name order, so the
        // entries come out sorted.
        let mut entries = Vec::with_capacity(weight_map.len());
        for (name, shard_name) in &weight_map {
            let shard = shard_ids[shard_name.as_str()];
            let Some(tensor) = shards[shard].position(name) else {
                return Err(QuantError::MissingTensor {
                    checkpoint: shards[shard].path().to_path_buf(),
                    tensor: name.clone(),
                });
            };
            entries.push(Entry { shard, tensor });
        }
        // Every tensor a shard holds is indexed, and indexed to that shard. The entries found above are distinct
        // (shard, tensor) pairs, so when the counts agree they cover every shard tensor; otherwise find the culprit.
        let held: usize = shards.iter().map(SafetensorsFile::len).sum();
        for (si, shard) in shards.iter().enumerate().filter(|_| held != entries.len()) {
            for (name, _) in shard.tensors() {
                match weight_map.get(name) {
                    None => {
                        return Err(QuantError::invalid(
                            format!("{}: tensor {name:?}", shard.path().display()),
                            format!("present in the shard but absent from the weight_map of {}", index.display()),
                        ));
                    }
                    Some(indexed) if shard_ids[indexed.as_str()] != si => {
                        return Err(QuantError::DuplicateTensor {
                            tensor: name.to_owned(),
                            first: shards[shard_ids[indexed.as_str()]].path().to_path_buf(),
                            second: shard.path().to_path_buf(),
                        });
                    }
                    Some(_) => {}
                }
            }
        }
        debug_assert_eq!(held, entries.len());
        Ok(Self::build(root, Some(index), shards, entries))
    }

    fn build(root: PathBuf, index: Option<PathBuf>, shards: Vec<SafetensorsFile>, entries: Vec<Entry>) -> Self {
        let total_bytes = entries.iter().map(|e| shards[e.shard].entry(e.tensor).1.nbytes()).sum();
        Self { root, index, shards, entries, total_bytes }
    }

    /// The path the checkpoint was opened from (a directory, or the single file).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The index file, when the checkpoint was opened through one.
    pub fn index_path(&self) -> Option<&Path> {
        self.index.as_deref()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl ExactSizeIterator<Item = &str> + DoubleEndedIterator + '_ {
        self.entries.iter().map(|&e| self.name_of(e))
    }

    /// The sorted names that start with `prefix` (`model.layers.3.` gives that layer's tensors).
    pub fn names_with_prefix<'a>(&'a self, prefix: &str) -> impl ExactSizeIterator<Item = &'a str> + use<'a> {
        // Names sharing a prefix form one contiguous run of the sorted table.
        let start = self.entries.partition_point(|&e| self.name_of(e) < prefix);
        let len = self.entries[start..].partition_point(|&e| self.name_of(e).starts_with(prefix));
        self.entries[start..start + len].iter().map(|&e| self.name_of(e))
    }

    /// Whether the checkpoint holds tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.lookup(name).is_some()
    }

    /// The header entry of tensor `name`.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.lookup(name).map(|e| self.shards[e.shard].entry(e.tensor).1)
    }

    /// A view of tensor `name`; [`QuantError::MissingTensor`] when the checkpoint does not hold it.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        match self.lookup(name) {
            Some(e) => Ok(self.shards[e.shard].view_at(e.tensor)),
            None => Err(QuantError::MissingTensor { checkpoint: self.root.clone(), tensor: name.to_owned() }),
        }
    }

    /// The shard file holding tensor `name`.
    pub fn shard_path(&self, name: &str) -> Option<&Path> {
        self.lookup(name).map(|e| self.shards[e.shard].path())
    }

    /// The opened shard files (sorted by file name).
    pub fn shards(&self) -> &[SafetensorsFile] {
        &self.shards
    }

    /// Sum of the tensors' data sizes in bytes (the index's `total_size` for a well-formed checkpoint).
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    fn name_of(&self, e: Entry) -> &str {
        self.shards[e.shard].entry(e.tensor).0
    }

    /// Binary search of the sorted table; no allocation.
    fn lookup(&self, name: &str) -> Option<Entry> {
        self.entries.binary_search_by(|&e| self.name_of(e).cmp(name)).ok().map(|i| self.entries[i])
    }
}

/// Opens `files` in parallel; on failure, the error of the first failing file in `files` order.
fn open_all(files: &[PathBuf]) -> Result<Vec<SafetensorsFile>> {
    let opened: Vec<Result<SafetensorsFile>> = files.par_iter().map(SafetensorsFile::open).collect();
    opened.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;
    use crate::write::{SafetensorsWriter, write_index};

    /// Two shards with inconsistent zero padding, plus the index.
    fn sharded() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut a = SafetensorsWriter::new();
        a.add_f32("model.layers.0.w", &[2], &[1.0, 2.0]).expect("add");
        a.add_i32("model.layers.1.w", &[1], &[7]).expect("add");
        a.write(dir.path().join("model-00001-of-000002.safetensors")).expect("write");
        let mut b = SafetensorsWriter::new();
        b.add_bool("model.layers.10.mask", &[2], &[true, false]).expect("add");
        b.add_i64("lm_head.bias", &[], &[3]).expect("add");
        b.write(dir.path().join("model-2-of-2.safetensors")).expect("write");
        let map: BTreeMap<String, String> = [
            ("model.layers.0.w", "model-00001-of-000002.safetensors"),
            ("model.layers.1.w", "model-00001-of-000002.safetensors"),
            ("model.layers.10.mask", "model-2-of-2.safetensors"),
            ("lm_head.bias", "model-2-of-2.safetensors"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        write_index(dir.path(), &map, 8 + 4 + 2 + 8).expect("index");
        dir
    }

    #[test]
    fn opens_through_the_index() {
        let dir = sharded();
        // A stray file the index does not name is ignored.
        std::fs::write(dir.path().join("junk.safetensors"), b"not safetensors").expect("junk");
        let ck = Checkpoint::open(dir.path()).expect("open");
        assert_eq!(ck.len(), 4);
        assert!(!ck.is_empty());
        assert_eq!(ck.shards().len(), 2);
        assert_eq!(ck.index_path(), Some(dir.path().join(INDEX_FILE).as_path()));
        assert_eq!(ck.root(), dir.path());
        let names: Vec<&str> = ck.names().collect();
        assert_eq!(names, ["lm_head.bias", "model.layers.0.w", "model.layers.1.w", "model.layers.10.mask"]);
        assert_eq!(ck.total_bytes(), 22);
        assert!(ck.contains("model.layers.1.w"));
        assert!(!ck.contains("model.layers.2.w"));
        assert_eq!(ck.info("lm_head.bias").expect("info").dtype, Dtype::I64);
        assert_eq!(ck.tensor("model.layers.0.w").expect("w").to_f32_vec().expect("f32"), vec![1.0, 2.0]);
        assert_eq!(ck.tensor("model.layers.10.mask").expect("mask").to_bool_vec().expect("bool"), vec![true, false]);
        assert_eq!(ck.shard_path("model.layers.10.mask"), Some(dir.path().join("model-2-of-2.safetensors").as_path()));
        assert!(ck.shard_path("nope").is_none());
        let via_index = Checkpoint::open(dir.path().join(INDEX_FILE)).expect("open the index file");
        assert_eq!(via_index.root(), dir.path());
        assert_eq!(via_index.len(), 4);
        assert!(matches!(ck.tensor("nope"), Err(QuantError::MissingTensor { .. })));
        assert!(format!("{ck:?}").contains("tensors: 4"));
    }

    #[test]
    fn prefix_queries_return_contiguous_runs() {
        let dir = sharded();
        let ck = Checkpoint::open(dir.path()).expect("open");
        let layer1: Vec<&str> = ck.names_with_prefix("model.layers.1").collect();
        assert_eq!(layer1, ["model.layers.1.w", "model.layers.10.mask"]);
        let layer1_only: Vec<&str> = ck.names_with_prefix(&String::from("model.layers.1.")).collect();
        assert_eq!(layer1_only, ["model.layers.1.w"]);
        assert_eq!(ck.names_with_prefix("").len(), 4);
        assert_eq!(ck.names_with_prefix("zzz").len(), 0);
        assert_eq!(ck.names_with_prefix("a").len(), 0);
    }

    #[test]
    fn opens_a_directory_without_index_and_a_single_file() {
        let dir = sharded();
        std::fs::remove_file(dir.path().join(INDEX_FILE)).expect("rm index");
        let ck = Checkpoint::open(dir.path()).expect("open dir");
        assert_eq!(ck.len(), 4);
        assert!(ck.index_path().is_none());
        let single = dir.path().join("model-2-of-2.safetensors");
        let ck = Checkpoint::open(&single).expect("open file");
        assert_eq!(ck.root(), single);
        let names: Vec<&str> = ck.names().collect();
        assert_eq!(names, ["lm_head.bias", "model.layers.10.mask"]);
        assert_eq!(ck.tensor("lm_head.bias").expect("bias").to_i64_vec().expect("i64"), vec![3]);
    }

    #[test]
    fn index_must_cover_every_shard_tensor() {
        let dir = sharded();
        let map: BTreeMap<String, String> =
            [("model.layers.0.w".to_owned(), "model-00001-of-000002.safetensors".to_owned())].into();
        write_index(dir.path(), &map, 8).expect("index");
        let err = Checkpoint::open(dir.path()).expect_err("incomplete index");
        assert!(matches!(err, QuantError::Invalid { .. }), "{err:?}");
        assert!(err.to_string().contains("model.layers.1.w"), "{err}");
    }

    #[test]
    fn index_shard_names_stay_inside_the_directory() {
        let dir = sharded();
        for bad in ["../model-2-of-2.safetensors", "sub/x.safetensors", "/etc/passwd", ""] {
            let map: BTreeMap<String, String> = [("t".to_owned(), bad.to_owned())].into();
            write_index(dir.path(), &map, 0).expect("index");
            let err = Checkpoint::open(dir.path()).expect_err(bad);
            assert!(matches!(err, QuantError::Invalid { .. }), "{bad}: {err:?}");
        }
    }

    #[test]
    fn missing_path_is_an_io_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(matches!(Checkpoint::open(dir.path().join("absent")), Err(QuantError::Io { .. })));
    }
}

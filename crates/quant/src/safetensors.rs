//! One memory-mapped `.safetensors` file: header parsed and validated at open, tensor data read lazily.
//!
//! Layout (see the reference library): a little-endian `u64` header length `N`, then `N` bytes of JSON
//! `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the data buffer.
//! Offsets are relative to the start of the data buffer.
//!
//! Opening maps the file and touches only the header bytes; tensor bytes are paged in by the OS when a
//! [`TensorView`] is read. Every check that can be made from the header (dtype, byte count, bounds, overlap) is made
//! at open, so a [`TensorView`] always holds exactly `numel * dtype.size()` bytes.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, Visitor};

use crate::{Dtype, QuantError, Result};

/// Largest header accepted, in bytes. The reference library uses the same bound; a larger length means a file
/// that is not safetensors (or is corrupt), and would otherwise make us parse gigabytes of garbage.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// The header key that holds free-form string metadata rather than a tensor.
pub(crate) const METADATA_KEY: &str = "__metadata__";

/// One tensor's entry in a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: Dtype,
    /// Shape, outermost dimension first (row-major).
    pub shape: Vec<usize>,
    /// `[begin, end)` byte range relative to the start of the data buffer.
    pub data_offsets: (u64, u64),
}

impl TensorInfo {
    /// Number of elements (1 for a scalar, 0 when any dimension is 0).
    pub fn numel(&self) -> usize {
        numel(&self.shape).unwrap_or(usize::MAX)
    }

    /// Size of the tensor's data in bytes (`end - begin`).
    pub fn nbytes(&self) -> u64 {
        self.data_offsets.1.saturating_sub(self.data_offsets.0)
    }
}

/// Product of the dimensions, `None` on overflow.
fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// A memory-mapped safetensors file with a validated header.
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
    /// Offset of the data buffer in the file (`8 + N`).
    data_start: usize,
    metadata: BTreeMap<String, String>,
    /// Tensors sorted by name (a sorted map searched by binary search, addressable by index).
    tensors: Vec<(String, TensorInfo)>,
}

impl fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("file_size", &self.mmap.len())
            .field("tensors", &self.tensors.len())
            .field("metadata", &self.metadata)
            .finish()
    }
}

/// A tensor entry as written in the header, before validation.
#[derive(Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (u64, u64),
}

impl SafetensorsFile {
    /// Opens and memory-maps `path`, then parses and validates its header. Tensor data is not read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| QuantError::io(&path, e))?;
        // SAFETY: the map is only ever read, through shared slices that borrow `self`. Like every mmap-based
        // safetensors loader we rely on the file not being truncated or rewritten while it is open; checkpoints
        // are immutable inputs, and every length checked below is that of the mapping itself.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| QuantError::io(&path, e))?;
        let map_len = mmap.len() as u64;
        if map_len < 8 {
            return Err(QuantError::Truncated { path, what: "header length".into(), needed: 8, actual: map_len });
        }
        let mut len_bytes = [0u8; 8];
        len_bytes.copy_from_slice(&mmap[..8]);
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER_LEN {
            return Err(QuantError::BadHeader {
                path,
                tensor: None,
                message: format!("header length {header_len} exceeds the {MAX_HEADER_LEN}-byte limit"),
            });
        }
        if header_len > map_len - 8 {
            return Err(QuantError::Truncated { path, what: "header".into(), needed: 8 + header_len, actual: map_len });
        }
        // Both fit in usize: header_len <= MAX_HEADER_LEN and data_start <= mmap.len().
        let data_start = 8 + header_len as usize;
        let Header { metadata, tensors } = parse_header(&path, &mmap[8..data_start], map_len - data_start as u64)?;
        Ok(Self { path, mmap, data_start, metadata, tensors })
    }

    /// The file's path, as given to [`SafetensorsFile::open`].
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The header's `__metadata__` (empty when absent).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// All tensors, sorted by name.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = (&str, &TensorInfo)> + '_ {
        self.tensors.iter().map(|(n, i)| (n.as_str(), i))
    }

    /// The header entry of tensor `name`, if present.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.position(name).map(|i| &self.tensors[i].1)
    }

    /// Whether the file holds a tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.position(name).is_some()
    }

    /// A view of tensor `name`; [`QuantError::MissingTensor`] when the file does not hold it.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        match self.position(name) {
            Some(i) => Ok(self.view_at(i)),
            None => Err(QuantError::MissingTensor { checkpoint: self.path.clone(), tensor: name.to_owned() }),
        }
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the file holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Size of the whole file in bytes.
    pub fn file_size(&self) -> u64 {
        self.mmap.len() as u64
    }

    /// Size of the data buffer (the file after the header) in bytes.
    pub fn data_len(&self) -> u64 {
        (self.mmap.len() - self.data_start) as u64
    }

    /// Index of `name` in the sorted tensor table.
    pub(crate) fn position(&self, name: &str) -> Option<usize> {
        self.tensors.binary_search_by(|(n, _)| n.as_str().cmp(name)).ok()
    }

    /// Name and header entry of the tensor at `index` in the sorted table.
    pub(crate) fn entry(&self, index: usize) -> (&str, &TensorInfo) {
        let (n, i) = &self.tensors[index];
        (n, i)
    }

    /// A view of the tensor at `index` in the sorted table.
    pub(crate) fn view_at(&self, index: usize) -> TensorView<'_> {
        let (name, info) = &self.tensors[index];
        // Offsets were checked against the data buffer at open, so both fit in usize and the range is in bounds.
        let begin = self.data_start + info.data_offsets.0 as usize;
        let end = self.data_start + info.data_offsets.1 as usize;
        TensorView { name, path: &self.path, dtype: info.dtype, shape: &info.shape, data: &self.mmap[begin..end] }
    }
}

/// A parsed and validated header.
struct Header {
    metadata: BTreeMap<String, String>,
    /// Sorted by name.
    tensors: Vec<(String, TensorInfo)>,
}

/// The header as written: tensors in file order, and the metadata.
struct RawHeader {
    metadata: BTreeMap<String, String>,
    tensors: Vec<(String, RawTensor)>,
}

/// Deserializes the header object straight into [`RawHeader`] (no intermediate `serde_json::Value`), keeping in
/// `key` the entry whose value is being read so that an error can name it.
struct HeaderSeed<'k> {
    key: &'k mut Option<String>,
}

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = RawHeader;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<RawHeader, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = RawHeader;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object mapping tensor names to {dtype, shape, data_offsets}")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
        let mut metadata = None;
        let mut tensors = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(name) = map.next_key::<String>()? {
            *self.key = Some(name);
            if self.key.as_deref() == Some(METADATA_KEY) {
                if metadata.is_some() {
                    return Err(A::Error::custom("__metadata__ appears twice"));
                }
                metadata = Some(map.next_value()?);
                *self.key = None;
            } else {
                let raw: RawTensor = map.next_value()?;
                tensors.push((self.key.take().unwrap_or_default(), raw));
            }
        }
        Ok(RawHeader { metadata: metadata.unwrap_or_default(), tensors })
    }
}

/// Parses and validates the header JSON; `data_len` is the size of the data buffer that follows it.
fn parse_header(path: &Path, json: &[u8], data_len: u64) -> Result<Header> {
    let json_err = |field: Option<&str>, e: serde_json::Error| QuantError::Json {
        path: path.to_path_buf(),
        field: field.map(str::to_owned),
        message: e.to_string(),
    };
    let bad = |tensor: &str, message: String| QuantError::BadHeader {
        path: path.to_path_buf(),
        tensor: Some(tensor.to_owned()),
        message,
    };
    let mut key = None;
    let mut de = serde_json::Deserializer::from_slice(json);
    let raw = HeaderSeed { key: &mut key }.deserialize(&mut de).and_then(|h| de.end().map(|()| h));
    let RawHeader { metadata, tensors: mut raw_tensors } = raw.map_err(|e| json_err(key.as_deref(), e))?;
    raw_tensors.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(pair) = raw_tensors.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        return Err(bad(&pair[0].0, "appears twice in the header".to_owned()));
    }

    let mut tensors = Vec::with_capacity(raw_tensors.len());
    for (name, raw) in raw_tensors {
        let Some(dtype) = Dtype::parse(&raw.dtype) else {
            return Err(QuantError::UnknownDtype { path: path.to_path_buf(), tensor: name, dtype: raw.dtype });
        };
        let (begin, end) = raw.data_offsets;
        if begin > end {
            return Err(bad(&name, format!("data_offsets [{begin}, {end}] end before they begin")));
        }
        let expected = numel(&raw.shape)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| bad(&name, format!("shape {:?} overflows", raw.shape)))?;
        if end - begin != expected as u64 {
            return Err(bad(
                &name,
                format!(
                    "data_offsets [{begin}, {end}] span {} bytes but {dtype} x {:?} needs {expected}",
                    end - begin,
                    raw.shape
                ),
            ));
        }
        if end > data_len {
            let header_end = 8 + json.len() as u64;
            return Err(QuantError::Truncated {
                path: path.to_path_buf(),
                what: format!("tensor {name:?}"),
                needed: header_end + end,
                actual: header_end + data_len,
            });
        }
        tensors.push((name, TensorInfo { dtype, shape: raw.shape, data_offsets: raw.data_offsets }));
    }

    // Overlap check over non-empty ranges sorted by start; an empty range overlaps nothing.
    let mut ranges: Vec<(u64, u64, usize)> = tensors
        .iter()
        .enumerate()
        .filter(|(_, (_, info))| info.nbytes() > 0)
        .map(|(i, (_, info))| (info.data_offsets.0, info.data_offsets.1, i))
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let (b0, e0, i0) = pair[0];
        let (b1, e1, i1) = pair[1];
        if b1 < e0 {
            return Err(bad(
                &tensors[i1].0,
                format!("data_offsets [{b1}, {e1}] overlap [{b0}, {e0}] of tensor {:?}", tensors[i0].0),
            ));
        }
    }
    Ok(Header { metadata, tensors })
}

/// A borrowed view of one tensor: its header entry and its bytes (exactly `numel * dtype.size()` of them,
/// little-endian, possibly unaligned).
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// The file holding it.
    pub path: &'a Path,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, outermost dimension first.
    pub shape: &'a [usize],
    /// Raw little-endian bytes.
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel(self.shape).unwrap_or(usize::MAX)
    }

    /// [`QuantError::DtypeMismatch`] unless the dtype is one of `allowed`.
    pub fn expect_dtype(&self, allowed: &[Dtype]) -> Result<()> {
        if allowed.contains(&self.dtype) { Ok(()) } else { Err(self.dtype_mismatch(allowed)) }
    }

    /// [`QuantError::ShapeMismatch`] unless the shape equals `shape`.
    pub fn expect_shape(&self, shape: &[usize]) -> Result<()> {
        if self.shape == shape { Ok(()) } else { Err(self.shape_mismatch(format!("{shape:?}"))) }
    }

    /// [`QuantError::ShapeMismatch`] unless the tensor has `rank` dimensions.
    pub fn expect_rank(&self, rank: usize) -> Result<()> {
        if self.shape.len() == rank { Ok(()) } else { Err(self.shape_mismatch(format!("rank {rank}"))) }
    }

    /// Elements as `f32`: F32 as is, BF16/F16/F64/F8_E4M3/F8_E5M2 converted (FP8 decoded by [`crate::fp8`]).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        self.check_len()?;
        Ok(match self.dtype {
            Dtype::F32 => self.le::<4, _>(f32::from_le_bytes),
            Dtype::BF16 => self.le::<2, _>(|b| bf16::from_le_bytes(b).to_f32()),
            Dtype::F16 => self.le::<2, _>(|b| f16::from_le_bytes(b).to_f32()),
            Dtype::F64 => self.le::<8, _>(|b| f64::from_le_bytes(b) as f32),
            Dtype::F8_E4M3 => self.data.iter().map(|&b| crate::fp8::e4m3_to_f32(b)).collect(),
            Dtype::F8_E5M2 => self.data.iter().map(|&b| crate::fp8::e5m2_to_f32(b)).collect(),
            _ => {
                return Err(self.dtype_mismatch(&[
                    Dtype::F32,
                    Dtype::BF16,
                    Dtype::F16,
                    Dtype::F64,
                    Dtype::F8_E4M3,
                    Dtype::F8_E5M2,
                ]));
            }
        })
    }

    /// Elements of a BF16 tensor.
    pub fn to_bf16_vec(&self) -> Result<Vec<bf16>> {
        self.expect_dtype(&[Dtype::BF16])?;
        self.check_len()?;
        Ok(self.le::<2, _>(bf16::from_le_bytes))
    }

    /// Elements of an F16 tensor.
    pub fn to_f16_vec(&self) -> Result<Vec<f16>> {
        self.expect_dtype(&[Dtype::F16])?;
        self.check_len()?;
        Ok(self.le::<2, _>(f16::from_le_bytes))
    }

    /// Elements of any integer tensor widened to `i64`; a U64 value above `i64::MAX` is
    /// [`QuantError::Invalid`].
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        self.check_len()?;
        Ok(match self.dtype {
            Dtype::I8 => self.le::<1, _>(|b| i64::from(i8::from_le_bytes(b))),
            Dtype::U8 => self.le::<1, _>(|b| i64::from(b[0])),
            Dtype::I16 => self.le::<2, _>(|b| i64::from(i16::from_le_bytes(b))),
            Dtype::U16 => self.le::<2, _>(|b| i64::from(u16::from_le_bytes(b))),
            Dtype::I32 => self.le::<4, _>(|b| i64::from(i32::from_le_bytes(b))),
            Dtype::U32 => self.le::<4, _>(|b| i64::from(u32::from_le_bytes(b))),
            Dtype::I64 => self.le::<8, _>(i64::from_le_bytes),
            Dtype::U64 => {
                let (chunks, _) = self.data.as_chunks::<8>();
                let mut out = Vec::with_capacity(chunks.len());
                for (i, c) in chunks.iter().enumerate() {
                    let v = u64::from_le_bytes(*c);
                    let v =
                        i64::try_from(v).map_err(|_| self.invalid(format!("element {i} = {v} does not fit in i64")))?;
                    out.push(v);
                }
                out
            }
            _ => {
                return Err(self.dtype_mismatch(&[
                    Dtype::I8,
                    Dtype::U8,
                    Dtype::I16,
                    Dtype::U16,
                    Dtype::I32,
                    Dtype::U32,
                    Dtype::I64,
                    Dtype::U64,
                ]));
            }
        })
    }

    /// Elements of an I32 tensor.
    pub fn to_i32_vec(&self) -> Result<Vec<i32>> {
        self.expect_dtype(&[Dtype::I32])?;
        self.check_len()?;
        Ok(self.le::<4, _>(i32::from_le_bytes))
    }

    /// 32-bit words of an I32 or U32 tensor, bits reinterpreted as `u32` (packed INT4 weights are stored as I32).
    pub fn to_u32_vec(&self) -> Result<Vec<u32>> {
        self.expect_dtype(&[Dtype::I32, Dtype::U32])?;
        self.check_len()?;
        Ok(self.le::<4, _>(u32::from_le_bytes))
    }

    /// Elements of a BOOL tensor; a byte other than 0 or 1 is [`QuantError::Invalid`].
    pub fn to_bool_vec(&self) -> Result<Vec<bool>> {
        self.expect_dtype(&[Dtype::BOOL])?;
        self.check_len()?;
        self.data
            .iter()
            .enumerate()
            .map(|(i, &b)| match b {
                0 => Ok(false),
                1 => Ok(true),
                _ => Err(self.invalid(format!("element {i} is byte {b:#04x}, not a bool (0 or 1)"))),
            })
            .collect()
    }

    /// A copy of the raw bytes of a one-byte tensor (U8, I8, F8_E4M3, F8_E5M2).
    pub fn to_u8_vec(&self) -> Result<Vec<u8>> {
        self.expect_dtype(&[Dtype::U8, Dtype::I8, Dtype::F8_E4M3, Dtype::F8_E5M2])?;
        self.check_len()?;
        Ok(self.data.to_vec())
    }

    /// Decodes every `N`-byte little-endian chunk with `f`. Works on unaligned data.
    fn le<const N: usize, T>(&self, f: impl Fn([u8; N]) -> T) -> Vec<T> {
        let (chunks, _) = self.data.as_chunks::<N>();
        chunks.iter().map(|c| f(*c)).collect()
    }

    /// [`QuantError::Invalid`] unless the byte count matches dtype x shape (always true for views handed out by
    /// [`SafetensorsFile`]; the fields are public, so a hand-built view may disagree).
    fn check_len(&self) -> Result<()> {
        let expected = numel(self.shape).and_then(|n| n.checked_mul(self.dtype.size()));
        if expected == Some(self.data.len()) {
            Ok(())
        } else {
            Err(self.invalid(format!("{} bytes of data for {} x {:?}", self.data.len(), self.dtype, self.shape)))
        }
    }

    fn invalid(&self, message: String) -> QuantError {
        QuantError::invalid(format!("{}: tensor {:?}", self.path.display(), self.name), message)
    }

    fn dtype_mismatch(&self, allowed: &[Dtype]) -> QuantError {
        QuantError::DtypeMismatch {
            path: self.path.to_path_buf(),
            tensor: self.name.to_owned(),
            expected: join_dtypes(allowed),
            found: self.dtype,
        }
    }

    fn shape_mismatch(&self, expected: String) -> QuantError {
        QuantError::ShapeMismatch {
            path: self.path.to_path_buf(),
            tensor: self.name.to_owned(),
            expected,
            found: self.shape.to_vec(),
        }
    }
}

/// `"F32"`, `"F32 or BF16"`, `"F32, BF16 or F16"`.
fn join_dtypes(dtypes: &[Dtype]) -> String {
    match dtypes {
        [] => "nothing".to_owned(),
        [one] => one.to_string(),
        [init @ .., last] => {
            let init: Vec<&str> = init.iter().map(|d| d.as_str()).collect();
            format!("{} or {last}", init.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::write::SafetensorsWriter;

    fn write(w: &SafetensorsWriter) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.safetensors");
        w.write(&path).expect("write");
        (dir, path)
    }

    /// Writes a raw file: header JSON (unpadded) followed by `data`.
    fn write_raw(header: &str, data: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("raw.safetensors");
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        std::fs::write(&path, bytes).expect("write raw");
        (dir, path)
    }

    #[test]
    fn round_trips_float_types() {
        let f32s = [1.5f32, -2.25, 0.0, f32::INFINITY, 3.0e-8, 65504.0];
        let bf16s: Vec<bf16> = f32s.iter().map(|&x| bf16::from_f32(x)).collect();
        let f16s: Vec<f16> = f32s.iter().map(|&x| f16::from_f32(x)).collect();
        let f64s = [1.5f64, -2.25, 1e300];
        let mut w = SafetensorsWriter::new();
        w.add_f32("a.f32", &[2, 3], &f32s).expect("add");
        w.add_bf16("b.bf16", &[6], &bf16s).expect("add");
        w.add_f16("c.f16", &[3, 2], &f16s).expect("add");
        let f64_bytes: Vec<u8> = f64s.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.add("d.f64", Dtype::F64, &[3], f64_bytes).expect("add");
        let (_dir, path) = write(&w);

        let f = SafetensorsFile::open(&path).expect("open");
        assert_eq!(f.len(), 4);
        let a = f.tensor("a.f32").expect("a");
        assert_eq!(a.dtype, Dtype::F32);
        assert_eq!(a.shape, &[2, 3]);
        assert_eq!(a.numel(), 6);
        assert_eq!(a.to_f32_vec().expect("f32"), f32s);
        let b = f.tensor("b.bf16").expect("b");
        assert_eq!(b.to_bf16_vec().expect("bf16"), bf16s);
        let b32: Vec<f32> = bf16s.iter().map(|x| x.to_f32()).collect();
        assert_eq!(b.to_f32_vec().expect("bf16 as f32"), b32);
        let c = f.tensor("c.f16").expect("c");
        assert_eq!(c.to_f16_vec().expect("f16"), f16s);
        let c32: Vec<f32> = f16s.iter().map(|x| x.to_f32()).collect();
        assert_eq!(c.to_f32_vec().expect("f16 as f32"), c32);
        let d = f.tensor("d.f64").expect("d");
        assert_eq!(d.to_f32_vec().expect("f64 as f32"), vec![1.5, -2.25, f32::INFINITY]);
    }

    #[test]
    fn round_trips_integer_and_byte_types() {
        let mut w = SafetensorsWriter::new();
        w.add("i8", Dtype::I8, &[3], vec![0xff, 0x7f, 0x80]).expect("add");
        w.add("u8", Dtype::U8, &[3], vec![0xff, 0x7f, 0x80]).expect("add");
        w.add("i16", Dtype::I16, &[2], [-2i16, 300].iter().flat_map(|x| x.to_le_bytes()).collect()).expect("add");
        w.add("u16", Dtype::U16, &[2], [65535u16, 300].iter().flat_map(|x| x.to_le_bytes()).collect()).expect("add");
        w.add_i32("i32", &[2, 2], &[-1, 0, i32::MAX, i32::MIN]).expect("add");
        w.add("u32", Dtype::U32, &[1], u32::MAX.to_le_bytes().to_vec()).expect("add");
        w.add_u32_as_i32("packed", &[2], &[0x8765_4321, 0xffff_ffff]).expect("add");
        w.add_i64("i64", &[2], &[i64::MIN, 7]).expect("add");
        w.add("u64", Dtype::U64, &[2], [5u64, i64::MAX as u64].iter().flat_map(|x| x.to_le_bytes()).collect())
            .expect("add");
        w.add_bool("mask", &[4], &[true, false, false, true]).expect("add");
        w.add("e4m3", Dtype::F8_E4M3, &[2], vec![0x38, 0x7f]).expect("add");
        w.add("e5m2", Dtype::F8_E5M2, &[2], vec![0x3c, 0x00]).expect("add");
        let (_dir, path) = write(&w);
        let f = SafetensorsFile::open(&path).expect("open");

        let t = |n: &str| f.tensor(n).expect(n);
        assert_eq!(t("i8").to_i64_vec().expect("i8"), vec![-1, 127, -128]);
        assert_eq!(t("u8").to_i64_vec().expect("u8"), vec![255, 127, 128]);
        assert_eq!(t("i8").to_u8_vec().expect("i8 bytes"), vec![0xff, 0x7f, 0x80]);
        assert_eq!(t("u8").to_u8_vec().expect("u8 bytes"), vec![0xff, 0x7f, 0x80]);
        assert_eq!(t("i16").to_i64_vec().expect("i16"), vec![-2, 300]);
        assert_eq!(t("u16").to_i64_vec().expect("u16"), vec![65535, 300]);
        assert_eq!(t("i32").to_i32_vec().expect("i32"), vec![-1, 0, i32::MAX, i32::MIN]);
        assert_eq!(t("i32").to_i64_vec().expect("i32 wide"), vec![-1, 0, i64::from(i32::MAX), i64::from(i32::MIN)]);
        assert_eq!(t("i32").to_u32_vec().expect("i32 bits"), vec![u32::MAX, 0, 0x7fff_ffff, 0x8000_0000]);
        assert_eq!(t("u32").to_u32_vec().expect("u32"), vec![u32::MAX]);
        assert_eq!(t("u32").to_i64_vec().expect("u32 wide"), vec![i64::from(u32::MAX)]);
        assert_eq!(t("packed").dtype, Dtype::I32);
        assert_eq!(t("packed").to_u32_vec().expect("packed"), vec![0x8765_4321, 0xffff_ffff]);
        assert_eq!(t("i64").to_i64_vec().expect("i64"), vec![i64::MIN, 7]);
        assert_eq!(t("u64").to_i64_vec().expect("u64"), vec![5, i64::MAX]);
        assert_eq!(t("mask").to_bool_vec().expect("bool"), vec![true, false, false, true]);
        assert_eq!(t("e4m3").to_u8_vec().expect("e4m3"), vec![0x38, 0x7f]);
        assert_eq!(t("e5m2").to_u8_vec().expect("e5m2"), vec![0x3c, 0x00]);
    }

    #[test]
    fn readers_refuse_other_dtypes() {
        let mut w = SafetensorsWriter::new();
        w.add_f32("f", &[1], &[1.0]).expect("add");
        w.add_i32("i", &[1], &[1]).expect("add");
        w.add("e4m3", Dtype::F8_E4M3, &[1], vec![0x38]).expect("add");
        w.add("big", Dtype::U64, &[1], u64::MAX.to_le_bytes().to_vec()).expect("add");
        w.add("notbool", Dtype::BOOL, &[2], vec![1, 2]).expect("add");
        let (_dir, path) = write(&w);
        let f = SafetensorsFile::open(&path).expect("open");
        let t = |n: &str| f.tensor(n).expect(n);
        let mismatch = |r: Result<()>| matches!(r, Err(QuantError::DtypeMismatch { .. }));
        assert!(mismatch(t("i").to_f32_vec().map(drop)));
        assert_eq!(t("e4m3").to_f32_vec().expect("fp8 decodes"), vec![1.0]); // 0x38 = 2^(7-7) = 1.0
        assert!(mismatch(t("f").to_bf16_vec().map(drop)));
        assert!(mismatch(t("f").to_f16_vec().map(drop)));
        assert!(mismatch(t("f").to_i64_vec().map(drop)));
        assert!(mismatch(t("f").to_i32_vec().map(drop)));
        assert!(mismatch(t("f").to_u32_vec().map(drop)));
        assert!(mismatch(t("i").to_bool_vec().map(drop)));
        assert!(mismatch(t("i").to_u8_vec().map(drop)));
        let err = t("f").to_i32_vec().expect_err("f32 as i32");
        assert!(err.to_string().contains("expected I32"), "{err}");
        let err = t("f").to_u32_vec().expect_err("f32 as u32");
        assert!(err.to_string().contains("expected I32 or U32"), "{err}");
        assert!(matches!(t("big").to_i64_vec(), Err(QuantError::Invalid { .. })));
        let err = t("notbool").to_bool_vec().expect_err("byte 2");
        assert!(matches!(err, QuantError::Invalid { .. }));
        assert!(err.to_string().contains("notbool") && err.to_string().contains("element 1"), "{err}");
    }

    #[test]
    fn expect_helpers() {
        let mut w = SafetensorsWriter::new();
        w.add_f32("w", &[2, 3], &[0.0; 6]).expect("add");
        let (_dir, path) = write(&w);
        let f = SafetensorsFile::open(&path).expect("open");
        let t = f.tensor("w").expect("w");
        t.expect_dtype(&[Dtype::BF16, Dtype::F32]).expect("dtype ok");
        t.expect_shape(&[2, 3]).expect("shape ok");
        t.expect_rank(2).expect("rank ok");
        let err = t.expect_dtype(&[Dtype::BF16, Dtype::F16, Dtype::I32]).expect_err("dtype");
        assert!(err.to_string().contains("expected BF16, F16 or I32"), "{err}");
        assert!(matches!(t.expect_shape(&[3, 2]), Err(QuantError::ShapeMismatch { .. })));
        let err = t.expect_rank(3).expect_err("rank");
        assert!(err.to_string().contains("rank 3") && err.to_string().contains("[2, 3]"), "{err}");
    }

    #[test]
    fn header_is_padded_to_eight_bytes_and_tensors_are_contiguous() {
        let mut w = SafetensorsWriter::new();
        w.add_f32("b", &[1], &[1.0]).expect("add");
        w.add("a", Dtype::U8, &[3], vec![1, 2, 3]).expect("add");
        w.add_bf16("c", &[0], &[]).expect("add");
        let (_dir, path) = write(&w);
        let bytes = std::fs::read(&path).expect("read");
        let mut n = [0u8; 8];
        n.copy_from_slice(&bytes[..8]);
        let n = u64::from_le_bytes(n) as usize;
        assert_eq!(n % 8, 0);
        let header = std::str::from_utf8(&bytes[8..8 + n]).expect("utf8");
        let json = header.trim_end_matches(' ');
        assert!(json.starts_with('{') && json.ends_with('}'), "{header:?}");
        assert!(n - json.len() < 8, "padding is shorter than 8 bytes: {header:?}");
        assert_eq!(bytes.len(), 8 + n + 3 + 4);

        let f = SafetensorsFile::open(&path).expect("open");
        assert_eq!(f.data_len(), 7);
        assert_eq!(f.file_size(), bytes.len() as u64);
        let names: Vec<&str> = f.tensors().map(|(n, _)| n).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!(f.info("a").expect("a").data_offsets, (0, 3));
        assert_eq!(f.info("b").expect("b").data_offsets, (3, 7));
        assert_eq!(f.info("b").expect("b").nbytes(), 4);
        assert_eq!(f.info("c").expect("c").numel(), 0);
        assert_eq!(f.tensor("c").expect("c").to_bf16_vec().expect("empty"), vec![]);
    }

    #[test]
    fn metadata_round_trips() {
        let mut w = SafetensorsWriter::new();
        w.metadata("format", "pt").metadata("note", "héllo \"quoted\"");
        w.add_i64("x", &[], &[42]).expect("add");
        let (_dir, path) = write(&w);
        let f = SafetensorsFile::open(&path).expect("open");
        assert_eq!(f.metadata().get("format").map(String::as_str), Some("pt"));
        assert_eq!(f.metadata().get("note").map(String::as_str), Some("héllo \"quoted\""));
        assert_eq!(f.len(), 1);
        assert!(!f.contains("__metadata__"));
        assert_eq!(f.tensor("x").expect("x").to_i64_vec().expect("scalar"), vec![42]);
    }

    #[test]
    fn empty_file_with_no_tensors() {
        let (_dir, path) = write(&SafetensorsWriter::new());
        let f = SafetensorsFile::open(&path).expect("open");
        assert!(f.is_empty());
        assert_eq!(f.data_len(), 0);
        assert!(f.metadata().is_empty());
        assert!(format!("{f:?}").contains("tensors: 0"));
    }

    #[test]
    fn unaligned_data_is_read_correctly() {
        // A 1-byte tensor first pushes the f32 tensor to an odd offset in the data buffer.
        let header = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}}"#;
        let mut data = vec![7u8];
        data.extend_from_slice(&1.25f32.to_le_bytes());
        data.extend_from_slice(&(-3.5f32).to_le_bytes());
        let (_dir, path) = write_raw(header, &data);
        let f = SafetensorsFile::open(&path).expect("open");
        assert_eq!(f.tensor("b").expect("b").to_f32_vec().expect("f32"), vec![1.25, -3.5]);
    }

    #[test]
    fn empty_ranges_do_not_overlap() {
        let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}}"#;
        let (_dir, path) = write_raw(header, &[0; 8]);
        SafetensorsFile::open(&path).expect("an empty tensor inside another's range is harmless");
    }

    #[test]
    fn rejects_bad_headers() {
        type Check = fn(&QuantError) -> bool;
        let cases: &[(&str, usize, Check)] = &[
            (r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#, 8, |e| {
                matches!(e, QuantError::BadHeader { .. })
            }),
            (r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#, 8, |e| {
                matches!(e, QuantError::BadHeader { .. })
            }),
            (
                r#"{"a":{"dtype":"F32","shape":[2]}}"#,
                8,
                |e| matches!(e, QuantError::Json { field: Some(f), .. } if f == "a"),
            ),
            (r#"{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}"#, 8, |e| matches!(e, QuantError::Json { .. })),
            (
                r#"{"__metadata__":{"n":1}}"#,
                0,
                |e| matches!(e, QuantError::Json { field: Some(f), .. } if f == "__metadata__"),
            ),
            (r#"[1, 2]"#, 0, |e| matches!(e, QuantError::Json { field: None, .. })),
            (r#"{} x"#, 0, |e| matches!(e, QuantError::Json { field: None, .. })),
            (r#"{"__metadata__":{},"__metadata__":{}}"#, 0, |e| matches!(e, QuantError::Json { .. })),
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                2,
                |e| matches!(e, QuantError::BadHeader { tensor: Some(t), .. } if t == "a"),
            ),
            (r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}"#, 8, |e| {
                matches!(e, QuantError::BadHeader { .. })
            }),
        ];
        for (header, data_len, check) in cases {
            let (_dir, path) = write_raw(header, &vec![0; *data_len]);
            let err = SafetensorsFile::open(&path).expect_err(header);
            assert!(check(&err), "{header}: {err:?}");
        }
    }

    #[test]
    fn rejects_short_files_and_huge_header_lengths() {
        let dir = tempfile::tempdir().expect("tempdir");
        let short = dir.path().join("short.safetensors");
        std::fs::write(&short, [1, 2, 3]).expect("write");
        assert!(matches!(SafetensorsFile::open(&short), Err(QuantError::Truncated { needed: 8, actual: 3, .. })));
        let empty = dir.path().join("empty.safetensors");
        std::fs::write(&empty, []).expect("write");
        assert!(matches!(SafetensorsFile::open(&empty), Err(QuantError::Truncated { .. })));
        let huge = dir.path().join("huge.safetensors");
        std::fs::write(&huge, (MAX_HEADER_LEN + 1).to_le_bytes()).expect("write");
        let err = SafetensorsFile::open(&huge).expect_err("huge");
        assert!(matches!(err, QuantError::BadHeader { tensor: None, .. }), "{err:?}");
        assert!(matches!(SafetensorsFile::open(dir.path().join("absent")), Err(QuantError::Io { .. })));
    }

    #[test]
    fn opening_does_not_read_tensor_data() {
        // A 1 GiB tensor in a sparse file: opening touches only the header, and reading one slice of the view
        // only the pages it covers.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sparse.safetensors");
        let n: u64 = 1 << 30;
        let header = format!(r#"{{"big":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#);
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(&path, &bytes).expect("write");
        let file = std::fs::OpenOptions::new().write(true).open(&path).expect("reopen");
        file.set_len(bytes.len() as u64 + n).expect("set_len");
        drop(file);
        let f = SafetensorsFile::open(&path).expect("open");
        let view = f.tensor("big").expect("big");
        assert_eq!(view.data.len() as u64, n);
        assert_eq!(view.data[(n / 2) as usize], 0);
    }

    #[test]
    fn missing_tensor_names_file_and_tensor() {
        let mut w = SafetensorsWriter::new();
        w.add_f32("present", &[1], &[1.0]).expect("add");
        let (_dir, path) = write(&w);
        let f = SafetensorsFile::open(&path).expect("open");
        assert!(f.info("absent").is_none());
        let err = f.tensor("absent").expect_err("absent");
        assert!(matches!(err, QuantError::MissingTensor { .. }));
        assert!(err.to_string().contains("absent") && err.to_string().contains("t.safetensors"), "{err}");
    }

    #[test]
    fn join_dtypes_reads_naturally() {
        assert_eq!(join_dtypes(&[Dtype::F32]), "F32");
        assert_eq!(join_dtypes(&[Dtype::F32, Dtype::BF16]), "F32 or BF16");
        assert_eq!(join_dtypes(&[Dtype::F32, Dtype::BF16, Dtype::F16]), "F32, BF16 or F16");
    }
}

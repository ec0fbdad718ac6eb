//! Safetensors checkpoints over memory maps: one `model.safetensors`, or the shards a
//! `model.safetensors.index.json` names. The `safetensors` crate parses and validates each header
//! (offsets contiguous, byte lengths matching dtype x shape, the data ending at the end of the
//! file); its errors become typed [`CheckpointError`]s that name the file.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use memwall_runtime::DType;
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors};
use serde_json::Value;

use crate::error::CheckpointError;

/// One mapped safetensors file.
#[derive(Debug)]
pub struct ShardFile {
    pub path: PathBuf,
    pub map: Arc<Mmap>,
}

/// Where a tensor's bytes are.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRecord {
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// The dtype string of the file (`BF16`, `F8_E4M3`, ...).
    pub st_dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte offset within the file (header included).
    pub offset: usize,
    pub len: usize,
}

impl TensorRecord {
    /// The runtime dtype, for the dtypes memwall computes with.
    pub fn dtype(&self) -> Option<DType> {
        st_dtype(self.st_dtype)
    }
}

/// The runtime dtype of a safetensors dtype, where memwall has one.
pub fn st_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F8_E4M3 => Some(DType::F8E4M3Fn),
        Dtype::F8_E5M2 => Some(DType::F8E5M2),
        Dtype::U32 => Some(DType::U32),
        _ => None,
    }
}

/// The mapped files of a checkpoint and the tensors they hold, by name.
#[derive(Debug)]
pub struct Checkpoint {
    pub files: Vec<ShardFile>,
    pub tensors: BTreeMap<String, TensorRecord>,
}

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` and its shards, or else `dir/model.safetensors`.
    pub fn open_dir(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Checkpoint::open_index(&index);
        }
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            return Checkpoint::open_files(&[single]);
        }
        Err(CheckpointError::NoWeights { dir: dir.to_path_buf() })
    }

    /// Opens a sharded checkpoint from its index: every file the `weight_map` names, and every
    /// tensor of the map found in the file it names.
    pub fn open_index(index: &Path) -> Result<Checkpoint, CheckpointError> {
        let text = std::fs::read_to_string(index)
            .map_err(|source| CheckpointError::Io { path: index.to_path_buf(), source })?;
        let bad = |reason: String| CheckpointError::BadIndex { path: index.to_path_buf(), reason };
        let value: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let Some(Value::Object(map)) = value.get("weight_map") else {
            return Err(bad("no `weight_map` object".into()));
        };
        let mut wanted: BTreeMap<String, String> = BTreeMap::new();
        for (name, file) in map {
            let Value::String(file) = file else {
                return Err(bad(format!("`weight_map.{name}` is not a file name")));
            };
            // Shards live beside the index: a path that leaves the directory is refused.
            if file.contains('/') || file.contains('\\') || file == ".." || file.is_empty() {
                return Err(bad(format!("`weight_map.{name}` = {file:?} is not a plain file name")));
            }
            wanted.insert(name.clone(), file.clone());
        }
        let dir = index.parent().unwrap_or(Path::new("."));
        let names: BTreeSet<&String> = wanted.values().collect();
        let paths: Vec<PathBuf> = names.iter().map(|f| dir.join(f)).collect();
        let ckpt = Checkpoint::open_files(&paths)?;
        for (tensor, file) in &wanted {
            let held = ckpt.tensors.get(tensor).map(|r| &ckpt.files[r.file].path);
            if held.is_none_or(|p| p.file_name().and_then(|n| n.to_str()) != Some(file.as_str())) {
                return Err(CheckpointError::NotInShard { tensor: tensor.clone(), file: file.clone() });
            }
        }
        Ok(ckpt)
    }

    /// Maps and validates each file; a tensor stored in two files is an error.
    pub fn open_files(paths: &[PathBuf]) -> Result<Checkpoint, CheckpointError> {
        let mut files = Vec::with_capacity(paths.len());
        let mut tensors: BTreeMap<String, TensorRecord> = BTreeMap::new();
        for (i, path) in paths.iter().enumerate() {
            let map = map_file(path)?;
            for (name, rec) in parse_header(path, &map, i)? {
                if let Some(prev) = tensors.get(&name) {
                    return Err(CheckpointError::Duplicate {
                        tensor: name,
                        first: paths[prev.file].display().to_string(),
                        second: path.display().to_string(),
                    });
                }
                tensors.insert(name, rec);
            }
            files.push(ShardFile { path: path.clone(), map: Arc::new(map) });
        }
        Ok(Checkpoint { files, tensors })
    }

    /// The bytes of a tensor.
    pub fn bytes(&self, rec: &TensorRecord) -> &[u8] {
        // `parse_header` checked offset + len against the map.
        &self.files[rec.file].map[rec.offset..rec.offset + rec.len]
    }

    /// Total bytes of the tensors.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(|r| r.len as u64).sum()
    }
}

fn map_file(path: &Path) -> Result<Mmap, CheckpointError> {
    let io = |source| CheckpointError::Io { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len < 8 {
        return Err(CheckpointError::Truncated { path: path.to_path_buf(), len });
    }
    // SAFETY: the map is read-only and private to this process. Memory maps of a file that
    // another process truncates or rewrites while we run are undefined behaviour in Rust's model;
    // like every mmap-based loader we require that checkpoints are not modified while loaded.
    unsafe { Mmap::map(&file) }.map_err(io)
}

/// Validates one file's header and returns its tensors with absolute byte offsets.
pub fn parse_header(
    path: &Path,
    bytes: &[u8],
    file: usize,
) -> Result<Vec<(String, TensorRecord)>, CheckpointError> {
    let p = || path.to_path_buf();
    if bytes.len() < 8 {
        return Err(CheckpointError::Truncated { path: p(), len: bytes.len() as u64 });
    }
    let (header_len, meta) = SafeTensors::read_metadata(bytes).map_err(|e| match e {
        SafeTensorError::HeaderTooSmall => CheckpointError::Truncated { path: p(), len: bytes.len() as u64 },
        SafeTensorError::InvalidHeaderLength => {
            CheckpointError::HeaderPastEnd { path: p(), file_len: bytes.len() as u64 }
        }
        SafeTensorError::HeaderTooLarge => {
            // The crate also says "too large" for a length past a small file; tell them apart.
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0xff; 8]));
            if n.saturating_add(8) > bytes.len() as u64 {
                CheckpointError::HeaderPastEnd { path: p(), file_len: bytes.len() as u64 }
            } else {
                CheckpointError::HeaderTooLarge { path: p() }
            }
        }
        SafeTensorError::InvalidHeader(e) => CheckpointError::BadHeader { path: p(), reason: e.to_string() },
        SafeTensorError::InvalidHeaderStart => {
            CheckpointError::BadHeader { path: p(), reason: "does not start with `{`".into() }
        }
        SafeTensorError::InvalidHeaderDeserialization(e) | SafeTensorError::JsonError(e) => {
            CheckpointError::BadHeader { path: p(), reason: e.to_string() }
        }
        SafeTensorError::InvalidOffset(tensor) => CheckpointError::BadOffsets { path: p(), tensor },
        SafeTensorError::TensorInvalidInfo | SafeTensorError::MisalignedSlice => {
            CheckpointError::ByteLength { path: p() }
        }
        SafeTensorError::MetadataIncompleteBuffer => CheckpointError::DataLength { path: p() },
        SafeTensorError::ValidationOverflow => CheckpointError::Overflow { path: p() },
        other => CheckpointError::BadHeader { path: p(), reason: other.to_string() },
    })?;
    let data_start = 8 + header_len;
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        // Validated by the crate (contiguous, ending at the end of the file); checked again so an
        // out-of-range slice can never happen here whatever the crate's version does.
        let (Some(offset), Some(end)) = (data_start.checked_add(s), data_start.checked_add(e)) else {
            return Err(CheckpointError::DataLength { path: p() });
        };
        if s > e || end > bytes.len() {
            return Err(CheckpointError::DataLength { path: p() });
        }
        let rec = TensorRecord { file, st_dtype: info.dtype, shape: info.shape.clone(), offset, len: e - s };
        out.push((name, rec));
    }
    out.sort_by_key(|(_, r)| r.offset);
    Ok(out)
}

/// Writes a safetensors file (used by tests and tools): tensors in the order given, the header
/// padded with spaces to a multiple of 8 bytes as the Python writer does.
pub fn serialize(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        let dtype = serde_json::to_value(dtype).unwrap_or(Value::Null);
        header.insert(
            name.to_string(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.len()] }),
        );
        offset += data.len();
    }
    let mut text = Value::Object(header).to_string();
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = Vec::with_capacity(8 + text.len() + offset);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    out
}

//! Tensors: a backend's storage plus a dtype and a row-major shape, and the host storage the CPU
//! backends use (owned and 64-byte aligned, or a read-only window of a memory-mapped file).

use std::sync::Arc;

use memmap2::{Mmap, MmapMut};

use crate::{DType, Error, Result};

/// Memory that holds a tensor's bytes on some device.
pub trait Storage: Send + Sync {
    /// Length in bytes.
    fn len_bytes(&self) -> usize;
}

/// A dense, row-major tensor on a backend.
///
/// A tensor's storage may be larger than its shape: a workspace buffer is allocated once for the
/// most rows a step can have, and each step sets its leading dimension ([`Tensor::set_rows`]) to
/// the rows it uses. The shape, `numel` and `nbytes` are always the current ones, and every op
/// reads and writes only the first `nbytes` bytes of the storage; the rest keeps whatever it
/// held.
#[derive(Debug)]
pub struct Tensor<S> {
    storage: S,
    dtype: DType,
    shape: Vec<usize>,
}

/// Number of elements of a shape, `None` on overflow.
pub fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Bytes a tensor of `dtype` and `shape` occupies, or `ShapeOverflow`.
pub fn nbytes(dtype: DType, shape: &[usize]) -> Result<usize> {
    numel(shape)
        .and_then(|n| n.checked_mul(dtype.size()))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| Error::ShapeOverflow { shape: shape.to_vec() })
}

impl<S: Storage> Tensor<S> {
    /// Wraps `storage`, which must hold exactly the bytes of `dtype` x `shape`.
    pub fn new(storage: S, dtype: DType, shape: &[usize]) -> Result<Self> {
        let expected = nbytes(dtype, shape)?;
        if storage.len_bytes() != expected {
            return Err(Error::ByteLength {
                dtype,
                shape: shape.to_vec(),
                expected,
                got: storage.len_bytes(),
            });
        }
        Ok(Tensor { storage, dtype, shape: shape.to_vec() })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> usize {
        // Checked in `new`, `reshape` and `set_rows`: never more than the storage holds.
        self.shape.iter().product()
    }
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
    pub fn storage(&self) -> &S {
        &self.storage
    }
    pub fn storage_mut(&mut self) -> &mut S {
        &mut self.storage
    }
    pub fn into_storage(self) -> S {
        self.storage
    }

    /// Reads the same bytes as `dtype`, which has the current dtype's element size (an fp8 weight
    /// converted in place from one e4m3 flavour to the other).
    pub(crate) fn set_dtype(&mut self, dtype: DType) {
        debug_assert_eq!(dtype.size(), self.dtype.size(), "{} read as {dtype}", self.dtype);
        self.dtype = dtype;
    }

    /// The same bytes under another shape with as many elements as the current shape (the
    /// storage beyond them, if any, stays with the tensor).
    pub fn reshape(self, shape: &[usize]) -> Result<Self> {
        let expected = nbytes(self.dtype, shape)?;
        if expected != self.nbytes() {
            return Err(Error::ByteLength {
                dtype: self.dtype,
                shape: shape.to_vec(),
                expected,
                got: self.nbytes(),
            });
        }
        Ok(Tensor { shape: shape.to_vec(), ..self })
    }

    /// The rows (leading dimension) the storage can hold at the current row shape: the most
    /// [`Tensor::set_rows`] accepts. A rank-0 tensor, or one whose rows are empty, has its
    /// current leading dimension.
    pub fn max_rows(&self) -> usize {
        let Some(&rows) = self.shape.first() else { return 1 };
        let row_bytes = self.shape[1..].iter().product::<usize>() * self.dtype.size();
        self.storage.len_bytes().checked_div(row_bytes).unwrap_or(rows)
    }

    /// Sets the leading dimension to `rows`, at most [`Tensor::max_rows`]: the storage is not
    /// touched, and ops on the tensor read and write only its first `rows` rows.
    pub fn set_rows(&mut self, rows: usize) -> Result<()> {
        if self.shape.is_empty() {
            return Err(Error::Argument { op: "set_rows", msg: "a rank-0 tensor has no rows".into() });
        }
        let max = self.max_rows();
        if rows > max {
            return Err(Error::Argument {
                op: "set_rows",
                msg: format!("{rows} rows of {:?} beyond the {max} its storage holds", &self.shape[1..]),
            });
        }
        self.shape[0] = rows;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Host storage

/// Alignment of owned host buffers: one cache line, and a full AVX-512 vector.
pub const HOST_ALIGN: usize = 64;

/// Bytes of host memory: owned (zero-initialised, 64-byte aligned; large buffers are anonymous
/// mappings advised to use transparent huge pages), or a read-only window of a mapped file.
#[derive(Debug)]
pub enum HostStorage {
    /// Small owned buffer. `len` bytes of `words` are in use.
    Heap { words: Vec<Align64>, len: usize },
    /// Large owned buffer: an anonymous mapping.
    Anon(MmapMut),
    /// Read-only bytes `offset..offset + len` of a mapped file (weights used in place).
    Mapped { map: Arc<Mmap>, offset: usize, len: usize },
}

/// One 64-byte block of a heap buffer; gives the buffer its alignment.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
pub struct Align64(pub [u8; 64]);

/// Owned buffers at least this large are anonymous mappings with huge pages.
const ANON_THRESHOLD: usize = 1 << 21;

impl HostStorage {
    /// A zero-filled owned buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Result<Self> {
        if len >= ANON_THRESHOLD {
            let map = MmapMut::map_anon(len).map_err(|e| Error::OutOfMemory {
                device: "host".into(),
                bytes: len,
                reason: e.to_string(),
            })?;
            // Transparent huge pages cut TLB misses when streaming weights; advisory only, so a
            // kernel that refuses it changes speed, not results.
            #[cfg(target_os = "linux")]
            let _ = map.advise(memmap2::Advice::HugePage);
            Ok(HostStorage::Anon(map))
        } else {
            let mut words = Vec::new();
            let blocks = len.div_ceil(HOST_ALIGN);
            words.try_reserve_exact(blocks).map_err(|e| Error::OutOfMemory {
                device: "host".into(),
                bytes: len,
                reason: e.to_string(),
            })?;
            words.resize(blocks, Align64([0; 64]));
            Ok(HostStorage::Heap { words, len })
        }
    }

    /// An owned copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut s = HostStorage::zeroed(bytes.len())?;
        s.bytes_mut().expect("owned storage is writable").copy_from_slice(bytes);
        Ok(s)
    }

    /// A read-only window `offset..offset + len` of a mapped file, used in place. `align` is the
    /// element size the window will be read as; a misaligned window is an error, never UB.
    pub fn mapped(map: Arc<Mmap>, offset: usize, len: usize, align: usize) -> Result<Self> {
        if offset.checked_add(len).is_none_or(|end| end > map.len()) {
            return Err(Error::OutOfBounds { what: "mapped tensor".into(), offset, len, size: map.len() });
        }
        let addr = map.as_ptr() as usize + offset;
        if align > 1 && !addr.is_multiple_of(align) {
            return Err(Error::Misaligned { what: "mapped tensor".into(), offset, align });
        }
        Ok(HostStorage::Mapped { map, offset, len })
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            HostStorage::Heap { words, len } => &bytemuck::cast_slice(words)[..*len],
            HostStorage::Anon(m) => m,
            HostStorage::Mapped { map, offset, len } => &map[*offset..*offset + *len],
        }
    }

    /// Writable bytes; `None` for a read-only mapping.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            HostStorage::Heap { words, len } => Some(&mut bytemuck::cast_slice_mut(words)[..*len]),
            HostStorage::Anon(m) => Some(m),
            HostStorage::Mapped { .. } => None,
        }
    }

    pub fn is_read_only(&self) -> bool {
        matches!(self, HostStorage::Mapped { .. })
    }
}

impl Storage for HostStorage {
    fn len_bytes(&self) -> usize {
        match self {
            HostStorage::Heap { len, .. } | HostStorage::Mapped { len, .. } => *len,
            HostStorage::Anon(m) => m.len(),
        }
    }
}

/// A tensor in host memory.
pub type HostTensor = Tensor<HostStorage>;

impl HostTensor {
    /// The elements of the current shape, of type `T` (which must match the dtype's size;
    /// alignment is guaranteed by the storage constructors). Storage beyond the shape (see
    /// [`Tensor::set_rows`]) is not part of the slice.
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        debug_assert_eq!(std::mem::size_of::<T>(), self.dtype().size());
        bytemuck::cast_slice(&self.storage().bytes()[..self.nbytes()])
    }

    /// The mutable elements of the current shape, or `ReadOnly` for a mapped tensor.
    pub fn as_mut_slice<T: bytemuck::Pod>(
        &mut self,
        op: &'static str,
        name: &'static str,
    ) -> Result<&mut [T]> {
        debug_assert_eq!(std::mem::size_of::<T>(), self.dtype().size());
        let len = self.nbytes();
        match self.storage_mut().bytes_mut() {
            Some(b) => Ok(bytemuck::cast_slice_mut(&mut b[..len])),
            None => Err(Error::ReadOnly { op, tensor: name }),
        }
    }
}

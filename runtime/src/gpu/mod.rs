//! GPU backends: one `Backend` implementation, [`Gpu`], over any [`Device`] that can hold memory and
//! launch the kernels of `kernels-cuda/` (or `kernels-hip/`) by name.
//!
//! The launch code (grid sizing, params packing, shape and alignment checks) lives in `ops/`, one
//! module per kernel family, and is the same whichever device runs the kernels:
//! - [`cuda::CudaDevice`] (feature `cuda`): an NVIDIA GPU through cudarc, with the fatbins the
//!   top-level `build.rs` compiled, or the embedded sources compiled at first use by NVRTC;
//! - [`hip::HipDevice`] (feature `hip`): an AMD GPU through hip-sys, with the code objects
//!   `build.rs` compiled for its gfx target;
//! - [`emu::EmuDevice`]: the same kernel sources compiled as host C++ against the SIMT layer of
//!   `simt/` (the root crate's `emulate` feature links them), so CI runs the real kernels without a
//!   GPU.
//!
//! Data-dependent errors (a token id beyond the vocabulary, a slot or position outside the KV
//! cache, a gather index out of range) cannot stop a kernel that is already queued: the kernel
//! skips the bad row and records the first such error in the backend's status word
//! ([`status`]); [`Gpu`] returns it as the typed [`Error`] at the next `synchronize` or `read`.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod emu;
#[cfg(feature = "hip")]
pub mod hip;
#[cfg(feature = "cuda")]
pub mod nvrtc;
pub mod ops;
pub mod status;

mod backend;

use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crate::{Error, Result, Storage};

/// One kernel source file, embedded by the root crate's `build.rs`; `name` is its path relative
/// to the kernel folder (`linear.cu`, `params/linear.h`), as `#include` names it.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    pub name: &'static str,
    pub source: &'static str,
}

/// One compiled kernel file: a fatbin holding SASS for each of `targets` and PTX for the newest.
#[derive(Clone, Copy, Debug)]
pub struct KernelImage {
    /// The source file it was compiled from (`linear.cu`).
    pub name: &'static str,
    /// The targets it has SASS for (`sm_80`, `sm_90a`).
    pub targets: &'static [&'static str],
    pub fatbin: &'static [u8],
}

/// A kernel launch's geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchCfg {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

impl LaunchCfg {
    /// A 1-D launch of `blocks` blocks of `threads` threads.
    pub fn linear(blocks: u32, threads: u32, shared_bytes: u32) -> Self {
        LaunchCfg { grid: [blocks, 1, 1], block: [threads, 1, 1], shared_bytes }
    }
}

/// Who built the device: decides what the kernels may use beyond the common set (mma.sync, the
/// fp8 flavour the hardware converts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vendor {
    Nvidia,
    Amd,
    /// The SIMT emulator (`emu`): its warp-32 image stands for an NVIDIA GPU with mma.sync, its
    /// warp-64 image (the HIP build of the kernels) for an AMD CDNA3 GPU (MI300X).
    Simt,
}

/// What the launch heuristics may know about a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `NVIDIA H200`, `simt (host emulation, warp 32)`, ...; on AMD the device's name and its gfx
    /// target in parentheses, `AMD Instinct MI300X (gfx942)` (`gemm::has_mfma` reads the target).
    pub name: String,
    pub vendor: Vendor,
    /// Compute capability (major, minor) on NVIDIA; the gfx major and minor on AMD (gfx942 is
    /// (9, 4), gfx90a (9, 0)); (0, 0) for the emulator.
    pub arch: (u32, u32),
    /// Threads per warp (32 on NVIDIA, 64 on AMD CDNA).
    pub warp_size: u32,
    /// Streaming multiprocessors (compute units).
    pub sm_count: u32,
    /// The most dynamic shared memory one block may use, in bytes.
    pub max_shared_per_block: u32,
    /// The most threads per block.
    pub max_threads_per_block: u32,
    /// Grid limits per dimension.
    pub max_grid: [u32; 3],
    /// Device memory in bytes.
    pub total_memory: u64,
}

impl DeviceInfo {
    /// The e4m3 flavour the device's fp8 hardware reads: e4m3fnuz on AMD CDNA3 (gfx94x, MI300X)
    /// and on the warp-64 emulator standing for it, e4m3fn everywhere else. A checkpoint in the
    /// other flavour is converted at load (`memwall_model::weights`).
    pub fn native_e4m3(&self) -> crate::DType {
        let fnuz = match self.vendor {
            Vendor::Amd => self.arch >= (9, 4) && self.arch < (10, 0),
            Vendor::Simt => self.warp_size == 64,
            Vendor::Nvidia => false,
        };
        if fnuz { crate::DType::F8E4M3Fnuz } else { crate::DType::F8E4M3Fn }
    }
}

/// Bytes `offset..offset + len` lie inside a `size`-byte buffer of `device` (its `Device::name`),
/// or `OutOfBounds` naming the device and the copy (`op`): the check each device makes before a
/// copy touches its memory.
pub(crate) fn check_range(device: &str, op: &str, offset: usize, len: usize, size: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(Error::OutOfBounds { what: format!("{device} {op}"), offset, len, size });
    }
    Ok(())
}

/// Memory and kernel launches of one device. All work is ordered on one stream.
pub trait Device: Send + Sync + Sized + 'static {
    /// Device memory that frees itself on drop.
    type Buffer: Send + Sync + Debug;

    /// Short backend name: `cuda`, `hip`, `cuda-emu`, `hip-emu`.
    fn name(&self) -> &'static str;
    fn info(&self) -> &DeviceInfo;

    /// A zero-filled buffer of `bytes` bytes (at least 1), aligned to 256 bytes.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;
    /// The buffer's length in bytes.
    fn len(buf: &Self::Buffer) -> usize;
    /// The device address of the buffer's first byte, as the kernels see it.
    fn address(buf: &Self::Buffer) -> u64;
    /// Copies host `bytes` to `dst[offset..]` (ordered after queued work).
    fn write(&self, dst: &mut Self::Buffer, offset: usize, bytes: &[u8]) -> Result<()>;
    /// Sets `dst[offset..offset + len]` to zero (a memset on the stream, ordered after queued
    /// work).
    fn zero(&self, dst: &mut Self::Buffer, offset: usize, len: usize) -> Result<()>;
    /// Copies `src[offset..offset + out.len()]` to host `out` after queued work is done.
    fn read(&self, src: &Self::Buffer, offset: usize, out: &mut [u8]) -> Result<()>;
    /// Queues kernel `name` with `params` (the bytes of its `#[repr(C)]` params struct).
    ///
    /// # Safety
    /// `params` must be the params struct of kernel `name`, whose device pointers point into
    /// live buffers of this device that are large enough for every access the kernel makes with
    /// these params and `cfg`; buffers written by the kernel must not be read or written by the
    /// host until the launch is complete.
    unsafe fn launch(&self, name: &'static str, cfg: LaunchCfg, params: &[u8]) -> Result<()>;
    /// Waits until all queued work is done.
    fn synchronize(&self) -> Result<()>;

    /// A recorded sequence of launches ([`Device::end_capture`]): a CUDA or HIP graph.
    type Graph;
    /// Starts recording: the launches queued from now until [`Device::end_capture`] are recorded
    /// into a graph instead of run. [`Gpu`] refuses memory traffic and synchronisation meanwhile.
    fn begin_capture(&self) -> Result<()>;
    /// Stops recording and returns the graph of the launches queued since `begin_capture`; an
    /// error when it recorded none, or when the device gave up the capture (an illegal call).
    fn end_capture(&self) -> Result<Self::Graph>;
    /// Queues the recorded launches again, each with the params it was recorded with.
    fn replay(&self, graph: &Self::Graph) -> Result<()>;
}

/// A tensor's memory on a device.
#[derive(Debug)]
pub struct GpuStorage<B> {
    buf: B,
    len: usize,
}

impl<B> GpuStorage<B> {
    pub fn buffer(&self) -> &B {
        &self.buf
    }
}

impl<B: Send + Sync> Storage for GpuStorage<B> {
    fn len_bytes(&self) -> usize {
        self.len
    }
}

/// The GPU backend over a device.
pub struct Gpu<D: Device> {
    device: D,
    status: std::sync::Mutex<D::Buffer>,
    /// Device scratch the launchers keep between calls: (owner, part, buffer).
    scratch: std::sync::Mutex<Vec<(&'static str, usize, D::Buffer)>>,
    /// How many scratch buffers were replaced by larger ones (freeing the old): a graph recorded
    /// before a replacement would use freed memory.
    scratch_moves: AtomicU64,
    /// Set while [`Gpu::capture`] records.
    recording: AtomicBool,
    /// Kernel launches queued (see [`Gpu::launches`]).
    launches: AtomicUsize,
    /// Output features per warp of the 4-row GEMV (see [`Gpu::set_gemv_warp_rows`]).
    gemv_warp_rows: AtomicUsize,
    /// The fewest rows of a GEMV taken by the tensor cores; 0: never (see
    /// [`Gpu::set_gemv_tensor_core_rows`]).
    gemv_tc_rows: AtomicUsize,
    /// Whether the GEMM takes the warpgroup tensor cores where it can (see
    /// [`Gpu::set_gemm_warpgroup`]).
    gemm_wg: AtomicBool,
}

/// A graph of a [`Gpu`]'s launches ([`Backend::capture`](crate::Backend::capture)), with the
/// scratch generation it was recorded in.
pub struct GpuGraph<G> {
    graph: G,
    scratch_moves: u64,
    launches: usize,
}

impl<G> crate::Recorded for GpuGraph<G> {
    fn launches(&self) -> usize {
        self.launches
    }
}

impl<G> Debug for GpuGraph<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuGraph").field("launches", &self.launches).finish()
    }
}

impl<D: Device> Gpu<D> {
    pub fn new(device: D) -> Result<Self> {
        let status = device.alloc(status::STATUS_BYTES)?;
        Ok(Gpu {
            device,
            status: std::sync::Mutex::new(status),
            scratch: std::sync::Mutex::new(Vec::new()),
            scratch_moves: AtomicU64::new(0),
            recording: AtomicBool::new(false),
            launches: AtomicUsize::new(0),
            gemv_warp_rows: AtomicUsize::new(1),
            gemv_tc_rows: AtomicUsize::new(0),
            gemm_wg: AtomicBool::new(false),
        })
    }

    /// An error when a capture is recording: what `what` would do (allocate, copy, wait) cannot
    /// be part of a graph, and CUDA would abandon the capture over it.
    pub(crate) fn not_recording(&self, what: &str) -> Result<()> {
        if self.recording.load(Ordering::Relaxed) {
            return Err(Error::Device {
                device: self.device.name().into(),
                msg: format!(
                    "{what} while recording a graph (a captured step may only launch kernels; run it \
                     once unrecorded first so that its scratch exists)"
                ),
            });
        }
        Ok(())
    }

    /// Records the launches `f` queues (see [`Backend::capture`](crate::Backend::capture)).
    pub(crate) fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<GpuGraph<D::Graph>> {
        self.not_recording("starting a capture")?;
        let moves = self.scratch_moves.load(Ordering::Relaxed);
        let launches = self.launches.load(Ordering::Relaxed);
        self.device.begin_capture()?;
        self.recording.store(true, Ordering::Relaxed);
        let ran = f();
        self.recording.store(false, Ordering::Relaxed);
        // Ended whatever `f` returned, so the device is never left recording.
        let graph = self.device.end_capture();
        ran?;
        let graph = graph?;
        if self.scratch_moves.load(Ordering::Relaxed) != moves {
            return Err(Error::Device {
                device: self.device.name().into(),
                msg: "a scratch buffer moved while recording a graph".into(),
            });
        }
        Ok(GpuGraph {
            graph,
            scratch_moves: moves,
            launches: self.launches.load(Ordering::Relaxed) - launches,
        })
    }

    /// Replays `graph` unless a scratch buffer moved since it was recorded (then `Ok(false)`).
    pub(crate) fn replay(&self, graph: &GpuGraph<D::Graph>) -> Result<bool> {
        self.not_recording("replaying a graph")?;
        if graph.scratch_moves != self.scratch_moves.load(Ordering::Relaxed) {
            return Ok(false);
        }
        self.device.replay(&graph.graph)?;
        Ok(true)
    }

    /// Kernel launches queued through this backend so far (recorded ones included; replays
    /// not).
    pub fn launches(&self) -> usize {
        self.launches.load(Ordering::Relaxed)
    }

    /// How many output features one warp of the GEMV computes at once where `linear` runs the
    /// 4-row tile (2 to 4 rows of x): 1 (`gemv_*_r4`, the default) or 4 (`gemv_j4_*_r4`, which
    /// reads x through L1 a quarter as often per weight byte; kernels-cuda/gemv.cu). Both give results within the same bound; which is faster is a
    /// measurement (`benches/gpu` runs both). Other values are an [`Error::Argument`].
    pub fn set_gemv_warp_rows(&self, rows: usize) -> Result<()> {
        if !matches!(rows, 1 | 4) {
            return Err(Error::Argument {
                op: "set_gemv_warp_rows",
                msg: format!("{rows} output features per warp (1 or 4)"),
            });
        }
        self.gemv_warp_rows.store(rows, Ordering::Relaxed);
        Ok(())
    }

    /// See [`Gpu::set_gemv_warp_rows`].
    pub fn gemv_warp_rows(&self) -> usize {
        self.gemv_warp_rows.load(Ordering::Relaxed)
    }

    /// Whether `linear` runs decode batches (at most `GEMV_MAX_ROWS` rows) on the matrix units:
    /// `Some(r)` sends a GEMV of at least `r` rows (1 to 16) to `gemv_tc_*` (kernels-cuda/gemv_tc.cu:
    /// x staged once per 128 output features, mma.sync on bf16 parts, f32 accuracy) on NVIDIA, or
    /// to `gemv_mfma_*` (kernels-cuda/gemv_mfma.cu: the same on AMD's MFMA) on AMD CDNA
    /// (`ops::linear::GemvMatrix`), wherever the preconditions hold
    /// (`ops::linear::gemv_tc_applies`); `None` (the default) keeps every GEMV on gemv.cu's tiles. Which is faster at which batch is a measurement (`benches/gpu`
    /// runs both); the results of either are within the bound tests/gpu_linear.rs derives. Rows
    /// outside 1 to 16 are an [`Error::Argument`].
    pub fn set_gemv_tensor_core_rows(&self, rows: Option<usize>) -> Result<()> {
        let rows = match rows {
            None => 0,
            Some(r) if (1..=ops::linear::GEMV_MAX_ROWS).contains(&r) => r,
            Some(r) => {
                return Err(Error::Argument {
                    op: "set_gemv_tensor_core_rows",
                    msg: format!("{r} rows (1 to {})", ops::linear::GEMV_MAX_ROWS),
                });
            }
        };
        self.gemv_tc_rows.store(rows, Ordering::Relaxed);
        Ok(())
    }

    /// See [`Gpu::set_gemv_tensor_core_rows`].
    pub fn gemv_tensor_core_rows(&self) -> Option<usize> {
        Some(self.gemv_tc_rows.load(Ordering::Relaxed)).filter(|&r| r > 0)
    }

    /// Whether `linear` runs the GEMMs gemm_tc.cu would take (more than `GEMV_MAX_ROWS` rows) on
    /// Hopper's warpgroup instruction instead: `gemm_wg_*` (kernels-cuda/gemm_wg.cu: wgmma, the
    /// same contract and bound) on devices that have it ([`ops::gemm::has_wgmma`]: sm_90, or
    /// the SIMT emulator, which emulates it); elsewhere the setting changes nothing. Off by
    /// default until a measurement (`benches/gpu` runs both) shows it faster.
    pub fn set_gemm_warpgroup(&self, on: bool) {
        self.gemm_wg.store(on, Ordering::Relaxed);
    }

    /// See [`Gpu::set_gemm_warpgroup`].
    pub fn gemm_warpgroup(&self) -> bool {
        self.gemm_wg.load(Ordering::Relaxed)
    }

    /// Runs `f` with the device addresses of `owner`'s scratch buffers, part `i` at least
    /// `bytes[i]` bytes, holding them (no other launcher gets them) until `f` returns, so the
    /// launches `f` queues own them in stream order. A buffer is zero-filled when allocated and
    /// otherwise holds what the owner's kernels left in it (an owner may keep counters there that
    /// its kernels return to zero). Growing one waits for queued work before freeing the old one.
    pub(crate) fn with_scratch<R>(
        &self,
        owner: &'static str,
        bytes: &[usize],
        f: impl FnOnce(&[u64]) -> Result<R>,
    ) -> Result<R> {
        let mut held = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let mut addresses = Vec::with_capacity(bytes.len());
        for (part, &want) in bytes.iter().enumerate() {
            let size = want.max(1).next_power_of_two();
            let at = match held.iter().position(|(o, p, _)| *o == owner && *p == part) {
                Some(at) if D::len(&held[at].2) >= want => at,
                Some(at) => {
                    self.not_recording(&format!("growing the scratch of {owner}"))?;
                    self.device.synchronize()?;
                    held[at].2 = self.device.alloc(size)?;
                    self.scratch_moves.fetch_add(1, Ordering::Relaxed);
                    at
                }
                None => {
                    self.not_recording(&format!("allocating the scratch of {owner}"))?;
                    held.push((owner, part, self.device.alloc(size)?));
                    held.len() - 1
                }
            };
            addresses.push(D::address(&held[at].2));
        }
        f(&addresses)
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    #[allow(dead_code)] // used by the launchers of the data-dependent ops as they land
    /// The device address of the status word the kernels report data-dependent errors to.
    pub(crate) fn status_address(&self) -> u64 {
        D::address(&self.status.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Reads and clears the status word: the first data-dependent error a kernel reported since
    /// the last check, if any. Waits for queued work.
    pub fn check_status(&self) -> Result<()> {
        let mut buf = self.status.lock().unwrap_or_else(|e| e.into_inner());
        let mut words = [0u8; status::STATUS_BYTES];
        self.device.read(&buf, 0, &mut words)?;
        match status::decode(&words) {
            None => Ok(()),
            Some(err) => {
                self.device.write(&mut buf, 0, &[0u8; status::STATUS_BYTES])?;
                Err(err)
            }
        }
    }

    /// Launches `name` with the params struct `params`.
    ///
    /// # Safety
    /// As [`Device::launch`].
    pub(crate) unsafe fn launch<P: bytemuck::Pod>(
        &self,
        name: &'static str,
        cfg: LaunchCfg,
        params: &P,
    ) -> Result<()> {
        let info = self.device.info();
        let threads = cfg.block.iter().try_fold(1u32, |a, &b| a.checked_mul(b));
        let bad = |msg: String| Error::Argument { op: name, msg };
        if cfg.grid.contains(&0) || cfg.block.contains(&0) {
            return Err(bad(format!("empty launch grid {:?} block {:?}", cfg.grid, cfg.block)));
        }
        if threads.is_none_or(|t| t > info.max_threads_per_block) {
            return Err(bad(format!("block {:?} exceeds {} threads", cfg.block, info.max_threads_per_block)));
        }
        if cfg.grid.iter().zip(info.max_grid).any(|(&g, m)| g > m) {
            return Err(bad(format!("grid {:?} exceeds the device's {:?}", cfg.grid, info.max_grid)));
        }
        if cfg.shared_bytes > info.max_shared_per_block {
            return Err(bad(format!(
                "{} bytes of shared memory exceed the device's {}",
                cfg.shared_bytes, info.max_shared_per_block
            )));
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.device.launch(name, cfg, bytemuck::bytes_of(params)) }?;
        self.launches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl<D: Device> Debug for Gpu<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("device", &self.device.info().name).finish()
    }
}

#[allow(dead_code)] // used by the launchers as they land
/// A `u32` from a `usize` launch dimension, or an error naming what overflowed.
pub(crate) fn dim(op: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v)
        .map_err(|_| Error::Argument { op, msg: format!("{what} {v} exceeds the 32-bit launch limit") })
}

#[cfg(test)]
mod tests {
    use super::check_range;
    use crate::Error;

    #[test]
    fn check_range_admits_the_buffer_and_names_what_falls_outside() {
        assert!(check_range("cuda", "write", 0, 8, 8).is_ok());
        assert!(check_range("cuda", "write", 8, 0, 8).is_ok());
        assert!(check_range("cuda", "write", 3, 5, 8).is_ok());
        assert_eq!(
            check_range("hip", "read", 3, 6, 8),
            Err(Error::OutOfBounds { what: "hip read".into(), offset: 3, len: 6, size: 8 })
        );
        assert_eq!(
            check_range("cuda-emu", "write", 9, 0, 8),
            Err(Error::OutOfBounds { what: "cuda-emu write".into(), offset: 9, len: 0, size: 8 })
        );
        // offset + len overflows usize: outside, not wrapped around.
        let e = check_range("cuda", "copy", usize::MAX, 2, 8).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("cuda copy: bytes {}..{}+2 lie outside the 8 bytes available", usize::MAX, usize::MAX)
        );
    }
}

#[cfg(test)]
mod capture_tests;

//! The memory ceiling of a GPU as its SMs see it: the read and copy kernels of
//! `kernels-cuda/stream.cu` over a working set of a few GB, timed on the device, checked after
//! timing (the read's word sum against the host's, the copy's ends against the source), in
//! decimal GB/s counting bytes read + written. `memwall peak --backend cuda` (or `hip`) adds the
//! copy engine (`cuMemcpyDtoD`, `hipMemcpyDtoD`) beside them.
//!
//! Generic over the device, so the emulated GPU runs the same path in CI (its figures are the
//! CPU emulator's, meaningless as a GPU ceiling).

use memwall_runtime::gpu::{Device, Gpu};
use memwall_runtime::{Error, Result};

/// Default working set: 4 GiB read (two 2 GiB buffers for the copy), far above any L2 (50 MiB on
/// H100 and H200, 256 MiB of Infinity Cache on MI300X).
pub const DEFAULT_WORKING_SET: u64 = 4 << 30;

/// Bytes of the pattern the buffers repeat (random, so the sum check sees every byte).
const PATTERN_BYTES: usize = 1 << 20;

/// Times the work a closure queues, in seconds (CUDA events, or the host clock around a
/// synchronize: [`host_time`]).
pub type Timer<'a> = &'a dyn Fn(&mut dyn FnMut() -> Result<()>) -> Result<f64>;

/// A device's own copy of `src` to `dst` (the copy engine), timed beside the SM copy.
pub type EngineCopy<'a, D> = &'a dyn Fn(&mut <D as Device>::Buffer, &<D as Device>::Buffer) -> Result<()>;

/// What a GPU measurement timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuKernel {
    /// `stream_read_u32` over the working set.
    Read,
    /// `stream_copy_u32` from one half of the working set to the other.
    Copy,
    /// The copy engine (`cuMemcpyDtoDAsync`) between the same halves, for comparison.
    CopyEngine,
}

impl GpuKernel {
    pub fn name(self) -> &'static str {
        match self {
            GpuKernel::Read => "read",
            GpuKernel::Copy => "copy",
            GpuKernel::CopyEngine => "copy-engine",
        }
    }
}

/// One kernel's best pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuMeasurement {
    pub kernel: GpuKernel,
    /// Bytes read + written per pass.
    pub bytes_per_pass: u64,
    /// The best (shortest) timed pass, seconds.
    pub seconds: f64,
    /// `bytes_per_pass / seconds / 1e9`.
    pub gb_per_s: f64,
}

/// The buffers of a GPU measurement: `src` (the working set, a repeated random pattern) and
/// `dst` (half of it, the copy's target).
pub struct GpuStreamBuffers<D: Device> {
    src: D::Buffer,
    dst: D::Buffer,
    sum: D::Buffer,
    bytes: usize,
    want_sum: u32,
    pattern: Vec<u8>,
}

fn arg(msg: String) -> Error {
    Error::Argument { op: "peak", msg }
}

fn word_sum(bytes: &[u8]) -> u32 {
    bytes.chunks_exact(4).fold(0u32, |a, w| a.wrapping_add(u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
}

impl<D: Device> GpuStreamBuffers<D> {
    /// Allocates and fills a working set of `working_set` bytes (rounded down to a whole number
    /// of pattern repeats, at least one pattern's worth of 16-byte vectors).
    pub fn new(g: &Gpu<D>, working_set: u64, seed: u64) -> Result<Self> {
        let pattern_bytes = (working_set.min(PATTERN_BYTES as u64) as usize) / 32 * 32;
        if pattern_bytes == 0 {
            return Err(arg(format!(
                "a working set of {working_set} bytes is too small (32 bytes at least)"
            )));
        }
        let repeats = usize::try_from(working_set / pattern_bytes as u64).map_err(|_| {
            arg(format!("a working set of {working_set} bytes does not fit this host's usize"))
        })?;
        let bytes = pattern_bytes * repeats;
        let mut state = seed | 1;
        let pattern: Vec<u8> = (0..pattern_bytes)
            .map(|_| {
                // xorshift64*: the bytes need only be irregular, not good random numbers.
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
            })
            .collect();
        let dev = g.device();
        let mut src = dev.alloc(bytes)?;
        for r in 0..repeats {
            dev.write(&mut src, r * pattern_bytes, &pattern)?;
        }
        let dst = dev.alloc(bytes / 2)?;
        let sum = dev.alloc(4)?;
        let want_sum = word_sum(&pattern).wrapping_mul(repeats as u32);
        Ok(GpuStreamBuffers { src, dst, sum, bytes, want_sum, pattern })
    }

    /// The working set in bytes (the read's bytes per pass).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Runs `kernel` once (queued; `time` brackets it).
    fn pass(&mut self, g: &Gpu<D>, kernel: GpuKernel) -> Result<()> {
        match kernel {
            GpuKernel::Read => g.stream_read(&self.src, self.bytes, &mut self.sum),
            GpuKernel::Copy => g.stream_copy(&mut self.dst, &self.src, self.bytes / 2),
            GpuKernel::CopyEngine => Err(Error::Unsupported {
                backend: g.device().name(),
                op: "peak",
                reason: "the copy engine is the device's own copy (CudaDevice::copy, HipDevice::copy), timed by the device".into(),
            }),
        }
    }

    /// Fails unless the last pass of `kernel` produced what it must: the read's sum, the copy's
    /// first and last pattern's worth of bytes.
    fn verify(&self, g: &Gpu<D>, kernel: GpuKernel) -> Result<()> {
        let dev = g.device();
        match kernel {
            GpuKernel::Read => {
                let mut got = [0u8; 4];
                dev.read(&self.sum, 0, &mut got)?;
                let got = u32::from_le_bytes(got);
                if got != self.want_sum {
                    return Err(Error::Device {
                        device: dev.name().into(),
                        msg: format!(
                            "peak: the read kernel summed {got:#010x} over {} bytes, the host {:#010x}",
                            self.bytes, self.want_sum
                        ),
                    });
                }
            }
            GpuKernel::Copy | GpuKernel::CopyEngine => {
                let half = self.bytes / 2;
                let n = self.pattern.len().min(half);
                let (mut head, mut tail) = (vec![0u8; n], vec![0u8; n]);
                dev.read(&self.dst, 0, &mut head)?;
                dev.read(&self.dst, half - n, &mut tail)?;
                let mut want_tail = vec![0u8; n];
                for (i, b) in want_tail.iter_mut().enumerate() {
                    *b = self.pattern[(half - n + i) % self.pattern.len()];
                }
                if head != self.pattern[..n] || tail != want_tail {
                    return Err(Error::Device {
                        device: dev.name().into(),
                        msg: format!("peak: the {} left the wrong bytes", kernel.name()),
                    });
                }
            }
        }
        Ok(())
    }

    /// The bytes `kernel` moves per pass (read + written).
    pub fn bytes_per_pass(&self, kernel: GpuKernel) -> u64 {
        match kernel {
            GpuKernel::Read => self.bytes as u64,
            GpuKernel::Copy | GpuKernel::CopyEngine => 2 * (self.bytes / 2) as u64,
        }
    }

    /// One warm-up pass, then the best of `passes` passes of `kernel`, each timed by `time`
    /// (seconds of the work its closure queues), checked afterwards. `CopyEngine` takes `copy`,
    /// the device's own copy (`None` elsewhere).
    pub fn measure(
        &mut self,
        g: &Gpu<D>,
        kernel: GpuKernel,
        passes: usize,
        time: Timer<'_>,
        copy: Option<EngineCopy<'_, D>>,
    ) -> Result<GpuMeasurement> {
        if passes == 0 {
            return Err(arg("--passes must be at least 1".into()));
        }
        let mut best = f64::INFINITY;
        for i in 0..=passes {
            let seconds = {
                let this = &mut *self;
                time(&mut || match (kernel, copy) {
                    (GpuKernel::CopyEngine, Some(copy)) => copy(&mut this.dst, &this.src),
                    _ => this.pass(g, kernel),
                })?
            };
            if i > 0 {
                best = best.min(seconds);
            }
        }
        g.check_status()?;
        self.verify(g, kernel)?;
        let bytes_per_pass = self.bytes_per_pass(kernel);
        let gb_per_s = if best > 0.0 { bytes_per_pass as f64 / best / 1e9 } else { 0.0 };
        Ok(GpuMeasurement { kernel, bytes_per_pass, seconds: best, gb_per_s })
    }
}

/// Wall-clock timing of queued work: `f`, then a synchronize. For devices without events (the
/// emulator).
pub fn host_time<D: Device>(g: &Gpu<D>) -> impl Fn(&mut dyn FnMut() -> Result<()>) -> Result<f64> + '_ {
    move |f| {
        g.device().synchronize()?;
        let start = std::time::Instant::now();
        f()?;
        g.device().synchronize()?;
        Ok(start.elapsed().as_secs_f64())
    }
}

//! This machine's achievable memory bandwidth: the ceiling every kernel is judged against.
//!
//! Three streaming kernels run over a working set far larger than the last-level cache, so every
//! byte comes from DRAM:
//! - **read**: a wrapping sum of the buffer as `u64` words, each thread walking its share as eight
//!   streams in lockstep into eight lanes each (`sum_words`: integer addition is associative, so
//!   the order is free and the adds vectorise); the sum goes through `black_box`, so the loads
//!   cannot be dropped. Counts the buffer once.
//! - **copy**: `a = b` (`copy_from_slice`, i.e. the platform `memcpy`, which picks non-temporal
//!   stores for large blocks). Counts 2x the array: one read, one write.
//! - **triad**: `a = b + s * c` in f32. Counts 3x the array: two reads, one write.
//!
//! Write-allocate traffic (a cache line of `a` read before it is written) is not counted, as in
//! STREAM: the figure is the bytes the kernel asks for, which is also how kernels are judged.
//!
//! The working set is the total of the arrays a kernel streams: `max(3 x LLC, 1 GiB)`, the LLC read
//! from sysfs (`/sys/devices/system/cpu/cpu0/cache/index*/{level,size}`, the largest level). One
//! buffer of that size is carved into 1 (read), 2 (copy) or 3 (triad) arrays, so every kernel
//! moves the whole working set per pass. Buffers are `HostStorage::zeroed`, anonymous mappings
//! advised to use transparent huge pages, the same memory weights live in, filled with non-zero
//! data before the first pass.
//!
//! Each thread count gets its own rayon pool; each pool thread streams its own contiguous part
//! (`ThreadPool::broadcast`, one part per thread). A measurement is the best of `passes` timed
//! passes after one warm-up pass. GB are decimal (1e9 bytes), like memory datasheets.

use std::fmt;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use memwall_model::random::mix64;
use memwall_runtime::{Error, HostStorage, Result};
use rayon::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuilder};

/// The smallest working set measured, whatever the cache: 1 GiB.
pub const MIN_WORKING_SET: u64 = 1 << 30;

/// The working set is at least this many times the last-level cache.
pub const LLC_FACTOR: u64 = 3;

/// Arrays are whole pages, and the buffer splits into 1, 2 or 3 of them: a multiple of this.
const BUFFER_GRAIN: u64 = 6 * 4096;

/// Where Linux describes cpu0's caches.
pub const SYSFS_CACHE_DIR: &str = "/sys/devices/system/cpu/cpu0/cache";

// ---------------------------------------------------------------------------------------------
// Kernels and byte accounting

/// A streaming kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Read,
    Copy,
    Triad,
}

impl Kernel {
    pub const ALL: [Kernel; 3] = [Kernel::Read, Kernel::Copy, Kernel::Triad];

    pub const fn name(self) -> &'static str {
        match self {
            Kernel::Read => "read",
            Kernel::Copy => "copy",
            Kernel::Triad => "triad",
        }
    }

    pub fn from_name(name: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Arrays the kernel streams, each read or written once per pass: read 1, copy 2 (one read,
    /// one written), triad 3 (two read, one written).
    pub const fn arrays(self) -> u64 {
        match self {
            Kernel::Read => 1,
            Kernel::Copy => 2,
            Kernel::Triad => 3,
        }
    }

    /// Bytes read + written by one pass over arrays of `array_bytes` each.
    pub const fn bytes_per_pass(self, array_bytes: u64) -> u64 {
        self.arrays() * array_bytes
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

// ---------------------------------------------------------------------------------------------
// Cache size and working set

/// A sysfs cache size (`32768K`, `480M`, `1G`, or plain bytes; K, M, G are binary, as the kernel
/// writes them) in bytes. `None` if it does not parse or overflows.
pub fn parse_cache_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().last()? {
        (i, 'K' | 'k') => (&s[..i], 1u64 << 10),
        (i, 'M' | 'm') => (&s[..i], 1 << 20),
        (i, 'G' | 'g') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(unit)
}

/// The last-level cache described by a sysfs cache directory (`index*/level`, `index*/size`,
/// `index*/type`): the size at the largest level (instruction caches skipped; the largest size if
/// a level lists several). `None` if nothing readable is there.
pub fn llc_from_sysfs(dir: &Path) -> Option<u64> {
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let mut best: Option<(u32, u64)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let is_index = entry.file_name().to_str().is_some_and(|n| n.starts_with("index"));
        if !is_index {
            continue;
        }
        let path = entry.path();
        if read(&path.join("type")).is_some_and(|t| t.trim() == "Instruction") {
            continue;
        }
        let Some(level) = read(&path.join("level")).and_then(|l| l.trim().parse::<u32>().ok()) else {
            continue;
        };
        let Some(size) = read(&path.join("size")).and_then(|s| parse_cache_size(&s)) else {
            continue;
        };
        if best.is_none_or(|b| (level, size) > b) {
            best = Some((level, size));
        }
    }
    best.map(|(_, size)| size)
}

/// This machine's last-level cache in bytes, as cpu0 sees it; `None` where sysfs does not say.
pub fn llc_bytes() -> Option<u64> {
    llc_from_sysfs(Path::new(SYSFS_CACHE_DIR))
}

/// The working set for a last-level cache of `llc` bytes: `max(3 x LLC, 1 GiB)` (1 GiB when the
/// cache size is unknown).
pub fn working_set_for(llc: Option<u64>) -> u64 {
    llc.map_or(0, |l| l.saturating_mul(LLC_FACTOR)).max(MIN_WORKING_SET)
}

/// The working set on this machine: `max(3 x LLC, 1 GiB)`.
pub fn working_set_bytes() -> u64 {
    working_set_for(llc_bytes())
}

/// Threads available to this process (at least 1).
pub fn max_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

// ---------------------------------------------------------------------------------------------
// Measurement

/// One kernel at one thread count.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measurement {
    pub kernel: Kernel,
    pub threads: usize,
    /// Bytes read + written per pass.
    pub bytes_per_pass: u64,
    /// The best (shortest) timed pass.
    pub seconds: f64,
    /// `bytes_per_pass / seconds / 1e9`.
    pub gb_per_s: f64,
}

/// Decimal GB/s of `bytes` moved in `time` (0 for a zero duration, never infinity).
pub fn gb_per_s(bytes: u64, time: Duration) -> f64 {
    let s = time.as_secs_f64();
    if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 }
}

fn arg(msg: String) -> Error {
    Error::Argument { op: "peak", msg }
}

/// A rayon pool of exactly `threads` threads.
pub fn thread_pool(threads: usize) -> Result<ThreadPool> {
    if threads == 0 {
        return Err(arg("thread count must be at least 1".into()));
    }
    ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("memwall-peak-{i}"))
        .build()
        .map_err(|e| Error::Unsupported {
            backend: "cpu",
            op: "peak",
            reason: format!("cannot start {threads} threads: {e}"),
        })
}

/// The streaming buffer: one allocation of at least the working set, carved into a kernel's
/// arrays at each pass.
#[derive(Debug)]
pub struct StreamBuffers {
    storage: HostStorage,
}

impl StreamBuffers {
    /// Allocates at least `working_set_bytes` (rounded up to whole pages per array) and fills
    /// them with non-zero f32 values, in parallel.
    pub fn new(working_set_bytes: u64) -> Result<Self> {
        if working_set_bytes == 0 {
            return Err(arg("working set must be positive".into()));
        }
        let bytes = working_set_bytes
            .checked_next_multiple_of(BUFFER_GRAIN)
            .and_then(|b| usize::try_from(b).ok())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| arg(format!("working set of {working_set_bytes} bytes is too large")))?;
        let mut storage = HostStorage::zeroed(bytes)?;
        let words = f32_words(&mut storage)?;
        // Values in [1, 2) with hashed mantissas: finite, non-zero, never denormal (the triad's
        // `b + s * c` stays fast and finite), and no two pages alike, so nothing below us (page
        // merging, compressed memory) can serve a pass from fewer bytes than it claims.
        const CHUNK: usize = 1 << 16;
        words.par_chunks_mut(CHUNK).enumerate().for_each(|(chunk, w)| {
            for (i, v) in w.iter_mut().enumerate() {
                let h = mix64((chunk * CHUNK + i) as u64);
                *v = f32::from_bits(0x3f80_0000 | (h as u32 & 0x007f_ffff));
            }
        });
        Ok(StreamBuffers { storage })
    }

    /// Total bytes of the buffer (the working set actually streamed).
    pub fn bytes(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// Bytes read + written by one pass of `kernel`: the whole buffer, for every kernel.
    pub fn bytes_per_pass(&self, kernel: Kernel) -> u64 {
        kernel.bytes_per_pass(self.bytes() / kernel.arrays())
    }

    /// One pass of `kernel` on `pool`, each pool thread on its own contiguous part; its wall time.
    pub fn pass(&mut self, kernel: Kernel, pool: &ThreadPool) -> Result<Duration> {
        let threads = pool.current_num_threads();
        let words = f32_words(&mut self.storage)?;
        let array = words.len() / kernel.arrays() as usize;
        let start = Instant::now();
        match kernel {
            Kernel::Read => {
                let words: &[u64] = bytemuck::try_cast_slice(&*words).map_err(|_| misaligned())?;
                let parts = split(words, threads);
                let sums = pool.broadcast(|ctx| parts.get(ctx.index()).map_or(0, |p| sum_words(p)));
                std::hint::black_box(sums.into_iter().fold(0u64, u64::wrapping_add));
            }
            Kernel::Copy => {
                let (a, rest) = words.split_at_mut(array);
                let b = &rest[..array];
                let a_parts: Vec<Mutex<&mut [f32]>> =
                    split_mut(a, threads).into_iter().map(Mutex::new).collect();
                let b_parts = split(b, threads);
                pool.broadcast(|ctx| {
                    let i = ctx.index();
                    if let (Some(a), Some(b)) = (a_parts.get(i), b_parts.get(i)) {
                        let mut a = a.lock().unwrap_or_else(|e| e.into_inner());
                        a.copy_from_slice(b);
                    }
                });
                std::hint::black_box(&a_parts);
            }
            Kernel::Triad => {
                let (a, rest) = words.split_at_mut(array);
                let (b, c) = rest.split_at(array);
                let a_parts: Vec<Mutex<&mut [f32]>> =
                    split_mut(a, threads).into_iter().map(Mutex::new).collect();
                let b_parts = split(b, threads);
                let c_parts = split(&c[..array], threads);
                let s = std::hint::black_box(3.0f32);
                pool.broadcast(|ctx| {
                    let i = ctx.index();
                    if let (Some(a), Some(b), Some(c)) = (a_parts.get(i), b_parts.get(i), c_parts.get(i)) {
                        let mut a = a.lock().unwrap_or_else(|e| e.into_inner());
                        triad(&mut a, b, c, s);
                    }
                });
                std::hint::black_box(&a_parts);
            }
        }
        Ok(start.elapsed())
    }

    /// One warm-up pass, then the best of `passes` timed passes of `kernel` on `threads` threads.
    pub fn measure(&mut self, kernel: Kernel, threads: usize, passes: usize) -> Result<Measurement> {
        let pool = thread_pool(threads)?;
        self.measure_on(kernel, &pool, passes)
    }

    /// As `measure`, on an existing pool (its thread count is the measurement's).
    pub fn measure_on(&mut self, kernel: Kernel, pool: &ThreadPool, passes: usize) -> Result<Measurement> {
        if passes == 0 {
            return Err(arg("at least one timed pass is needed".into()));
        }
        self.pass(kernel, pool)?;
        let mut best = Duration::MAX;
        for _ in 0..passes {
            best = best.min(self.pass(kernel, pool)?);
        }
        let bytes_per_pass = self.bytes_per_pass(kernel);
        Ok(Measurement {
            kernel,
            threads: pool.current_num_threads(),
            bytes_per_pass,
            seconds: best.as_secs_f64(),
            gb_per_s: gb_per_s(bytes_per_pass, best),
        })
    }
}

/// Allocates a working set of `working_set_bytes` and measures `kernel` on `threads` threads: the
/// best of `passes` passes after a warm-up pass. To measure several kernels or thread counts,
/// reuse one `StreamBuffers`.
pub fn measure(kernel: Kernel, threads: usize, working_set_bytes: u64, passes: usize) -> Result<Measurement> {
    StreamBuffers::new(working_set_bytes)?.measure(kernel, threads, passes)
}

fn misaligned() -> Error {
    Error::Misaligned { what: "peak stream buffer".into(), offset: 0, align: 8 }
}

fn f32_words(storage: &mut HostStorage) -> Result<&mut [f32]> {
    let bytes = storage.bytes_mut().ok_or(Error::ReadOnly { op: "peak", tensor: "stream buffer" })?;
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| misaligned())
}

/// The length of each of `parts` contiguous parts of `len` elements: as equal as whole multiples of
/// 16 elements allow (the last part takes the rest; fewer parts if `len` is short).
fn part_len(len: usize, parts: usize) -> usize {
    len.div_ceil(parts.max(1)).next_multiple_of(16).max(16)
}

fn split<T>(s: &[T], parts: usize) -> Vec<&[T]> {
    s.chunks(part_len(s.len(), parts)).collect()
}

fn split_mut<T>(s: &mut [T], parts: usize) -> Vec<&mut [T]> {
    let len = part_len(s.len(), parts);
    s.chunks_mut(len).collect()
}

/// Parts of a thread's share the read kernel walks in lockstep: as many as the GEMV's rows
/// (`GEMV_ROWS`). On an AMD EPYC (Zen 3, family 25 model 1, 2 cores, 32 MiB L3; 2026-12-07)
/// 4 streams measured 26.0-34.6 GB/s on 2 threads and 8 streams 30.4-33.4 (six alternated runs
/// each, 10 passes; 8 ahead in five), while the bf16 GEMV measured up to 37 GB/s against the
/// 4-stream kernel's 31.1 in one bench run: 4 streams were not the ceiling there.
const READ_STREAMS: usize = 8;
/// u64 words per cache line.
const LINE_WORDS: usize = 8;

/// Wrapping sum of the words (associative, so any order is the same sum). The slice is walked as
/// `READ_STREAMS` equal parts in lockstep, a cache line of each per step, into eight independent
/// lanes per part: several streams of misses in flight, as the GEMV's rows keep, and adds the
/// compiler vectorises. On 2 threads of the development VM (2026-12-06) a single running sum
/// over one stream measured 22.2 GB/s, below the fast backend's GEMV, where a four-stream probe
/// measured 25-27 and this kernel 23.5 in the next bench run.
fn sum_words(words: &[u64]) -> u64 {
    let part = words.len() / READ_STREAMS / LINE_WORDS * LINE_WORDS;
    let (body, rest) = words.split_at(part * READ_STREAMS);
    let mut acc = [[0u64; LINE_WORDS]; READ_STREAMS];
    let mut i = 0;
    while i < part {
        for (s, lanes) in acc.iter_mut().enumerate() {
            let line = &body[s * part + i..s * part + i + LINE_WORDS];
            for (a, &w) in lanes.iter_mut().zip(line) {
                *a = a.wrapping_add(w);
            }
        }
        i += LINE_WORDS;
    }
    let lanes = acc.iter().flatten().fold(0u64, |a, &w| a.wrapping_add(w));
    rest.iter().fold(lanes, |a, &w| a.wrapping_add(w))
}

fn triad(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    for ((a, &b), &c) in a.iter_mut().zip(b).zip(c) {
        *a = b + s * c;
    }
}

// ---------------------------------------------------------------------------------------------
// Compute ceiling (estimated, not measured)

/// Where Linux lists the CPUs (`cpu*/topology/{core_id,physical_package_id}`).
pub const SYSFS_CPU_DIR: &str = "/sys/devices/system/cpu";

/// FMA units per core assumed by the estimate: two on every x86 core since Haswell / Zen 1 (one on
/// some server Skylakes with AVX-512, where the estimate is 2x high) and on Neoverse N1/V1 (4 on V2).
pub const FMA_PORTS: usize = 2;

/// A rough peak f32 FLOP/s of this CPU, the compute roof of "this machine". The CPU backends widen
/// bf16 and fp8 weights to f32 and multiply-add in f32, so f32 FMA throughput is their roof:
///
/// `flops_per_s = cores x GHz x 1e9 x FMA ports x f32 lanes x 2` (an FMA is 2 FLOPs),
///
/// with physical cores from sysfs topology, the clock the fastest `cpu MHz` of `/proc/cpuinfo`
/// (or cpufreq's `cpuinfo_max_freq`), lanes from the SIMD detected at run time, and
/// [`FMA_PORTS`] assumed. Estimated, never measured: turbo under all-core load, AVX-512 clock
/// offsets and one-port parts all make the real figure lower.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct FlopsEstimate {
    pub cores: usize,
    pub ghz: f64,
    pub fma_ports: usize,
    pub f32_lanes: usize,
    pub flops_per_s: f64,
}

impl FlopsEstimate {
    /// The estimate for the given figures (the formula above).
    pub fn new(cores: usize, ghz: f64, fma_ports: usize, f32_lanes: usize) -> FlopsEstimate {
        let flops_per_s = cores as f64 * ghz * 1e9 * fma_ports as f64 * f32_lanes as f64 * 2.0;
        FlopsEstimate { cores, ghz, fma_ports, f32_lanes, flops_per_s }
    }

    /// `cores x GHz x ports x lanes x 2 = GFLOP/s`, for reports.
    pub fn formula(&self) -> String {
        format!(
            "{} cores x {:.2} GHz x {} FMA ports x {} f32 lanes x 2 = {:.0} GFLOP/s (estimated)",
            self.cores,
            self.ghz,
            self.fma_ports,
            self.f32_lanes,
            self.flops_per_s / 1e9
        )
    }
}

/// f32 lanes of the widest FMA-capable vector unit detected at run time: AVX-512F 16, AVX2 + FMA 8,
/// NEON 4, otherwise 4 (SSE's width, with the multiply and add counted as one FMA).
pub fn simd_f32_lanes() -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return 16;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return 8;
        }
    }
    4
}

/// The fastest `cpu MHz` in `/proc/cpuinfo`-formatted text, in GHz.
pub fn parse_cpuinfo_ghz(text: &str) -> Option<f64> {
    text.lines()
        .filter_map(|l| {
            let (key, value) = l.split_once(':')?;
            (key.trim() == "cpu MHz").then(|| value.trim().parse::<f64>().ok()).flatten()
        })
        .filter(|mhz| mhz.is_finite() && *mhz > 0.0)
        .fold(None, |best: Option<f64>, mhz| Some(best.map_or(mhz, |b| b.max(mhz))))
        .map(|mhz| mhz / 1e3)
}

/// Physical cores under a sysfs CPU directory: distinct (`physical_package_id`, `core_id`) pairs
/// of the `cpuN` entries. `None` if none is readable.
pub fn physical_cores_from_sysfs(dir: &Path) -> Option<usize> {
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    let mut cores = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let name = entry.file_name();
        let Some(n) = name.to_str().and_then(|n| n.strip_prefix("cpu")) else { continue };
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let topo = entry.path().join("topology");
        if let (Some(pkg), Some(core)) = (read(topo.join("physical_package_id")), read(topo.join("core_id")))
        {
            cores.insert((pkg, core));
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// This machine's estimated f32 FMA peak; `None` where the clock cannot be read. Cores are the
/// physical cores this process may use (sysfs, capped by the threads it is allowed).
pub fn estimate_peak_flops() -> Option<FlopsEstimate> {
    let threads = max_threads();
    let cores = physical_cores_from_sysfs(Path::new(SYSFS_CPU_DIR)).map_or(threads, |c| c.min(threads));
    let ghz =
        std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|t| parse_cpuinfo_ghz(&t)).or_else(|| {
            let khz = std::fs::read_to_string(Path::new(SYSFS_CPU_DIR).join("cpu0/cpufreq/cpuinfo_max_freq"))
                .ok()?;
            khz.trim().parse::<f64>().ok().filter(|k| *k > 0.0).map(|k| k / 1e6)
        })?;
    Some(FlopsEstimate::new(cores, ghz, FMA_PORTS, simd_f32_lanes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sysfs_cache_sizes() {
        assert_eq!(parse_cache_size("32768K"), Some(32 << 20));
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("480M"), Some(480 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size(""), None);
        assert_eq!(parse_cache_size("K"), None);
        assert_eq!(parse_cache_size("12Q"), None);
        assert_eq!(parse_cache_size("-1K"), None);
        assert_eq!(parse_cache_size("99999999999999999999G"), None);
        assert_eq!(parse_cache_size("18446744073709551615K"), None);
    }

    /// A sysfs-like cache directory in a fresh temporary folder.
    struct FakeSysfs(std::path::PathBuf);

    impl FakeSysfs {
        fn new(tag: &str, entries: &[(&str, &str, &str, &str)]) -> Self {
            let dir = std::env::temp_dir().join(format!("memwall-peak-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            for (name, level, kind, size) in entries {
                let d = dir.join(name);
                std::fs::create_dir_all(&d).expect("create fake sysfs dir");
                std::fs::write(d.join("level"), format!("{level}\n")).expect("write level");
                std::fs::write(d.join("type"), format!("{kind}\n")).expect("write type");
                std::fs::write(d.join("size"), format!("{size}\n")).expect("write size");
            }
            std::fs::create_dir_all(&dir).expect("create fake sysfs root");
            FakeSysfs(dir)
        }
    }

    impl Drop for FakeSysfs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn llc_is_the_largest_level() {
        let fake = FakeSysfs::new(
            "epyc",
            &[
                ("index0", "1", "Data", "32K"),
                ("index1", "1", "Instruction", "32K"),
                ("index2", "2", "Unified", "1024K"),
                ("index3", "3", "Unified", "32768K"),
            ],
        );
        assert_eq!(llc_from_sysfs(&fake.0), Some(32 << 20));

        let big =
            FakeSysfs::new("big", &[("index0", "1", "Data", "48K"), ("index3", "3", "Unified", "480M")]);
        assert_eq!(llc_from_sysfs(&big.0), Some(480 << 20));

        // A larger L2 must not beat a smaller L3; an unreadable entry is skipped.
        let odd = FakeSysfs::new(
            "odd",
            &[
                ("index2", "2", "Unified", "4096K"),
                ("index3", "3", "Unified", "2048K"),
                ("index4", "x", "Unified", "9G"),
            ],
        );
        assert_eq!(llc_from_sysfs(&odd.0), Some(2 << 20));

        let empty = FakeSysfs::new("empty", &[]);
        assert_eq!(llc_from_sysfs(&empty.0), None);
        assert_eq!(llc_from_sysfs(Path::new("/nonexistent/memwall")), None);
    }

    #[test]
    fn working_set_is_at_least_three_llc_and_one_gib() {
        for llc in [None, Some(0), Some(1 << 20), Some(32 << 20), Some(480 << 20), Some(4 << 30)] {
            let ws = working_set_for(llc);
            assert!(ws >= MIN_WORKING_SET, "{llc:?}: {ws}");
            if let Some(l) = llc {
                assert!(ws >= 3 * l, "{llc:?}: {ws}");
            }
        }
        assert_eq!(working_set_for(Some(32 << 20)), 1 << 30);
        assert_eq!(working_set_for(Some(480 << 20)), 1440 << 20);
        assert_eq!(working_set_for(Some(u64::MAX)), u64::MAX);
        // This machine, whatever it is.
        let ws = working_set_bytes();
        assert!(ws >= MIN_WORKING_SET);
        if let Some(l) = llc_bytes() {
            assert!(ws >= 3 * l);
        }
    }

    #[test]
    fn bytes_per_pass_counts_reads_and_writes() {
        assert_eq!(Kernel::Read.bytes_per_pass(1000), 1000);
        assert_eq!(Kernel::Copy.bytes_per_pass(1000), 2000);
        assert_eq!(Kernel::Triad.bytes_per_pass(1000), 3000);
        for k in Kernel::ALL {
            assert_eq!(Kernel::from_name(k.name()), Some(k));
        }
        assert_eq!(Kernel::from_name("scale"), None);
    }

    #[test]
    fn buffers_cover_the_working_set_and_every_kernel_moves_all_of_it() {
        let ws = 3 * 1000 * 1000 + 17;
        let mut buf = StreamBuffers::new(ws).expect("allocate");
        assert!(buf.bytes() >= ws && buf.bytes() < ws + BUFFER_GRAIN);
        assert_eq!(buf.bytes() % BUFFER_GRAIN, 0);
        for k in Kernel::ALL {
            assert_eq!(buf.bytes_per_pass(k), buf.bytes(), "{k}");
        }
        // Filled with non-zero values, no two pages alike.
        let words = f32_words(&mut buf.storage).expect("words");
        assert!(words.iter().all(|&w| (1.0..2.0).contains(&w)));
        let mut pages: Vec<&[f32]> = words.chunks(1024).collect();
        pages.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
        assert!(pages.windows(2).all(|p| p[0] != p[1]), "two pages alike");
    }

    #[test]
    fn kernels_compute_what_they_claim() {
        let mut buf = StreamBuffers::new(BUFFER_GRAIN * 3).expect("allocate");
        let pool = thread_pool(3).expect("pool");
        let n = buf.bytes() as usize / 4;

        buf.pass(Kernel::Copy, &pool).expect("copy");
        let w = f32_words(&mut buf.storage).expect("words");
        assert_eq!(w[..n / 2], w[n / 2..]);

        buf.pass(Kernel::Triad, &pool).expect("triad");
        let w = f32_words(&mut buf.storage).expect("words");
        let third = n / 3;
        for i in 0..third {
            assert_eq!(w[i], w[third + i] + 3.0 * w[2 * third + i], "element {i}");
        }
        buf.pass(Kernel::Read, &pool).expect("read");
    }

    #[test]
    fn split_covers_every_element_once_in_order() {
        let v: Vec<u32> = (0..1000).collect();
        for parts in 1..9 {
            let p = split(&v, parts);
            assert!(p.len() <= parts);
            assert_eq!(p.concat(), v);
        }
        assert_eq!(sum_words(&[u64::MAX, 2, 3]), 4);
        // Every length around the streams' lines, against a plain sum.
        for len in [0, 1, 31, 32, 33, 63, 64, 65, 1000, 4097] {
            let w: Vec<u64> = (0..len as u64).map(|i| mix64(i) | 1 << 63).collect();
            let want = w.iter().fold(0u64, |a, &x| a.wrapping_add(x));
            assert_eq!(sum_words(&w), want, "{len} words");
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(matches!(thread_pool(0), Err(Error::Argument { .. })));
        assert!(matches!(StreamBuffers::new(0), Err(Error::Argument { .. })));
        let mut buf = StreamBuffers::new(BUFFER_GRAIN).expect("allocate");
        assert!(matches!(buf.measure(Kernel::Read, 1, 0), Err(Error::Argument { .. })));
        assert!(matches!(measure(Kernel::Read, 0, BUFFER_GRAIN, 1), Err(Error::Argument { .. })));
        assert_eq!(gb_per_s(1000, Duration::ZERO), 0.0);
        assert_eq!(gb_per_s(2_000_000_000, Duration::from_secs(1)), 2.0);
    }

    #[test]
    fn flops_estimate_is_the_formula() {
        let e = FlopsEstimate::new(8, 3.0, 2, 8);
        assert_eq!(e.flops_per_s, 8.0 * 3.0e9 * 2.0 * 8.0 * 2.0);
        assert!(e.formula().contains("8 cores x 3.00 GHz x 2 FMA ports x 8 f32 lanes x 2 = 768 GFLOP/s"));
        assert!([4, 8, 16].contains(&simd_f32_lanes()));
        let text = "processor\t: 0\ncpu MHz\t\t: 2400.000\nprocessor\t: 1\ncpu MHz\t\t: 3100.5\nflags: x\n";
        assert_eq!(parse_cpuinfo_ghz(text), Some(3.1005));
        assert_eq!(parse_cpuinfo_ghz("cpu MHz : fast\n"), None);
        assert_eq!(parse_cpuinfo_ghz(""), None);
    }

    #[test]
    fn physical_cores_count_distinct_core_ids() {
        let dir = std::env::temp_dir().join(format!("memwall-peak-topo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // Two cores with two SMT threads each, and entries that are not CPUs.
        for (cpu, core) in [("cpu0", "0"), ("cpu1", "1"), ("cpu2", "0"), ("cpu3", "1")] {
            let t = dir.join(cpu).join("topology");
            std::fs::create_dir_all(&t).expect("topology dir");
            std::fs::write(t.join("core_id"), format!("{core}\n")).expect("core_id");
            std::fs::write(t.join("physical_package_id"), "0\n").expect("package");
        }
        std::fs::create_dir_all(dir.join("cpufreq")).expect("other dir");
        std::fs::create_dir_all(dir.join("cpuidle")).expect("other dir");
        assert_eq!(physical_cores_from_sysfs(&dir), Some(2));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(physical_cores_from_sysfs(Path::new("/nonexistent/memwall")), None);
    }
}

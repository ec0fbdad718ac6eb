//! `HipDevice`: an AMD GPU through the HIP runtime (hip-sys, feature `hip`: links libamdhip64,
//! which Debian's libamdhip64-dev or a ROCm install provides). Its launch code has the shape of
//! [`super::cuda::CudaDevice`]'s:
//!
//! - Kernels: the code objects the root crate's `build.rs` compiled with clang (`build/hip.rs`),
//!   one per kernel file and gfx target; the device's `gcnArchName` (`gfx942:sramecc+:xnack-`)
//!   names the target, and only its code objects are loaded. A device whose target the build did
//!   not compile for is an error naming both.
//! - Launches go through `hipModuleLaunchKernel` with the params struct as the one kernel
//!   argument. All work goes to one stream, in order. AMD GPUs give every block 64 KiB of shared
//!   memory without opting in, and `DeviceInfo::max_shared_per_block` says so to the launchers.
//! - Memory: `hipMalloc` (256-byte aligned), zero-filled on the stream; out of memory is
//!   [`Error::OutOfMemory`] with the size asked for and the free memory left.
//!
//! Unverified: no AMD GPU exists where this was written; it is compiled and its no-device path
//! tested.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::sync::Mutex;

use hip_sys::hiprt as sys;

use super::{Device, DeviceInfo, KernelImage, LaunchCfg, Vendor, check_range};
use crate::{Error, Result};

fn device_err(msg: impl Into<String>) -> Error {
    Error::Device { device: "hip".into(), msg: msg.into() }
}

fn check(what: &str, e: sys::hipError_t) -> Result<()> {
    if e == sys::hipError_t::hipSuccess {
        return Ok(());
    }
    // SAFETY: both return static NUL-terminated strings for any code.
    let (name, text) = unsafe {
        (
            CStr::from_ptr(sys::hipGetErrorName(e)).to_string_lossy().into_owned(),
            CStr::from_ptr(sys::hipGetErrorString(e)).to_string_lossy().into_owned(),
        )
    };
    Err(device_err(format!("{what}: {name} ({text})")))
}

/// Device memory on an AMD GPU; freed on drop.
#[derive(Debug)]
pub struct HipBuffer {
    ptr: *mut c_void,
    len: usize,
}

// SAFETY: a device address, usable from any thread of the process (HIP's device memory is not
// bound to a thread).
unsafe impl Send for HipBuffer {}
unsafe impl Sync for HipBuffer {}

impl Drop for HipBuffer {
    fn drop(&mut self) {
        // hipFree waits for the work using it; an error here has nowhere to go.
        // SAFETY: allocated by hipMalloc, freed once.
        let _ = unsafe { sys::hipFree(self.ptr) };
    }
}

struct Module {
    file: String,
    module: sys::hipModule_t,
}

// SAFETY: modules and functions are process-wide handles of the device.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

#[derive(Clone, Copy)]
struct Function(sys::hipFunction_t);
// SAFETY: as above.
unsafe impl Send for Function {}

/// An AMD GPU.
pub struct HipDevice {
    info: DeviceInfo,
    ordinal: i32,
    /// The gfx target the loaded code objects were compiled for (`gfx942`).
    target: String,
    stream: sys::hipStream_t,
    modules: Vec<Module>,
    functions: Mutex<HashMap<&'static str, Function>>,
}

// SAFETY: the stream is used only through HIP calls, which are thread-safe; every method sets the
// device first.
unsafe impl Send for HipDevice {}
unsafe impl Sync for HipDevice {}

impl std::fmt::Debug for HipDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipDevice").field("info", &self.info).field("target", &self.target).finish()
    }
}

impl Drop for HipDevice {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: created and loaded by this device, destroyed once.
            unsafe {
                let _ = sys::hipStreamSynchronize(self.stream);
                for m in &self.modules {
                    let _ = sys::hipModuleUnload(m.module);
                }
                let _ = sys::hipStreamDestroy(self.stream);
            }
        }
    }
}

/// The number of AMD GPUs the HIP runtime sees, or an error naming why there are none.
pub fn device_count() -> Result<usize> {
    // SAFETY: plain queries.
    unsafe {
        check("no ROCm device: hipInit", sys::hipInit(0))?;
        let mut n = 0;
        check("no ROCm device: hipGetDeviceCount", sys::hipGetDeviceCount(&mut n))?;
        Ok(n.max(0) as usize)
    }
}

/// The gfx target of an arch name as the runtime reports it: `gfx942:sramecc+:xnack-` is `gfx942`.
pub fn gfx_target(arch_name: &str) -> &str {
    arch_name.split(':').next().unwrap_or(arch_name).trim()
}

/// (major, minor) of a gfx target: `gfx942` is (9, 4), `gfx90a` (9, 0), `gfx1100` (11, 0).
pub fn gfx_version(target: &str) -> Option<(u32, u32)> {
    let digits = target.strip_prefix("gfx")?;
    // The last two characters are the minor and stepping digits (hex), the rest the major.
    if digits.len() < 3 {
        return None;
    }
    let (major, rest) = digits.split_at(digits.len() - 2);
    let major = major.parse().ok()?;
    let minor = u32::from_str_radix(&rest[..1], 16).ok()?;
    Some((major, minor))
}

fn c_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl HipDevice {
    /// Device `ordinal` with the code objects of `images` for its gfx target.
    pub fn new(ordinal: usize, images: &[KernelImage]) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(device_err(format!("no ROCm device {ordinal}: {count} present")));
        }
        let id = ordinal as i32;
        // SAFETY: a valid device id.
        unsafe { check("hipSetDevice", sys::hipSetDevice(id))? };
        let (info, arch_name) = query_info(id)?;
        let target = gfx_target(&arch_name).to_string();
        let mine: Vec<&KernelImage> =
            images.iter().filter(|i| i.targets.contains(&target.as_str())).collect();
        if mine.is_empty() {
            let mut built: Vec<&str> = images.iter().flat_map(|i| i.targets.iter().copied()).collect();
            built.sort_unstable();
            built.dedup();
            return Err(device_err(format!(
                "no code objects for {target} ({}): the build compiled for {built:?} (MEMWALL_HIP_ARCHS)",
                info.name
            )));
        }
        let mut stream: sys::hipStream_t = std::ptr::null_mut();
        // SAFETY: creates a non-blocking stream on the current device.
        unsafe { check("creating a stream", sys::hipStreamCreateWithFlags(&mut stream, 1))? };
        let mut dev = HipDevice {
            info,
            ordinal: id,
            target,
            stream,
            modules: Vec::new(),
            functions: Mutex::new(HashMap::new()),
        };
        for image in mine {
            dev.load(image.name, image.fatbin)?;
        }
        Ok(dev)
    }

    fn load(&mut self, file: &str, image: &[u8]) -> Result<()> {
        // An 8-byte-aligned copy of the ELF for the loader.
        let mut aligned = vec![0u64; image.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..image.len()].copy_from_slice(image);
        let mut module: sys::hipModule_t = std::ptr::null_mut();
        // SAFETY: `aligned` holds the whole code object for the call.
        unsafe {
            check(
                &format!("loading the kernels of {file} for {}", self.target),
                sys::hipModuleLoadData(&mut module, aligned.as_ptr().cast()),
            )?
        };
        self.modules.push(Module { file: file.to_string(), module });
        Ok(())
    }

    /// The gfx target of the loaded code objects.
    pub fn target(&self) -> &str {
        &self.target
    }

    fn bind(&self) -> Result<()> {
        // SAFETY: a valid device id (checked at construction).
        unsafe { check("hipSetDevice", sys::hipSetDevice(self.ordinal)) }
    }

    fn function(&self, name: &'static str) -> Result<Function> {
        let mut cache = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = cache.get(name) {
            return Ok(*f);
        }
        let cname =
            CString::new(name).map_err(|_| device_err(format!("kernel name {name:?} holds a NUL")))?;
        for m in &self.modules {
            let mut f: sys::hipFunction_t = std::ptr::null_mut();
            // SAFETY: a live module; `f` is valid for the write.
            let rc = unsafe { sys::hipModuleGetFunction(&mut f, m.module, cname.as_ptr()) };
            if rc == sys::hipError_t::hipSuccess {
                cache.insert(name, Function(f));
                return Ok(Function(f));
            }
        }
        let files: Vec<&str> = self.modules.iter().map(|m| m.file.as_str()).collect();
        Err(device_err(format!("no kernel named {name} in {files:?} for {}", self.target)))
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: the outputs are valid for writes.
        unsafe { check("hipMemGetInfo", sys::hipMemGetInfo(&mut free, &mut total))? };
        Ok((free, total))
    }

    /// Seconds the work `f` queues takes on the device, from two events recorded around it on
    /// the stream (`hipEventElapsedTime`, about 1 us resolution): what the peak measurement and
    /// the benches time.
    pub fn time(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        self.bind()?;
        let start = Event::new()?;
        let end = Event::new()?;
        // SAFETY: live events and this device's stream.
        unsafe { check("recording an event", sys::hipEventRecord(start.0, self.stream))? };
        f()?;
        let mut ms = 0f32;
        // SAFETY: as above; `ms` is valid for the write.
        unsafe {
            check("recording an event", sys::hipEventRecord(end.0, self.stream))?;
            check("waiting for an event", sys::hipEventSynchronize(end.0))?;
            check("timing events", sys::hipEventElapsedTime(&mut ms, start.0, end.0))?;
        }
        Ok(f64::from(ms) / 1e3)
    }

    /// Copies all of `src` to the start of `dst` on the stream (`hipMemcpyDtoDAsync`): the
    /// device's copy ceiling, as `memwall peak` measures it.
    pub fn copy(&self, dst: &mut HipBuffer, src: &HipBuffer) -> Result<()> {
        check_range(self.name(), "copy", 0, src.len, dst.len)?;
        self.bind()?;
        // SAFETY: both ranges lie inside live buffers of this device.
        unsafe {
            check(
                &format!("copying {} bytes on the device", src.len),
                sys::hipMemcpyDtoDAsync(dst.ptr, src.ptr, src.len, self.stream),
            )
        }
    }
}

/// A HIP event, destroyed on drop.
struct Event(sys::hipEvent_t);

impl Event {
    fn new() -> Result<Event> {
        let mut e: sys::hipEvent_t = std::ptr::null_mut();
        // SAFETY: `e` is valid for the write.
        unsafe { check("creating an event", sys::hipEventCreate(&mut e))? };
        Ok(Event(e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by hipEventCreate, destroyed once; an error has nowhere to go.
        let _ = unsafe { sys::hipEventDestroy(self.0) };
    }
}

fn query_info(id: i32) -> Result<(DeviceInfo, String)> {
    // hipGetDeviceProperties writes the struct of the runtime it links; ROCm 6's is larger than
    // the HIP 5.4 layout of the bindings, so give it room beyond the struct (the fields read here
    // sit at the same offsets in both).
    let words = std::mem::size_of::<sys::hipDeviceProp_t>().div_ceil(8) + 1024;
    let mut raw = vec![0u64; words];
    let p = raw.as_mut_ptr().cast::<sys::hipDeviceProp_t>();
    // SAFETY: `raw` is zeroed, 8-byte aligned and larger than the struct.
    let props = unsafe {
        check("hipGetDeviceProperties", sys::hipGetDeviceProperties(p, id))?;
        &*p
    };
    let arch_name = c_string(&props.gcnArchName);
    let target = gfx_target(&arch_name).to_string();
    let info = DeviceInfo {
        name: format!("{} ({target})", c_string(&props.name)),
        vendor: Vendor::Amd,
        arch: gfx_version(&target).unwrap_or((props.major.max(0) as u32, props.minor.max(0) as u32)),
        warp_size: props.warpSize.max(0) as u32,
        sm_count: props.multiProcessorCount.max(0) as u32,
        max_shared_per_block: props.sharedMemPerBlock.min(u32::MAX as usize) as u32,
        max_threads_per_block: props.maxThreadsPerBlock.max(0) as u32,
        max_grid: props.maxGridSize.map(|g| g.max(0) as u32),
        total_memory: props.totalGlobalMem as u64,
    };
    Ok((info, arch_name))
}

impl Device for HipDevice {
    type Buffer = HipBuffer;

    fn name(&self) -> &'static str {
        "hip"
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: usize) -> Result<HipBuffer> {
        self.bind()?;
        let size = bytes.max(1);
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: a plain allocation on the current device.
        let rc = unsafe { sys::hipMalloc(&mut ptr, size) };
        if rc == sys::hipError_t::hipErrorOutOfMemory {
            let free = self.memory().map(|(f, _)| f).unwrap_or(0);
            return Err(Error::OutOfMemory {
                device: format!("hip ({})", self.info.name),
                bytes: size,
                reason: format!("hipMalloc: {free} bytes free of {}", self.info.total_memory),
            });
        }
        check(&format!("allocating {size} bytes"), rc)?;
        let buf = HipBuffer { ptr, len: size };
        // SAFETY: `buf` is `size` bytes; the memset is ordered before later work on the stream.
        unsafe { check("zero-filling a new buffer", sys::hipMemsetAsync(ptr, 0, size, self.stream))? };
        Ok(buf)
    }

    fn len(buf: &HipBuffer) -> usize {
        buf.len
    }

    fn address(buf: &HipBuffer) -> u64 {
        buf.ptr as u64
    }

    fn write(&self, dst: &mut HipBuffer, offset: usize, bytes: &[u8]) -> Result<()> {
        check_range(self.name(), "write", offset, bytes.len(), dst.len)?;
        if bytes.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range lies inside `dst`. HIP stages pageable host memory before the call
        // returns, so `bytes` may be reused; the runtime does not write through `src`.
        unsafe {
            check(
                &format!("copying {} bytes to the device", bytes.len()),
                sys::hipMemcpyHtoDAsync(
                    dst.ptr.cast::<u8>().add(offset).cast(),
                    bytes.as_ptr() as *mut c_void,
                    bytes.len(),
                    self.stream,
                ),
            )
        }
    }

    fn zero(&self, dst: &mut HipBuffer, offset: usize, len: usize) -> Result<()> {
        check_range(self.name(), "zero", offset, len, dst.len)?;
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range lies inside `dst`; the memset is ordered on the stream.
        unsafe {
            check(
                &format!("zero-filling {len} bytes"),
                sys::hipMemsetAsync(dst.ptr.cast::<u8>().add(offset).cast(), 0, len, self.stream),
            )
        }
    }

    fn read(&self, src: &HipBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(self.name(), "read", offset, out.len(), src.len)?;
        if out.is_empty() {
            return self.synchronize();
        }
        self.bind()?;
        // SAFETY: the range lies inside `src`; the stream is synchronised before `out` is used.
        unsafe {
            check(
                &format!("copying {} bytes from the device", out.len()),
                sys::hipMemcpyDtoHAsync(
                    out.as_mut_ptr().cast(),
                    src.ptr.cast::<u8>().add(offset).cast(),
                    out.len(),
                    self.stream,
                ),
            )?
        };
        self.synchronize()
    }

    unsafe fn launch(&self, name: &'static str, cfg: LaunchCfg, params: &[u8]) -> Result<()> {
        self.bind()?;
        let func = self.function(name)?;
        // The kernel's one parameter is the params struct; HIP copies it when the launch is
        // queued. (hipModuleLaunchKernel has no query of a kernel's params size: the mirrors are
        // checked against the C++ layouts by tests/simt.rs instead.)
        let mut args = [params.as_ptr() as *mut c_void];
        // SAFETY: the caller guarantees the params are kernel `name`'s and point into live
        // buffers of this device.
        unsafe {
            check(
                &format!("launching {name} grid {:?} block {:?}", cfg.grid, cfg.block),
                sys::hipModuleLaunchKernel(
                    func.0,
                    cfg.grid[0],
                    cfg.grid[1],
                    cfg.grid[2],
                    cfg.block[0],
                    cfg.block[1],
                    cfg.block[2],
                    cfg.shared_bytes,
                    self.stream,
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
            )
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: a live stream of this device.
        unsafe {
            check(
                "synchronising the stream (a kernel may have faulted)",
                sys::hipStreamSynchronize(self.stream),
            )
        }
    }

    type Graph = HipGraph;

    /// Thread-local capture mode, as on CUDA.
    fn begin_capture(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: a live stream of this device.
        unsafe {
            check(
                "beginning a graph capture",
                sys::hipStreamBeginCapture(
                    self.stream,
                    sys::hipStreamCaptureMode::hipStreamCaptureModeThreadLocal,
                ),
            )
        }
    }

    fn end_capture(&self) -> Result<HipGraph> {
        self.bind()?;
        let mut graph: sys::hipGraph_t = std::ptr::null_mut();
        // SAFETY: a live stream of this device; `graph` is valid for the write.
        unsafe { check("ending the graph capture", sys::hipStreamEndCapture(self.stream, &mut graph))? };
        if graph.is_null() {
            return Err(device_err("the graph capture recorded no work"));
        }
        let mut exec: sys::hipGraphExec_t = std::ptr::null_mut();
        // SAFETY: `graph` was just captured; no error node or log is asked for.
        let made = unsafe {
            check(
                "instantiating the graph",
                sys::hipGraphInstantiate(&mut exec, graph, std::ptr::null_mut(), std::ptr::null_mut(), 0),
            )
        };
        if let Err(e) = made {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { sys::hipGraphDestroy(graph) };
            return Err(e);
        }
        Ok(HipGraph { graph, exec })
    }

    fn replay(&self, graph: &HipGraph) -> Result<()> {
        self.bind()?;
        // SAFETY: an instantiated graph of this device and its stream.
        unsafe { check("replaying a graph", sys::hipGraphLaunch(graph.exec, self.stream)) }
    }
}

/// A recorded sequence of launches ([`Device::end_capture`]): a HIP graph and its executable
/// instance, destroyed on drop.
pub struct HipGraph {
    graph: sys::hipGraph_t,
    exec: sys::hipGraphExec_t,
}

// SAFETY: graphs are process-wide handles, used only through HIP calls, which are thread-safe.
unsafe impl Send for HipGraph {}
unsafe impl Sync for HipGraph {}

impl Drop for HipGraph {
    fn drop(&mut self) {
        // SAFETY: created by end_capture, destroyed once; an error has nowhere to go.
        unsafe {
            let _ = sys::hipGraphExecDestroy(self.exec);
            let _ = sys::hipGraphDestroy(self.graph);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gfx_names() {
        assert_eq!(gfx_target("gfx942:sramecc+:xnack-"), "gfx942");
        assert_eq!(gfx_target("gfx90a"), "gfx90a");
        assert_eq!(gfx_version("gfx942"), Some((9, 4)));
        assert_eq!(gfx_version("gfx90a"), Some((9, 0)));
        assert_eq!(gfx_version("gfx1100"), Some((11, 0)));
        assert_eq!(gfx_version("sm_90"), None);
        assert_eq!(gfx_version("gfx9"), None);
    }

    /// No AMD GPU here: the runtime (libamdhip64) is linked, the device is missing, and that is an
    /// error, never a panic. With MEMWALL_REQUIRE_GPU=1 (a ROCm machine) a device must exist.
    #[test]
    fn missing_device_is_an_error() {
        eprintln!("device_count: {:?}", device_count());
        match device_count() {
            Ok(n) if n > 0 => {}
            Ok(_) | Err(_) if std::env::var("MEMWALL_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
                panic!("MEMWALL_REQUIRE_GPU=1 but no ROCm device: {:?}", device_count())
            }
            Ok(_) => assert!(HipDevice::new(0, &[]).is_err()),
            Err(e) => {
                assert!(e.to_string().contains("no ROCm device"), "{e}");
                assert!(HipDevice::new(0, &[]).is_err());
            }
        }
    }
}

//! Compiling the embedded kernel sources at run time with NVRTC (feature `cuda`), for a build
//! that found no nvcc: each `.cu` file becomes one cubin for the device's exact target, with the
//! embedded headers handed to NVRTC by name, so nothing is read from disk.
//!
//! The flags follow `build/nvcc.rs` (`-O3`, C++17, no fast math), so both paths compile the same
//! code; the only difference is `__CUDACC_RTC__`, under which `common.cuh` defines the fixed-width
//! integer types NVRTC's missing C library would have supplied.

use std::ffi::{CStr, CString, c_char};
use std::ptr;

use cudarc::nvrtc::sys;

use super::KernelSource;
use crate::{Error, Result};

fn err(file: &str, msg: impl Into<String>) -> Error {
    Error::Device { device: "cuda".into(), msg: format!("NVRTC, {file}: {}", msg.into()) }
}

/// Whether the NVRTC library can be loaded (cudarc panics on a missing library: probe first).
pub fn available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// The NVRTC target of compute capability `(major, minor)`: the arch-specific `sm_90a` on 9.0
/// (wgmma and friends), `sm_XY` elsewhere.
pub fn target(arch: (u32, u32)) -> String {
    match arch {
        (9, 0) => "sm_90a".into(),
        (major, minor) => format!("sm_{major}{minor}"),
    }
}

/// The `.cu` files of `sources` that hold runtime kernels (not the SIMT layer's self-tests).
pub fn kernel_files(sources: &[KernelSource]) -> impl Iterator<Item = &KernelSource> {
    sources.iter().filter(|s| s.name.ends_with(".cu") && !s.name.starts_with("selftest"))
}

struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        unsafe {
            sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn check(file: &str, what: &str, r: sys::nvrtcResult) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static string for every result code.
    let name = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(r)) }.to_string_lossy().into_owned();
    Err(err(file, format!("{what}: {name}")))
}

/// Compiles `file` (a `.cu` of `sources`) into a cubin for `target` (`sm_90a`); the compile log
/// is in the error.
pub fn compile(sources: &[KernelSource], file: &str, target: &str) -> Result<Vec<u8>> {
    if !available() {
        return Err(err(file, "libnvrtc not found (install CUDA 13's NVRTC or build with nvcc)"));
    }
    let main = sources.iter().find(|s| s.name == file).ok_or_else(|| err(file, "no such embedded source"))?;
    let cstr = |s: &str| CString::new(s).map_err(|_| err(file, "a source holds a NUL byte"));
    let src = cstr(main.source)?;
    let name = cstr(main.name)?;
    let headers: Vec<(CString, CString)> = sources
        .iter()
        .filter(|s| !s.name.ends_with(".cu"))
        .map(|s| Ok((cstr(s.source)?, cstr(s.name)?)))
        .collect::<Result<_>>()?;
    let header_src: Vec<*const c_char> = headers.iter().map(|(s, _)| s.as_ptr()).collect();
    let header_names: Vec<*const c_char> = headers.iter().map(|(_, n)| n.as_ptr()).collect();
    let mut prog = ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated string for the call; the arrays hold
    // `headers.len()` entries.
    check(file, "create", unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            headers.len() as i32,
            header_src.as_ptr(),
            header_names.as_ptr(),
        )
    })?;
    let prog = Program(prog);
    let options: Vec<CString> = [format!("--gpu-architecture={target}"), "-std=c++17".into()]
        .into_iter()
        .map(|o| CString::new(o).expect("options hold no NUL"))
        .collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `prog` is live; the options are live NUL-terminated strings.
    let compiled =
        unsafe { sys::nvrtcCompileProgram(prog.0, option_ptrs.len() as i32, option_ptrs.as_ptr()) };
    if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
        let log = program_log(&prog).unwrap_or_default();
        check(file, &format!("compile for {target}:\n{log}"), compiled)?;
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled for a real target, so it has a cubin of `size` bytes.
    check(file, "cubin size", unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) })?;
    let mut cubin = vec![0u8; size];
    check(file, "cubin", unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) })?;
    Ok(cubin)
}

fn program_log(prog: &Program) -> Option<String> {
    let mut size = 0usize;
    // SAFETY: `prog` is live; the buffer holds `size` bytes.
    unsafe {
        if sys::nvrtcGetProgramLogSize(prog.0, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS {
            return None;
        }
        let mut log = vec![0u8; size.max(1)];
        if sys::nvrtcGetProgramLog(prog.0, log.as_mut_ptr().cast()) != sys::nvrtcResult::NVRTC_SUCCESS {
            return None;
        }
        Some(String::from_utf8_lossy(&log).trim_end_matches('\0').trim_end().to_string())
    }
}

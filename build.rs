//! Builds the kernels of `kernels-cuda/` (and `kernels-hip/`) into what the root crate embeds:
//! - `embed`: the sources themselves, for NVRTC at first use where no image was built;
//! - `nvcc`: a fatbin per kernel file with SASS for every target and PTX for the newest, when nvcc
//!   is found (never by probing the build machine's GPU);
//! - `hip`: a code object per kernel file and AMD target (gfx90a, gfx942), when a HIP-capable
//!   clang (17 or newer) and ROCm device libraries are found;
//! - `simt` (feature `emulate`): the sources compiled as host C++ against `simt/`, linked in, so
//!   the kernels run on the CPU in tests.
//!
//! `MEMWALL_CHECK_ONLY=1` writes only what rustc type-checks against (the embedded sources, empty
//! image lists) and compiles no kernel: for `cargo clippy` / `cargo check` (scripts/lint.sh), which
//! never link. A build that links fails with it under `emulate` (no SIMT images).

#[path = "build/embed.rs"]
mod embed;
#[path = "build/hip.rs"]
mod hip;
#[path = "build/nvcc.rs"]
mod nvcc;
#[path = "build/simt.rs"]
mod simt;

use std::path::PathBuf;

/// `MEMWALL_CHECK_ONLY=1`: compile no kernel (nvcc, clang, the SIMT images); see the module doc.
fn check_only() -> bool {
    println!("cargo::rerun-if-env-changed=MEMWALL_CHECK_ONLY");
    std::env::var("MEMWALL_CHECK_ONLY").is_ok_and(|v| v == "1")
}

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("set by cargo"));
    println!("cargo::rerun-if-changed=build");
    embed::run(&root, &out);
    nvcc::run(&root, &out);
    hip::run(&root, &out);
    simt::run(&root, &out);
}

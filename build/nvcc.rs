//! nvcc: compiles each `kernels-cuda/*.cu` (but the SIMT-only `selftest*.cu`) into a fatbin with
//! SASS for every target and PTX for the newest one's plain architecture, and embeds it.
//!
//! - nvcc is found, in order, at `$NVCC`, `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, `nvcc` on
//!   the PATH, and the project's pinned PyPI install (`scripts/setup.sh`:
//!   `.tools/cuda/nvidia/cu13/bin/nvcc`). The build machine's GPU is never probed.
//! - Targets: `MEMWALL_CUDA_ARCHS` (comma-separated, default `sm_80,sm_90a`); PTX for the newest
//!   target without its `a` suffix (`compute_90` by default), which later GPUs JIT.
//! - Each kernel's ptxas resource report (`-Xptxas -v`) is kept in `OUT_DIR/cuda/<file>.ptxas.txt`;
//!   the build fails when a kernel spills registers, unless it is listed in [`SPILL_ALLOWED`] with
//!   its reason.
//! - Skipped (no fatbins; the CUDA backend then compiles the embedded sources with NVRTC) where no
//!   nvcc is found, with `MEMWALL_NVCC=0`, and for the AddressSanitizer build of the SIMT images
//!   (`MEMWALL_SIMT_ASAN=1`), which does not need them.
//!
//! Generates `cuda_fatbins.rs`: `CUDA_FATBINS: &[KernelImage]`, `CUDA_NVCC` (the nvcc used, if
//! any) and `CUDA_KERNELS`: for each image and SASS target, the kernels ptxas compiled.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Kernels allowed to spill, as (name pattern, most bytes of spills on any target: ptxas's spill
/// stores plus spill loads, as parse_ptxas counts them, why); `*`
/// in a pattern stands for any run of characters. Keep it short and justified. ptxas trades a few
/// bytes of spills for occupancy at its register steps (48, 80, 96, 128, 168 registers), and which
/// kernels it picks moves with every change; what matters is where the spills land, and
/// tests/cuda_build.rs checks in the SASS that no kernel's innermost streaming loop touches local
/// memory. So these are spills at row setup, once per row or per kernel.
const SPILL_ALLOWED: &[(&str, u64, &str)] = &[
    // Block-scaled GEMVs hold the scale row, the block-column cursor and the row tile's sums.
    ("gemv_*_block_*", 64, "row setup of the block-scaled GEMV"),
    // The fused gate/up GEMV's 4-row tile at e5m2 on sm_80 (software decode) spills around its
    // setup and its final reductions, outside the chunk loop.
    ("gate_up_silu_*_block_*_r4", 96, "setup and reductions of the block-scaled fused gate/up GEMV"),
    // The fused q/k/v GEMV selects its part's params per block (sm_90a, hardware fp8 decode).
    ("qkv_*_r1", 8, "row setup of the fused q/k/v GEMV"),
    // The experts' GEMVs select their expert's matrix and rows per block (as qkv its part), and
    // hold them beside the row tile's sums: up to 76 bytes for the block-scaled 16-row tile of a
    // 16-bit or f32 weight on sm_80, 52 elsewhere.
    ("experts_*", 96, "block setup of the experts' GEMVs"),
    // The sampling kernel's radix searches are latency-bound on an L2-resident row.
    ("sample_f32", 12, "outside the hot loop"),
];

/// Whether `name` matches `pattern` (`*`: any run of characters, possibly none).
fn glob(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => {
            let Some(tail) = name.strip_prefix(head) else { return false };
            (0..=tail.len()).any(|i| tail.is_char_boundary(i) && glob(rest, &tail[i..]))
        }
    }
}

/// Whether `kernel` may spill `bytes` (SPILL_ALLOWED).
fn spill_allowed(kernel: &str, bytes: u64) -> bool {
    SPILL_ALLOWED.iter().any(|&(pattern, most, _)| glob(pattern, kernel) && bytes <= most)
}

fn find_nvcc(root: &Path) -> Option<PathBuf> {
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    if let Some(p) = std::env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let p = PathBuf::from(home).join("bin/nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    if let Some(p) = std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).map(|d| d.join("nvcc")).find(|p| p.is_file()))
    {
        return Some(p);
    }
    let pinned = root.join(".tools/cuda/nvidia/cu13/bin/nvcc");
    println!("cargo::rerun-if-changed={}", pinned.display());
    pinned.is_file().then_some(pinned)
}

/// `sm_90a` -> (`compute_90a`, `sm_90a`); the newest target's plain PTX architecture.
fn gencode_args(archs: &[String]) -> Vec<String> {
    let mut args = Vec::new();
    for a in archs {
        let compute = a.replacen("sm_", "compute_", 1);
        args.push(format!("-gencode=arch={compute},code={a}"));
    }
    let newest = archs
        .iter()
        .map(|a| a.trim_start_matches("sm_").trim_end_matches('a').to_string())
        .max_by_key(|n| n.parse::<u32>().unwrap_or(0));
    if let Some(n) = newest {
        args.push(format!("-gencode=arch=compute_{n},code=compute_{n}"));
    }
    args
}

/// `(kernel, target, spill bytes)` for each entry ptxas compiled.
fn parse_ptxas(report: &str) -> Vec<(String, String, u64)> {
    let mut out: Vec<(String, String, u64)> = Vec::new();
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let mut parts = rest.split('\'');
            let name = parts.next().unwrap_or_default().to_string();
            let target = parts.nth(1).unwrap_or_default().to_string();
            out.push((name, target, 0));
        } else if line.contains("bytes spill stores") {
            let spill: u64 = line
                .split(',')
                .filter(|f| f.contains("spill"))
                .filter_map(|f| f.split_whitespace().next()?.parse::<u64>().ok())
                .sum();
            if let Some(last) = out.last_mut() {
                last.2 += spill;
            }
        }
    }
    out
}

struct Built {
    name: String,
    fatbin: PathBuf,
    kernels: Vec<(String, String, u64)>,
}

fn compile(
    nvcc: &Path,
    src_dir: &Path,
    file: &Path,
    out: &Path,
    gencode: &[String],
) -> Result<Built, String> {
    let stem = file.file_stem().and_then(|s| s.to_str()).expect("UTF-8 kernel names").to_string();
    let fatbin = out.join(format!("{stem}.fatbin"));
    let output = Command::new(nvcc)
        .current_dir(src_dir)
        .args(["-fatbin", "-O3", "-std=c++17", "-Xptxas", "-v", "-Werror", "all-warnings"])
        .args(gencode)
        .arg("-o")
        .arg(&fatbin)
        .arg(file)
        .output()
        .map_err(|e| format!("running {}: {e}", nvcc.display()))?;
    let report = String::from_utf8_lossy(&output.stderr).into_owned();
    fs::write(out.join(format!("{stem}.ptxas.txt")), &report).map_err(|e| e.to_string())?;
    if !output.status.success() {
        return Err(format!("nvcc failed on {}:\n{report}", file.display()));
    }
    Ok(Built { name: format!("{stem}.cu"), fatbin, kernels: parse_ptxas(&report) })
}

pub fn run(root: &Path, out: &Path) {
    println!("cargo::rerun-if-env-changed=MEMWALL_NVCC");
    println!("cargo::rerun-if-env-changed=MEMWALL_CUDA_ARCHS");
    println!("cargo::rerun-if-env-changed=MEMWALL_SIMT_ASAN");
    let skip = std::env::var("MEMWALL_NVCC").is_ok_and(|v| v == "0")
        || std::env::var("MEMWALL_SIMT_ASAN").is_ok_and(|v| v == "1")
        || crate::check_only();
    let nvcc = if skip { None } else { find_nvcc(root) };
    let mut code = String::from("// @generated by build.rs\n");
    let Some(nvcc) = nvcc else {
        code.push_str("pub const CUDA_FATBINS: &[KernelImage] = &[];\n");
        code.push_str("pub const CUDA_NVCC: Option<&str> = None;\n");
        code.push_str("pub const CUDA_KERNELS: &[(&str, &str, &[&str])] = &[];\n");
        fs::write(out.join("cuda_fatbins.rs"), code).expect("write cuda_fatbins.rs");
        return;
    };
    let archs: Vec<String> = std::env::var("MEMWALL_CUDA_ARCHS")
        .unwrap_or_else(|_| "sm_80,sm_90a".into())
        .split(',')
        .map(|a| a.trim().to_string())
        .filter(|a| !a.is_empty())
        .collect();
    let gencode = gencode_args(&archs);
    let src_dir = root.join("kernels-cuda");
    let dir = out.join("cuda");
    fs::create_dir_all(&dir).expect("create OUT_DIR/cuda");
    let files: Vec<PathBuf> = super::embed::kernel_files(&src_dir)
        .into_iter()
        .filter(|f| f.extension().is_some_and(|e| e == "cu") && f.parent() == Some(src_dir.as_path()))
        .filter(|f| !f.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("selftest")))
        .collect();
    // Two at a time: nvcc is single-threaded per file and the machines here have two cores.
    let mut built = Vec::new();
    for pair in files.chunks(2) {
        let results: Vec<Result<Built, String>> = std::thread::scope(|s| {
            let handles: Vec<_> =
                pair.iter().map(|f| s.spawn(|| compile(&nvcc, &src_dir, f, &dir, &gencode))).collect();
            handles.into_iter().map(|h| h.join().expect("nvcc thread")).collect()
        });
        for r in results {
            match r {
                Ok(b) => built.push(b),
                Err(e) => panic!("{e}"),
            }
        }
    }
    let spills: Vec<String> = built
        .iter()
        .flat_map(|b| &b.kernels)
        .filter(|(k, _, s)| *s > 0 && !spill_allowed(k, *s))
        .map(|(k, t, s)| format!("{k} ({t}): {s} bytes of spills"))
        .collect();
    if !spills.is_empty() {
        panic!("kernels spill registers (see OUT_DIR/cuda/*.ptxas.txt):\n{}", spills.join("\n"));
    }
    let targets: Vec<String> = archs.iter().map(|a| format!("{a:?}")).collect();
    code.push_str("pub const CUDA_FATBINS: &[KernelImage] = &[\n");
    for b in &built {
        code.push_str(&format!(
            "    KernelImage {{ name: {:?}, targets: &[{}], fatbin: include_bytes!({:?}) }},\n",
            b.name,
            targets.join(", "),
            b.fatbin.display().to_string()
        ));
    }
    code.push_str("];\n");
    code.push_str(&format!("pub const CUDA_NVCC: Option<&str> = Some({:?});\n", nvcc.display().to_string()));
    code.push_str("pub const CUDA_KERNELS: &[(&str, &str, &[&str])] = &[\n");
    for b in &built {
        for a in &archs {
            let names: Vec<String> =
                b.kernels.iter().filter(|(_, t, _)| t == a).map(|(k, _, _)| format!("{k:?}")).collect();
            code.push_str(&format!("    ({:?}, {a:?}, &[{}]),\n", b.name, names.join(", ")));
        }
    }
    code.push_str("];\n");
    fs::write(out.join("cuda_fatbins.rs"), code).expect("write cuda_fatbins.rs");
}

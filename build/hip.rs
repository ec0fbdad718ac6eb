//! hip: compiles the kernel files of `kernels-cuda/` as HIP (clang `-x hip`, device code only,
//! `kernels-hip/hip.h` as the vendor header) into one AMD GPU code object (an ELF, `.hsaco`) per
//! file and target, and embeds them.
//!
//! - clang is found, in order, at `$MEMWALL_HIP_CLANG`, `$ROCM_PATH/llvm/bin/clang++`,
//!   `/opt/rocm/llvm/bin/clang++`, then Debian's `clang++-N` (`/usr/lib/llvm-N/bin/clang++`, N from
//!   22 down to 17: gfx942 needs clang 17 or newer, so Debian bookworm's hipcc 5.2, which drives
//!   clang 15, is not used). The build machine's GPU is never probed.
//! - HIP headers: `--rocm-path` is `$ROCM_PATH`, `/opt/rocm`, or `/usr` (Debian's
//!   libamdhip64-dev), the first holding `include/hip/hip_runtime.h`. Device libraries (ocml,
//!   ockl): `$MEMWALL_HIP_DEVICE_LIBS`, `$ROCM_PATH/amdgcn/bitcode`, `/opt/rocm/amdgcn/bitcode`,
//!   or Debian's rocm-device-libs (`/usr/lib/x86_64-linux-gnu/amdgcn/bitcode`). Debian's 5.2
//!   libraries have no `oclc_isa_version_942.bc` (the one-constant file naming the ISA version the
//!   libraries branch on); where a target's file is missing it is generated (`llvm-as` from the
//!   same LLVM) into `OUT_DIR/hip/bitcode`, beside links to the others.
//! - Targets: `MEMWALL_HIP_ARCHS` (comma-separated, default `gfx90a,gfx942`: MI250 and MI300X).
//! - Flags: `-O3 -Werror -Wall -Wextra`, and `--gpu-max-threads-per-block=256`: kernels declared
//!   without launch bounds (MW_KERNEL) are then compiled for at most 256 threads (every launcher
//!   in runtime/src/gpu/ops/ uses at most 256) instead of HIP's default 1024, which would cap
//!   them at 128 VGPRs and spill the prefill attention to scratch.
//! - Each code object's metadata (`llvm-readelf --notes`) is kept in
//!   `OUT_DIR/hip/<file>.<target>.notes.txt`; the build fails when a kernel uses scratch
//!   (`.private_segment_fixed_size` > 0, VGPR spills, or a dynamic stack). SGPR spills go to VGPR
//!   lanes, not memory, and are allowed.
//! - Skipped (no code objects) where no clang is found, with `MEMWALL_HIP=0`, and for the
//!   AddressSanitizer build of the SIMT images (`MEMWALL_SIMT_ASAN=1`).
//!
//! Generates `hip_code_objects.rs`: `HIP_CODE_OBJECTS: &[KernelImage]` (one per file and target),
//! `HIP_CLANG` (the clang used, if any), `HIP_LLVM_BIN` (its tool folder: llvm-readelf,
//! llvm-objdump), `HIP_KERNELS`: for each file and target, the kernels in its code object, and
//! `HIP_LEFT_OUT_PREFIXES`: the kernel-name prefix (`<stem>_`) of each file in [`HIP_LEFT_OUT`].

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Kernel files of `kernels-cuda/` not compiled for HIP, with why. `selftest*.cu` (SIMT-only)
/// are never compiled for a GPU.
pub const HIP_LEFT_OUT: &[(&str, &str)] = &[
    (
        "gemm_tc.cu",
        "mma.sync m16n8k16 and ldmatrix are NVIDIA warp-32 fragment layouts; AMD runs prefill on gemm_mfma.cu (MFMA)",
    ),
    ("gemv_tc.cu", "mma.sync m16n8k16 fragments (NVIDIA warp 32); AMD runs batched decode on gemv.cu"),
    ("gemm_wg.cu", "wgmma is Hopper's warpgroup instruction (sm_90a); AMD runs prefill on gemm.cu"),
];

fn find_clang() -> Option<PathBuf> {
    for var in ["MEMWALL_HIP_CLANG", "ROCM_PATH", "PATH"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    if let Some(p) = std::env::var_os("MEMWALL_HIP_CLANG") {
        return Some(PathBuf::from(p));
    }
    let mut candidates = Vec::new();
    if let Some(rocm) = std::env::var_os("ROCM_PATH") {
        candidates.push(PathBuf::from(rocm).join("llvm/bin/clang++"));
    }
    candidates.push(PathBuf::from("/opt/rocm/llvm/bin/clang++"));
    for n in (17..=22).rev() {
        candidates.push(PathBuf::from(format!("/usr/lib/llvm-{n}/bin/clang++")));
    }
    candidates.into_iter().find(|p| p.is_file())
}

fn rocm_path() -> PathBuf {
    let mut candidates: Vec<PathBuf> = std::env::var_os("ROCM_PATH").map(PathBuf::from).into_iter().collect();
    candidates.extend([PathBuf::from("/opt/rocm"), PathBuf::from("/usr")]);
    candidates
        .into_iter()
        .find(|p| p.join("include/hip/hip_runtime.h").is_file())
        .unwrap_or_else(|| PathBuf::from("/usr"))
}

fn device_libs() -> Option<PathBuf> {
    println!("cargo::rerun-if-env-changed=MEMWALL_HIP_DEVICE_LIBS");
    let mut candidates: Vec<PathBuf> =
        std::env::var_os("MEMWALL_HIP_DEVICE_LIBS").map(PathBuf::from).into_iter().collect();
    if let Some(rocm) = std::env::var_os("ROCM_PATH") {
        candidates.push(PathBuf::from(rocm).join("amdgcn/bitcode"));
    }
    candidates.push(PathBuf::from("/opt/rocm/amdgcn/bitcode"));
    candidates.push(PathBuf::from("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode"));
    candidates.into_iter().find(|p| p.join("ocml.bc").is_file())
}

/// `gfx942` -> `942` (the device libraries' file suffix) and 9402 (`__oclc_ISA_version`:
/// major * 1000 + minor * 100 + stepping, the stepping a hex digit: gfx90a is 9010).
fn isa_version(arch: &str) -> Option<(String, u32)> {
    let id = arch.strip_prefix("gfx")?;
    if id.len() < 3 {
        return None;
    }
    let (major, rest) = id.split_at(id.len() - 2);
    let mut digits = rest.chars();
    let minor = digits.next()?.to_digit(16)?;
    let stepping = digits.next()?.to_digit(16)?;
    Some((id.to_string(), major.parse::<u32>().ok()? * 1000 + minor * 100 + stepping))
}

/// The device library folder to hand clang: `libs` itself when it has every target's ISA file,
/// else `OUT_DIR/hip/bitcode` with links to `libs` and the missing files generated.
fn complete_device_libs(libs: &Path, archs: &[String], llvm_bin: &Path, out: &Path) -> PathBuf {
    let missing: Vec<(String, u32)> = archs
        .iter()
        .map(|a| isa_version(a).unwrap_or_else(|| panic!("MEMWALL_HIP_ARCHS: {a:?} is not a gfx target")))
        .filter(|(id, _)| !libs.join(format!("oclc_isa_version_{id}.bc")).is_file())
        .collect();
    if missing.is_empty() {
        return libs.to_path_buf();
    }
    let dir = out.join("bitcode");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("create OUT_DIR/hip/bitcode");
    for e in fs::read_dir(libs).expect("read the device libraries").filter_map(|e| e.ok()) {
        std::os::unix::fs::symlink(e.path(), dir.join(e.file_name())).expect("link a device library");
    }
    // The data layout of the libraries themselves (linking modules of different layouts warns,
    // and -Werror makes that an error): taken from their ABI-version file.
    let abi = Command::new(llvm_bin.join("llvm-dis"))
        .arg(libs.join("oclc_abi_version_500.bc"))
        .args(["-o", "-"])
        .output()
        .unwrap_or_else(|e| panic!("running {}/llvm-dis: {e}", llvm_bin.display()));
    let abi = String::from_utf8_lossy(&abi.stdout).into_owned();
    let layout = abi
        .lines()
        .find(|l| l.starts_with("target datalayout"))
        .unwrap_or_else(|| panic!("no data layout in {}", libs.join("oclc_abi_version_500.bc").display()));
    for (id, version) in missing {
        let ll = dir.join(format!("oclc_isa_version_{id}.ll"));
        fs::write(
            &ll,
            format!(
                "{layout}\ntarget triple = \"amdgcn-amd-amdhsa\"\n\
                 @__oclc_ISA_version = linkonce_odr protected local_unnamed_addr addrspace(4) constant i32 {version}, align 4\n"
            ),
        )
        .expect("write the ISA version");
        let status = Command::new(llvm_bin.join("llvm-as"))
            .arg(&ll)
            .arg("-o")
            .arg(dir.join(format!("oclc_isa_version_{id}.bc")))
            .status()
            .unwrap_or_else(|e| panic!("running {}/llvm-as: {e}", llvm_bin.display()));
        assert!(status.success(), "llvm-as failed on {}", ll.display());
    }
    dir
}

/// Per kernel of a code object's metadata: (name, private segment bytes, VGPR spills, dynamic
/// stack).
pub fn parse_notes(notes: &str) -> Vec<(String, u64, u64, bool)> {
    let mut out: Vec<(String, u64, u64, bool)> = Vec::new();
    let mut in_kernels = false;
    for line in notes.lines() {
        if line.starts_with("amdhsa.kernels:") {
            in_kernels = true;
            continue;
        }
        if in_kernels && !line.starts_with(' ') {
            in_kernels = false;
        }
        if !in_kernels {
            continue;
        }
        if line.starts_with("  - ") {
            out.push((String::new(), 0, 0, false));
        }
        let Some(field) = line.strip_prefix("    .").or_else(|| line.strip_prefix("  - .")) else { continue };
        let Some((key, value)) = field.split_once(':') else { continue };
        let value = value.trim();
        let Some(k) = out.last_mut() else { continue };
        match key {
            "name" => k.0 = value.to_string(),
            "private_segment_fixed_size" => k.1 = value.parse().unwrap_or(u64::MAX),
            "vgpr_spill_count" => k.2 = value.parse().unwrap_or(u64::MAX),
            "uses_dynamic_stack" => k.3 = value != "false",
            _ => {}
        }
    }
    out
}

struct Built {
    name: String,
    arch: String,
    code: PathBuf,
    kernels: Vec<(String, u64, u64, bool)>,
}

fn compile(
    clang: &Path,
    llvm_bin: &Path,
    rocm: &Path,
    libs: &Path,
    file: &Path,
    arch: &str,
    out: &Path,
) -> Result<Built, String> {
    let stem = file.file_stem().and_then(|s| s.to_str()).expect("UTF-8 kernel names").to_string();
    let code = out.join(format!("{stem}.{arch}.hsaco"));
    let output = Command::new(clang)
        .current_dir(file.parent().expect("a kernel file has a folder"))
        .args(["-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output"])
        .arg(format!("--offload-arch={arch}"))
        .arg(format!("--rocm-path={}", rocm.display()))
        .arg(format!("--rocm-device-lib-path={}", libs.display()))
        .args(["--gpu-max-threads-per-block=256", "-O3", "-std=c++17", "-Werror", "-Wall", "-Wextra"])
        .arg("-o")
        .arg(&code)
        .arg(file)
        .output()
        .map_err(|e| format!("running {}: {e}", clang.display()))?;
    if !output.status.success() {
        return Err(format!(
            "clang (HIP, {arch}) failed on {}:\n{}",
            file.display(),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let notes = Command::new(llvm_bin.join("llvm-readelf"))
        .arg("--notes")
        .arg(&code)
        .output()
        .map_err(|e| format!("running {}/llvm-readelf: {e}", llvm_bin.display()))?;
    let notes = String::from_utf8_lossy(&notes.stdout).into_owned();
    fs::write(out.join(format!("{stem}.{arch}.notes.txt")), &notes).map_err(|e| e.to_string())?;
    Ok(Built { name: format!("{stem}.cu"), arch: arch.to_string(), code, kernels: parse_notes(&notes) })
}

/// `HIP_LEFT_OUT` for the crate: the prefix (`<stem>_`) of every kernel name in each file left out.
fn left_out_prefixes() -> String {
    let prefixes: Vec<String> = HIP_LEFT_OUT
        .iter()
        .map(|(file, _)| format!("{:?}", format!("{}_", file.trim_end_matches(".cu"))))
        .collect();
    format!("pub const HIP_LEFT_OUT_PREFIXES: &[&str] = &[{}];\n", prefixes.join(", "))
}

fn write_empty(out: &Path) {
    let code = "// @generated by build.rs\n\
                pub const HIP_CODE_OBJECTS: &[KernelImage] = &[];\n\
                pub const HIP_CLANG: Option<&str> = None;\n\
                pub const HIP_LLVM_BIN: Option<&str> = None;\n\
                pub const HIP_KERNELS: &[(&str, &str, &[&str])] = &[];\n";
    fs::write(out.join("hip_code_objects.rs"), format!("{code}{}", left_out_prefixes()))
        .expect("write hip_code_objects.rs");
}

pub fn run(root: &Path, out: &Path) {
    println!("cargo::rerun-if-env-changed=MEMWALL_HIP");
    println!("cargo::rerun-if-env-changed=MEMWALL_HIP_ARCHS");
    println!("cargo::rerun-if-changed=kernels-hip");
    let skip = std::env::var("MEMWALL_HIP").is_ok_and(|v| v == "0")
        || std::env::var("MEMWALL_SIMT_ASAN").is_ok_and(|v| v == "1")
        || crate::check_only();
    let clang = if skip { None } else { find_clang() };
    let (Some(clang), Some(libs)) = (clang, if skip { None } else { device_libs() }) else {
        write_empty(out);
        return;
    };
    // /usr/bin/clang++-19 is a link into /usr/lib/llvm-19/bin, where its tools are.
    let clang = fs::canonicalize(&clang).unwrap_or(clang);
    let llvm_bin = clang.parent().expect("clang has a folder").to_path_buf();
    let archs: Vec<String> = std::env::var("MEMWALL_HIP_ARCHS")
        .unwrap_or_else(|_| "gfx90a,gfx942".into())
        .split(',')
        .map(|a| a.trim().to_string())
        .filter(|a| !a.is_empty())
        .collect();
    let dir = out.join("hip");
    fs::create_dir_all(&dir).expect("create OUT_DIR/hip");
    let libs = complete_device_libs(&libs, &archs, &llvm_bin, &dir);
    let rocm = rocm_path();
    let src_dir = root.join("kernels-cuda");
    let files: Vec<PathBuf> = super::embed::kernel_files(&src_dir)
        .into_iter()
        .filter(|f| f.extension().is_some_and(|e| e == "cu") && f.parent() == Some(src_dir.as_path()))
        .filter(|f| {
            let name = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            !name.starts_with("selftest") && !HIP_LEFT_OUT.iter().any(|(n, _)| *n == name)
        })
        .collect();
    let jobs: Vec<(&PathBuf, &String)> =
        files.iter().flat_map(|f| archs.iter().map(move |a| (f, a))).collect();
    // Two at a time (the CI machines have two cores), each thread taking the next job.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<Result<Built, String>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((f, a)) = jobs.get(i) else { break };
                        done.push((i, compile(&clang, &llvm_bin, &rocm, &libs, f, a, &dir)));
                    }
                    done
                })
            })
            .collect();
        let mut all: Vec<(usize, Result<Built, String>)> =
            workers.into_iter().flat_map(|w| w.join().expect("clang thread")).collect();
        all.sort_by_key(|(i, _)| *i);
        all.into_iter().map(|(_, r)| r).collect()
    });
    let built: Vec<Built> = results.into_iter().map(|r| r.unwrap_or_else(|e| panic!("{e}"))).collect();
    let scratch: Vec<String> = built
        .iter()
        .flat_map(|b| b.kernels.iter().map(move |k| (b, k)))
        .filter(|(_, (_, private, vgpr_spills, dynamic))| *private > 0 || *vgpr_spills > 0 || *dynamic)
        .map(|(b, (k, private, vgpr_spills, dynamic))| {
            format!(
                "{k} ({}): {private} bytes of scratch, {vgpr_spills} VGPR spills, dynamic stack {dynamic}",
                b.arch
            )
        })
        .collect();
    if !scratch.is_empty() {
        panic!("kernels use scratch (see OUT_DIR/hip/*.notes.txt):\n{}", scratch.join("\n"));
    }
    let mut code = String::from("// @generated by build.rs\n");
    code.push_str("pub const HIP_CODE_OBJECTS: &[KernelImage] = &[\n");
    for b in &built {
        code.push_str(&format!(
            "    KernelImage {{ name: {:?}, targets: &[{:?}], fatbin: include_bytes!({:?}) }},\n",
            b.name,
            b.arch,
            b.code.display().to_string()
        ));
    }
    code.push_str("];\n");
    code.push_str(&format!("pub const HIP_CLANG: Option<&str> = Some({:?});\n", clang.display().to_string()));
    code.push_str(&format!(
        "pub const HIP_LLVM_BIN: Option<&str> = Some({:?});\n",
        llvm_bin.display().to_string()
    ));
    code.push_str("pub const HIP_KERNELS: &[(&str, &str, &[&str])] = &[\n");
    for b in &built {
        let names: Vec<String> = b.kernels.iter().map(|(k, ..)| format!("{k:?}")).collect();
        code.push_str(&format!("    ({:?}, {:?}, &[{}]),\n", b.name, b.arch, names.join(", ")));
    }
    code.push_str("];\n");
    code.push_str(&left_out_prefixes());
    fs::write(out.join("hip_code_objects.rs"), code).expect("write hip_code_objects.rs");
}

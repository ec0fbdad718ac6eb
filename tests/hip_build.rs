//! What `build.rs` compiled for AMD GPUs (`build/hip.rs`), read back from the embedded code
//! objects with the LLVM tools of the clang that built them:
//! - every kernel name a launcher can pick is in the code objects of every target;
//! - every code object is an AMDGPU ELF for its target, wave64, and no kernel uses scratch
//!   (`.private_segment_fixed_size` 0, no VGPR spills, no dynamic stack);
//! - the GEMV streams its weights in 128-bit loads: in every `gemv_*` kernel the number of
//!   `global_load_dwordx4` is exactly GEMV_UNROLL x (1 weight word + R x VEC / 4 float4 of x)
//!   (`gemv_j4_*`: one word of each of its 4 rows + R x VEC / 4 float4 of x, shared by the four),
//!   so each 16-byte weight word is one `global_load_dwordx4` (split loads would give
//!   GEMV_UNROLL fewer and a dword or narrower load in their place);
//! - no kernel of any file goes through flat memory instructions (`flat_*`, an address space the
//!   compiler could not prove global or LDS): loads and stores are global or LDS;
//! - fp8 in the fnuz formats is decoded by the CDNA3 conversion instructions (kernels-hip/hip.h)
//!   on gfx94x and nowhere else: every `*_e4m3fnuz*` kernel there uses `v_cvt_(pk_)f32_fp8` and
//!   no bf8 conversion, every `*_e5m2fnuz*` kernel the bf8 ones and no fp8 one, and every other
//!   kernel (the OCP e4m3fn / e5m2 ones included: the same opcodes would misread them) and every
//!   kernel of the other targets none; the GEMV's 16-byte words go through the packed form, both
//!   16-bit halves of each word (as many `src0_sel:WORD_1` conversions as low-half ones, 4 pairs
//!   per word), and its scalar tail through the one-byte form; every kernel of those targets keeps
//!   f32 denormals (`.amdhsa_float_denorm_mode_32 3` in its descriptor).
//!
//! What no check here can see: which half lands in which element (swapping them keeps every
//! count), and the values the instructions produce. Those need an AMD GPU; hip.h argues the
//! values from AMD's documentation.
//!
//! Where no HIP-capable clang was found at build time there is nothing to check and the test
//! says so, unless `MEMWALL_REQUIRE_HIPCC=1` (set by scripts/test.sh, whose setup installs clang
//! 19 and the HIP headers), which makes a build without code objects fail.

use std::path::{Path, PathBuf};
use std::process::Command;

use memwall::kernels::{HIP_CLANG, HIP_CODE_OBJECTS, HIP_KERNELS, HIP_LLVM_BIN, KernelImage};
use memwall::runtime::gpu::ops;

/// `GEMV_UNROLL` of kernels-cuda/gemv.cu: 16-byte weight loads in flight per lane.
const GEMV_UNROLL: usize = 4;
/// `J4` of kernels-cuda/gemv.cu: the rows of W one `gemv_j4` warp reads together, one 16-byte word
/// of each per step.
const J4: usize = ops::linear::GEMV_J4_FEATURES;

/// How many `gemv_*` kernels each weight dtype and scale kind has: gemv's row tiles and gemv_j4's.
fn gemv_tiles() -> usize {
    ops::linear::GEMV_ROW_TILES.len() + ops::linear::GEMV_J4_ROW_TILES.len()
}

fn launcher_kernels() -> Vec<&'static str> {
    let mut names = ops::kernel_names();
    // The files of build/hip.rs's HIP_LEFT_OUT (NVIDIA tensor-core fragments and wgmma).
    names.retain(|n| !memwall::kernels::HIP_LEFT_OUT_PREFIXES.iter().any(|p| n.starts_with(p)));
    names
}

fn built() -> bool {
    if HIP_CLANG.is_none() {
        let required = std::env::var("MEMWALL_REQUIRE_HIPCC").is_ok_and(|v| v == "1");
        assert!(!required, "MEMWALL_REQUIRE_HIPCC=1 but build.rs found no HIP clang (run scripts/setup.sh)");
        eprintln!("skipping: no HIP-capable clang at build time, no code objects embedded");
        return false;
    }
    true
}

fn targets() -> Vec<&'static str> {
    let mut t: Vec<&str> = HIP_CODE_OBJECTS.iter().flat_map(|c| c.targets.iter().copied()).collect();
    t.sort_unstable();
    t.dedup();
    t
}

/// The code object written to a temporary file, for the LLVM tools.
fn on_disk(name: &str, target: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memwall-hip-build-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("{name}.{target}.hsaco"));
    std::fs::write(&p, bytes).unwrap();
    p
}

fn tool(name: &str, args: &[&str], file: &Path) -> String {
    let bin = Path::new(HIP_LLVM_BIN.expect("built with a clang")).join(name);
    let out =
        Command::new(&bin).args(args).arg(file).output().unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "{name} failed on {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Per kernel of `llvm-readelf --notes`: its metadata fields (`name`, `private_segment_fixed_size`, ...).
fn kernels_metadata(notes: &str) -> Vec<Vec<(String, String)>> {
    let mut out: Vec<Vec<(String, String)>> = Vec::new();
    let mut inside = false;
    for line in notes.lines() {
        if line.starts_with("amdhsa.kernels:") {
            inside = true;
            continue;
        }
        if inside && !line.starts_with(' ') {
            inside = false;
        }
        if !inside {
            continue;
        }
        if line.starts_with("  - ") {
            out.push(Vec::new());
        }
        if let Some(field) = line.strip_prefix("    .").or_else(|| line.strip_prefix("  - ."))
            && let (Some((k, v)), Some(last)) = (field.split_once(':'), out.last_mut())
        {
            last.push((k.to_string(), v.trim().to_string()));
        }
    }
    out
}

#[test]
fn every_launcher_kernel_is_in_every_target() {
    if !built() {
        return;
    }
    let targets = targets();
    assert!(!targets.is_empty());
    assert_eq!(HIP_KERNELS.len(), HIP_CODE_OBJECTS.len());
    for target in &targets {
        let have: Vec<&str> = HIP_KERNELS
            .iter()
            .filter(|(_, t, _)| t == target)
            .flat_map(|(_, _, k)| k.iter().copied())
            .collect();
        for name in launcher_kernels() {
            assert!(have.contains(&name), "{name} is not in the HIP code objects for {target}");
        }
    }
}

#[test]
fn code_objects_are_wave64_elf_without_scratch() {
    if !built() {
        return;
    }
    for image in HIP_CODE_OBJECTS {
        let target = image.targets[0];
        assert_eq!(&image.fatbin[..4], b"\x7fELF", "{} {target}: not an ELF", image.name);
        let file = on_disk(image.name, target, image.fatbin);
        let notes = tool("llvm-readelf", &["--notes"], &file);
        assert!(
            notes.contains(&format!("amdgcn-amd-amdhsa--{target}")),
            "{} is not for {target}",
            image.name
        );
        let kernels = kernels_metadata(&notes);
        assert!(!kernels.is_empty(), "{} {target}: no kernels", image.name);
        for k in &kernels {
            let field =
                |key: &str| k.iter().find(|(f, _)| f == key).map(|(_, v)| v.as_str()).unwrap_or("missing");
            let name = field("name");
            assert_eq!(field("private_segment_fixed_size"), "0", "{name} ({target}) uses scratch");
            assert_eq!(field("vgpr_spill_count"), "0", "{name} ({target}) spills VGPRs");
            assert_eq!(field("uses_dynamic_stack"), "false", "{name} ({target}) has a dynamic stack");
            assert_eq!(field("wavefront_size"), "64", "{name} ({target}) is not wave64");
        }
    }
}

/// The instructions of each function of `llvm-objdump -d` (`<addr> <name>:` opens one), each
/// line trimmed, without the trailing `// address: encoding` comment.
fn functions(asm: &str) -> Vec<(String, Vec<String>)> {
    let mut functions: Vec<(String, Vec<String>)> = Vec::new();
    for line in asm.lines() {
        if let Some(name) = line.split_once(" <").and_then(|(_, r)| r.strip_suffix(">:")) {
            functions.push((name.to_string(), Vec::new()));
        } else if let Some(f) = functions.last_mut() {
            let text = line.split_once("//").map_or(line, |(code, _)| code).trim();
            if !text.is_empty() {
                f.1.push(text.to_string());
            }
        }
    }
    functions
}

fn disassemble(image: &KernelImage) -> Vec<(String, Vec<String>)> {
    let target = image.targets[0];
    let file = on_disk(image.name, target, image.fatbin);
    functions(&tool("llvm-objdump", &["-d", &format!("--mcpu={target}")], &file))
}

/// No kernel of any file reads or writes memory through flat instructions: every kernel's memory
/// is global (its params' pointers) or LDS, and a `flat_*` op means the compiler lost a pointer's
/// address space (read back from LDS, or merged with another path), which on CDNA also makes each
/// LDS wait (lgkmcnt) wait for the global loads in flight. The grouped GEMMs of the experts
/// (`gemm_experts_*`, `gemm_mfma_experts_*`) once did: their params were staged in LDS or built
/// before the early return.
#[test]
fn no_kernel_goes_through_flat() {
    if !built() {
        return;
    }
    let mut kernels = 0;
    for image in HIP_CODE_OBJECTS {
        let target = image.targets[0];
        for (name, lines) in &disassemble(image) {
            let flat: Vec<&str> = lines
                .iter()
                .filter_map(|l| l.split_whitespace().next())
                .filter(|o| o.starts_with("flat_"))
                .collect();
            assert!(
                flat.is_empty(),
                "{name} ({target}) of {}: {} flat ops, {:?}",
                image.name,
                flat.len(),
                flat[0]
            );
            kernels += 1;
        }
    }
    assert!(
        kernels >= HIP_KERNELS.iter().map(|(_, _, k)| k.len()).sum::<usize>(),
        "{kernels} kernels disassembled"
    );
}

/// The CDNA3 targets, whose fp8 conversions read the fnuz formats.
fn fnuz_hardware(target: &str) -> bool {
    matches!(target, "gfx940" | "gfx941" | "gfx942")
}

#[test]
fn fnuz_fp8_is_decoded_by_the_cdna3_instructions_only() {
    if !built() {
        return;
    }
    let opcode = |line: &String| line.split_whitespace().next().unwrap_or_default().to_string();
    let (mut hardware_kernels, mut gemv_checked) = (0, 0);
    for image in HIP_CODE_OBJECTS {
        let target = image.targets[0];
        if fnuz_hardware(target) {
            // hip.h's argument that no fp8 subnormal is flushed leans on the f32 denormal mode of
            // every kernel: 3, denormals kept on input and output (the kernel descriptors).
            let file = on_disk(image.name, target, image.fatbin);
            let descriptors =
                tool("llvm-objdump", &["-D", "-j", ".rodata", &format!("--mcpu={target}")], &file);
            let modes: Vec<&str> = descriptors
                .lines()
                .filter_map(|l| l.trim().strip_prefix(".amdhsa_float_denorm_mode_32"))
                .map(str::trim)
                .collect();
            let kernels =
                HIP_KERNELS.iter().find(|(n, t, _)| *n == image.name && *t == target).unwrap().2.len();
            assert_eq!(modes.len(), kernels, "{} ({target}): kernel descriptors decoded", image.name);
            assert!(
                modes.iter().all(|m| *m == "3"),
                "{} ({target}): f32 denormal modes {modes:?}",
                image.name
            );
        }
        for (name, lines) in disassemble(image) {
            let count = |prefixes: &[&str]| {
                lines.iter().filter(|l| prefixes.iter().any(|p| opcode(l).starts_with(p))).count()
            };
            let fp8 = count(&["v_cvt_f32_fp8", "v_cvt_pk_f32_fp8"]);
            let bf8 = count(&["v_cvt_f32_bf8", "v_cvt_pk_f32_bf8"]);
            let (want_fp8, want_bf8) = if !fnuz_hardware(target) {
                (false, false)
            } else {
                (name.contains("_e4m3fnuz"), name.contains("_e5m2fnuz"))
            };
            assert_eq!(
                (fp8 > 0, bf8 > 0),
                (want_fp8, want_bf8),
                "{name} ({target}, {}): {fp8} fp8 and {bf8} bf8 conversion instructions",
                image.name
            );
            if !(want_fp8 || want_bf8) {
                continue;
            }
            hardware_kernels += 1;
            let kind = if want_fp8 { "fp8" } else { "bf8" };
            if name.starts_with("gemv_mfma_") {
                // A lane's 4 weight words per x tile (2 feature tiles x 2 steps), each four 32-bit
                // words of four codes, each one packed conversion per half; no scalar tail.
                let packed: Vec<&String> =
                    lines.iter().filter(|l| opcode(l).starts_with(&format!("v_cvt_pk_f32_{kind}"))).collect();
                let high = packed.iter().filter(|l| l.contains("src0_sel:WORD_1")).count();
                assert_eq!((packed.len() - high, high), (16, 16), "{name} ({target}): packed (low, high)");
                assert_eq!(count(&[&format!("v_cvt_f32_{kind}")]), 0, "{name} ({target}): a scalar decode");
            } else if name.starts_with("gemv_") {
                // Vector path: GEMV_UNROLL 16-byte loads per step, each four 32-bit words of four
                // codes, each word one packed conversion per half; scalar tail: one-byte ones.
                let packed: Vec<&String> =
                    lines.iter().filter(|l| opcode(l).starts_with(&format!("v_cvt_pk_f32_{kind}"))).collect();
                let high = packed.iter().filter(|l| l.contains("src0_sel:WORD_1")).count();
                let low = packed.len() - high;
                assert_eq!(
                    (low, high),
                    (GEMV_UNROLL * 4, GEMV_UNROLL * 4),
                    "{name} ({target}): packed conversions of the (low, high) halves"
                );
                let single = count(&[&format!("v_cvt_f32_{kind}")]);
                assert!(single > 0, "{name} ({target}): the scalar tail decodes without v_cvt_f32_{kind}");
                gemv_checked += 1;
            }
        }
    }
    let fnuz_named = HIP_KERNELS
        .iter()
        .filter(|(_, t, _)| fnuz_hardware(t))
        .flat_map(|(_, _, k)| k.iter())
        .filter(|k| k.contains("_e4m3fnuz") || k.contains("_e5m2fnuz"))
        .count();
    assert_eq!(hardware_kernels, fnuz_named, "fnuz kernels disassembled");
    let cdna3 = targets().iter().filter(|t| fnuz_hardware(t)).count();
    // 2 fnuz dtypes x {plain, block f32, block bf16} x (gemv's row tiles and gemv_j4's) per
    // CDNA3 target.
    assert_eq!(gemv_checked, 2 * 3 * gemv_tiles() * cdna3, "fnuz GEMV kernels checked");
}

#[test]
fn gemv_weight_loads_are_128_bit() {
    if !built() {
        return;
    }
    let images: Vec<_> = HIP_CODE_OBJECTS.iter().filter(|c| c.name == "gemv.cu").collect();
    assert_eq!(images.len(), targets().len());
    for image in images {
        let target = image.targets[0];
        let mut checked = 0;
        for (name, lines) in &disassemble(image) {
            let ops: Vec<&str> = lines.iter().filter_map(|l| l.split_whitespace().next()).collect();
            let Some(rest) = name.strip_prefix("gemv_") else { continue };
            let (j4, rest) = match rest.strip_prefix("j4_") {
                Some(rest) => (true, rest),
                None => (false, rest),
            };
            let weight = rest.split('_').next().unwrap();
            let rows: usize = rest.rsplit_once("_r").unwrap().1.parse().unwrap();
            let vec = 16
                / match weight {
                    "f32" => 4,
                    "f16" | "bf16" => 2,
                    _ => 1,
                };
            let x4 = ops.iter().filter(|o| **o == "global_load_dwordx4").count();
            let want = if j4 { J4 + rows * vec / 4 } else { GEMV_UNROLL * (1 + rows * vec / 4) };
            assert_eq!(x4, want, "{name} ({target}): {x4} global_load_dwordx4");
            checked += 1;
        }
        // 7 weight dtypes x {plain, block f32, block bf16} x (gemv's row tiles and gemv_j4's).
        assert_eq!(checked, 7 * 3 * gemv_tiles(), "gemv kernels disassembled for {target}");
    }
}

/// The files that use the matrix cores, each with the MFMAs of one kernel's k loop: gemm_mfma.cu,
/// 48 per 32-column tile (2 k steps x 2 x 4 fragments x 3 parts of x); gemv_mfma.cu, 48 per
/// 128-column x tile (8 k slices x 2 feature tiles x 3 parts of x); twice that for f16 weights
/// (2 parts each).
const MFMA_FILES: [&str; 2] = ["gemm_mfma.cu", "gemv_mfma.cu"];

/// gemm_mfma.cu and gemv_mfma.cu on every target: the 18 kernels of each family (6 weight dtypes x
/// {plain, block f32, block bf16}; each file has two, its op and the experts' grouped form)
/// run their products on the matrix cores,
/// `v_mfma_f32_16x16x16_bf16` (gfx94x's spelling) or `v_mfma_f32_16x16x16bf16_1k` (gfx90a's), 48 per
/// k tile or 96 for f16 weights (`MFMA_FILES`), and no other MFMA; no other file uses the matrix
/// cores. gemv_mfma.cu loads a lane's weight words as whole 16-byte `global_load_dwordx4`: per x
/// tile, 2 of x per thread and 2 feature tiles x STEPS (2 for fp8, 4 for 16-bit) of weights, in the
/// prologue and again in the loop; reads x's parts as 16-byte `ds_read_b128`, 3 parts x STEPS x
/// 16-byte halves (2 for fp8, 1 for 16-bit) = 12. (Scratch and flat are checked for every kernel by
/// `code_objects_are_wave64_elf_without_scratch` and `no_kernel_goes_through_flat`.)
#[test]
fn mfma_kernels_run_on_the_matrix_cores() {
    if !built() {
        return;
    }
    let mut files = 0;
    for image in HIP_CODE_OBJECTS {
        let target = image.targets[0];
        let mut kernels = 0;
        for (name, lines) in &disassemble(image) {
            let ops: Vec<&str> = lines.iter().filter_map(|l| l.split_whitespace().next()).collect();
            let mfma: Vec<&str> = ops.iter().copied().filter(|o| o.starts_with("v_mfma")).collect();
            if !MFMA_FILES.contains(&image.name) {
                assert!(mfma.is_empty(), "{name} ({target}) of {} uses {mfma:?}", image.name);
                continue;
            }
            let f16 = ["gemm_mfma_f16", "gemm_mfma_experts_f16", "gemv_mfma_f16", "gemv_mfma_experts_f16"]
                .iter()
                .any(|p| name.starts_with(p));
            let want = if f16 { 96 } else { 48 };
            assert_eq!(mfma.len(), want, "{name} ({target}): {} MFMAs", mfma.len());
            assert!(
                mfma.iter().all(|o| matches!(*o, "v_mfma_f32_16x16x16_bf16" | "v_mfma_f32_16x16x16bf16_1k")),
                "{name} ({target}): {mfma:?}"
            );
            if image.name == "gemv_mfma.cu" {
                let count = |op: &str| ops.iter().filter(|o| **o == op).count();
                let weight =
                    name["gemv_mfma_".len()..].trim_start_matches("experts_").split('_').next().unwrap();
                let steps = if matches!(weight, "f16" | "bf16") { 4 } else { 2 };
                assert_eq!(count("global_load_dwordx4"), 2 * (2 + 2 * steps), "{name} ({target})");
                assert_eq!(count("ds_read_b128"), 12, "{name} ({target})");
            }
            kernels += 1;
        }
        if MFMA_FILES.contains(&image.name) {
            // Each file's kernels and the experts' grouped form (gemm_mfma_experts_*,
            // gemv_mfma_experts_*).
            assert_eq!(kernels, 2 * 6 * 3, "{} kernels disassembled for {target}", image.name);
            files += 1;
        }
    }
    assert_eq!(files, MFMA_FILES.len() * targets().len(), "a code object per MFMA file and target");
}

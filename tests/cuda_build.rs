//! What `build.rs` compiled with nvcc (`build/nvcc.rs`): every kernel name a launcher can pick is
//! in the fatbins, for every SASS target, and every image is a fatbin with kernels for each target.
//! In the SASS (cuobjdump from scripts/setup.sh's pinned install): no innermost loop of any kernel
//! touches local memory, the e4m3fn / e5m2 GEMVs use the hardware fp8 conversion where the
//! target has it, only gemm_wg.cu's kernels use wgmma, on sm_90a alone, and only the experts'
//! grouped kernels use generic (not global or shared) loads and stores.
//!
//! Where no nvcc was found at build time there is nothing to check and the test says so, unless
//! `MEMWALL_REQUIRE_NVCC=1` (set by scripts/test.sh, which installs the pinned nvcc), which makes
//! a build without fatbins fail.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use memwall::kernels::{CUDA_FATBINS, CUDA_KERNELS, CUDA_NVCC};
use memwall::runtime::gpu::ops;

fn launcher_kernels() -> Vec<&'static str> {
    ops::kernel_names()
}

fn built() -> bool {
    if CUDA_NVCC.is_none() {
        let required = std::env::var("MEMWALL_REQUIRE_NVCC").is_ok_and(|v| v == "1");
        assert!(!required, "MEMWALL_REQUIRE_NVCC=1 but build.rs found no nvcc (run scripts/setup.sh)");
        eprintln!("skipping: no nvcc at build time, no fatbins embedded");
        return false;
    }
    true
}

#[test]
fn every_launcher_kernel_is_in_every_target() {
    if !built() {
        return;
    }
    let targets: Vec<&str> = CUDA_FATBINS[0].targets.to_vec();
    assert!(!targets.is_empty());
    for target in &targets {
        let have: Vec<&str> = CUDA_KERNELS
            .iter()
            .filter(|(_, t, _)| t == target)
            .flat_map(|(_, _, k)| k.iter().copied())
            .collect();
        for name in launcher_kernels() {
            assert!(have.contains(&name), "{name} is not in the fatbins for {target}");
        }
    }
}

#[test]
fn images_are_fatbins_with_kernels_for_every_target() {
    if !built() {
        return;
    }
    for image in CUDA_FATBINS {
        assert!(image.fatbin.len() > 64, "{}: empty fatbin", image.name);
        // A fatbin starts with its magic 0xBA55ED50 (little endian).
        assert_eq!(&image.fatbin[..4], &0xba55_ed50u32.to_le_bytes(), "{}: not a fatbin", image.name);
        for target in image.targets {
            assert!(
                CUDA_KERNELS.iter().any(|(i, t, k)| *i == image.name && t == target && !k.is_empty()),
                "{}: no kernels compiled for {target}",
                image.name
            );
        }
    }
}

/// `$CUOBJDUMP`, the pinned PyPI install's (scripts/setup.sh installs it beside nvcc, with the
/// nvdisasm it runs), or a CUDA toolkit's on the PATH (the GPU machine's). None where there is
/// none: the SASS checks then skip, unless `MEMWALL_REQUIRE_NVCC=1`.
fn cuobjdump() -> Option<PathBuf> {
    let pinned = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/cuda/nvidia/cu13/bin/cuobjdump");
    let on_path = || {
        let runs = Command::new("cuobjdump").arg("--version").output().is_ok_and(|o| o.status.success());
        runs.then(|| PathBuf::from("cuobjdump"))
    };
    let tool = std::env::var_os("CUOBJDUMP")
        .map(PathBuf::from)
        .or_else(|| pinned.exists().then_some(pinned))
        .or_else(on_path);
    if tool.is_none() {
        let required = std::env::var("MEMWALL_REQUIRE_NVCC").is_ok_and(|v| v == "1");
        assert!(!required, "MEMWALL_REQUIRE_NVCC=1 but no cuobjdump (run scripts/setup.sh)");
        eprintln!("skipping: no cuobjdump");
    }
    tool
}

/// One kernel's SASS: its name and its instructions as (address, text without the `;`).
struct Sass {
    kernel: String,
    code: Vec<(u64, String)>,
}

/// Each SASS target's kernels.
type TargetSass = (&'static str, Vec<Sass>);

/// The SASS of every kernel of every image, per SASS target (disassembled once per process: the
/// GEMV image alone is 9 MB).
fn sass() -> Option<&'static [TargetSass]> {
    static SASS: std::sync::OnceLock<Option<Vec<TargetSass>>> = std::sync::OnceLock::new();
    SASS.get_or_init(|| {
        let tool = cuobjdump()?;
        Some(CUDA_FATBINS[0].targets.iter().map(|&t| (t, disassemble(&tool, t))).collect())
    })
    .as_deref()
}

/// The SASS of every kernel of every image for `target`, disassembled by `tool`.
fn disassemble(tool: &Path, target: &str) -> Vec<Sass> {
    let dir = std::env::temp_dir().join(format!("memwall-sass-{}-{target}", std::process::id()));
    fs::create_dir_all(&dir).expect("temp dir");
    // cuobjdump runs nvdisasm, which the same install put beside it.
    let bin = tool.parent().filter(|d| !d.as_os_str().is_empty()).map(Path::to_path_buf);
    let path = std::env::join_paths(
        bin.into_iter().chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .expect("PATH");
    let mut all = Vec::new();
    for image in CUDA_FATBINS {
        let file = dir.join(format!("{}.fatbin", image.name));
        fs::write(&file, image.fatbin).expect("write the fatbin");
        let out = Command::new(tool)
            .args(["-sass", "-arch", target])
            .arg(&file)
            .env("PATH", &path)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", tool.display()));
        assert!(out.status.success(), "cuobjdump {}: {}", image.name, String::from_utf8_lossy(&out.stderr));
        all.extend(parse_sass(&String::from_utf8_lossy(&out.stdout)));
    }
    let _ = fs::remove_dir_all(&dir);
    all
}

/// Splits cuobjdump's listing into kernels: `Function : name`, then lines
/// `/*0a30*/  @!P0 BRA 0x48a0 ;  /* encoding */`.
fn parse_sass(listing: &str) -> Vec<Sass> {
    let mut kernels: Vec<Sass> = Vec::new();
    for line in listing.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("Function : ") {
            kernels.push(Sass { kernel: name.trim().to_string(), code: Vec::new() });
        } else if let Some(rest) = line.strip_prefix("/*")
            && let Some((addr, text)) = rest.split_once("*/")
            && let Ok(addr) = u64::from_str_radix(addr, 16)
            && let Some((text, _)) = text.split_once(';')
            && let Some(k) = kernels.last_mut()
        {
            k.code.push((addr, text.trim().to_string()));
        }
    }
    kernels
}

/// The mnemonic of an instruction, past its predicate (`@!P0`).
fn mnemonic(text: &str) -> &str {
    text.split_whitespace().find(|t| !t.starts_with('@')).unwrap_or("")
}

/// The address ranges of the innermost streaming loops: a backward branch closes a loop from its
/// target to itself; streaming when it loads from global memory (LDG), which also leaves out the
/// out-of-line slow paths of warp shuffles that branch back into the body; innermost when no other
/// such loop lies inside it.
fn streaming_loops(code: &[(u64, String)]) -> Vec<(u64, u64)> {
    let mut loops: Vec<(u64, u64)> = code
        .iter()
        .filter(|(_, t)| mnemonic(t).starts_with("BRA"))
        .filter_map(|(a, t)| {
            let target = t.split_whitespace().find_map(|w| w.strip_prefix("0x"))?;
            let target = u64::from_str_radix(target, 16).ok()?;
            (target <= *a).then_some((target, *a))
        })
        .filter(|&(s, e)| code.iter().any(|(a, t)| (s..=e).contains(a) && mnemonic(t).starts_with("LDG")))
        .collect();
    loops.sort_unstable();
    loops.dedup();
    loops
        .iter()
        .copied()
        .filter(|&(s, e)| !loops.iter().any(|&(s2, e2)| (s2, e2) != (s, e) && s <= s2 && e2 <= e))
        .collect()
}

/// No kernel's innermost streaming loop touches local memory (LDL / STL: register spills, or an
/// array indexed at run time): build/nvcc.rs lets a few kernels spill a few bytes, and this is what
/// keeps those spills out of the loops that stream the weights, the activations and the KV cache.
#[test]
fn streaming_loops_have_no_local_memory() {
    if !built() {
        return;
    }
    let Some(sass) = sass() else { return };
    for (target, kernels) in sass {
        let mut loops = 0;
        for k in kernels {
            for (start, end) in streaming_loops(&k.code) {
                loops += 1;
                for (a, t) in k.code.iter().filter(|(a, _)| (start..=end).contains(a)) {
                    let m = mnemonic(t);
                    assert!(
                        !m.starts_with("LDL") && !m.starts_with("STL"),
                        "{} ({target}): local memory at {a:#x} ({t}) in the loop {start:#x}..{end:#x}",
                        k.kernel
                    );
                }
            }
        }
        // Each GEMV family kernel has a chunk loop and a scalar loop: a parser that found no
        // loops would pass vacuously.
        assert!(loops > 500, "{target}: only {loops} streaming loops found");
    }
}

/// The e4m3fn and e5m2 GEMV kernels (gemv_tc.cu's too) widen their weights with the hardware conversion on sm_89 and
/// later (F2FP.F16.E4M3.UNPACK_B / .E5M2.: common.cuh's MW_OCP_FP8_HW), and no kernel uses it on
/// an older target. The fnuz formats have no such instruction on NVIDIA.
#[test]
fn ocp_fp8_gemv_uses_the_hardware_conversion() {
    if !built() {
        return;
    }
    let Some(sass) = sass() else { return };
    for (target, kernels) in sass {
        let number = sm_number(target);
        let mut gemv_kernels = 0;
        for k in kernels {
            let has = |fmt: &str| k.code.iter().any(|(_, t)| t.contains(&format!("F2FP.F16.{fmt}.UNPACK_B")));
            // gemv_mfma_* is AMD's (a trap on NVIDIA: gemv_mfma.cu).
            let gemv = ["gemv_", "gate_up_silu_", "qkv_"].iter().any(|f| k.kernel.starts_with(f))
                && !k.kernel.starts_with("gemv_mfma_");
            let weight = |w: &str| k.kernel.contains(&format!("_{w}_"));
            if number < 89 {
                assert!(!has("E4M3") && !has("E5M2"), "{} ({target}) uses an sm_89 conversion", k.kernel);
            } else if gemv && weight("e4m3fn") {
                assert!(has("E4M3") && !has("E5M2"), "{} ({target}): no hardware e4m3 decode", k.kernel);
                gemv_kernels += 1;
            } else if gemv && weight("e5m2") {
                assert!(has("E5M2") && !has("E4M3"), "{} ({target}): no hardware e5m2 decode", k.kernel);
                gemv_kernels += 1;
            } else if gemv {
                assert!(!has("E4M3") && !has("E5M2"), "{} ({target}): a hardware fp8 decode", k.kernel);
            }
        }
        if number >= 89 {
            // Each family's row tiles, 3 scale kinds (none, f32 and bf16 blocks), 2 formats;
            // gemv_tc.cu's twice (gemv_tc_* and the experts' grouped gemv_tc_experts_*).
            use ops::linear::{
                GATE_UP_ROW_TILES, GEMV_J4_ROW_TILES, GEMV_ROW_TILES, GEMV_TC_ROW_TILES, QKV_ROW_TILES,
            };
            let tiles = GEMV_ROW_TILES.len()
                + GATE_UP_ROW_TILES.len()
                + QKV_ROW_TILES.len()
                + GEMV_J4_ROW_TILES.len()
                + 2 * GEMV_TC_ROW_TILES.len();
            assert_eq!(gemv_kernels, 2 * 3 * tiles, "{target}: OCP fp8 GEMV kernels");
        }
    }
}

/// gemm_wg.cu's kernels run on wgmma where the fatbin has sm_90a code (HGMMA.64x128x16.F32.BF16:
/// at least X_PARTS x W_PARTS per 16 columns of a 32-column tile, no local memory) and only trap
/// on the other targets (the launcher sends them to sm_90 devices only); no other kernel uses
/// wgmma.
#[test]
fn warpgroup_gemm_uses_wgmma_on_sm_90a() {
    if !built() {
        return;
    }
    let Some(sass) = sass() else { return };
    for (target, kernels) in sass {
        let mut warpgroup = 0;
        for k in kernels {
            let count = |prefix: &str| k.code.iter().filter(|(_, t)| mnemonic(t).starts_with(prefix)).count();
            let hgmma = count("HGMMA");
            if !k.kernel.starts_with("gemm_wg_") {
                assert_eq!(hgmma, 0, "{} ({target}) uses wgmma", k.kernel);
                continue;
            }
            warpgroup += 1;
            if *target == "sm_90a" {
                let per_tile = if k.kernel.starts_with("gemm_wg_f16") { 12 } else { 6 };
                assert!(
                    count("HGMMA.64x128x16.F32.BF16") == hgmma && hgmma >= per_tile,
                    "{} ({target}): {hgmma} HGMMA, want at least {per_tile}, all m64n128k16 bf16",
                    k.kernel
                );
                assert_eq!(count("LDL") + count("STL"), 0, "{} ({target}): local memory", k.kernel);
            } else {
                assert!(hgmma == 0 && count("BPT.TRAP") > 0, "{} ({target}): not a trap", k.kernel);
            }
        }
        // 6 weight dtypes x 3 scale kinds.
        assert_eq!(warpgroup, 18, "{target}: gemm_wg kernels");
    }
}

/// Loads and stores name their address space: no kernel uses the generic `LD` / `ST` (an address
/// the compiler could not prove global or shared, checked by the hardware at each access), but
/// the experts' grouped kernels, whose matrix comes out of `pick_matrix` (an indexed read of the
/// params' table: nvcc no longer knows the pointer global). Of those, gemv_tc_experts_* on sm_89
/// and later (sm_90a) builds its params in registers and loads its weights through
/// `load_weight_words`, so it has none there either but its block-scaled forms' scale loads (one
/// 32- or 16-bit word per row and k-block); the rest (gemv.cu's experts_*, gemm.cu's and
/// gemm_tc.cu's *_experts_*, and gemv_tc_experts_* below sm_89, whose params stay in shared
/// memory) are left until measured (kernels-cuda/linear.cuh, load_words).
#[test]
fn generic_memory_ops_only_in_the_experts_kernels() {
    if !built() {
        return;
    }
    let Some(sass) = sass() else { return };
    for (target, kernels) in sass {
        // gemv_tc.cu's gemv_tc_experts: the shared copy of its params below sm_89.
        let shared_params = sm_number(target) < 89;
        let (mut checked, mut tc_experts) = (0, 0);
        for k in kernels {
            let generic: Vec<&str> = k
                .code
                .iter()
                .map(|(_, t)| mnemonic(t))
                .filter(|m| matches!(m.split('.').next(), Some("LD" | "ST")))
                .collect();
            let tc = k.kernel.starts_with("gemv_tc_experts_");
            tc_experts += usize::from(tc && !generic.is_empty());
            if k.kernel.contains("experts") && (!tc || shared_params) {
                continue;
            }
            if tc && k.kernel.contains("_block_") {
                // The k-block scales (one 32- or 16-bit word per row and block, through
                // Scale::in_row) still load generic; the weight words and the stores do not.
                let wide: Vec<&&str> =
                    generic.iter().filter(|m| m.starts_with("ST") || m.ends_with(".128")).collect();
                assert!(wide.is_empty(), "{} ({target}): generic {wide:?}", k.kernel);
                checked += 1;
                continue;
            }
            assert!(
                generic.is_empty(),
                "{} ({target}): generic {:?} ({} in all)",
                k.kernel,
                generic[0],
                generic.len()
            );
            checked += 1;
        }
        assert!(checked > 0, "{target}: no kernel checked");
        if shared_params {
            // The shared-params form of gemv_tc_experts is what this test lets pass here; it must
            // still be what the kernels are, or the exemption is stale.
            assert!(tc_experts > 0, "{target}: gemv_tc_experts_* has no generic access: tighten this test");
        }
    }
}

/// The number of an `sm_NN` / `sm_NNa` target.
fn sm_number(target: &str) -> u32 {
    target.trim_start_matches("sm_").trim_end_matches('a').parse().expect("sm_<n> target")
}

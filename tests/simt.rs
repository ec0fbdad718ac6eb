//! The SIMT layer (`simt/`) that runs the kernels of `kernels-cuda/` on the CPU (feature
//! `emulate`): each built-in the kernels rely on, through the selftest kernels of
//! `kernels-cuda/selftest.cu`, against host references written here from the CUDA programming
//! guide, under every schedule (forward, reverse, seeded random) and at warp 32 (the CUDA image)
//! and warp 64 (the selftest64 image); the faults the layer turns into launch errors; the
//! freshness of the Rust params mirrors against the C++ layouts; and `add_assign` end to end
//! through `memwall::emulated_backend` against `cpu::Reference`.
//!
//! Exact comparisons throughout: the selftests move values, they never round them.
#![cfg(feature = "emulate")]

mod common;

use std::collections::BTreeMap;
use std::sync::LazyLock;

use common::gpu::emulated;
use common::{Rng, assert_close, read_f32, upload};
use memwall::runtime::cpu::Reference;
use memwall::runtime::gpu::emu::{EmuBuffer, EmuDevice, Schedule, SimtImage};
use memwall::runtime::gpu::ops::{ParamsLayout, params_layouts};
use memwall::runtime::gpu::{Device, LaunchCfg};
use memwall::runtime::{Backend, DType, Error, params_layout};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::RngSeed;

/// `SelftestParams` of `kernels-cuda/params/selftest.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct SelftestParams {
    out: u64,
    r#in: u64,
    words: u64,
    wide: u64,
    n: u64,
    arg: i32,
    width: i32,
}

const SCHEDULES: [Schedule; 3] = [Schedule::Forward, Schedule::Reverse, Schedule::Random(0x5eed)];

/// Both images: the CUDA kernels at warp 32 and the selftests at warp 64.
fn images() -> [SimtImage; 2] {
    [memwall::kernels::simt_cuda(), memwall::kernels::simt_selftest64()]
}

/// Every (image, schedule) pair as a device with a label.
fn devices() -> Vec<(String, EmuDevice)> {
    let mut v = Vec::new();
    for image in images() {
        for s in SCHEDULES {
            v.push((format!("{} warp {} {s:?}", image.label, image.warp()), EmuDevice::new(image, s)));
        }
    }
    v
}

/// The host side of one selftest launch: inputs, and outputs as they are before the launch.
#[derive(Clone, Debug, Default)]
struct Case {
    out: Vec<f32>,
    input: Vec<f32>,
    words: Vec<u32>,
    wide: Vec<u64>,
    n: u64,
    arg: i32,
    width: i32,
}

/// The buffers after the launch.
#[derive(Debug)]
struct Outputs {
    out: Vec<f32>,
    words: Vec<u32>,
    wide: Vec<u64>,
}

fn buffer<T: bytemuck::Pod>(dev: &EmuDevice, data: &[T]) -> EmuBuffer {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    let mut b = dev.alloc(bytes.len()).expect("alloc");
    dev.write(&mut b, 0, bytes).expect("write");
    b
}

fn read_back<T: bytemuck::Pod>(dev: &EmuDevice, b: &EmuBuffer, n: usize) -> Vec<T> {
    let mut v = vec![T::zeroed(); n];
    dev.read(b, 0, bytemuck::cast_slice_mut(&mut v)).expect("read");
    v
}

/// Runs selftest `name` over `case`'s buffers (each exactly its length, at least one byte).
fn launch(dev: &EmuDevice, name: &'static str, cfg: LaunchCfg, case: &Case) -> Result<Outputs, Error> {
    let out = buffer(dev, &case.out);
    let input = buffer(dev, &case.input);
    let words = buffer(dev, &case.words);
    let wide = buffer(dev, &case.wide);
    let p = SelftestParams {
        out: EmuDevice::address(&out),
        r#in: EmuDevice::address(&input),
        words: EmuDevice::address(&words),
        wide: EmuDevice::address(&wide),
        n: case.n,
        arg: case.arg,
        width: case.width,
    };
    // SAFETY: every selftest touches in[g], out[g], words[g] (words[8g..8g+8] for
    // selftest_grid_u32), wide[g] for global indices g < n only, or the first elements the
    // kernel's contract names; each case sizes its vectors for that, and the buffers live until
    // the launch (synchronous) returns.
    unsafe { dev.launch(name, cfg, bytemuck::bytes_of(&p))? };
    Ok(Outputs {
        out: read_back(dev, &out, case.out.len()),
        words: read_back(dev, &words, case.words.len()),
        wide: read_back(dev, &wide, case.wide.len()),
    })
}

fn run(dev: &EmuDevice, label: &str, name: &'static str, cfg: LaunchCfg, case: &Case) -> Outputs {
    launch(dev, name, cfg, case).unwrap_or_else(|e| panic!("{label}: {name} {cfg:?}: {e}"))
}

fn launch_error(dev: &EmuDevice, name: &'static str, cfg: LaunchCfg, case: &Case) -> String {
    match launch(dev, name, cfg, case) {
        Ok(_) => panic!("{name} {cfg:?} succeeded; it must fail"),
        Err(e) => e.to_string(),
    }
}

const POISON: f32 = f32::from_bits(0x7fc5_a5a5);

fn threads(cfg: &LaunchCfg) -> usize {
    cfg.block.iter().map(|&b| b as usize).product()
}
fn blocks(cfg: &LaunchCfg) -> usize {
    cfg.grid.iter().map(|&b| b as usize).product()
}

/// `n` distinct values that reveal their index.
fn index_values(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32 + 0.25).collect()
}

/// Fails with the first differing index.
fn assert_same<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!("{what}: first difference at {i}: got {:?}, want {:?}", got[i], want[i]);
    }
}

fn assert_same_f32(what: &str, got: &[f32], want: &[f32]) {
    let g: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
    let w: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
    assert_same(what, &g, &w);
}

// ---------------------------------------------------------------------------------------------
// The image

#[test]
fn images_hold_every_selftest_once() {
    for image in images() {
        let names = image.kernels();
        let mut seen = BTreeMap::new();
        for n in &names {
            *seen.entry(n.as_str()).or_insert(0) += 1;
        }
        assert!(seen.values().all(|&c| c == 1), "{}: a kernel registered twice: {names:?}", image.label);
        for k in ["selftest_reverse_f32", "selftest_vote", "selftest_atomics", "selftest_oob_read"] {
            assert!(seen.contains_key(k), "{}: {k} missing from {names:?}", image.label);
        }
    }
    assert_eq!(memwall::kernels::simt_cuda().warp(), 32);
    assert_eq!(memwall::kernels::simt_selftest64().warp(), 64);
    assert!(memwall::kernels::simt_cuda().kernels().iter().any(|k| k == "add_assign_f32"));
}

/// The HIP image holds what the HIP build compiles: every kernel a launcher can pick but those of
/// the files of build/hip.rs's HIP_LEFT_OUT (gemm_tc.cu, gemv_tc.cu, gemm_wg.cu), no selftest, at warp 64; and, where clang built the
/// code objects, exactly the kernels of each target's code objects.
#[test]
fn hip_image_holds_the_hip_build() {
    let left_out = |k: &str| memwall::kernels::HIP_LEFT_OUT_PREFIXES.iter().any(|p| k.starts_with(p));
    assert_eq!(memwall::kernels::HIP_LEFT_OUT_PREFIXES, ["gemm_tc_", "gemv_tc_", "gemm_wg_"]);
    let hip = memwall::kernels::simt_hip();
    assert_eq!(hip.warp(), 64);
    let mut have = hip.kernels();
    have.sort();
    let mut want: Vec<String> = memwall::runtime::gpu::ops::kernel_names()
        .into_iter()
        .filter(|n| !left_out(n))
        .map(String::from)
        .collect();
    want.sort();
    want.dedup();
    let extra: Vec<&String> = have.iter().filter(|k| !want.contains(k)).collect();
    let missing: Vec<&String> = want.iter().filter(|k| !have.contains(k)).collect();
    // The image may hold kernels no launcher names yet (none today); it must hold every one named.
    assert!(missing.is_empty(), "launcher kernels missing from the HIP image: {missing:?}");
    assert!(extra.iter().all(|k| !k.starts_with("selftest") && !left_out(k)), "{extra:?}");
    let mut targets: Vec<&str> = memwall::kernels::HIP_KERNELS.iter().map(|(_, t, _)| *t).collect();
    targets.sort_unstable();
    targets.dedup();
    for target in targets {
        let mut built: Vec<String> = memwall::kernels::HIP_KERNELS
            .iter()
            .filter(|(_, t, _)| *t == target)
            .flat_map(|(_, _, k)| k.iter().map(|s| s.to_string()))
            .collect();
        built.sort();
        assert_eq!(have, built, "the HIP image vs the {target} code objects");
    }
}

/// The Rust mirrors of the params structs: the launchers' table plus the selftests' own.
fn rust_layouts() -> Vec<ParamsLayout> {
    let mut v = params_layouts();
    v.push(params_layout!(SelftestParams { out, r#in, words, wide, n, arg, width }));
    v
}

/// (name, offset, size) of one field.
type Field = (String, usize, usize);

#[test]
fn params_mirrors_match_the_cxx_layouts() {
    for image in images().into_iter().chain([memwall::kernels::simt_hip()]) {
        let mut cxx: BTreeMap<String, (usize, Vec<Field>)> = BTreeMap::new();
        for f in image.layouts() {
            let e = cxx.entry(f.strct.clone()).or_insert((f.struct_size, Vec::new()));
            e.1.push((f.field, f.offset, f.size));
        }
        assert!(!cxx.is_empty(), "{}: no MW_LAYOUT entries", image.label);
        let rust: BTreeMap<&str, ParamsLayout> = rust_layouts().into_iter().map(|l| (l.name, l)).collect();
        for (name, (size, fields)) in &cxx {
            let r = rust.get(name.as_str()).unwrap_or_else(|| {
                panic!(
                    "{}: params struct {name} has no Rust mirror in gpu::ops::params_layouts()",
                    image.label
                )
            });
            assert_eq!(r.size, *size, "{name}: Rust size {} vs C++ {size}", r.size);
            let rf: Vec<(String, usize, usize)> =
                r.fields.iter().map(|&(f, o, s)| (f.to_string(), o, s)).collect();
            assert_eq!(&rf, fields, "{name}: Rust fields (name, offset, size) vs C++");
        }
        if image.label == "cuda" {
            for name in rust.keys() {
                assert!(
                    cxx.contains_key(*name),
                    "Rust mirror {name} has no MW_LAYOUT in kernels-cuda/params"
                );
            }
        }
    }
}

#[test]
fn params_layout_macro_reads_offsets_and_sizes() {
    let l = params_layout!(SelftestParams { out, r#in, words, wide, n, arg, width });
    assert_eq!(l.name, "SelftestParams");
    assert_eq!(l.size, 48);
    assert_eq!(l.fields[1], ("in", 8, 8));
    assert_eq!(l.fields[6], ("width", 44, 4));
}

// ---------------------------------------------------------------------------------------------
// Barriers and shared memory

/// The block shapes: whole warps, partial warps, one thread, the most threads, 3-D.
const BLOCKS: [[u32; 3]; 7] =
    [[256, 1, 1], [48, 1, 1], [1, 1, 1], [1024, 1, 1], [4, 3, 5], [33, 2, 1], [100, 1, 1]];

/// out = in reversed within each block of `t` threads (threads past n read 0).
fn reversed(n: usize, t: usize, input: &[f32]) -> Vec<f32> {
    (0..n)
        .map(|g| {
            let (b, i) = (g / t, g % t);
            let src = b * t + (t - 1 - i);
            if src < n { input[src] } else { 0.0 }
        })
        .collect()
}

#[test]
fn barrier_orders_shared_memory_under_every_schedule() {
    for (label, dev) in devices() {
        for block in BLOCKS {
            let cfg = LaunchCfg { grid: [3, 1, 1], block, shared_bytes: 0 };
            let t = threads(&cfg);
            let n = (3 * t).saturating_sub(5).max(1);
            let input = index_values(n);
            for rounds in [1, 2, 3] {
                let case = Case {
                    out: vec![POISON; n],
                    input: input.clone(),
                    n: n as u64,
                    arg: rounds,
                    ..Case::default()
                };
                let got = run(&dev, &label, "selftest_reverse_f32", cfg, &case);
                let want = if rounds % 2 == 1 { reversed(n, t, &input) } else { input.clone() };
                assert_same_f32(&format!("{label} reverse block {block:?} rounds {rounds}"), &got.out, &want);
            }
        }
    }
}

/// MW_SHARED arrays (simt.h block_shared): one per declaration and block, shared by the block's
/// threads across barriers, each filled with 0xff bytes when the block starts (so blocks never see
/// each other's values), and more than the static shared memory limit is a launch error.
#[test]
fn shared_arrays_are_per_block_poisoned_and_bounded() {
    for (label, dev) in devices() {
        let t = 96;
        let cfg = LaunchCfg::linear(3, t as u32, 0);
        let case = Case { words: vec![0x1234_5678; 3 * 3 * t], n: 0, ..Case::default() };
        let got = run(&dev, &label, "selftest_shared_arrays", cfg, &case);
        let mut want = Vec::new();
        for b in 0..3u32 {
            want.extend(std::iter::repeat_n(u32::MAX, t));
            want.extend((0..t).map(|i| (((t - 1 - i) as f32) + 0.5).to_bits()));
            want.extend((0..t as u32).map(|i| 7 * ((i + 1) % t as u32) + b));
        }
        assert_same(&format!("{label} MW_SHARED"), &got.words, &want);
        let e = launch_error(&dev, "selftest_shared_arrays", cfg, &Case { arg: 1, ..case });
        assert!(e.contains("exceed the 65536 bytes of static shared memory"), "{label}: {e:?}");
    }
}

/// The evidence that the schedules catch a missing barrier: the same exchange without
/// `__syncthreads` must give a wrong answer under at least one schedule (here: under all).
#[test]
fn missing_barrier_gives_a_wrong_result() {
    for image in images() {
        let mut wrong = Vec::new();
        for s in SCHEDULES {
            let dev = EmuDevice::new(image, s);
            let cfg = LaunchCfg::linear(2, 128, 0);
            let n = 256;
            let input = index_values(n);
            let case = Case { out: vec![POISON; n], input: input.clone(), n: n as u64, ..Case::default() };
            let got = run(&dev, image.label, "selftest_reverse_nobarrier_f32", cfg, &case);
            if got.out != reversed(n, 128, &input) {
                wrong.push(s);
            }
        }
        eprintln!("{}: the missing barrier gives a wrong result under {wrong:?}", image.label);
        assert_eq!(wrong.len(), SCHEDULES.len(), "{}: a missing barrier went unnoticed", image.label);
    }
}

#[test]
fn dynamic_shared_memory_is_poisoned_then_shared() {
    for (label, dev) in devices() {
        for t in [1u32, 100, 256] {
            let cfg = LaunchCfg::linear(2, t, t * 4);
            let n = 2 * t as usize - 1;
            let input = index_values(n);
            let case = Case {
                out: vec![POISON; n],
                input: input.clone(),
                words: vec![0; n],
                n: n as u64,
                ..Case::default()
            };
            let got = run(&dev, &label, "selftest_reverse_dynamic_f32", cfg, &case);
            assert_same_f32(
                &format!("{label} dynamic reverse {t}"),
                &got.out,
                &reversed(n, t as usize, &input),
            );
            // Each block starts with every byte 0xff, even after the previous block wrote.
            assert_same(&format!("{label} dynamic poison {t}"), &got.words, &vec![u32::MAX; n]);
        }
    }
}

#[test]
fn syncthreads_count_and_or() {
    for (label, dev) in devices() {
        for block in [[64, 1, 1], [48, 1, 1], [5, 2, 3]] {
            let cfg = LaunchCfg { grid: [4, 1, 1], block, shared_bytes: 0 };
            let t = threads(&cfg);
            let n = 4 * t - 3;
            let mut rng = Rng::new(7);
            // Block 0 all positive, block 1 all negative, blocks 2-3 mixed (and the tail).
            let input: Vec<f32> = (0..n)
                .map(|g| match g / t {
                    0 => 0.5,
                    1 => -0.5,
                    _ => rng.unit(),
                })
                .collect();
            let case =
                Case { input: input.clone(), words: vec![u32::MAX; n], n: n as u64, ..Case::default() };
            let got = run(&dev, &label, "selftest_barrier_vote", cfg, &case);
            let want: Vec<u32> = (0..n)
                .map(|g| {
                    let b = g / t;
                    let count = (b * t..(b + 1) * t).filter(|&i| i < n && input[i] > 0.0).count() as u32;
                    count | u32::from(count == t as u32) << 16 | u32::from(count > 0) << 17
                })
                .collect();
            assert_same(&format!("{label} syncthreads_count/and/or block {block:?}"), &got.words, &want);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shuffles and votes

#[derive(Clone, Copy, Debug)]
enum Shfl {
    Idx,
    Up,
    Down,
    Xor,
}

/// The lane whose value lane `lane` receives, after the CUDA programming guide ("Warp Shuffle
/// Functions"): the warp splits into groups of `width` lanes; __shfl_sync reads lane `arg` modulo
/// `width` of the caller's group; __shfl_up_sync lane - delta, unless that leaves the group
/// (then its own value); __shfl_down_sync lane + delta, likewise; __shfl_xor_sync lane ^ mask,
/// which may reach an earlier group but not a later one (then its own value).
fn shfl_source(kind: Shfl, lane: usize, arg: i32, width: usize) -> usize {
    let first = lane / width * width;
    match kind {
        Shfl::Idx => first + arg.rem_euclid(width as i32) as usize,
        Shfl::Up => {
            if lane - first >= arg as usize {
                lane - arg as usize
            } else {
                lane
            }
        }
        Shfl::Down => {
            if lane - first + (arg as usize) < width {
                lane + arg as usize
            } else {
                lane
            }
        }
        Shfl::Xor => {
            let j = lane ^ arg as usize;
            if j < first + width { j } else { lane }
        }
    }
}

#[test]
fn shuffles_follow_the_programming_guide() {
    for (label, dev) in devices() {
        let warp = dev.info().warp_size as usize;
        let cfg = LaunchCfg::linear(2, 2 * warp as u32, 0);
        let n = 4 * warp - 3; // the tail's threads still take part
        let input = index_values(n);
        let mut widths = vec![warp, 16, 8, 2, 1];
        widths.dedup();
        for kind in [Shfl::Idx, Shfl::Up, Shfl::Down, Shfl::Xor] {
            let name = match kind {
                Shfl::Idx => "selftest_shfl_idx_f32",
                Shfl::Up => "selftest_shfl_up_f32",
                Shfl::Down => "selftest_shfl_down_f32",
                Shfl::Xor => "selftest_shfl_xor_f32",
            };
            for &width in &widths {
                let args: Vec<i32> = match kind {
                    Shfl::Idx => vec![0, 3, width as i32 - 1, width as i32 + 2, -1],
                    Shfl::Up | Shfl::Down => vec![0, 1, 5, width as i32, warp as i32 + 1],
                    Shfl::Xor => vec![0, 1, 3, 16, warp as i32 - 1, warp as i32],
                };
                for arg in args {
                    let case = Case {
                        out: vec![POISON; n],
                        input: input.clone(),
                        n: n as u64,
                        arg,
                        width: width as i32,
                        ..Case::default()
                    };
                    let got = run(&dev, &label, name, cfg, &case);
                    let want: Vec<f32> = (0..n)
                        .map(|g| {
                            let (base, lane) = (g / warp * warp, g % warp);
                            let src = base + shfl_source(kind, lane, arg, width);
                            if src < n { input[src] } else { 0.0 }
                        })
                        .collect();
                    assert_same_f32(&format!("{label} {kind:?} width {width} arg {arg}"), &got.out, &want);
                }
            }
        }
    }
}

#[test]
fn shuffles_move_64_bit_values() {
    for (label, dev) in devices() {
        let warp = dev.info().warp_size as usize;
        let cfg = LaunchCfg::linear(2, warp as u32, 0);
        let n = 2 * warp;
        // Both halves differ per lane, so a shuffle that moved 32 bits shows.
        let wide: Vec<u64> = (0..n as u64).map(|i| (i + 1) << 32 | (0xabc0 + i)).collect();
        for (width, arg) in [(warp, 7), (8, 3)] {
            let case = Case { wide: wide.clone(), n: n as u64, arg, width: width as i32, ..Case::default() };
            let got = run(&dev, &label, "selftest_shfl_idx_u64", cfg, &case);
            let want: Vec<u64> = (0..n)
                .map(|g| wide[g / warp * warp + shfl_source(Shfl::Idx, g % warp, arg, width)])
                .collect();
            assert_same(&format!("{label} u64 idx width {width}"), &got.wide, &want);
        }
        let doubles: Vec<u64> = (0..n).map(|i| (i as f64 * 1.000_000_000_1 + 0.5).to_bits()).collect();
        let case = Case { wide: doubles.clone(), n: n as u64, arg: 2, width: warp as i32, ..Case::default() };
        let got = run(&dev, &label, "selftest_shfl_down_f64", cfg, &case);
        let want: Vec<u64> =
            (0..n).map(|g| doubles[g / warp * warp + shfl_source(Shfl::Down, g % warp, 2, warp)]).collect();
        assert_same(&format!("{label} f64 down"), &got.wide, &want);
    }
}

#[test]
fn shuffles_in_a_partial_warp_read_poison_beyond_the_block() {
    for (label, dev) in devices() {
        let warp = dev.info().warp_size as usize;
        for t in [warp + warp / 2, 3, warp - 1] {
            let cfg = LaunchCfg::linear(2, t as u32, 0);
            let n = 2 * t;
            let input = index_values(n);
            for arg in [1, warp as i32 / 2] {
                let case =
                    Case { out: vec![POISON; n], input: input.clone(), n: n as u64, arg, ..Case::default() };
                let got = run(&dev, &label, "selftest_shfl_xor_active_f32", cfg, &case);
                let want: Vec<f32> = (0..n)
                    .map(|g| {
                        let (b, i) = (g / t, g % t);
                        let (base, lane) = (i / warp * warp, i % warp);
                        let src = base + shfl_source(Shfl::Xor, lane, arg, warp);
                        // A lane beyond the block is outside the collective: all-ones bits.
                        if src < t { input[b * t + src] } else { f32::from_bits(u32::MAX) }
                    })
                    .collect();
                assert_same_f32(&format!("{label} xor {arg} in blocks of {t}"), &got.out, &want);
            }
        }
    }
}

#[test]
fn votes_over_whole_and_partial_warps() {
    for (label, dev) in devices() {
        let warp = dev.info().warp_size as usize;
        for t in [2 * warp, warp + 5, 1, 7] {
            let cfg = LaunchCfg::linear(3, t as u32, 0);
            let n = 3 * t;
            let mut rng = Rng::new(11);
            // Warp 0 of block 0 all positive, block 1 all negative, the rest random.
            let input: Vec<f32> = (0..n)
                .map(|g| match g / t {
                    0 => 0.5,
                    1 => -0.5,
                    _ => rng.unit(),
                })
                .collect();
            let case = Case {
                input: input.clone(),
                words: vec![u32::MAX; n],
                wide: vec![u64::MAX; n],
                n: n as u64,
                ..Case::default()
            };
            let got = run(&dev, &label, "selftest_vote", cfg, &case);
            let (mut want_wide, mut want_words) = (Vec::new(), Vec::new());
            for g in 0..n {
                let (b, i) = (g / t, g % t);
                let first = i / warp * warp;
                let lanes = (first..(first + warp).min(t)).map(|j| b * t + j);
                let ballot = lanes
                    .clone()
                    .filter(|&j| input[j] > 0.0)
                    .fold(0u64, |m, j| m | 1 << ((j - b * t) % warp));
                let all_lanes = lanes.fold(0u64, |m, j| m | 1 << ((j - b * t) % warp));
                want_wide.push(ballot);
                want_words.push(u32::from(ballot != 0) | u32::from(ballot == all_lanes) << 1);
            }
            assert_same(&format!("{label} ballot blocks of {t}"), &got.wide, &want_wide);
            assert_same(&format!("{label} any/all blocks of {t}"), &got.words, &want_words);
        }
    }
}

#[test]
fn syncwarp_orders_shared_memory_within_a_warp() {
    for (label, dev) in devices() {
        let warp = dev.info().warp_size;
        let cfg = LaunchCfg::linear(2, 2 * warp, 0);
        let n = 4 * warp as usize;
        let input = index_values(n);
        let case = Case { out: vec![POISON; n], input: input.clone(), n: n as u64, ..Case::default() };
        let got = run(&dev, &label, "selftest_syncwarp_f32", cfg, &case);
        let want: Vec<f32> = (0..n).map(|g| input[g ^ 1]).collect();
        assert_same_f32(&format!("{label} syncwarp"), &got.out, &want);
    }
}

// ---------------------------------------------------------------------------------------------
// Atomics, grids, launch bounds

#[test]
fn atomics_across_blocks() {
    for (label, dev) in devices() {
        let cfg = LaunchCfg::linear(3, 100, 0);
        let total = 300u32;
        let case = Case {
            out: vec![0.0],
            words: vec![0, 0, u32::MAX, 0, 12345, 1000, 0, 0],
            wide: vec![0],
            n: u64::from(total),
            ..Case::default()
        };
        let got = run(&dev, &label, "selftest_atomics", cfg, &case);
        assert_eq!(got.words[0], total, "{label}: atomicAdd u32");
        assert_eq!(got.out[0], total as f32, "{label}: atomicAdd f32");
        assert_eq!(got.words[1], total - 1, "{label}: atomicMax");
        assert_eq!(got.words[2], 5, "{label}: atomicMin");
        assert_eq!(got.wide[0], u64::from(total) * u64::from(total - 1) / 2, "{label}: atomicAdd u64");
        assert_eq!(got.words[3], total, "{label}: atomicCAS loop");
        assert!(got.words[4] < total, "{label}: atomicExch left {}", got.words[4]);
        assert_eq!(got.words[5], 1000 - total, "{label}: atomicSub");
        assert_eq!(got.words[6], u32::MAX, "{label}: atomicOr");
        assert_eq!(got.words[7], total % 3, "{label}: atomicInc wraps after 2");
    }
}

#[test]
fn three_dimensional_grids_and_blocks() {
    for (label, dev) in devices() {
        for (grid, block) in [([3, 2, 4], [5, 3, 2]), ([1, 1, 1], [1, 1, 1]), ([2, 3, 1], [7, 1, 3])] {
            let cfg = LaunchCfg { grid, block, shared_bytes: 0 };
            let (t, nb) = (threads(&cfg), blocks(&cfg));
            let case = Case { words: vec![u32::MAX; 8 * t * nb], n: (t * nb) as u64, ..Case::default() };
            let got = run(&dev, &label, "selftest_grid_u32", cfg, &case);
            let pack = |d: [u32; 3]| d[0] | d[1] << 8 | d[2] << 16;
            let mut want = Vec::new();
            for bz in 0..grid[2] {
                for by in 0..grid[1] {
                    for bx in 0..grid[0] {
                        for tz in 0..block[2] {
                            for ty in 0..block[1] {
                                for tx in 0..block[0] {
                                    want.extend([bx, by, bz, tx, ty, tz, pack(grid), pack(block)]);
                                }
                            }
                        }
                    }
                }
            }
            assert_same(&format!("{label} grid {grid:?} block {block:?}"), &got.words, &want);
        }
    }
}

#[test]
fn launch_bounds_are_enforced() {
    let dev = EmuDevice::new(memwall::kernels::simt_cuda(), Schedule::Forward);
    let case = Case { words: vec![0; 128], n: 128, ..Case::default() };
    let got = run(&dev, "cuda", "selftest_bounded_128", LaunchCfg::linear(1, 128, 0), &case);
    assert!(got.words.iter().all(|&w| w == 1));
    let case = Case { words: vec![0; 129], n: 129, ..Case::default() };
    let e = launch_error(&dev, "selftest_bounded_128", LaunchCfg::linear(1, 129, 0), &case);
    assert!(e.contains("launch bounds (128)"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Faults become launch errors

fn expect_error(name: &'static str, cfg: LaunchCfg, case: &Case, wanted: &[&str]) {
    for (label, dev) in devices() {
        if !dev.image().kernels().iter().any(|k| k == name) && name != "no_such_kernel" {
            continue;
        }
        let e = launch_error(&dev, name, cfg, case);
        for w in wanted {
            assert!(e.contains(w), "{label}: {name}: error {e:?} lacks {w:?}");
        }
    }
}

fn small_case() -> Case {
    Case {
        out: vec![0.0; 1024],
        input: vec![0.5; 1024],
        words: vec![0; 1024],
        wide: vec![0; 1024],
        n: 1024,
        ..Case::default()
    }
}

#[test]
fn unknown_kernel_is_an_error() {
    expect_error(
        "no_such_kernel",
        LaunchCfg::linear(1, 32, 0),
        &small_case(),
        &["unknown kernel `no_such_kernel`"],
    );
}

#[test]
fn params_size_mismatch_is_an_error() {
    for (label, dev) in devices() {
        let p = [0u8; 40];
        // SAFETY: the layer rejects the launch before running the kernel (wrong params size).
        let r = unsafe { dev.launch("selftest_reverse_f32", LaunchCfg::linear(1, 32, 0), &p) };
        let e = r.expect_err("a short params struct must fail").to_string();
        assert!(e.contains("params of 40 bytes") && e.contains("48"), "{label}: {e}");
    }
}

#[test]
fn launch_geometry_limits_are_errors() {
    let case = small_case();
    expect_error("selftest_reverse_f32", LaunchCfg::linear(1, 1025, 0), &case, &["limits"]);
    expect_error(
        "selftest_reverse_f32",
        LaunchCfg { grid: [1, 1, 1], block: [32, 32, 2], shared_bytes: 0 },
        &case,
        &["2048 threads exceeds 1024"],
    );
    expect_error("selftest_reverse_f32", LaunchCfg::linear(0, 32, 0), &case, &["limits"]);
    expect_error(
        "selftest_reverse_dynamic_f32",
        LaunchCfg::linear(1, 32, 227 * 1024 + 1),
        &case,
        &["dynamic shared memory exceed"],
    );
}

#[test]
fn deadlock_is_an_error_naming_block_and_threads() {
    expect_error(
        "selftest_deadlock",
        LaunchCfg::linear(1, 32, 0),
        &small_case(),
        &[
            "block (0,0,0): deadlock",
            "wait at __syncthreads (thread (0,0,0)",
            "warp 0 lanes 1-31 in __shfl_sync (mask 0x",
        ],
    );
}

#[test]
fn collective_naming_an_exited_lane_is_an_error() {
    expect_error(
        "selftest_exited_lane",
        LaunchCfg::linear(1, 32, 0),
        &small_case(),
        &["thread (5,0,0)", "exited"],
    );
}

#[test]
fn lanes_at_different_collectives_are_an_error() {
    expect_error(
        "selftest_mixed_collectives",
        LaunchCfg::linear(1, 64, 0),
        &small_case(),
        &["different collectives", "__ballot_sync", "__shfl_sync"],
    );
}

#[test]
fn trap_is_an_error_naming_the_thread() {
    let case = Case { arg: 70, ..small_case() };
    expect_error(
        "selftest_trap",
        LaunchCfg::linear(3, 32, 0),
        &case,
        &["__trap", "block (2,0,0) thread (6,0,0)"],
    );
}

#[test]
fn invalid_shuffle_width_is_an_error() {
    for width in [3, 0, 128] {
        let case = Case { width, ..small_case() };
        expect_error("selftest_shfl_idx_f32", LaunchCfg::linear(1, 64, 0), &case, &["width", "power of two"]);
    }
}

/// The layer keeps working after a failed launch (stacks of abandoned fibers are reused).
#[test]
fn launches_after_a_fault_still_work() {
    for (label, dev) in devices() {
        let _ = launch(&dev, "selftest_deadlock", LaunchCfg::linear(1, 64, 0), &small_case());
        let n = 64;
        let input = index_values(n);
        let case =
            Case { out: vec![POISON; n], input: input.clone(), n: n as u64, arg: 1, ..Case::default() };
        let got = run(&dev, &label, "selftest_reverse_f32", LaunchCfg::linear(1, 64, 0), &case);
        assert_same_f32(&label, &got.out, &reversed(n, 64, &input));
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor cores (kernels-cuda/mma.cuh, selftest_mma.cu; wgmma.cuh, selftest_wgmma.cu): warp 32 only

fn cuda_devices() -> Vec<(String, EmuDevice)> {
    devices().into_iter().filter(|(_, d)| d.image().label == "cuda").collect()
}

/// `rows x cols` row-major product of `a` (rows x 16) and `b` (16 x cols) plus `c`, in f64: every
/// selftest input makes it exact, so it is compared bit for bit.
fn product(a: &[f32], b: &[f32], c: Option<&[f32]>, rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|e| {
            let (i, n) = (e / cols, e % cols);
            let sum: f64 = (0..16).map(|k| a[i * 16 + k] as f64 * b[k * cols + n] as f64).sum();
            (sum + c.map_or(0.0, |c| c[e] as f64)) as f32
        })
        .collect()
}

#[test]
fn mma_m16n8k16_follows_the_fragment_layouts() {
    // A[i][k] = 16 i + k, B[k][n] = (8 k + n) / 128, C[i][n] = 8 i + n + 0.5: exact in bf16/f16.
    let a: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..128).map(|i| i as f32 / 128.0).collect();
    let c: Vec<f32> = (0..128).map(|i| i as f32 + 0.5).collect();
    let want = product(&a, &b, Some(&c), 16, 8);
    let input = [a, b, c].concat();
    for (label, dev) in cuda_devices() {
        for name in ["selftest_mma_bf16_f32", "selftest_mma_f16_f32"] {
            let case = Case { out: vec![POISON; 128], input: input.clone(), n: 32, ..Case::default() };
            let got = run(&dev, &label, name, LaunchCfg::linear(1, 32, 0), &case);
            assert_same_f32(&format!("{label} {name}"), &got.out, &want);
        }
    }
}

#[test]
fn ldmatrix_follows_the_ptx_layout() {
    // t[r][c] = 16 r + c; lane l points at row l % 16, column 8 (l / 16); row i of matrix m is
    // the row lane 8 m + i points at.
    let t = |r: usize, c: usize| (16 * r + c) as u32;
    let at = |lane: usize| (lane % 16, 8 * (lane / 16));
    let elem = |m: usize, i: usize, j: usize| {
        let (r, c) = at(8 * m + i);
        t(r, c + j)
    };
    let mut want = vec![0u32; 256];
    for l in 0..32 {
        let (g, q) = (l / 4, l % 4);
        for m in 0..4 {
            want[4 * l + m] = elem(m, g, 2 * q) | elem(m, g, 2 * q + 1) << 16;
            want[128 + 4 * l + m] = elem(m, 2 * q, g) | elem(m, 2 * q + 1, g) << 16;
        }
    }
    for (label, dev) in cuda_devices() {
        let case = Case { words: vec![u32::MAX; 256], n: 32, ..Case::default() };
        let got = run(&dev, &label, "selftest_ldmatrix_u32", LaunchCfg::linear(1, 32, 0), &case);
        assert_same(&format!("{label} ldmatrix x4 (0..128) and x4.trans (128..256)"), &got.words, &want);
    }
}

#[test]
fn ldmatrix_fragments_feed_mma() {
    // A[i][k] = 16 i + k, B[k][n] = (16 k + n) / 256: exact in bf16.
    let a: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..256).map(|i| i as f32 / 256.0).collect();
    let want = product(&a, &b, None, 16, 16);
    let input = [a, b].concat();
    for (label, dev) in cuda_devices() {
        let case = Case { out: vec![POISON; 256], input: input.clone(), n: 32, ..Case::default() };
        let got = run(&dev, &label, "selftest_ldmatrix_mma_bf16", LaunchCfg::linear(1, 32, 0), &case);
        assert_same_f32(&format!("{label} ldmatrix + mma"), &got.out, &want);
    }
}

/// The emulated MFMA (mfma.cuh) at warp 64, against the host product: each lane packs its A, B
/// and C elements from global memory by the documented layout (lane l: A[l % 16][4 (l / 16) + e],
/// B[4 (l / 16) + e][l % 16], C and D[4 (l / 16) + e][l % 16]) and stores D back from the same
/// places, so the product comes out right only if the emulation reads the fragments that way.
/// A block of 48 lanes (a partial wavefront) is an error naming the lanes; at warp 32 the
/// selftest is a trap, as MFMA is a wave-64 instruction.
#[test]
fn mfma_follows_the_fragment_layouts() {
    // A[i][k] = 16 i + k, B[k][n] = (16 k + n) / 256, C[i][n] = 16 i + n + 0.5: exact in bf16.
    let a: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..256).map(|i| i as f32 / 256.0).collect();
    let c: Vec<f32> = (0..256).map(|i| i as f32 + 0.5).collect();
    let want = product(&a, &b, Some(&c), 16, 16);
    let input = [a, b, c].concat();
    let mut ran = 0;
    for (label, dev) in devices() {
        let case = Case { out: vec![POISON; 256], input: input.clone(), n: 64, ..Case::default() };
        match dev.image().label {
            "selftest64" => {
                let got = run(&dev, &label, "selftest_mfma_bf16", LaunchCfg::linear(1, 64, 0), &case);
                assert_same_f32(&format!("{label} mfma 16x16x16 bf16"), &got.out, &want);
                let e = launch_error(&dev, "selftest_mfma_bf16", LaunchCfg::linear(1, 48, 0), &case);
                assert!(e.contains("needs all 64 lanes of the wavefront"), "{label}: {e:?}");
                ran += 1;
            }
            "cuda" => {
                let e = launch_error(&dev, "selftest_mfma_bf16", LaunchCfg::linear(1, 64, 0), &case);
                assert!(e.contains("__trap() called"), "{label}: {e:?}");
            }
            other => panic!("unexpected image {other}"),
        }
    }
    assert_eq!(ran, SCHEDULES.len());
}

#[test]
fn mma_needs_the_whole_warp() {
    let case = Case { out: vec![0.0; 128], input: vec![0.5; 512], n: 32, ..Case::default() };
    expect_error(
        "selftest_mma_bf16_f32",
        LaunchCfg::linear(1, 16, 0),
        &case,
        &["mma.sync needs all 32 lanes"],
    );
    let case = Case { words: vec![0; 256], n: 32, ..Case::default() };
    expect_error(
        "selftest_ldmatrix_u32",
        LaunchCfg::linear(1, 24, 0),
        &case,
        &["ldmatrix needs all 32 lanes"],
    );
}

/// `selftest_wgmma_bf16`'s input: A (64x16), B (16x128) and C (64x128) of small random integers,
/// so every product and sum is exact and the result compares bit for bit.
fn wgmma_input() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(0x3767);
    let mut ints = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.range(0, 17) as f32 - 8.0).collect() };
    (ints(64 * 16), ints(16 * 128), ints(64 * 128))
}

#[test]
fn wgmma_follows_the_fragment_and_descriptor_layouts() {
    let (a, b, c) = wgmma_input();
    let input = [a.clone(), b.clone(), c.clone()].concat();
    for (label, dev) in cuda_devices() {
        for accumulate in [1, 0] {
            let case = Case {
                out: vec![POISON; 64 * 128],
                input: input.clone(),
                width: accumulate,
                ..Case::default()
            };
            let got = run(&dev, &label, "selftest_wgmma_bf16", LaunchCfg::linear(1, 128, 4096), &case);
            let want = product(&a, &b, (accumulate != 0).then_some(&c[..]), 64, 128);
            assert_same_f32(&format!("{label} wgmma accumulate {accumulate}"), &got.out, &want);
        }
    }
}

#[test]
fn wgmma_hazards_and_unemulated_descriptors_are_errors() {
    let (a, b, c) = wgmma_input();
    let input = [a, b, c].concat();
    let cfg = LaunchCfg::linear(1, 128, 4096);
    for (arg, wanted) in [
        (1, "was written before the group completed"),
        (2, "swizzle"),
        (3, "not in the block's dynamic shared memory"),
    ] {
        let case = Case { out: vec![0.0; 64 * 128], input: input.clone(), width: 1, arg, ..Case::default() };
        expect_error("selftest_wgmma_bf16", cfg, &case, &[wanted]);
    }
}

// ---------------------------------------------------------------------------------------------
// AddressSanitizer (scripts/test.sh runs this file again with MEMWALL_SIMT_ASAN=1)

/// An ASan build must abort a launch that reads one element past its input. The read runs in a
/// child process (this test binary, filtered to `oob_read_child`), since ASan ends the process.
#[test]
fn asan_catches_a_read_past_a_buffer() {
    if !memwall::kernels::SIMT_ASAN {
        eprintln!("not an AddressSanitizer build (MEMWALL_SIMT_ASAN=1): nothing to check");
        return;
    }
    let exe = std::env::current_exe().expect("test binary path");
    let out = std::process::Command::new(exe)
        .args(["--exact", "oob_read_child", "--nocapture", "--test-threads=1"])
        .env("MEMWALL_SIMT_OOB_CHILD", "1")
        .output()
        .expect("run the child");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the out-of-bounds read went unnoticed:\n{stderr}");
    assert!(
        stderr.contains("AddressSanitizer: heap-buffer-overflow") && stderr.contains("selftest_oob_read"),
        "the child failed, but not by ASan in selftest_oob_read:\n{stderr}"
    );
}

#[test]
fn oob_read_child() {
    if std::env::var("MEMWALL_SIMT_OOB_CHILD").is_err() {
        return;
    }
    let dev = EmuDevice::new(memwall::kernels::simt_cuda(), Schedule::Forward);
    let case = Case { out: vec![0.0; 1], input: vec![0.5; 17], n: 17, ..Case::default() };
    let _ = launch(&dev, "selftest_oob_read", LaunchCfg::linear(1, 32, 0), &case);
}

// ---------------------------------------------------------------------------------------------
// End to end: add_assign through the emulated backend

static REF: LazyLock<Reference> = LazyLock::new(Reference::default);

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(0x7369_6d74_7465_7374),
        failure_persistence: None,
        max_shrink_iters: 100,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(24))]
    #[test]
    fn add_assign_on_the_emulated_backend_matches_reference(
        rows in select(vec![1usize, 3, 17]),
        cols in select(vec![1usize, 3, 17, 4097]),
        seed in any::<u64>(),
    ) {
        let r = &*REF;
        let mut rng = Rng::new(seed);
        let xv = common::random_values(&mut rng, DType::F32, rows * cols);
        let yv = common::random_values(&mut rng, DType::F32, rows * cols);
        let mut x_ref = upload(r, DType::F32, &[rows, cols], &xv);
        r.add_assign(&mut x_ref, &upload(r, DType::F32, &[rows, cols], &yv))
            .unwrap_or_else(|e| panic!("reference add_assign: {e}"));
        let want = read_f32(r, &x_ref);
        // Both round the exact sum of two f32 values once: bit-identical, bound 0.
        let zero = vec![0.0; rows * cols];
        for (name, g) in emulated() {
            let mut x = upload(&g, DType::F32, &[rows, cols], &xv);
            let y = upload(&g, DType::F32, &[rows, cols], &yv);
            g.add_assign(&mut x, &y).unwrap_or_else(|e| panic!("{name} add_assign: {e}"));
            assert_close(&format!("add_assign {name} ({rows}x{cols})"), &read_f32(&g, &x), &want, &zero);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Speed (not a test: `cargo test --release --features emulate --test simt -- --ignored speed --nocapture`)

#[test]
#[ignore = "prints timings"]
fn speed() {
    let dev = EmuDevice::new(memwall::kernels::simt_cuda(), Schedule::Forward);
    let time = |cfg: LaunchCfg, rounds: i32, iters: u32| {
        let t = threads(&cfg);
        let case =
            Case { out: vec![0.0; t], input: vec![0.5; t], n: t as u64, arg: rounds, ..Case::default() };
        let _ = run(&dev, "speed", "selftest_reverse_f32", cfg, &case);
        let start = std::time::Instant::now();
        for _ in 0..iters {
            let _ = run(&dev, "speed", "selftest_reverse_f32", cfg, &case);
        }
        start.elapsed().as_secs_f64() / f64::from(iters)
    };
    // Two threads, 2 x 100000 barriers: each barrier is 2 fiber runs, each 2 switches.
    let s = time(LaunchCfg::linear(1, 2, 0), 100_000, 3);
    println!("context switch (incl. scheduling): {:.1} ns", s / (200_000.0 * 4.0) * 1e9);
    let s = time(LaunchCfg::linear(1, 256, 0), 5, 200);
    println!("launch of 256 threads with 10 barriers: {:.1} us", s * 1e6);
    let s = time(LaunchCfg::linear(1, 256, 0), 0, 200);
    println!("launch of 256 threads, no barrier: {:.1} us", s * 1e6);
}

/// The process's static thread-local storage (the PT_TLS segment of this test binary, which links
/// every SIMT image) stays small. glibc carves it out of every thread's stack, and Rust's threads
/// get 2 MiB (or the TLS size plus a little, when that is larger), so TLS near 2 MiB leaves the
/// test harness's, rayon's and NVRTC's threads almost no stack. It reached 2.4 MiB when the
/// kernels' shared arrays were `static thread_local` (one copy per kernel); MW_SHARED keeps them
/// in per-block allocations (simt.h block_shared), and this holds the line.
#[test]
fn static_tls_stays_small() {
    let exe = std::fs::read("/proc/self/exe").expect("read /proc/self/exe");
    assert_eq!(&exe[..4], b"\x7fELF");
    assert_eq!(exe[4], 2, "a 64-bit ELF");
    let u16_at = |o: usize| u16::from_le_bytes(exe[o..o + 2].try_into().unwrap()) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(exe[o..o + 8].try_into().unwrap());
    let (phoff, phentsize, phnum) = (u64_at(0x20) as usize, u16_at(0x36), u16_at(0x38));
    const PT_TLS: u32 = 7;
    let tls: u64 = (0..phnum)
        .map(|i| phoff + i * phentsize)
        .filter(|&ph| u32::from_le_bytes(exe[ph..ph + 4].try_into().unwrap()) == PT_TLS)
        .map(|ph| u64_at(ph + 0x28))
        .sum();
    assert!(tls > 0, "the SIMT layer's thread-local scheduler is in the PT_TLS segment");
    assert!(
        tls <= 256 << 10,
        "{tls} bytes of static TLS: a kernel declares a large `__shared__` array (use MW_SHARED)"
    );
}

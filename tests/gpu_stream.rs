//! The memory-ceiling kernels of the GPU backend (`kernels-cuda/stream.cu`), the ones
//! `memwall peak --backend cuda` times: the read kernel's wrapping word sum against the host's,
//! the copy against its source (destination poisoned first, a guard past its end), odd vector
//! counts (1, 3, 17, a block's worth and one more, 4097, and enough for several grid-stride passes
//! with the unrolled loop and its tail), and the launcher's checks. Also the device's memset
//! (`Device::zero`, `Backend::zero`): a range inside a buffer of random bytes, nothing outside it.
//!
//! Runs on each emulated backend (`--features memwall/emulate`) and, ignored unless asked for, on
//! a CUDA or ROCm device (`--features memwall/cuda` or `memwall/hip`, `-- --ignored`; `MEMWALL_REQUIRE_GPU=1` makes a missing
//! device fail).

#![cfg_attr(
    not(any(feature = "emulate", feature = "cuda", feature = "hip")),
    allow(dead_code, unused_imports)
)]

mod common;

use common::Rng;
use common::cli::memwall;
use memwall::runtime::gpu::{Device, Gpu};

/// Vector counts (16 bytes each): tiny, a block's unrolled group (256 x 4) and one more, odd
/// sizes, and one that takes several grid-stride passes on the emulator's grid.
const VECS: [usize; 8] = [1, 3, 17, 1024, 1025, 4097, 9999, 70_001];

/// Random bytes (never all zero: a kernel that reads nothing would still sum to 0).
fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

fn host_sum(bytes: &[u8]) -> u32 {
    bytes.chunks_exact(4).fold(0u32, |a, w| a.wrapping_add(u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
}

const GUARD: usize = 64;
const POISON: u8 = 0xa5;

fn stream_cases<D: Device>(g: &Gpu<D>, who: &str, vecs: &[usize]) {
    let dev = g.device();
    let mut rng = Rng::new(0x7374_7265_616d);
    for &v in vecs {
        let bytes = v * 16;
        let data = random_bytes(&mut rng, bytes);
        let mut src = dev.alloc(bytes).unwrap();
        dev.write(&mut src, 0, &data).unwrap();

        let mut sum = dev.alloc(4).unwrap();
        dev.write(&mut sum, 0, &[POISON; 4]).unwrap();
        g.stream_read(&src, bytes, &mut sum).unwrap();
        let mut got = [0u8; 4];
        dev.read(&sum, 0, &mut got).unwrap();
        assert_eq!(u32::from_le_bytes(got), host_sum(&data), "{who}: stream_read of {v} vectors");
        // Read twice: the launcher clears the sum, it does not accumulate across calls.
        g.stream_read(&src, bytes, &mut sum).unwrap();
        dev.read(&sum, 0, &mut got).unwrap();
        assert_eq!(u32::from_le_bytes(got), host_sum(&data), "{who}: second stream_read of {v} vectors");

        let mut dst = dev.alloc(bytes + GUARD).unwrap();
        dev.write(&mut dst, 0, &vec![POISON; bytes + GUARD]).unwrap();
        g.stream_copy(&mut dst, &src, bytes).unwrap();
        let mut out = vec![0u8; bytes + GUARD];
        dev.read(&dst, 0, &mut out).unwrap();
        if let Some(i) = (0..bytes).find(|&i| out[i] != data[i]) {
            panic!("{who}: stream_copy of {v} vectors: byte {i} is {:#04x}, want {:#04x}", out[i], data[i]);
        }
        assert!(
            out[bytes..].iter().all(|&b| b == POISON),
            "{who}: stream_copy of {v} vectors wrote past the end"
        );
    }
}

/// `Device::zero` of ranges inside random bytes (odd offsets and lengths, the whole buffer,
/// nothing) zeroes them and nothing else; `Backend::zero` zeroes a tensor's current rows and not
/// the rest of its storage; past the end is an error that writes nothing.
fn zero_cases<D: Device>(g: &Gpu<D>, who: &str) {
    let dev = g.device();
    let mut rng = Rng::new(0x7a65_726f);
    let len = 70_001;
    for (offset, n) in [(0, len), (1, 3), (17, 4097), (4096, 65_537), (len, 0), (5, 0)] {
        let mut want = random_bytes(&mut rng, len);
        let mut buf = dev.alloc(len).unwrap();
        dev.write(&mut buf, 0, &want).unwrap();
        dev.zero(&mut buf, offset, n).unwrap_or_else(|e| panic!("{who}: zero {n} bytes at {offset}: {e}"));
        want[offset..offset + n].fill(0);
        let mut got = vec![0u8; len];
        dev.read(&buf, 0, &mut got).unwrap();
        if let Some(i) = (0..len).find(|&i| got[i] != want[i]) {
            panic!("{who}: zero {n} bytes at {offset}: byte {i} is {:#04x}, want {:#04x}", got[i], want[i]);
        }
        assert!(dev.zero(&mut buf, offset, len - offset + 1).is_err(), "{who}: zero past the end");
        dev.read(&buf, 0, &mut got).unwrap();
        assert!(got == want, "{who}: a refused zero wrote");
    }
    use memwall::runtime::{Backend, DType};
    let mut t = g.upload_f32(DType::F32, &[3, 5], &[2.5; 15]).unwrap();
    t.set_rows(2).unwrap();
    g.zero(&mut t).unwrap();
    t.set_rows(3).unwrap();
    let v = g.read_f32(&t).unwrap();
    assert!(
        v[..10].iter().all(|&x| x == 0.0) && v[10..].iter().all(|&x| x == 2.5),
        "{who}: Backend::zero {v:?}"
    );
}

fn bad_input<D: Device>(g: &Gpu<D>, who: &str) {
    let dev = g.device();
    let src = dev.alloc(64).unwrap();
    let mut dst = dev.alloc(32).unwrap();
    let mut sum = dev.alloc(4).unwrap();
    let mut short = dev.alloc(2).unwrap();
    let err = |r: memwall::runtime::Result<()>, what: &str| match r {
        Err(memwall::runtime::Error::Argument { msg, .. }) => msg,
        other => panic!("{who}: {what}: want an argument error, got {other:?}"),
    };
    assert!(err(g.stream_read(&src, 0, &mut sum), "0 bytes").contains("multiple of 16"));
    assert!(err(g.stream_read(&src, 24, &mut sum), "24 bytes").contains("multiple of 16"));
    assert!(err(g.stream_read(&src, 80, &mut sum), "past src").contains("src holds 64"));
    assert!(err(g.stream_read(&src, 64, &mut short), "short sum").contains("sum holds"));
    assert!(err(g.stream_copy(&mut dst, &src, 64), "past dst").contains("dst holds 32"));
}

/// `memwall peak --backend cuda` and `--backend hip`: without the feature, an error saying how to
/// build it; with it and no device, the backend's no-device error (a GPU machine runs the command
/// for real in scripts/device-check.sh).
#[test]
fn peak_on_a_gpu_is_an_error_without_a_device() {
    for (backend, want) in common::cli::gpus_without_a_device() {
        let (ok, _, err) = memwall(&["peak", "--backend", backend, "--passes", "1"]);
        assert!(!ok, "{backend} measured without a device");
        assert!(err.contains(&want), "{backend}: {err}");
    }
}

#[test]
fn peak_takes_threads_only_on_the_cpu() {
    let (ok, _, err) = memwall(&["peak", "--backend", "cuda-emu", "--threads", "2"]);
    assert!(!ok);
    assert!(err.contains("--threads is for --backend cpu"), "{err}");
}

#[cfg(feature = "emulate")]
mod emulated {
    use super::*;

    #[test]
    fn every_kernel_is_in_the_image() {
        let have = memwall::kernels::simt_cuda().kernels();
        for name in memwall::runtime::gpu::ops::stream::kernel_names() {
            assert!(have.iter().any(|k| k == name), "{name} is not in the SIMT image");
        }
    }

    #[test]
    fn read_and_copy_match_the_host() {
        for (name, g) in common::gpu::emulated() {
            stream_cases(&g, &name, &VECS);
        }
    }

    /// The command's GPU path end to end on the emulator: both SM kernels measured and checked,
    /// the bytes they count, no datasheet for the emulator.
    #[test]
    fn peak_on_the_emulated_gpu() {
        let (ok, out, err) = memwall(&[
            "peak",
            "--backend",
            "cuda-emu",
            "--working-set-gib",
            "0.0005",
            "--passes",
            "1",
            "--json",
        ]);
        assert!(ok, "{err}");
        let rows: serde_json::Value = serde_json::from_str(&out).expect("json");
        let rows = rows.as_array().expect("an array");
        let kernels: Vec<&str> = rows.iter().map(|r| r["kernel"].as_str().unwrap()).collect();
        assert_eq!(kernels, ["read", "copy"]);
        // 0.0005 GiB = 536871 bytes (rounded up), below one 1 MiB pattern: the pattern shrinks to
        // the working set rounded down to 32 bytes (two halves of whole 16-byte vectors).
        let ws = rows[0]["working_set_bytes"].as_u64().unwrap();
        assert_eq!(ws, 536_864);
        assert_eq!(rows[0]["bytes_per_pass"].as_u64(), Some(ws));
        assert_eq!(rows[1]["bytes_per_pass"].as_u64(), Some(ws / 2 * 2));
        for r in rows {
            assert!(r["gb_per_s"].as_f64().is_some_and(|g| g > 0.0), "{r}");
            assert!(r["fraction_of_datasheet"].is_null(), "{r}");
        }
    }

    #[test]
    fn bad_sizes_are_errors() {
        for (name, g) in common::gpu::emulated() {
            bad_input(&g, &name);
        }
    }

    #[test]
    fn zero_fills_only_its_range() {
        for (name, g) in common::gpu::emulated() {
            zero_cases(&g, &name);
        }
    }
}

device_tests! {
    fn read_and_copy_match_the_host(g, who) {
        // Add a few hundred MB: the full grid, many passes.
        let mut vecs = VECS.to_vec();
        vecs.push((300 << 20) / 16 + 7);
        stream_cases(&g, who, &vecs);
    }

    fn bad_sizes_are_errors(g, who) {
        bad_input(&g, who);
    }

    fn zero_fills_only_its_range(g, who) {
        zero_cases(&g, who);
    }
}

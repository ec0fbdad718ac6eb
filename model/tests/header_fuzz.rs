//! Property tests over checkpoint header parsing and manifest validation: arbitrary bytes, and
//! valid files with bytes flipped, truncated or extended, give a typed error or a checkpoint whose
//! every tensor lies inside the file, never a panic. (The cargo-fuzz target in `model/fuzz` runs
//! the same function under libFuzzer.)

mod common;

use std::path::Path;

use common::*;
use memwall_model::checkpoint::{Checkpoint, parse_header};
use memwall_runtime::DType;
use proptest::prelude::*;

fn valid_file() -> Vec<u8> {
    safetensors_bytes(&[
        encode("a", DType::F32, &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        encode("b", DType::BF16, &[5], &[1.0; 5]),
        encode("c", DType::F8E4M3Fn, &[2, 2], &[0.5; 4]),
    ])
}

fn check(bytes: &[u8]) {
    if let Ok(tensors) = parse_header(Path::new("fuzz"), bytes, 0) {
        let mut end_prev = 0;
        for (_, r) in tensors {
            assert!(r.offset >= end_prev, "overlap");
            assert!(r.offset + r.len <= bytes.len(), "out of bounds");
            end_prev = r.offset + r.len;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        check(&bytes);
    }

    #[test]
    fn mutated_valid_file(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
                          cut in any::<usize>(), extend in 0usize..16) {
        let mut b = valid_file();
        for (i, v) in &flips {
            let n = b.len();
            b[i % n] = *v;
        }
        check(&b);
        let n = b.len();
        check(&b[..cut % n]);
        b.extend(std::iter::repeat_n(0u8, extend));
        check(&b);
    }
}

#[test]
fn mutated_files_through_the_loader() {
    // The whole path (map, parse, manifest) on a corrupted real checkpoint: errors, not panics.
    let cfg = llama_config(64, false);
    let t = store_all(&random_weights(&cfg, 5), DType::BF16);
    let good = safetensors_bytes(&t);
    let dir = TempDir::new("fuzzload");
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let header_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let mut state = 0x1234_5678u64;
    for _ in 0..200 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut b = good.clone();
        // Corrupt the header region, where parsing decisions are made.
        let at = 8 + (state >> 33) as usize % header_len;
        b[at] = (state >> 20) as u8;
        std::fs::write(dir.path().join("model.safetensors"), &b).unwrap();
        let _ = Checkpoint::open_dir(dir.path());
        let _ = memwall_model::Model::load(memwall_runtime::cpu::Reference, dir.path(), |_, _| {});
    }
}

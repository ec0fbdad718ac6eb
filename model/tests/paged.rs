//! The paged KV cache through a session: reserve / release / OutOfBlocks / NotReserved, and
//! generation that gives the same tokens and logits whatever the block size and however the
//! pool's blocks were scattered by earlier sequences; contexts filled by `Session::fill_context`
//! read back through the block table.

mod common;

use common::*;
use memwall_model::session::Row;
use memwall_model::{GenerateOptions, Generation, Model, ModelError, Session, SessionOptions};
use memwall_runtime::{Backend, DType, SamplingParams, cpu};
use serde_json::Value;

fn model<B: Backend>(b: B, cfg: &Value, dir: &TempDir) -> Model<B>
where
    B::Storage: 'static,
{
    let w = random_weights(cfg, 33);
    write_model(dir.path(), cfg, &store_all(&w, DType::F32));
    Model::load(b, dir.path(), |_, _| {}).expect("load")
}

fn opts(batch: usize, capacity: usize, block_size: usize, num_blocks: usize) -> SessionOptions {
    SessionOptions {
        max_batch: batch,
        capacity,
        cache_dtype: DType::F32,
        block_size,
        num_blocks,
        ..Default::default()
    }
}

fn recorded(n: usize) -> GenerateOptions {
    GenerateOptions { max_new_tokens: n, record_logits: true, ..Default::default() }
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 6, 7, 8, 9, 10, 11], vec![12, 13], vec![14, 15, 16, 17]]
}

/// Tokens and every logit equal (bit for bit: each backend sums the same positions in the same
/// order whatever block holds them).
fn assert_same(what: &str, got: &Generation, want: &Generation) {
    assert_eq!(got.tokens, want.tokens, "{what}: tokens");
    assert_eq!(got.prefill_logits, want.prefill_logits, "{what}: prefill logits");
    assert_eq!(got.decode_logits, want.decode_logits, "{what}: decode logits");
}

#[test]
fn block_size_and_scattered_blocks_change_no_result() {
    fn check<B: Backend>(b: B, name: &str)
    where
        B::Storage: 'static,
    {
        let dir = TempDir::new(&format!("paged-{name}"));
        let m = model(b, &llama_config(64, false), &dir);
        let capacity = 20;
        // The contiguous layout: one block of the whole capacity per slot.
        let mut s = Session::new(&m, opts(3, capacity, capacity, 0)).unwrap();
        assert_eq!((s.total_blocks(), s.block_size()), (3, capacity));
        let want = s.generate(&prompts(), &recorded(9)).unwrap();
        assert_eq!(s.free_blocks(), 3, "generate released its blocks");
        for bs in [1, 3, 16, 7] {
            let mut s = Session::new(&m, opts(3, capacity, bs, 0)).unwrap();
            assert_eq!(s.total_blocks(), 3 * capacity.div_ceil(bs));
            let got = s.generate(&prompts(), &recorded(9)).unwrap();
            assert_same(&format!("{name}: block size {bs}"), &got, &want);
            assert_eq!(s.free_blocks(), s.total_blocks(), "{name}: block size {bs}: blocks leaked");
            // Scatter the free list: reserve slots in a mixed order, release some, so the next
            // generation's blocks are out of order and interleaved across slots.
            s.reserve(2, 5).unwrap();
            s.reserve(0, 2).unwrap();
            s.reserve(1, 11).unwrap();
            s.release(2);
            s.reserve(2, 1).unwrap();
            s.release(0);
            s.release(2);
            s.release(1);
            let got = s.generate(&prompts(), &recorded(9)).unwrap();
            assert_same(&format!("{name}: block size {bs}, scattered blocks"), &got, &want);
            assert_eq!(s.free_blocks(), s.total_blocks());
        }
    }
    check(cpu::Reference, "reference");
    check(cpu::Fast::with_threads(2).unwrap(), "fast");
}

#[test]
fn a_small_pool_runs_what_fits_and_refuses_the_rest() {
    let dir = TempDir::new("paged-small");
    let m = model(cpu::Reference, &llama_config(64, false), &dir);
    // 3 slots of 20 positions, but only 6 blocks of 4 positions (24 positions in all).
    let mut s = Session::new(&m, opts(3, 20, 4, 6)).unwrap();
    assert_eq!((s.total_blocks(), s.free_blocks(), s.block_size()), (6, 6, 4));
    // 7 + 9 and 2 + 9 positions: 4 + 3 blocks > 6: refused before any compute, nothing kept.
    let e = s.generate(&prompts()[..2], &recorded(9)).unwrap_err();
    assert!(matches!(e, ModelError::OutOfBlocks { slot: 1, needed: 3, free: 2 }), "{e}");
    assert_eq!(s.free_blocks(), 6);
    // What fits runs, equal to a session with the default pool.
    let got = s.generate(&prompts()[..2], &recorded(5)).unwrap();
    let mut full = Session::new(&m, opts(3, 20, 4, 0)).unwrap();
    let want = full.generate(&prompts()[..2], &recorded(5)).unwrap();
    assert_same("a pool of 6 blocks", &got, &want);
    assert_eq!(s.free_blocks(), 6);
}

#[test]
fn steps_need_reserved_positions() {
    let dir = TempDir::new("paged-steps");
    let m = model(cpu::Reference, &llama_config(64, false), &dir);
    let mut s = Session::new(&m, opts(2, 16, 4, 0)).unwrap();
    let greedy = SamplingParams::GREEDY;
    let row = |slot, pos| Row { token: 3, slot, pos };
    // Nothing reserved: refused, typed.
    let e = s.step(&[row(0, 0)], &[0], false, false, (&greedy, &[0], &[0])).unwrap_err();
    assert!(matches!(e, ModelError::NotReserved { slot: 0, pos: 0, reserved: 0 }), "{e}");
    s.reserve(0, 3).unwrap();
    assert_eq!(s.reserved_len(0), 4);
    let prefill: Vec<Row> = (0..4).map(|p| row(0, p)).collect();
    s.step(&prefill, &[3], false, false, (&greedy, &[0], &[0])).unwrap();
    let e = s.step(&[row(0, 4)], &[0], false, false, (&greedy, &[0], &[0])).unwrap_err();
    assert!(matches!(e, ModelError::NotReserved { slot: 0, pos: 4, reserved: 4 }), "{e}");
    // Slot 1 has nothing, even when slot 0 does.
    let e = s.step(&[row(0, 1), row(1, 0)], &[0, 1], false, false, (&greedy, &[0; 2], &[0; 2])).unwrap_err();
    assert!(matches!(e, ModelError::NotReserved { slot: 1, pos: 0, reserved: 0 }), "{e}");
    // Growing the reservation lets the next position run; the session is still usable.
    s.reserve(0, 5).unwrap();
    s.step(&[row(0, 4)], &[0], false, false, (&greedy, &[0], &[0])).unwrap();
    let e = s.reserve(1, 17).unwrap_err();
    assert!(matches!(e, ModelError::CacheTooShort { needed: 17, capacity: 16, .. }), "{e}");
    s.release(0);
    s.release(0);
    assert_eq!((s.free_blocks(), s.reserved_len(0)), (s.total_blocks(), 0));
    let e = s.step(&[row(0, 0)], &[0], false, false, (&greedy, &[0], &[0])).unwrap_err();
    assert!(matches!(e, ModelError::NotReserved { .. }), "{e}");
    let bad = Session::new(&m, opts(2, 16, 0, 0)).err().expect("block size 0");
    assert!(matches!(bad, ModelError::Session(_)), "{bad}");
}

#[test]
fn filled_contexts_are_read_through_the_block_table() {
    fn check<B: Backend>(b: B, name: &str)
    where
        B::Storage: 'static,
    {
        let dir = TempDir::new(&format!("paged-fill-{name}"));
        let m = model(b, &llama_config(64, false), &dir);
        let greedy = SamplingParams::GREEDY;
        let (len, capacity) = (21, 40);
        // Slot 1's logits at position `len` after `fill` positions of it were filled from `seed`.
        // Scattered: slot 1's blocks come after slot 0 released its, and slot 2 is filled too,
        // after slot 1.
        let logits = |block_size: usize, scatter: bool, fill: usize, seed: u64| {
            let mut s = Session::new(&m, opts(3, capacity, block_size, 0)).unwrap();
            if scatter {
                s.reserve(0, 9).unwrap();
                s.reserve(2, 13).unwrap();
                s.release(0);
            }
            s.reserve(1, fill.max(len + 1)).unwrap();
            s.fill_context(1, fill, seed).unwrap();
            if scatter {
                s.fill_context(2, 13, seed + 1).unwrap();
            }
            let row = Row { token: 3, slot: 1, pos: len as u32 };
            s.step(&[row], &[0], false, true, (&greedy, &[0], &[0])).unwrap().logits.unwrap()
        };
        let want = logits(capacity, false, len, 5);
        assert!(want.iter().all(|x| x.is_finite()), "{name}");
        // The same bits through scattered blocks of 4 or 7 positions, with another slot filled.
        for bs in [4, 7] {
            assert_eq!(logits(bs, true, len, 5), want, "{name}: block size {bs}");
        }
        // Positions filled past the step's: overwritten (len) or not attended to.
        assert_eq!(logits(4, true, capacity, 5), want, "{name}: filled to capacity");
        // Another seed is another context.
        assert_ne!(logits(4, true, len, 6), want, "{name}: seed 6");

        let mut s = Session::new(&m, opts(3, capacity, 4, 0)).unwrap();
        s.reserve(1, 10).unwrap();
        let e = s.fill_context(1, 13, 0).unwrap_err();
        assert!(matches!(e, ModelError::NotReserved { slot: 1, pos: 12, reserved: 12 }), "{name}: {e}");
        let e = s.fill_context(3, 1, 0).unwrap_err();
        assert!(matches!(e, ModelError::BatchTooLarge { got: 4, allocated: 3 }), "{name}: {e}");
        s.fill_context(1, 0, 0).unwrap();
    }
    check(cpu::Reference, "reference");
    check(cpu::Fast::with_threads(2).unwrap(), "fast");
}

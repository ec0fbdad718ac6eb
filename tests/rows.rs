//! Tensors run at fewer rows than allocated (`Tensor::set_rows`): every op, on both CPU backends,
//! reads and writes only the current rows. Each tensor lives in storage for `MAX` rows whose spare
//! rows hold the poison pattern (NaN, `0xFFFFFFFF`); the op must give bytes identical to the same
//! op on exactly sized tensors (so no poison was read: a NaN would spread, a huge index would
//! fail) and leave every spare byte of every tensor intact (so nothing was written there).

mod common;

use common::spare::{ROWS, f32_pair, pair_at as pair};
use common::*;
use memwall_runtime::cpu::{Fast, Reference};
use memwall_runtime::{Backend, DType, HostStorage, HostTensor, KvCacheLayer, Linear, Rope, SamplingParams};

fn u32_pair<B: Backend<Storage = HostStorage>>(b: &B, rows: usize, vals: &[u32]) -> (HostTensor, HostTensor) {
    pair(b, DType::U32, rows, &[], bytemuck::cast_slice(vals))
}

/// The spare tensor equals the exact one over its rows, and its spare rows are still poison.
fn same(name: &str, exact: &HostTensor, spare: &HostTensor) {
    let all = spare.storage().bytes();
    let (head, tail) = all.split_at(spare.nbytes());
    assert_same_bytes(&format!("{name}: rows"), spare.dtype(), head, exact.storage().bytes());
    let want = poison_bytes(spare.dtype(), tail.len() / spare.dtype().size());
    if let Some(i) = tail.iter().zip(&want).position(|(g, w)| g != w) {
        panic!("{name}: spare byte {i} past the {} current bytes was written", spare.nbytes());
    }
}

fn check<B: Backend<Storage = HostStorage>>(b: &B) {
    let who = b.name();
    let mut rng = Rng::new(0x5a5a);
    let (h, n, vocab) = (40, 24, 50);

    // linear, rms_norm, silu_mul, add_assign, rope
    let w = Linear::plain(upload(b, DType::BF16, &[n, h], &random_values(&mut rng, DType::BF16, n * h)));
    let (xe, xs) = f32_pair(b, &mut rng, &[h]);
    let (mut ye, mut ys) = f32_pair(b, &mut rng, &[n]);
    b.linear(&xe, &w, &mut ye).unwrap();
    b.linear(&xs, &w, &mut ys).unwrap();
    same(&format!("{who} linear y"), &ye, &ys);
    same(&format!("{who} linear x"), &xe, &xs);
    let norm_w = upload(b, DType::F32, &[h], &random_positive(&mut rng, DType::F32, h));
    let (mut oe, mut os) = f32_pair(b, &mut rng, &[h]);
    b.rms_norm(&xe, &norm_w, 1e-5, &mut oe).unwrap();
    b.rms_norm(&xs, &norm_w, 1e-5, &mut os).unwrap();
    same(&format!("{who} rms_norm"), &oe, &os);
    let (ge, gs) = f32_pair(b, &mut rng, &[n]);
    let (mut ae, mut as_) = f32_pair(b, &mut rng, &[n]);
    b.silu_mul(&ge, &ye, &mut ae).unwrap();
    b.silu_mul(&gs, &ys, &mut as_).unwrap();
    same(&format!("{who} silu_mul"), &ae, &as_);
    b.add_assign(&mut ae, &ge).unwrap();
    b.add_assign(&mut as_, &gs).unwrap();
    same(&format!("{who} add_assign"), &ae, &as_);
    let rope = Rope { head_dim: 8, theta: 10000.0, scaling: None };
    let (pe, ps) = u32_pair(b, ROWS, &[0, 5, 2]);
    let (qe, qs) = f32_pair(b, &mut rng, &[3, 8]);
    let (mut qe, mut qs) = (qe, qs);
    b.rope(&mut qe, &pe, &rope).unwrap();
    b.rope(&mut qs, &ps, &rope).unwrap();
    same(&format!("{who} rope"), &qe, &qs);

    // embedding, kv_store, attention
    let table =
        Linear::plain(upload(b, DType::F32, &[vocab, h], &random_values(&mut rng, DType::F32, vocab * h)));
    let (ie, is) = u32_pair(b, ROWS, &[4, 49, 4]);
    let (mut ee, mut es) = f32_pair(b, &mut rng, &[h]);
    b.embedding(&table, &ie, &mut ee).unwrap();
    b.embedding(&table, &is, &mut es).unwrap();
    same(&format!("{who} embedding"), &ee, &es);
    let cache = || KvCacheLayer {
        k: b.alloc(DType::F32, &[6, 3, 1, 8]).unwrap(),
        v: b.alloc(DType::F32, &[6, 3, 1, 8]).unwrap(),
    };
    let (mut ce, mut cs) = (cache(), cache());
    let (se, ss) = u32_pair(b, ROWS, &[1, 0, 1]);
    let (ke, ks) = f32_pair(b, &mut rng, &[1, 8]);
    let (ve, vs) = f32_pair(b, &mut rng, &[1, 8]);
    // Paged: blocks of 3 positions, the slots' blocks interleaved and out of order.
    let bt = upload_u32(b, &[2, 3], &[5, 0, 2, 1, 4, 3]);
    b.kv_store(&ke, &ve, &mut ce, &bt, &se, &pe).unwrap();
    b.kv_store(&ks, &vs, &mut cs, &bt, &ss, &ps).unwrap();
    assert_eq!(read_bytes(b, &ce.k), read_bytes(b, &cs.k), "{who} kv_store k");
    assert_eq!(read_bytes(b, &ce.v), read_bytes(b, &cs.v), "{who} kv_store v");
    let (mut oe, mut os) = f32_pair(b, &mut rng, &[3, 8]);
    b.attention(&qe, &ce, &bt, &se, &pe, 0.35, &mut oe).unwrap();
    b.attention(&qs, &cs, &bt, &ss, &ps, 0.35, &mut os).unwrap();
    same(&format!("{who} attention"), &oe, &os);

    // router_topk, argmax, sample, gather_rows, scatter_add_rows
    let (le, ls) = f32_pair(b, &mut rng, &[vocab]);
    let (mut ide, mut ids) = pair(b, DType::U32, ROWS, &[2], &[0; ROWS * 2 * 4]);
    let (mut wte, mut wts) = f32_pair(b, &mut rng, &[2]);
    b.router_topk(&le, 2, &mut ide, &mut wte).unwrap();
    b.router_topk(&ls, 2, &mut ids, &mut wts).unwrap();
    same(&format!("{who} router ids"), &ide, &ids);
    same(&format!("{who} router weights"), &wte, &wts);
    let (mut te, mut ts) = u32_pair(b, ROWS, &[7; ROWS]);
    b.argmax(&le, &mut te).unwrap();
    b.argmax(&ls, &mut ts).unwrap();
    same(&format!("{who} argmax"), &te, &ts);
    let params = SamplingParams { temperature: 1.2, top_k: 30, top_p: 0.9 };
    let (seeds_e, seeds_s) = u32_pair(b, ROWS, &[1, 2, 3]);
    let (steps_e, steps_s) = u32_pair(b, ROWS, &[0, 9, 4]);
    b.sample(&le, &params, &seeds_e, &steps_e, &mut te).unwrap();
    b.sample(&ls, &params, &seeds_s, &steps_s, &mut ts).unwrap();
    same(&format!("{who} sample"), &te, &ts);
    let (gie, gis) = u32_pair(b, 2, &[2, 0]);
    let (mut goe, mut gos) = pair(b, DType::F32, 2, &[vocab], &[0; 2 * 50 * 4]);
    b.gather_rows(&le, &gie, &mut goe).unwrap();
    b.gather_rows(&ls, &gis, &mut gos).unwrap();
    same(&format!("{who} gather_rows"), &goe, &gos);
    let (swe, sws) = pair(b, DType::F32, 2, &[], bytemuck::cast_slice(&[0.5f32, -2.0]));
    let (mut de, mut ds) = f32_pair(b, &mut rng, &[vocab]);
    b.scatter_add_rows(&mut de, &gie, &goe, &swe).unwrap();
    b.scatter_add_rows(&mut ds, &gis, &gos, &sws).unwrap();
    same(&format!("{who} scatter_add_rows"), &de, &ds);
}

#[test]
fn ops_touch_only_the_current_rows() {
    check(&Reference);
    for simd in Fast::simd_available() {
        check(&Fast::with_simd(2, simd).expect("fast backend"));
    }
}

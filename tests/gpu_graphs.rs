//! Decode steps replayed as graphs (`SessionOptions::graphs`, `Backend::capture`): the same tokens
//! and logits as op by op, bit for bit, on the emulated GPUs (CI) and on a real one.
//!
//! Both runs launch the same kernels with the same params in the same order; a graph changes only
//! who queues them. The kernels are deterministic (no atomics in any sum, split attention merged
//! in split order), so the logits must be equal bit for bit, not merely close. The checks that
//! can tell a replay from a re-run: sampled tokens (a replay that kept the step counter or the
//! positions it was recorded with draws other tokens), later batch shapes (their own graphs), and
//! a graph gone stale (a launcher's scratch buffer was replaced by a larger one, freeing the one
//! the graph points into) being recorded again instead of replayed.

#![cfg(any(feature = "emulate", feature = "cuda", feature = "hip"))]

mod common;
#[path = "../model/tests/parity_kit/mod.rs"]
mod parity_kit;

use memwall_model::{GenerateOptions, GraphStats, Model, Session, SessionOptions};
use memwall_runtime::{Backend, DType, Linear, SamplingParams, WeightScale};

const MAX_NEW: usize = 6;

/// What a session's run left: every call's tokens and decode logits (as bits), and its stats.
#[derive(Debug, PartialEq)]
struct Run {
    tokens: Vec<Vec<Vec<u32>>>,
    logits: Vec<Vec<Vec<u32>>>,
    decode_steps: usize,
    stats: GraphStats,
}

/// Runs a `[rows, 32]` bf16 `linear` on `b` outside any session: its launcher widens x into
/// scratch, so a larger `rows` than before replaces that scratch buffer (the GEMM path: above the
/// 16 rows the GEMV reads x in).
fn widen_scratch<B: Backend>(b: &B, rows: usize) {
    let x: Vec<f32> = (0..rows * 32).map(|i| (i % 7) as f32 - 3.0).collect();
    let w: Vec<f32> = (0..8 * 32).map(|i| (i % 5) as f32 - 2.0).collect();
    let x = b.upload_f32(DType::BF16, &[rows, 32], &x).expect("x");
    let w = Linear { weight: b.upload_f32(DType::F32, &[8, 32], &w).expect("w"), scale: WeightScale::None };
    let mut y = b.alloc(DType::F32, &[rows, 8]).expect("y");
    b.linear(&x, &w, &mut y).expect("linear");
    b.synchronize().expect("synchronize");
}

/// One session, three generate calls: one prompt (decode steps of 1 row), three (3 rows), and the
/// first prompt again, after a `linear` beside the session replaced a scratch buffer (so its
/// 1-row graph is stale and must be recorded again). `widen`: rows of that `linear`, doubled at
/// each use so that it outgrows every earlier one on the same backend.
fn run<B: Backend>(model: &Model<B>, graphs: bool, sampling: SamplingParams, widen: &mut usize) -> Run
where
    B::Storage: 'static,
{
    // Token ids folded into the model's vocabulary (the Mixtral fixtures have 256).
    let vocab = model.config.vocab_size as u32;
    let prompts = [vec![221u32, 416, 172, 430, 292, 35, 442], vec![269, 274, 115, 147], vec![7, 8, 9]]
        .map(|p| p.into_iter().map(|t| t % vocab).collect::<Vec<u32>>());
    let calls: [&[Vec<u32>]; 3] = [&prompts[..1], &prompts[..], &prompts[..1]];
    let session_options =
        SessionOptions { max_batch: 3, capacity: 64, cache_dtype: DType::F32, graphs, ..Default::default() };
    let mut session = Session::new(model, session_options).expect("session");
    let options = GenerateOptions {
        max_new_tokens: MAX_NEW,
        sampling,
        seed: 11,
        stop_at_eos: false,
        record_logits: true,
    };
    let mut out =
        Run { tokens: Vec::new(), logits: Vec::new(), decode_steps: 0, stats: GraphStats::default() };
    for (c, prompts) in calls.into_iter().enumerate() {
        if c == 0 || c == 2 {
            widen_scratch(&model.backend, *widen);
            *widen *= 2;
        }
        let g = session.generate(prompts, &options).unwrap_or_else(|e| panic!("generate: {e}"));
        out.decode_steps += g.timing.decode_steps;
        out.tokens.push(g.tokens);
        out.logits.push(g.decode_logits.iter().map(|l| l.iter().map(|x| x.to_bits()).collect()).collect());
    }
    out.stats = session.graph_stats();
    out
}

/// Graph replay against op by op on `backend`, greedy and sampled, for the parity fixture
/// `fixture` (a Mixtral's decode steps record too: its experts route on the device).
fn replay_matches_op_by_op<B: Backend>(backend: B, fixture: &str)
where
    B::Storage: 'static,
{
    let dir = parity_kit::fixtures().join(fixture);
    let model = Model::load(backend, &dir, |_, _| {}).unwrap_or_else(|e| panic!("load: {e}"));
    let who = model.backend.name();
    let sampled = SamplingParams { temperature: 0.9, top_k: 40, top_p: 0.95 };
    let mut widen = 32;
    for sampling in [SamplingParams::GREEDY, sampled] {
        let eager = run(&model, false, sampling, &mut widen);
        let replayed = run(&model, true, sampling, &mut widen);
        assert_eq!(eager.stats, GraphStats::default(), "{who}: graphs off records nothing");
        assert_eq!(replayed.tokens, eager.tokens, "{who} {sampling:?}: tokens");
        assert!(replayed.logits == eager.logits, "{who} {sampling:?}: decode logits differ in some bit");
        assert_eq!(replayed.decode_steps, eager.decode_steps);
        // Per call MAX_NEW - 1 decode steps of one shape: the first of a new shape runs op by op,
        // the second records (and replays), the rest replay; the third call's shape ran before.
        let s = replayed.stats;
        assert_eq!(s.replayed_steps, 3 * (MAX_NEW - 1) - 2, "{who} {sampling:?}: {s:?}");
        assert_eq!(s.recorded, 3, "{who} {sampling:?}: the stale 1-row graph is recorded again: {s:?}");
        // A decode step of this model: embedding, 2 layers of ops, the final norm, the head, the
        // pick; a graph holds at least one launch per op.
        let ops = model.graph.step_ops(false).count();
        assert!(s.recorded_launches >= s.recorded * ops, "{who}: {s:?} for {ops} ops per step");
    }
}

#[cfg(feature = "emulate")]
#[test]
fn decode_graphs_replay_bit_for_bit_on_the_emulated_gpus() {
    use memwall::runtime::gpu::emu::Schedule;
    replay_matches_op_by_op(
        memwall::emulated_backend(Schedule::Random(0x9a)).expect("emu"),
        "llama31_gqa_bf16",
    );
    replay_matches_op_by_op(
        memwall::emulated_hip_backend(Schedule::Forward).expect("hip-emu"),
        "llama31_gqa_bf16",
    );
}

/// A Mixtral's decode steps (`experts` routed on the device: nothing read back mid-step) record
/// and replay bit for bit too, top-2 of bf16 experts and top-1 of f32 ones.
#[cfg(feature = "emulate")]
#[test]
fn mixtral_decode_graphs_replay_bit_for_bit_on_the_emulated_gpus() {
    use memwall::runtime::gpu::emu::Schedule;
    replay_matches_op_by_op(
        memwall::emulated_backend(Schedule::Random(0x9c)).expect("emu"),
        "mixtral_top2_bf16",
    );
    replay_matches_op_by_op(
        memwall::emulated_hip_backend(Schedule::Forward).expect("hip-emu"),
        "mixtral_top1_f32",
    );
}

/// The same with every decode GEMV on the matrix units (`Gpu::set_gemv_tensor_core_rows`):
/// gemv_tc.cu on the warp-32 image, gemv_mfma.cu on the warp-64 one, whose launcher holds
/// scratch (x widened to f32, split-K partials and arrival counters) that replays must reuse.
#[cfg(feature = "emulate")]
#[test]
fn decode_graphs_replay_bit_for_bit_on_the_matrix_units() {
    use memwall::runtime::gpu::emu::Schedule;
    for backend in [
        memwall::emulated_backend(Schedule::Random(0x9b)).expect("emu"),
        memwall::emulated_hip_backend(Schedule::Forward).expect("hip-emu"),
    ] {
        backend.set_gemv_tensor_core_rows(Some(1)).expect("every GEMV on the matrix units");
        replay_matches_op_by_op(backend, "llama31_gqa_bf16");
    }
}

/// The CPU backends record nothing: graphs on is op by op there.
#[test]
fn graphs_are_a_no_op_on_the_cpu() {
    let dir = parity_kit::fixtures().join("llama31_gqa_bf16");
    let model = Model::load(memwall_runtime::cpu::Fast::new(), &dir, |_, _| {}).expect("load");
    let eager = run(&model, false, SamplingParams::GREEDY, &mut 32);
    let graphs = run(&model, true, SamplingParams::GREEDY, &mut 32);
    assert_eq!(graphs, eager);
}

device_tests! {
    fn decode_graphs_replay_bit_for_bit(b, who) {
        replay_matches_op_by_op(b, "llama31_gqa_bf16");
    }
    fn mixtral_decode_graphs_replay_bit_for_bit(b, who) {
        replay_matches_op_by_op(b, "mixtral_top2_bf16");
    }
}

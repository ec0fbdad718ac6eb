//! The continuous-batching scheduler (`memwall::engine`): on the mock engine (admission when the
//! cache is full, preemption, no starvation, cancellation, the row budget, every block returned)
//! and on real models of the parity fixtures (under greedy decoding, and seeded sampling, every
//! request's tokens equal those of the request run alone), and a soak test of thousands of short
//! requests through the Server scenario on the fast CPU backend.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memwall::engine::mock::{MockConfig, MockEngine};
use memwall::engine::{
    Completion, EngineError, Event, Request, RequestId, Scheduler, SchedulerConfig, SessionEngine, StepEngine,
};
use memwall::model::{GenerateOptions, Model, Session, SessionOptions};
use memwall::runtime::{Backend, DType, SamplingParams};
use memwall::scenario::{self, Arrivals, StepClock, requests};

const VOCAB: usize = 50;

fn mock(slots: usize, block_size: usize, total_blocks: usize, max_step_rows: usize) -> MockEngine {
    MockEngine::new(MockConfig { slots, block_size, total_blocks, capacity: 64, max_step_rows, vocab: VOCAB })
        .expect("mock")
}

fn sched(e: MockEngine, sampling: SamplingParams) -> Scheduler<MockEngine> {
    Scheduler::new(e, SchedulerConfig { sampling, max_step_rows: None }).expect("scheduler")
}

/// Requests of random prompt and output lengths (a small LCG: the test needs variety, not quality).
fn random_requests(n: usize, seed: u64, max_prompt: usize, max_new: usize) -> Vec<Request> {
    let mut s = seed;
    let mut next = move |m: usize| {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 33) % m as u64) as usize
    };
    (0..n)
        .map(|i| Request {
            prompt: (0..1 + next(max_prompt)).map(|_| next(VOCAB) as u32).collect(),
            max_new_tokens: 1 + next(max_new),
            seed: 1000 + i as u32,
        })
        .collect()
}

fn run_all(s: &mut Scheduler<MockEngine>, reqs: &[Request]) -> HashMap<RequestId, Completion> {
    let ids: Vec<RequestId> = reqs.iter().map(|r| s.submit(r.clone()).expect("submit")).collect();
    let done = s.run_to_completion().expect("run");
    assert_eq!(done.len(), ids.len());
    done
}

#[test]
fn mock_batched_equals_alone_with_preemption_and_blocks_returned() {
    for (sampling, seeded) in
        [(SamplingParams::GREEDY, false), (SamplingParams { temperature: 0.7, top_k: 0, top_p: 1.0 }, true)]
    {
        // 4 slots, blocks of 4 positions, 12 blocks: fewer than 4 long sequences need, so running
        // sequences must be preempted to grow.
        let reqs = random_requests(40, 7, 20, 20);
        let mut s = sched(mock(4, 4, 12, 8), sampling);
        let done = run_all(&mut s, &reqs);
        for (id, r) in reqs.iter().enumerate() {
            let c = &done[&(id as u64)];
            let want = MockEngine::alone(&r.prompt, r.max_new_tokens, seeded.then_some(r.seed), VOCAB);
            assert_eq!(c.tokens, want, "request {id}");
            assert!(!c.cancelled);
        }
        assert!(s.preemptions() > 0, "the cache was meant to be too small for the batch");
        let e = s.engine();
        assert_eq!(e.free_blocks(), e.total_blocks(), "every block returned");
        assert!(e.peak_blocks_used <= e.total_blocks());
        assert!(e.step_rows.iter().all(|&r| r <= 8), "row budget");
        assert!(s.is_idle());
    }
}

#[test]
fn admission_waits_when_the_cache_is_full() {
    // 8 slots but 6 blocks of 8 positions: prompts of 10 need 2 blocks each, so 3 fit.
    let mut s = sched(mock(8, 8, 6, 64), SamplingParams::GREEDY);
    for i in 0..5 {
        s.submit(Request { prompt: vec![i; 10], max_new_tokens: 3, seed: 0 }).expect("submit");
    }
    s.step().expect("step").expect("ran");
    assert_eq!(s.running(), 3);
    assert_eq!(s.waiting(), 2);
    assert_eq!(s.engine().free_blocks(), 0);
    let done = s.run_to_completion().expect("run");
    assert_eq!(done.len(), 5);
    assert_eq!(s.engine().free_blocks(), 6);
}

#[test]
fn preemption_takes_the_newest_and_requeues_it_first() {
    // Blocks of 2, 4 blocks, 2 slots: two prompts of 2 (1 block each) fill half; growing to 5
    // positions each needs 3 blocks each: the newer is preempted.
    let mut s = sched(mock(2, 2, 4, 16), SamplingParams::GREEDY);
    let a = s.submit(Request { prompt: vec![1, 2], max_new_tokens: 5, seed: 0 }).expect("a");
    let b = s.submit(Request { prompt: vec![3, 4], max_new_tokens: 5, seed: 0 }).expect("b");
    let mut preempted = Vec::new();
    let mut a_done_step = None;
    let mut step = 0;
    while !s.is_idle() {
        let r = s.step().expect("step").expect("ran");
        step += 1;
        for ev in &r.events {
            match *ev {
                Event::Preempted { id } => preempted.push(id),
                Event::Finished { id } if id == a => a_done_step = Some(step),
                _ => {}
            }
        }
        s.take_finished();
    }
    assert!(!preempted.is_empty());
    assert!(preempted.iter().all(|&id| id == b), "only the newest is preempted: {preempted:?}");
    assert!(a_done_step.is_some());
    assert_eq!(s.engine().free_blocks(), 4);
}

#[test]
fn no_starvation_fifo_admission() {
    // A long request behind short ones, with short ones arriving every step: it must still be
    // admitted (the queue head blocks later requests) and finish.
    let mut s = sched(mock(4, 4, 8, 16), SamplingParams::GREEDY);
    for i in 0..3 {
        s.submit(Request { prompt: vec![i; 4], max_new_tokens: 8, seed: 0 }).expect("short");
    }
    let long = s.submit(Request { prompt: vec![9; 20], max_new_tokens: 8, seed: 0 }).expect("long");
    let mut finished_long = false;
    for step in 0..400 {
        if step % 2 == 0 {
            s.submit(Request { prompt: vec![5; 4], max_new_tokens: 4, seed: 0 }).expect("short");
        }
        s.step().expect("step");
        if s.take_finished().iter().any(|c| c.id == long) {
            finished_long = true;
            break;
        }
    }
    assert!(finished_long, "the long request starved");
}

#[test]
fn cancellation_of_waiting_and_running() {
    let mut s = sched(mock(1, 4, 4, 16), SamplingParams::GREEDY);
    let a = s.submit(Request { prompt: vec![1; 3], max_new_tokens: 10, seed: 0 }).expect("a");
    let b = s.submit(Request { prompt: vec![2; 3], max_new_tokens: 10, seed: 0 }).expect("b");
    s.step().expect("step");
    s.step().expect("step");
    assert_eq!((s.running(), s.waiting()), (1, 1));
    assert!(s.cancel(b), "waiting");
    assert!(s.cancel(a), "running");
    assert!(!s.cancel(a), "already gone");
    assert!(s.is_idle());
    assert_eq!(s.engine().free_blocks(), 4);
    let done = s.take_finished();
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|c| c.cancelled));
    let ca = done.iter().find(|c| c.id == a).expect("a");
    assert_eq!(ca.tokens.len(), 2, "two steps: a prefill token and a decode token");
    assert_eq!(ca.tokens, MockEngine::alone(&[1; 3], 2, None, VOCAB));
    // The scheduler still works afterwards.
    let c = s.submit(Request { prompt: vec![3; 3], max_new_tokens: 2, seed: 0 }).expect("c");
    let done = s.run_to_completion().expect("run");
    assert_eq!(done[&c].tokens, MockEngine::alone(&[3; 3], 2, None, VOCAB));
}

#[test]
fn decode_rows_first_while_a_long_prompt_prefills() {
    // Budget 6 rows: a decoding sequence gets a token every step while a 40-token prompt is
    // prefilled in chunks beside it.
    let mut s = sched(mock(2, 8, 16, 6), SamplingParams::GREEDY);
    let a = s.submit(Request { prompt: vec![1; 2], max_new_tokens: 20, seed: 0 }).expect("a");
    s.step().expect("prefill a");
    let b = s
        .submit(Request { prompt: (0..40).map(|i| i % VOCAB as u32).collect(), max_new_tokens: 2, seed: 0 })
        .expect("b");
    let mut b_first = None;
    for step in 0..12 {
        let r = s.step().expect("step").expect("ran");
        assert!(r.rows() <= 6);
        assert!(
            r.events.iter().any(|e| matches!(e, Event::Token { id, .. } if *id == a)),
            "a got no token in step {step}"
        );
        if r.events.iter().any(|e| matches!(e, Event::Token { id, index: 0, .. } if *id == b)) {
            b_first = Some(step);
            break;
        }
    }
    // 40 rows at 5 per step (one row is a's decode row): the 8th step.
    assert_eq!(b_first, Some(7));
}

#[test]
fn refused_requests_are_typed_errors() {
    let mut s = sched(mock(2, 4, 3, 8), SamplingParams::GREEDY);
    let r = |prompt: Vec<u32>, n: usize| Request { prompt, max_new_tokens: n, seed: 0 };
    assert!(matches!(s.submit(r(vec![], 1)), Err(EngineError::EmptyPrompt { .. })));
    assert!(matches!(s.submit(r(vec![1], 0)), Err(EngineError::NoNewTokens { .. })));
    assert!(matches!(
        s.submit(r(vec![1, 99], 1)),
        Err(EngineError::TokenOutOfRange { index: 1, token: 99, .. })
    ));
    assert!(matches!(s.submit(r(vec![1; 60], 10)), Err(EngineError::TooLong { needed: 69, .. })));
    // 13 positions need 4 blocks of 4; the cache has 3.
    assert!(matches!(s.submit(r(vec![1; 10], 4)), Err(EngineError::NeverFits { needed: 4, total: 3, .. })));
    // 12 positions fit exactly: prompt 10 + 3 new (the last token is never stored).
    let id = s.submit(r(vec![1; 10], 3)).expect("fits");
    let done = s.run_to_completion().expect("run");
    assert_eq!(done[&id].tokens.len(), 3);
    assert!(s.is_idle());
}

// ---------------------------------------------------------------------------------------------
// Real models

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/fixtures").join(name)
}

fn session_opts(max_batch: usize, capacity: usize, rows: usize) -> SessionOptions {
    SessionOptions {
        max_batch,
        capacity,
        cache_dtype: DType::F32,
        max_prefill_rows: rows,
        ..SessionOptions::default()
    }
}

/// Every request through the scheduler (3 slots, 5 rows per step; with `blocks`, a pool of that
/// many KV blocks of 4 positions) against `Session::generate` of the request alone.
fn batched_equals_alone<B: Backend>(backend: B, name: &str, sampling: SamplingParams, blocks: Option<usize>)
where
    B::Storage: 'static,
{
    let model = Model::load(backend, &fixture(name), |_, _| {}).expect("load");
    let vocab = model.config.vocab_size;
    let mut reqs = random_requests(10, 11, 14, 10);
    for r in &mut reqs {
        for t in &mut r.prompt {
            *t = (*t * 5 + 3) % vocab as u32;
        }
    }
    let mut alone = Session::new(&model, session_opts(1, 32, 512)).expect("session");
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| {
            let opts = GenerateOptions {
                max_new_tokens: r.max_new_tokens,
                sampling,
                seed: r.seed,
                ..Default::default()
            };
            alone.generate(std::slice::from_ref(&r.prompt), &opts).expect("alone").tokens.remove(0)
        })
        .collect();
    drop(alone);
    let mut opts = session_opts(3, 32, 5);
    if let Some(total) = blocks {
        (opts.block_size, opts.num_blocks) = (4, total);
    }
    let engine = SessionEngine::new(Session::new(&model, opts).expect("session"), vocab);
    let config = SchedulerConfig { sampling, max_step_rows: None };
    let mut s = Scheduler::new(engine, config).expect("scheduler");
    for r in &reqs {
        s.submit(r.clone()).expect("submit");
    }
    let got = s.run_to_completion().expect("run");
    if let Some(total) = blocks {
        assert!(s.preemptions() > 0, "{total} blocks were meant to force preemptions");
        assert_eq!(s.engine().total_blocks(), total);
    }
    assert_eq!(s.engine().free_blocks(), s.engine().total_blocks(), "blocks leaked");
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[&(i as u64)].tokens, w, "{name}: request {i}");
    }
}

#[test]
fn greedy_batched_equals_alone_reference_backend() {
    for name in ["llama31_gqa_bf16", "mixtral_top2_bf16"] {
        batched_equals_alone(memwall::runtime::cpu::Reference, name, SamplingParams::GREEDY, None);
    }
}

#[test]
fn greedy_batched_equals_alone_through_preemptions() {
    // 7 blocks of 4 positions for 3 slots of up to 24 positions: sequences wait and are preempted.
    batched_equals_alone(memwall::runtime::cpu::Reference, "llama_tied_f32", SamplingParams::GREEDY, Some(7));
}

#[test]
fn sampled_batched_equals_alone_fast_backend() {
    let sampling = SamplingParams { temperature: 0.9, top_k: 20, top_p: 0.95 };
    batched_equals_alone(memwall::default_backend(), "llama_mha_f16", sampling, None);
}

/// Thousands of short requests through the Server scenario (Poisson arrivals, a fixed step time)
/// on the fast CPU backend: every block back after each run, nothing left queued, and the
/// scheduler's collections do not grow from one run to the next.
#[test]
fn soak_server_thousands_of_short_requests() {
    // 5000 queries/s at 1 ms a step: 5 arrivals per step, more than 8 slots retire, so the queue
    // builds up to hundreds (at 0.5 ms it stays under a hundred).
    const SOAK_STEP_S: f64 = 1e-3;
    let model = Model::load(memwall::default_backend(), &fixture("llama_tied_f32"), |_, _| {}).expect("load");
    let vocab = model.config.vocab_size;
    let engine = SessionEngine::new(Session::new(&model, session_opts(8, 8, 16)).expect("session"), vocab);
    let mut s = Scheduler::new(engine, SchedulerConfig::default()).expect("scheduler");
    let (input, output) = (requests::LenDist { min: 1, max: 4 }, requests::LenDist { min: 1, max: 4 });
    let mut footprints = Vec::new();
    let mut total = 0;
    for round in 0..3u64 {
        let queries = requests::synthetic(1000, input, output, vocab, round).expect("queries");
        let arrivals = requests::poisson_arrivals(queries.len(), 5000.0, round);
        // A fixed step time: on the measured clock, a loaded machine's slower steps queue more
        // arrivals per step, and the capacities below would depend on the machine's load.
        let summary = scenario::drive_with(
            &mut s,
            &queries,
            &Arrivals::At(arrivals),
            0,
            StepClock::Fixed(SOAK_STEP_S),
            |_| {},
        )
        .expect("drive");
        assert_eq!(summary.queries, 1000);
        assert_eq!(summary.output_tokens, queries.iter().map(|q| q.max_new_tokens).sum::<usize>());
        total += summary.queries;
        assert!(s.is_idle());
        assert_eq!(s.engine().free_blocks(), s.engine().total_blocks(), "round {round}: blocks leaked");
        footprints.push(s.footprint());
    }
    assert_eq!(total, 3000);
    for f in &footprints {
        assert_eq!((f.waiting, f.running, f.finished), (0, 0, 0));
    }
    // The queue did build up (a soak that never queued would test little): the capacities here
    // are 568 in every round, against 88 where the slots keep up.
    assert!(footprints[0].capacity > 256, "{footprints:?}");
    // Capacities settle after the first round: later rounds reuse the buffers (a queue that
    // kept growing would at least double its allocation).
    assert!(footprints[2].capacity < 2 * footprints[0].capacity, "{footprints:?}");
}

/// On a fixed step clock a run's times are whole steps: the same summary on any machine.
#[test]
fn fixed_step_clock_counts_steps() {
    let queries: Vec<requests::Query> = (0..20)
        .map(|i| requests::Query { input_ids: vec![1 + i % 7; 3], max_new_tokens: 2 + i as usize % 3 })
        .collect();
    let arrivals = Arrivals::At((0..20).map(|i| f64::from(i) * 0.01).collect());
    let run = |step| {
        let mut s = sched(mock(4, 4, 64, 8), SamplingParams::GREEDY);
        scenario::drive_with(&mut s, &queries, &arrivals, 0, step, |_| {})
    };
    let a = run(StepClock::Fixed(0.004)).expect("drive");
    let b = run(StepClock::Fixed(0.004)).expect("drive");
    assert_eq!(a, b);
    let steps: u64 = a.decode_steps.iter().map(|d| d.steps).sum();
    assert!(steps > 0 && a.steps >= 20, "{a:?}");
    for d in &a.decode_steps {
        assert!((d.seconds - d.steps as f64 * 0.004).abs() < 1e-9, "{d:?}");
    }
    // A query's latency is at least the one step that answered it, at most the run.
    assert!(a.latency_s.p50 >= 0.004 && a.latency_s.p99 <= a.duration_s + 1e-9, "{a:?}");
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(matches!(run(StepClock::Fixed(bad)), Err(EngineError::Config(_))), "step {bad}");
    }
}

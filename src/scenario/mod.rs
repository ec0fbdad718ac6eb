//! The MLPerf scenarios, measured: queries through the continuous-batching [`Scheduler`] on a
//! real model step, timed.
//!
//! - **SingleStream**: one query at a time, the next issued when the previous completes.
//! - **Server**: Poisson arrivals at a target rate (seeded); the run holds when the p99 time to
//!   first token and the p99 time per output token are within their limits; a search finds the
//!   highest rate that holds.
//! - **Offline**: every query at once.
//!
//! **Clock.** Runs use an *engine clock*: it advances by each step's measured duration (real wall
//! time of the step, scheduling included; or a fixed time per step, [`StepClock::Fixed`]), and
//! jumps over idle gaps to the next arrival. An
//! arrival joins the queue once the clock has passed it, so a Server run takes only the time its
//! steps take and gives the same schedule for the same step times. Latencies are engine-clock
//! differences: TTFT = end of the step that gave the first token - arrival; TPOT = (finish -
//! first token) / (tokens - 1); latency = finish - arrival.

pub mod plot;
pub mod predict;
pub mod requests;

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::engine::{EngineError, Event, Request, RequestId, Scheduler, SchedulerConfig, StepEngine};
pub use requests::{LenDist, Query, RequestsError};

/// When queries arrive.
#[derive(Clone, Debug, PartialEq)]
pub enum Arrivals {
    /// Each query when the previous one has finished (SingleStream).
    Sequential,
    /// At these engine-clock times, seconds, ascending (Server, Offline: all 0).
    At(Vec<f64>),
}

/// Latency percentiles, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `v` (zeros when empty).
    pub fn of(v: &mut [f64]) -> Percentiles {
        if v.is_empty() {
            return Percentiles::default();
        }
        v.sort_by(f64::total_cmp);
        let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Percentiles {
            p50: rank(0.5),
            p90: rank(0.9),
            p99: rank(0.99),
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }
}

/// Decode-only steps of one batch size: how many and their total time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct BatchSteps {
    pub batch: usize,
    pub steps: u64,
    pub seconds: f64,
}

impl BatchSteps {
    pub fn tokens_per_s(&self) -> f64 {
        if self.seconds > 0.0 { (self.batch as u64 * self.steps) as f64 / self.seconds } else { 0.0 }
    }
}

/// What one run measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RunSummary {
    pub queries: usize,
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// Engine-clock seconds from the first arrival to the last finish.
    pub duration_s: f64,
    /// Output tokens / duration.
    pub tokens_per_s: f64,
    pub queries_per_s: f64,
    pub latency_s: Percentiles,
    pub ttft_s: Percentiles,
    /// Over queries with at least two output tokens.
    pub tpot_s: Percentiles,
    pub steps: usize,
    /// Mean decode rows per step, over steps with decode rows.
    pub mean_decode_batch: f64,
    pub preemptions: usize,
    /// Decode-only steps by batch size (steps that also prefilled are not counted here).
    pub decode_steps: Vec<BatchSteps>,
}

/// Timestamps of one query in flight.
#[derive(Clone, Copy, Debug)]
struct Flight {
    arrival: f64,
    first: Option<f64>,
}

/// How the engine clock advances per step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepClock {
    /// By the step's measured wall time (the scenarios' runs).
    Measured,
    /// By this many seconds per step, whatever the step took: the same schedule on any machine
    /// under any load (tests, and what-if runs at an assumed step time).
    Fixed(f64),
}

/// Runs `queries` through `sched` as `arrivals` says, on the measured engine clock;
/// `progress(done)` after each finished query.
pub fn drive<E: StepEngine>(
    sched: &mut Scheduler<E>,
    queries: &[Query],
    arrivals: &Arrivals,
    seed: u32,
    progress: impl FnMut(usize),
) -> Result<RunSummary, EngineError> {
    drive_with(sched, queries, arrivals, seed, StepClock::Measured, progress)
}

/// [`drive`] with the engine clock advanced as `step_clock` says.
pub fn drive_with<E: StepEngine>(
    sched: &mut Scheduler<E>,
    queries: &[Query],
    arrivals: &Arrivals,
    seed: u32,
    step_clock: StepClock,
    mut progress: impl FnMut(usize),
) -> Result<RunSummary, EngineError> {
    if let StepClock::Fixed(s) = step_clock
        && !(s.is_finite() && s > 0.0)
    {
        return Err(EngineError::Config(format!("a fixed step time of {s} s")));
    }
    let n = queries.len();
    if let Arrivals::At(t) = arrivals
        && t.len() != n
    {
        return Err(EngineError::Config(format!("{} arrival times for {n} queries", t.len())));
    }
    let mut flights: HashMap<RequestId, Flight> = HashMap::with_capacity(sched.engine().max_batch() * 2);
    let (mut latency, mut ttft, mut tpot) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::new());
    let mut batches: BTreeMap<usize, BatchSteps> = BTreeMap::new();
    let (mut clock, mut next, mut done, mut steps, mut decode_rows, mut decode_steps) =
        (0.0f64, 0, 0, 0, 0, 0);
    let preempted_before = sched.preemptions();
    let mut finished = Vec::new();
    let mut out_tokens = 0;
    while done < n {
        // Admit arrivals the clock has passed.
        loop {
            if next >= n {
                break;
            }
            let at = match arrivals {
                Arrivals::Sequential if sched.is_idle() => clock,
                Arrivals::Sequential => break,
                Arrivals::At(t) if t[next] <= clock => t[next],
                Arrivals::At(_) => break,
            };
            let q = &queries[next];
            let id = sched.submit(Request {
                prompt: q.input_ids.clone(),
                max_new_tokens: q.max_new_tokens,
                seed: seed.wrapping_add(next as u32),
            })?;
            flights.insert(id, Flight { arrival: at, first: None });
            next += 1;
        }
        if sched.is_idle() {
            if let Arrivals::At(t) = arrivals
                && next < n
            {
                clock = clock.max(t[next]);
                continue;
            }
            return Err(EngineError::Config("the scheduler is idle with queries left".into()));
        }
        let Some(report) = sched.step()? else {
            return Err(EngineError::Config("the scheduler ran no step with sequences admitted".into()));
        };
        let secs = match step_clock {
            StepClock::Measured => report.duration.as_secs_f64(),
            StepClock::Fixed(s) => s,
        };
        clock += secs;
        steps += 1;
        if report.decode_rows > 0 {
            decode_rows += report.decode_rows;
            decode_steps += 1;
            if report.prefill_rows == 0 {
                let b = batches
                    .entry(report.decode_rows)
                    .or_insert(BatchSteps { batch: report.decode_rows, ..Default::default() });
                b.steps += 1;
                b.seconds += secs;
            }
        }
        for ev in &report.events {
            match *ev {
                Event::Token { id, index: 0, .. } => {
                    if let Some(f) = flights.get_mut(&id)
                        && f.first.is_none()
                    {
                        f.first = Some(clock);
                    }
                }
                Event::Token { .. } | Event::Preempted { .. } => {}
                Event::Finished { .. } => {}
            }
        }
        sched.drain_finished(&mut finished);
        for c in finished.drain(..) {
            let Some(f) = flights.remove(&c.id) else { continue };
            let first = f.first.unwrap_or(clock);
            latency.push(clock - f.arrival);
            ttft.push(first - f.arrival);
            if c.tokens.len() > 1 {
                tpot.push((clock - first) / (c.tokens.len() - 1) as f64);
            }
            out_tokens += c.tokens.len();
            done += 1;
            progress(done);
        }
    }
    let start = match arrivals {
        Arrivals::At(t) => t.first().copied().unwrap_or(0.0),
        Arrivals::Sequential => 0.0,
    };
    let duration = (clock - start).max(f64::MIN_POSITIVE);
    Ok(RunSummary {
        queries: n,
        input_tokens: queries.iter().map(|q| q.input_ids.len()).sum(),
        output_tokens: out_tokens,
        duration_s: duration,
        tokens_per_s: out_tokens as f64 / duration,
        queries_per_s: n as f64 / duration,
        latency_s: Percentiles::of(&mut latency),
        ttft_s: Percentiles::of(&mut ttft),
        tpot_s: Percentiles::of(&mut tpot),
        steps,
        mean_decode_batch: if decode_steps > 0 { decode_rows as f64 / decode_steps as f64 } else { 0.0 },
        preemptions: sched.preemptions() - preempted_before,
        decode_steps: batches.into_values().collect(),
    })
}

/// The latency limits of the Server scenario, seconds (p99).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ServerLimits {
    pub ttft_s: f64,
    pub tpot_s: f64,
}

impl ServerLimits {
    /// MLPerf's: llama3.1-8b 2000 ms / 100 ms; mixtral-8x7b 2000 ms / 200 ms (a model with
    /// experts gets Mixtral's).
    pub fn mlperf(moe: bool) -> ServerLimits {
        ServerLimits { ttft_s: 2.0, tpot_s: if moe { 0.2 } else { 0.1 } }
    }
    pub fn held_by(&self, s: &RunSummary) -> bool {
        s.ttft_s.p99 <= self.ttft_s && s.tpot_s.p99 <= self.tpot_s
    }
}

/// One Server run of the search.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServerTrial {
    pub rate_qps: f64,
    pub held: bool,
    pub summary: RunSummary,
}

/// The Server scenario's result.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServerResult {
    pub limits: ServerLimits,
    /// The highest rate tried that held the limits (`None`: none did).
    pub rate_qps: Option<f64>,
    /// The run at that rate.
    pub best: Option<RunSummary>,
    /// True when the highest rate tried held (the search ran out of steps before a failing rate:
    /// the true limit is higher).
    pub search_capped: bool,
    pub trials: Vec<ServerTrial>,
}

/// Searches for the highest Poisson rate that holds `limits`: from `start` queries/s, doubling
/// while runs hold and halving while they fail, then bisecting (geometric mean) between the
/// highest holding and the lowest failing rate, `steps` runs in all. `run(rate)` runs one.
pub fn server_search(
    start: f64,
    steps: usize,
    limits: ServerLimits,
    mut run: impl FnMut(f64) -> Result<RunSummary, EngineError>,
) -> Result<ServerResult, EngineError> {
    if !(start.is_finite() && start > 0.0) || steps == 0 {
        return Err(EngineError::Config(format!("a server search from {start} q/s in {steps} runs")));
    }
    let (mut rate, mut hold, mut fail) = (start, None::<(f64, RunSummary)>, None::<f64>);
    let mut trials = Vec::with_capacity(steps);
    for _ in 0..steps {
        let s = run(rate)?;
        let held = limits.held_by(&s);
        trials.push(ServerTrial { rate_qps: rate, held, summary: s.clone() });
        if held {
            if hold.as_ref().is_none_or(|(r, _)| rate > *r) {
                hold = Some((rate, s));
            }
        } else if fail.is_none_or(|f| rate < f) {
            fail = Some(rate);
        }
        rate = match (&hold, fail) {
            (Some((h, _)), Some(f)) => (h * f).sqrt(),
            (Some((h, _)), None) => h * 2.0,
            (None, Some(f)) => f / 2.0,
            (None, None) => rate,
        };
    }
    let search_capped = hold.is_some() && fail.is_none();
    let (rate_qps, best) = match hold {
        Some((r, s)) => (Some(r), Some(s)),
        None => (None, None),
    };
    Ok(ServerResult { limits, rate_qps, best, search_capped, trials })
}

/// A fresh scheduler over `engine` for one run; returns the engine afterwards, every block back.
pub fn with_scheduler<E: StepEngine, T>(
    engine: E,
    config: SchedulerConfig,
    f: impl FnOnce(&mut Scheduler<E>) -> Result<T, EngineError>,
) -> Result<(E, T), EngineError> {
    let mut sched = Scheduler::new(engine, config)?;
    let out = f(&mut sched)?;
    let engine = sched.into_engine();
    if engine.free_blocks() != engine.total_blocks() {
        return Err(EngineError::Step(format!(
            "{} of {} KV blocks not returned after the run",
            engine.total_blocks() - engine.free_blocks(),
            engine.total_blocks()
        )));
    }
    Ok((engine, out))
}

//! The continuous-batching scheduler.
//!
//! Each [`Scheduler::step`]:
//! 1. **Admission** (FIFO): while the request at the head of the queue finds a free slot and the
//!    free blocks hold all its positions so far (prompt, plus the tokens it generated before a
//!    preemption), it reserves them and joins the batch. The head that does not fit blocks those
//!    behind it, so no request is overtaken forever (no starvation).
//! 2. **Growth**: a decoding sequence whose next position lies beyond its reservation asks for
//!    one more block. When none is free, the **preemption policy** applies: the most recently
//!    admitted running sequence (possibly the one growing) is preempted: its blocks are released
//!    and it goes back to the *front* of the queue with the tokens it generated; on readmission it
//!    recomputes prompt + generated tokens in its prefill and continues. The oldest sequence is
//!    never preempted while a newer one runs, so every sequence finishes. Answers do not change:
//!    the recomputed cache holds the same values, and the next token is drawn with the same
//!    (seed, step).
//! 3. **Rows**, in a per-step row budget (`SchedulerConfig::max_step_rows`, at most the engine's):
//!    one decode row per decoding sequence first, then prefill chunks of the admitted sequences,
//!    oldest first, in the rows left. A chunk that reaches the end of its sequence's known tokens
//!    picks the next token.
//! 4. After the step, a sequence with all its tokens leaves the batch and releases its blocks.
//!
//! A request that could never run (longer than a sequence may be, or more blocks than the cache
//! has) is refused by [`Scheduler::submit`] with a typed error. Cancellation removes a request
//! wherever it is and releases its blocks.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use memwall_model::session::Row;
use memwall_runtime::SamplingParams;

use super::{EngineError, Request, RequestId, Result, StepEngine, blocks_for};

/// How to schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Sampling of every request (one per engine: a step takes one set of parameters); each
    /// request has its own seed.
    pub sampling: SamplingParams,
    /// Rows per step (decode rows + prefill chunks); `None`: the engine's `max_step_rows`. Smaller
    /// budgets keep steps short (time per output token) at the cost of slower prefills.
    pub max_step_rows: Option<usize>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig { sampling: SamplingParams::GREEDY, max_step_rows: None }
    }
}

/// What happened to a request in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The request's token number `index` (0: the first).
    Token { id: RequestId, index: usize, token: u32 },
    /// The request has all its tokens (see [`Scheduler::take_finished`]).
    Finished { id: RequestId },
    /// The request was preempted (its blocks released; it waits at the front of the queue).
    Preempted { id: RequestId },
}

/// One step as it ran.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    /// The whole step, scheduling included, measured.
    pub duration: Duration,
    pub decode_rows: usize,
    pub prefill_rows: usize,
    /// Sequences that picked a token.
    pub picks: usize,
    pub events: Vec<Event>,
}

impl StepReport {
    pub fn rows(&self) -> usize {
        self.decode_rows + self.prefill_rows
    }
}

/// A request that left the scheduler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub id: RequestId,
    pub prompt_len: usize,
    pub tokens: Vec<u32>,
    pub cancelled: bool,
    pub preemptions: usize,
}

/// The sizes of the scheduler's collections (lengths and allocated capacities), to check that a
/// long run does not grow them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    pub waiting: usize,
    pub running: usize,
    pub finished: usize,
    pub capacity: usize,
}

struct Seq {
    id: RequestId,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    max_new: usize,
    seed: u32,
    slot: usize,
    /// Positions in the cache.
    computed: usize,
    /// Admission order (larger: admitted later).
    admitted: u64,
    preemptions: usize,
}

impl Seq {
    fn len(&self) -> usize {
        self.prompt.len() + self.generated.len()
    }
    fn token(&self, i: usize) -> u32 {
        if i < self.prompt.len() { self.prompt[i] } else { self.generated[i - self.prompt.len()] }
    }
    /// Decoding: every known token but the last is in the cache, and the last is generated.
    fn decoding(&self) -> bool {
        !self.generated.is_empty() && self.computed + 1 == self.len()
    }
    fn completion(self, cancelled: bool) -> Completion {
        Completion {
            id: self.id,
            prompt_len: self.prompt.len(),
            tokens: self.generated,
            cancelled,
            preemptions: self.preemptions,
        }
    }
}

/// See the module documentation.
pub struct Scheduler<E: StepEngine> {
    engine: E,
    config: SchedulerConfig,
    budget: usize,
    next_id: RequestId,
    admissions: u64,
    waiting: VecDeque<Seq>,
    /// In admission order.
    running: Vec<Seq>,
    free_slots: Vec<usize>,
    finished: Vec<Completion>,
    // Reused per step.
    rows: Vec<Row>,
    last: Vec<u32>,
    seeds: Vec<u32>,
    steps: Vec<u32>,
    /// (index into `running`, rows in the step, picks).
    plan: Vec<(usize, usize, bool)>,
    preemptions: usize,
}

impl<E: StepEngine> Scheduler<E> {
    pub fn new(engine: E, config: SchedulerConfig) -> Result<Self> {
        config.sampling.check().map_err(|e| EngineError::Config(e.to_string()))?;
        let most = engine.max_step_rows();
        let budget = config.max_step_rows.unwrap_or(most).min(most);
        if budget == 0 || engine.max_batch() == 0 || engine.block_size() == 0 {
            return Err(EngineError::Config(format!(
                "a row budget of {budget}, {} slots, blocks of {} positions",
                engine.max_batch(),
                engine.block_size()
            )));
        }
        let slots = engine.max_batch();
        Ok(Scheduler {
            config,
            budget,
            next_id: 0,
            admissions: 0,
            waiting: VecDeque::new(),
            running: Vec::with_capacity(slots),
            free_slots: (0..slots).rev().collect(),
            finished: Vec::new(),
            rows: Vec::with_capacity(budget),
            last: Vec::with_capacity(slots),
            seeds: Vec::with_capacity(slots),
            steps: Vec::with_capacity(slots),
            plan: Vec::with_capacity(slots),
            preemptions: 0,
            engine,
        })
    }

    pub fn engine(&self) -> &E {
        &self.engine
    }
    pub fn into_engine(self) -> E {
        self.engine
    }
    /// Rows per step.
    pub fn row_budget(&self) -> usize {
        self.budget
    }
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn running(&self) -> usize {
        self.running.len()
    }
    /// Nothing waits and nothing runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }
    /// Preemptions so far.
    pub fn preemptions(&self) -> usize {
        self.preemptions
    }

    pub fn footprint(&self) -> Footprint {
        Footprint {
            waiting: self.waiting.len(),
            running: self.running.len(),
            finished: self.finished.len(),
            capacity: self.waiting.capacity()
                + self.running.capacity()
                + self.finished.capacity()
                + self.rows.capacity()
                + self.last.capacity()
                + self.plan.capacity()
                + self.free_slots.capacity(),
        }
    }

    /// Queues a request; it joins the batch at a later step. Refuses one that could never run.
    pub fn submit(&mut self, req: Request) -> Result<RequestId> {
        let id = self.next_id;
        let e = &self.engine;
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt { id });
        }
        if req.max_new_tokens == 0 {
            return Err(EngineError::NoNewTokens { id });
        }
        let vocab = e.vocab_size();
        if let Some((index, &token)) = req.prompt.iter().enumerate().find(|(_, t)| **t as usize >= vocab) {
            return Err(EngineError::TokenOutOfRange { id, index, token, vocab });
        }
        // The last generated token is never fed back: the cache holds prompt + new - 1 positions.
        let needed = req.prompt.len() + req.max_new_tokens - 1;
        if needed > e.capacity() {
            return Err(EngineError::TooLong {
                id,
                prompt: req.prompt.len(),
                new: req.max_new_tokens,
                needed,
                capacity: e.capacity(),
            });
        }
        let blocks = blocks_for(needed, e.block_size());
        if blocks > e.total_blocks() {
            return Err(EngineError::NeverFits {
                id,
                needed: blocks,
                block_size: e.block_size(),
                total: e.total_blocks(),
            });
        }
        self.next_id += 1;
        self.waiting.push_back(Seq {
            id,
            prompt: req.prompt,
            generated: Vec::with_capacity(req.max_new_tokens),
            max_new: req.max_new_tokens,
            seed: req.seed,
            slot: usize::MAX,
            computed: 0,
            admitted: 0,
            preemptions: 0,
        });
        Ok(id)
    }

    /// Cancels a request, waiting or running (its blocks released); its completion, marked
    /// cancelled, holds the tokens generated so far. False when the id is not in the scheduler.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(s) = self.waiting.remove(i) {
                self.finished.push(s.completion(true));
            }
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.engine.release(s.slot);
            self.free_slots.push(s.slot);
            self.finished.push(s.completion(true));
            return true;
        }
        false
    }

    /// Requests that left (finished or cancelled) since the last call.
    pub fn take_finished(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.finished)
    }

    /// Moves the finished completions into `out` (keeps this scheduler's buffer).
    pub fn drain_finished(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.finished);
    }

    /// Runs until every queued request has finished; returns the completions by id.
    pub fn run_to_completion(&mut self) -> Result<HashMap<RequestId, Completion>> {
        let mut done = HashMap::new();
        while !self.is_idle() {
            self.step()?;
            for c in self.take_finished() {
                done.insert(c.id, c);
            }
        }
        for c in self.take_finished() {
            done.insert(c.id, c);
        }
        Ok(done)
    }

    fn admit(&mut self) -> Result<()> {
        while let Some(head) = self.waiting.front() {
            let Some(&slot) = self.free_slots.last() else { break };
            let need = blocks_for(head.len(), self.engine.block_size());
            if need > self.engine.free_blocks() {
                break;
            }
            self.engine.reserve(slot, head.len())?;
            self.free_slots.pop();
            let Some(mut s) = self.waiting.pop_front() else { break };
            s.slot = slot;
            s.computed = 0;
            s.admitted = self.admissions;
            self.admissions += 1;
            self.running.push(s);
        }
        Ok(())
    }

    fn preempt(&mut self, i: usize, events: &mut Vec<Event>) {
        let mut s = self.running.remove(i);
        self.engine.release(s.slot);
        self.free_slots.push(s.slot);
        s.slot = usize::MAX;
        s.computed = 0;
        s.preemptions += 1;
        self.preemptions += 1;
        events.push(Event::Preempted { id: s.id });
        self.waiting.push_front(s);
    }

    /// Gives every decoding sequence the block its next row needs, preempting (see the module
    /// documentation) when none is free.
    fn grow(&mut self, events: &mut Vec<Event>) -> Result<()> {
        let bs = self.engine.block_size();
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            let need_len = s.computed + 1;
            if !s.decoding() || self.engine.reserved_len(s.slot) >= need_len {
                i += 1;
                continue;
            }
            let more =
                blocks_for(need_len, bs).saturating_sub(blocks_for(self.engine.reserved_len(s.slot), bs));
            if more <= self.engine.free_blocks() {
                self.engine.reserve(s.slot, need_len)?;
                i += 1;
                continue;
            }
            // `running` is in admission order: the last is the most recently admitted.
            let victim = self.running.len() - 1;
            self.preempt(victim, events);
            // If the victim was this sequence, `i` now points past the end; else retry `i`.
        }
        Ok(())
    }

    /// Runs one step. `None` when there is nothing to run.
    pub fn step(&mut self) -> Result<Option<StepReport>> {
        let start = Instant::now();
        let mut report = StepReport::default();
        self.admit()?;
        self.grow(&mut report.events)?;
        if self.running.is_empty() {
            return Ok(None);
        }
        self.rows.clear();
        self.last.clear();
        self.seeds.clear();
        self.steps.clear();
        self.plan.clear();
        // Decode rows first.
        for (i, s) in self.running.iter().enumerate() {
            if s.decoding() && self.rows.len() < self.budget {
                let pos = s.computed;
                self.last.push(self.rows.len() as u32);
                self.rows.push(Row { token: s.token(pos), slot: s.slot as u32, pos: pos as u32 });
                self.seeds.push(s.seed);
                self.steps.push(s.generated.len() as u32);
                self.plan.push((i, 1, true));
            }
        }
        report.decode_rows = self.rows.len();
        // Then prefill chunks, oldest first, in the rows left.
        for (i, s) in self.running.iter().enumerate() {
            let left = self.budget - self.rows.len();
            if left == 0 {
                break;
            }
            if s.decoding() {
                continue;
            }
            let pending = s.len() - s.computed;
            let n = pending.min(left);
            for pos in s.computed..s.computed + n {
                self.rows.push(Row { token: s.token(pos), slot: s.slot as u32, pos: pos as u32 });
            }
            let picks = n == pending;
            if picks {
                self.last.push(self.rows.len() as u32 - 1);
                self.seeds.push(s.seed);
                self.steps.push(s.generated.len() as u32);
            }
            self.plan.push((i, n, picks));
        }
        report.prefill_rows = self.rows.len() - report.decode_rows;
        let tokens =
            self.engine.step(&self.rows, &self.last, (&self.config.sampling, &self.seeds, &self.steps))?;
        if tokens.len() != self.last.len() {
            return Err(EngineError::Step(format!("{} tokens for {} picks", tokens.len(), self.last.len())));
        }
        report.picks = tokens.len();
        let mut t = 0;
        let mut done = false;
        for &(i, n, picks) in &self.plan {
            let s = &mut self.running[i];
            s.computed += n;
            if picks {
                let token = tokens[t];
                t += 1;
                report.events.push(Event::Token { id: s.id, index: s.generated.len(), token });
                s.generated.push(token);
                if s.generated.len() == s.max_new {
                    report.events.push(Event::Finished { id: s.id });
                    done = true;
                }
            }
        }
        if done {
            let mut i = 0;
            while i < self.running.len() {
                if self.running[i].generated.len() == self.running[i].max_new {
                    let s = self.running.remove(i);
                    self.engine.release(s.slot);
                    self.free_slots.push(s.slot);
                    self.finished.push(s.completion(false));
                } else {
                    i += 1;
                }
            }
        }
        report.duration = start.elapsed();
        Ok(Some(report))
    }
}

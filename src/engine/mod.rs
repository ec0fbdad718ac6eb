//! The serving engine: a request queue and a continuous-batching scheduler over any model step
//! that can run rows of several sequences at once ([`StepEngine`]).
//!
//! - [`Scheduler`]: requests join the running batch at the next step; each step runs one decode
//!   row per decoding sequence first, then prefill chunks of waiting prompts in the row budget that
//!   is left, so running sequences keep their time per token while new ones are prefilled. A
//!   sequence that has its tokens leaves the batch and returns its KV blocks. See
//!   [`scheduler`] for the admission, growth and preemption policy.
//! - [`StepEngine`]: what the scheduler needs of a model: a step over rows, KV blocks to reserve
//!   and release per slot, and its limits. [`SessionEngine`] adapts today's `model::Session`;
//!   [`mock::MockEngine`] is a model-free engine for fast scheduler tests.
//!
//! Answers never depend on scheduling: under greedy decoding a sequence's tokens are those of the
//! sequence run alone (each row of a step is computed on its own), and a sampled sequence draws
//! from its own stream `(seed, tokens generated so far)`, whatever runs beside it.

pub mod mock;
pub mod scheduler;
pub mod session;

use memwall_model::ModelError;
use memwall_model::session::Row;
use memwall_runtime::SamplingParams;

pub use scheduler::{Completion, Event, Footprint, Scheduler, SchedulerConfig, StepReport};
pub use session::SessionEngine;

/// The id the scheduler gives a request, in submission order from 0.
pub type RequestId = u64;

/// One request: a prompt, how many tokens to generate, and the seed of its sampling stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// Tokens to generate (exactly this many; at least 1).
    pub max_new_tokens: usize,
    /// Seed of this request's sampling stream (unused under greedy decoding).
    pub seed: u32,
}

/// Why the engine refused a request or a step failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),

    #[error("slot {slot} needs {needed} more KV blocks; {free} are free")]
    OutOfBlocks { slot: usize, needed: usize, free: usize },

    #[error("request {id}: the prompt is empty")]
    EmptyPrompt { id: RequestId },

    #[error("request {id}: max_new_tokens is 0 (at least one token must be generated)")]
    NoNewTokens { id: RequestId },

    #[error("request {id}: token id {token} at index {index} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: RequestId, index: usize, token: u32, vocab: usize },

    #[error(
        "request {id}: {prompt} prompt + {new} new tokens need {needed} positions; a sequence holds at \
         most {capacity}"
    )]
    TooLong { id: RequestId, prompt: usize, new: usize, needed: usize, capacity: usize },

    #[error("request {id}: needs {needed} KV blocks of {block_size} positions; the cache has {total}")]
    NeverFits { id: RequestId, needed: usize, block_size: usize, total: usize },

    #[error("invalid engine setting: {0}")]
    Config(String),

    /// A step the engine refused (the mock engine's checks of what the scheduler sends).
    #[error("engine step: {0}")]
    Step(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// A model step with a block-granular KV cache, as the scheduler sees it. The contract is that of
/// the paged `model::Session`:
///
/// - `reserve(slot, len)` makes `slot` hold at least `len` positions, all or nothing (an error,
///   nothing reserved, when the free blocks do not suffice); `release(slot)` returns every block of
///   the slot (idempotent);
/// - `step` errors when a row's position is at or beyond `reserved_len(slot)`;
/// - a row at position p attends to positions 0..=p of its slot, written by earlier rows.
pub trait StepEngine {
    /// Runs `rows` and picks one token for each entry of `last` (a row index) with
    /// `sampling = (params, seeds, steps)`, one seed and one step per entry.
    fn step(
        &mut self,
        rows: &[Row],
        last: &[u32],
        sampling: (&SamplingParams, &[u32], &[u32]),
    ) -> Result<Vec<u32>>;
    fn reserve(&mut self, slot: usize, len: usize) -> Result<()>;
    fn release(&mut self, slot: usize);
    fn reserved_len(&self, slot: usize) -> usize;
    fn free_blocks(&self) -> usize;
    fn total_blocks(&self) -> usize;
    /// Positions per block.
    fn block_size(&self) -> usize;
    /// Slots: sequences that can be in the cache at once.
    fn max_batch(&self) -> usize;
    /// Most rows of one step.
    fn max_step_rows(&self) -> usize;
    /// Most positions of one sequence.
    fn capacity(&self) -> usize;
    fn vocab_size(&self) -> usize;
}

/// Blocks of `block_size` positions that hold `len` positions.
pub fn blocks_for(len: usize, block_size: usize) -> usize {
    len.div_ceil(block_size.max(1))
}

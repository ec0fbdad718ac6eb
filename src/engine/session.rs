//! [`StepEngine`] over `model::Session` and its paged KV cache: every block call delegates to the
//! session's block pool, and a step at an unreserved position is refused by the session itself.

use memwall_model::session::Row;
use memwall_model::{ModelError, Session};
use memwall_runtime::{Backend, SamplingParams};

use super::{EngineError, Result, StepEngine};

/// A session as a [`StepEngine`].
pub struct SessionEngine<'m, B: Backend> {
    session: Session<'m, B>,
    vocab: usize,
}

impl<'m, B: Backend> SessionEngine<'m, B> {
    pub fn new(session: Session<'m, B>, vocab: usize) -> Self {
        SessionEngine { session, vocab }
    }

    pub fn session(&self) -> &Session<'m, B> {
        &self.session
    }

    pub fn into_session(self) -> Session<'m, B> {
        self.session
    }
}

impl<B: Backend> StepEngine for SessionEngine<'_, B> {
    fn step(
        &mut self,
        rows: &[Row],
        last: &[u32],
        sampling: (&SamplingParams, &[u32], &[u32]),
    ) -> Result<Vec<u32>> {
        Ok(self.session.step(rows, last, false, false, sampling)?.tokens)
    }

    fn reserve(&mut self, slot: usize, len: usize) -> Result<()> {
        self.session.reserve(slot, len).map_err(|e| match e {
            // The scheduler's preemption policy acts on this one.
            ModelError::OutOfBlocks { slot, needed, free } => EngineError::OutOfBlocks { slot, needed, free },
            e => e.into(),
        })
    }

    fn release(&mut self, slot: usize) {
        self.session.release(slot)
    }

    fn reserved_len(&self, slot: usize) -> usize {
        self.session.reserved_len(slot)
    }

    fn free_blocks(&self) -> usize {
        self.session.free_blocks()
    }

    fn total_blocks(&self) -> usize {
        self.session.total_blocks()
    }

    fn block_size(&self) -> usize {
        self.session.block_size()
    }

    fn max_batch(&self) -> usize {
        self.session.options().max_batch
    }

    fn max_step_rows(&self) -> usize {
        self.session.max_step_rows()
    }

    fn capacity(&self) -> usize {
        self.session.options().capacity
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }
}

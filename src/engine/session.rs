//! [`StepEngine`] over today's `model::Session`, whose KV cache is contiguous: one slot of
//! `capacity` positions per sequence.
//!
//! TO BE REPLACED once the paged session lands (branch h-paged): `Session::reserve`, `release`,
//! `free_blocks`, `total_blocks`, `block_size` and `reserved_len` then exist, and every method
//! below delegates to them. Until then the adapter models the contiguous cache as paged with
//! `block_size = capacity` and `total_blocks = max_batch` (a slot is one block), accounts the
//! reservations itself, and checks `pos < reserved_len(slot)` before a step as the paged session
//! will.

use memwall_model::Session;
use memwall_model::session::Row;
use memwall_runtime::{Backend, SamplingParams};

use super::{EngineError, Result, StepEngine};

/// A session as a [`StepEngine`].
pub struct SessionEngine<'m, B: Backend> {
    session: Session<'m, B>,
    /// Reserved positions per slot (0 or `capacity`: the slot's one block).
    reserved: Vec<usize>,
    vocab: usize,
}

impl<'m, B: Backend> SessionEngine<'m, B> {
    pub fn new(session: Session<'m, B>, vocab: usize) -> Self {
        let slots = session.options().max_batch;
        SessionEngine { session, reserved: vec![0; slots], vocab }
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
        for r in rows {
            let reserved = self.reserved_len(r.slot as usize);
            if r.pos as usize >= reserved {
                return Err(EngineError::Step(format!(
                    "slot {} position {} is beyond its {reserved} reserved positions",
                    r.slot, r.pos
                )));
            }
        }
        Ok(self.session.step(rows, last, false, false, sampling)?.tokens)
    }

    fn reserve(&mut self, slot: usize, len: usize) -> Result<()> {
        let capacity = self.capacity();
        let Some(have) = self.reserved.get(slot).copied() else {
            return Err(EngineError::Step(format!("slot {slot} of {}", self.reserved.len())));
        };
        if len > capacity {
            return Err(EngineError::OutOfBlocks { slot, needed: 1, free: 0 });
        }
        if have == 0 && len > 0 {
            // A slot always has its own block free: the scheduler never gives a slot to two sequences.
            self.reserved[slot] = capacity;
        }
        Ok(())
    }

    fn release(&mut self, slot: usize) {
        if let Some(r) = self.reserved.get_mut(slot) {
            *r = 0;
        }
    }

    fn reserved_len(&self, slot: usize) -> usize {
        self.reserved.get(slot).copied().unwrap_or(0)
    }

    fn free_blocks(&self) -> usize {
        self.reserved.iter().filter(|&&r| r == 0).count()
    }

    fn total_blocks(&self) -> usize {
        self.reserved.len()
    }

    fn block_size(&self) -> usize {
        self.capacity()
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

//! A model-free [`StepEngine`] for scheduler tests: a paged cache of token ids and a "model" whose
//! next token is a hash of everything its sequence holds, so any scheduling mistake (a position
//! skipped or repeated, a row of the wrong slot, a stale cache after a release, a step count off
//! by one) changes the tokens. It checks every step as strictly as the paged session:
//! positions within the reservation, written in order, every earlier position present, at most
//! `max_step_rows` rows and `max_batch` picks.

use memwall_model::session::Row;
use memwall_runtime::SamplingParams;

use super::{EngineError, Result, StepEngine, blocks_for};

/// The mock engine's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MockConfig {
    pub slots: usize,
    pub block_size: usize,
    pub total_blocks: usize,
    pub capacity: usize,
    pub max_step_rows: usize,
    pub vocab: usize,
}

/// See the module documentation.
pub struct MockEngine {
    config: MockConfig,
    /// The token stored at each position of each slot (`None`: never written since the release).
    cache: Vec<Vec<Option<u32>>>,
    /// Blocks held per slot.
    held: Vec<usize>,
    free: usize,
    /// Steps run, rows run, and the most blocks ever in use at once.
    pub steps: usize,
    pub rows: usize,
    pub peak_blocks_used: usize,
    /// Row counts of every step (for budget checks).
    pub step_rows: Vec<usize>,
}

fn mix(mut h: u64, v: u64) -> u64 {
    h ^= v.wrapping_add(0x9e37_79b9_7f4a_7c15).wrapping_add(h << 6).wrapping_add(h >> 2);
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb)
}

impl MockEngine {
    pub fn new(config: MockConfig) -> Result<MockEngine> {
        let c = config;
        if c.slots == 0 || c.block_size == 0 || c.capacity == 0 || c.max_step_rows < c.slots || c.vocab == 0 {
            return Err(EngineError::Config(format!("mock engine {c:?}")));
        }
        Ok(MockEngine {
            config,
            cache: vec![Vec::new(); c.slots],
            held: vec![0; c.slots],
            free: c.total_blocks,
            steps: 0,
            rows: 0,
            peak_blocks_used: 0,
            step_rows: Vec::new(),
        })
    }

    /// The token this "model" gives a sequence whose cache holds `tokens` (positions 0..=p), drawn
    /// at generation step `step` with `seed` when sampling.
    pub fn next_token(tokens: &[u32], sampled: Option<(u32, u32)>, vocab: usize) -> u32 {
        let mut h = tokens.iter().fold(0x1234_5678u64, |h, &t| mix(h, t as u64));
        if let Some((seed, step)) = sampled {
            h = mix(mix(h, seed as u64), step as u64);
        }
        (h % vocab as u64) as u32
    }

    /// What a request gives run alone on this model: `new` tokens after `prompt`.
    pub fn alone(prompt: &[u32], new: usize, sampled_seed: Option<u32>, vocab: usize) -> Vec<u32> {
        let mut all = prompt.to_vec();
        let mut out = Vec::new();
        for step in 0..new {
            let t = Self::next_token(&all, sampled_seed.map(|s| (s, step as u32)), vocab);
            out.push(t);
            all.push(t);
        }
        out
    }
}

impl StepEngine for MockEngine {
    fn step(
        &mut self,
        rows: &[Row],
        last: &[u32],
        (params, seeds, steps): (&SamplingParams, &[u32], &[u32]),
    ) -> Result<Vec<u32>> {
        let c = self.config;
        let bad = |m: String| Err(EngineError::Step(m));
        if rows.is_empty() || rows.len() > c.max_step_rows {
            return bad(format!("a step of {} rows (at most {})", rows.len(), c.max_step_rows));
        }
        if last.len() > c.slots || seeds.len() != last.len() || steps.len() != last.len() {
            return bad(format!("{} picks, {} seeds, {} steps", last.len(), seeds.len(), steps.len()));
        }
        for r in rows {
            let (slot, pos) = (r.slot as usize, r.pos as usize);
            if slot >= c.slots {
                return bad(format!("slot {slot} of {}", c.slots));
            }
            if pos >= self.reserved_len(slot) {
                return bad(format!(
                    "slot {slot} position {pos} beyond its reservation {}",
                    self.reserved_len(slot)
                ));
            }
            let cache = &mut self.cache[slot];
            if pos > cache.len() || cache[..pos].iter().any(Option::is_none) {
                return bad(format!("slot {slot} position {pos} written before the positions before it"));
            }
            if r.token as usize >= c.vocab {
                return bad(format!("token {} of a vocabulary of {}", r.token, c.vocab));
            }
            cache.truncate(pos);
            cache.push(Some(r.token));
        }
        let mut out = Vec::with_capacity(last.len());
        for (j, &l) in last.iter().enumerate() {
            let Some(r) = rows.get(l as usize) else { return bad(format!("last row {l} of {}", rows.len())) };
            let held: Vec<u32> =
                self.cache[r.slot as usize][..=r.pos as usize].iter().flatten().copied().collect();
            let sampled = (params.temperature > 0.0).then_some((seeds[j], steps[j]));
            out.push(Self::next_token(&held, sampled, c.vocab));
        }
        self.steps += 1;
        self.rows += rows.len();
        self.step_rows.push(rows.len());
        Ok(out)
    }

    fn reserve(&mut self, slot: usize, len: usize) -> Result<()> {
        let c = self.config;
        if slot >= c.slots {
            return Err(EngineError::Step(format!("reserve slot {slot} of {}", c.slots)));
        }
        if len > c.capacity {
            return Err(EngineError::Step(format!("reserve {len} positions; capacity {}", c.capacity)));
        }
        let want = blocks_for(len, c.block_size);
        let needed = want.saturating_sub(self.held[slot]);
        if needed > self.free {
            return Err(EngineError::OutOfBlocks { slot, needed, free: self.free });
        }
        self.free -= needed;
        self.held[slot] += needed;
        self.peak_blocks_used = self.peak_blocks_used.max(c.total_blocks - self.free);
        Ok(())
    }

    fn release(&mut self, slot: usize) {
        if let Some(h) = self.held.get_mut(slot) {
            self.free += *h;
            *h = 0;
            self.cache[slot].clear();
        }
    }

    fn reserved_len(&self, slot: usize) -> usize {
        self.held.get(slot).map_or(0, |h| (h * self.config.block_size).min(self.config.capacity))
    }
    fn free_blocks(&self) -> usize {
        self.free
    }
    fn total_blocks(&self) -> usize {
        self.config.total_blocks
    }
    fn block_size(&self) -> usize {
        self.config.block_size
    }
    fn max_batch(&self) -> usize {
        self.config.slots
    }
    fn max_step_rows(&self) -> usize {
        self.config.max_step_rows
    }
    fn capacity(&self) -> usize {
        self.config.capacity
    }
    fn vocab_size(&self) -> usize {
        self.config.vocab
    }
}

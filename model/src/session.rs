//! Running a model: a preallocated, paged KV cache, one workspace of buffers, and the interpreter
//! of the graph's op list.
//!
//! The KV cache is a pool of fixed-size blocks ([`BlockPool`]): each sequence slot has a row of
//! the block table naming the blocks that hold its positions (position p in block
//! `table[slot][p / block_size]`), grown by [`Session::reserve`] (all or nothing: `OutOfBlocks`
//! when the pool is short, nothing taken) and returned by [`Session::release`]. A step refuses a
//! row beyond its slot's reservation, and uploads the table before the graph runs when it changed.
//!
//! Everything a step touches on the backend is allocated once, in [`Session::new`], at its
//! largest shape: the rows of a step are at most `max(max_prefill_rows, max_batch)`, its
//! sequences at most `max_batch`. Each step sets the leading dimension of every buffer to the rows
//! it runs ([`Tensor::set_rows`]), so the ops of a step are the graph's fixed list over the same
//! buffers, whatever the step's size, and no step allocates.
//!
//! Prefill runs the prompt positions of a batch (all sequences, in order) in chunks of at most
//! `max_prefill_rows` rows; a chunk attends to the KV cache the earlier chunks wrote, so the
//! chunking changes no result (each op computes each row on its own). Decode runs one token per
//! live sequence per step.
//!
//! Every request is checked before any compute: token ids below the vocabulary, prompt plus new
//! tokens within the cache and within `max_position_embeddings`, the batch within the slots.

use std::time::Instant;

use memwall_runtime::{
    Backend, DType, Expert, ExpertsDims, ExpertsScratch, KvCacheLayer, Recorded, SamplingParams, Storage,
    Tensor,
};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::graph::{Buf, Op, OpCost, StepShape};
use crate::model::Model;
use crate::random::{mix64, unit};
use crate::weights::Mlp;

/// Default of [`SessionOptions::max_prefill_rows`]: large enough that a prefill step's weight
/// reads are amortised over many rows, small enough that the `[rows, vocab]` logits of a step
/// stay modest (512 x 128256 f32 is 263 MB for Llama 3).
pub const DEFAULT_MAX_PREFILL_ROWS: usize = 512;

/// Default of [`SessionOptions::block_size`].
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// What to allocate for a session.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SessionOptions {
    /// Sequences that can run at once (KV cache slots, rows of the block table).
    pub max_batch: usize,
    /// Positions per sequence (prompt + generated tokens); capped at `max_position_embeddings`.
    pub capacity: usize,
    /// Element type of the KV cache (f32, bf16 or f16).
    pub cache_dtype: DType,
    /// Most rows (prompt positions, over all sequences) of one prefill step: longer prefills run
    /// in chunks of this many rows. At least 1; capped at `max_batch * capacity`, the most
    /// positions a prefill can have. The workspace holds `max(max_prefill_rows, max_batch)` rows,
    /// and the logits of every row of a step (`record_logits`) `max_prefill_rows x vocab`.
    pub max_prefill_rows: usize,
    /// Positions per KV cache block (at least 1).
    pub block_size: usize,
    /// Blocks of the KV cache pool; 0 = `max_batch * ceil(capacity / block_size)`, enough for
    /// every slot at full capacity (as much as a contiguous cache holds).
    pub num_blocks: usize,
    /// Replay decode steps as graphs where the backend records them (CUDA and HIP graphs: see
    /// [`Backend::capture`]): the first decode step of each shape (sequences, sampling
    /// parameters) runs op by op, the second records its launches, and every later one replays
    /// them, so a step costs one launch on the host instead of one per kernel. A no-op on the
    /// CPU backends and for models whose step reads results back to the host mid-step (Mixtral's
    /// router). Default `true`; `false` always runs op by op.
    pub graphs: bool,
}

impl Default for SessionOptions {
    /// One slot of 4096 positions, an f32 cache, [`DEFAULT_MAX_PREFILL_ROWS`], blocks of
    /// [`DEFAULT_BLOCK_SIZE`] positions, as many as the slots can use.
    fn default() -> Self {
        SessionOptions {
            max_batch: 1,
            capacity: 4096,
            cache_dtype: DType::F32,
            max_prefill_rows: DEFAULT_MAX_PREFILL_ROWS,
            block_size: DEFAULT_BLOCK_SIZE,
            num_blocks: 0,
            graphs: true,
        }
    }
}

/// How to generate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate per sequence (exactly this many unless `stop_at_eos`).
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// The seed of every sequence: each sequence draws its own stream (seed, its count of
    /// generated tokens), so a batch samples exactly as each sequence run alone, and a batch of
    /// identical prompts gives identical outputs.
    pub seed: u32,
    /// Stop a sequence after it generates one of the config's `eos_token_id`s (kept in the output).
    pub stop_at_eos: bool,
    /// Read back the logits of every prompt position and of every generated token.
    pub record_logits: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 16,
            sampling: SamplingParams::GREEDY,
            seed: 0,
            stop_at_eos: false,
            record_logits: false,
        }
    }
}

/// Timing of a generation, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Timing {
    pub prefill_s: f64,
    pub decode_s: f64,
    pub prefill_tokens: usize,
    /// Steps (chunks of at most `max_prefill_rows` rows) the prefill ran in.
    pub prefill_steps: usize,
    pub decode_steps: usize,
    /// Tokens generated by the decode steps (all sequences).
    pub decode_tokens: usize,
}

/// The result of [`Session::generate`], per sequence.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generation {
    pub tokens: Vec<Vec<u32>>,
    /// `[prompt_len, vocab]` row-major, when recorded.
    pub prefill_logits: Vec<Vec<f32>>,
    /// `[generated, vocab]`: row i holds the logits generated token i was picked from.
    pub decode_logits: Vec<Vec<f32>>,
    pub timing: Timing,
}

/// Whether a buffer has one row per sequence of a step (else one per row of the step).
fn per_sequence(b: Buf) -> bool {
    match b {
        Buf::LastIdx | Buf::LastHidden | Buf::Logits | Buf::Next | Buf::Seeds | Buf::Steps => true,
        Buf::Ids
        | Buf::Positions
        | Buf::Slots
        | Buf::Hidden
        | Buf::Normed
        | Buf::Q
        | Buf::K
        | Buf::V
        | Buf::Attn
        | Buf::Proj
        | Buf::Gate
        | Buf::Up
        | Buf::Act
        | Buf::RouterLogits
        | Buf::RouterIds
        | Buf::RouterWeights
        | Buf::AllLogits => false,
    }
}

/// Whether an op of the head writes a per-sequence buffer (it has nothing to do in a step where
/// no sequence ends).
fn writes_per_sequence(op: &Op) -> bool {
    matches!(op, Op::Linear { y: out, .. } | Op::GatherRows { out, .. } if per_sequence(*out))
}

/// The buffers of every step, allocated once at their largest shape.
struct Workspace<S> {
    /// Most rows of a step.
    rows: usize,
    /// Most sequences of a step.
    seqs: usize,
    /// Most rows of a step that computes the logits of every row (`AllLogits`).
    all_rows: usize,
    bufs: Vec<Option<Tensor<S>>>,
    /// The host-routed experts' buffers (Mixtral only).
    experts: Option<ExpertsScratch<S>>,
}

impl<S: Storage> Workspace<S> {
    fn new<B: Backend<Storage = S>>(
        b: &B,
        c: &ModelConfig,
        rows: usize,
        seqs: usize,
        all_rows: usize,
    ) -> Result<Self> {
        let f32s = |shape: &[usize]| b.alloc(DType::F32, shape);
        let u32s = |shape: &[usize]| b.alloc(DType::U32, shape);
        let mut bufs: Vec<Option<Tensor<S>>> = Buf::ALL.iter().map(|_| None).collect();
        let mut set = |buf: Buf, t: Tensor<S>| bufs[buf.index()] = Some(t);
        let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        set(Buf::Ids, u32s(&[rows])?);
        set(Buf::Positions, u32s(&[rows])?);
        set(Buf::Slots, u32s(&[rows])?);
        set(Buf::Hidden, f32s(&[rows, h])?);
        set(Buf::Normed, f32s(&[rows, h])?);
        set(Buf::Q, f32s(&[rows, c.q_dim()])?);
        set(Buf::K, f32s(&[rows, c.kv_dim()])?);
        set(Buf::V, f32s(&[rows, c.kv_dim()])?);
        set(Buf::Attn, f32s(&[rows, c.q_dim()])?);
        set(Buf::Proj, f32s(&[rows, h])?);
        set(Buf::LastIdx, u32s(&[seqs])?);
        set(Buf::LastHidden, f32s(&[seqs, h])?);
        set(Buf::Logits, f32s(&[seqs, v])?);
        set(Buf::Next, u32s(&[seqs])?);
        set(Buf::Seeds, u32s(&[seqs])?);
        set(Buf::Steps, u32s(&[seqs])?);
        set(Buf::AllLogits, f32s(&[all_rows, v])?);
        let mut experts = None;
        match c.moe {
            None => {
                set(Buf::Gate, f32s(&[rows, i])?);
                set(Buf::Up, f32s(&[rows, i])?);
                set(Buf::Act, f32s(&[rows, i])?);
            }
            Some(moe) => {
                set(Buf::RouterLogits, f32s(&[rows, moe.num_experts])?);
                set(Buf::RouterIds, u32s(&[rows, moe.experts_per_token])?);
                set(Buf::RouterWeights, f32s(&[rows, moe.experts_per_token])?);
                experts = Some(ExpertsScratch::alloc(
                    b,
                    ExpertsDims {
                        rows,
                        k: moe.experts_per_token,
                        experts: moe.num_experts,
                        hidden: h,
                        inter: i,
                    },
                )?);
            }
        }
        Ok(Workspace { rows, seqs, all_rows, bufs, experts })
    }

    fn take(&mut self, b: Buf) -> Result<Tensor<S>> {
        self.bufs[b.index()]
            .take()
            .ok_or_else(|| ModelError::Session(format!("buffer {b:?} is not allocated")))
    }
    fn put(&mut self, b: Buf, t: Tensor<S>) {
        self.bufs[b.index()] = Some(t);
    }
    fn get(&self, b: Buf) -> Result<&Tensor<S>> {
        self.bufs[b.index()]
            .as_ref()
            .ok_or_else(|| ModelError::Session(format!("buffer {b:?} is not allocated")))
    }

    /// Sets every buffer a step uses to `rows` rows (or `seqs`, for the per-sequence buffers).
    fn set_rows(&mut self, rows: usize, seqs: usize, all_logits: bool) -> Result<()> {
        for b in Buf::ALL {
            if b == Buf::AllLogits && !all_logits {
                continue;
            }
            if let Some(t) = self.bufs[b.index()].as_mut() {
                t.set_rows(if per_sequence(b) { seqs } else { rows })?;
            }
        }
        Ok(())
    }
}

/// The KV cache's blocks: a free list, and for each slot the blocks that hold its positions, in
/// order (the slot's row of the block table). Every block is either free or owned by exactly one
/// slot: `reserve` takes blocks only from the free list, `release` gives back exactly the slot's
/// own, so no block is lost or handed out twice.
#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: usize,
    /// Table entries per slot: `ceil(capacity / block_size)`.
    max_blocks: usize,
    /// Positions one slot may hold.
    capacity: usize,
    total: usize,
    /// Free blocks, taken from the end.
    free: Vec<u32>,
    /// Blocks each slot owns.
    owned: Vec<usize>,
    /// `[slots, max_blocks]`, row-major: the owned blocks first, then [`BlockPool::UNASSIGNED`].
    table: Vec<u32>,
    /// Whether the table changed since [`BlockPool::take_dirty`].
    dirty: bool,
}

impl BlockPool {
    /// Table entry of a block a slot does not own (no block: the kernels refuse to read through it).
    pub const UNASSIGNED: u32 = u32::MAX;

    /// `slots` table rows, each able to address `capacity` positions, over `num_blocks` blocks of
    /// `block_size` positions (all free).
    pub fn new(slots: usize, capacity: usize, block_size: usize, num_blocks: usize) -> Result<Self> {
        if slots == 0 || capacity == 0 || block_size == 0 || num_blocks == 0 {
            return Err(ModelError::Session(format!(
                "a block pool of {num_blocks} blocks of {block_size} positions for {slots} slots of \
                 {capacity} positions: every count must be at least 1"
            )));
        }
        if num_blocks >= BlockPool::UNASSIGNED as usize {
            return Err(ModelError::Session(format!("{num_blocks} KV cache blocks: block ids are u32")));
        }
        let max_blocks = capacity.div_ceil(block_size);
        let entries = slots
            .checked_mul(max_blocks)
            .ok_or_else(|| ModelError::Session(format!("a block table of {slots} x {max_blocks}")))?;
        Ok(BlockPool {
            block_size,
            max_blocks,
            capacity,
            total: num_blocks,
            // Popped from the end: block 0 first.
            free: (0..num_blocks as u32).rev().collect(),
            owned: vec![0; slots],
            table: vec![BlockPool::UNASSIGNED; entries],
            dirty: true,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn total_blocks(&self) -> usize {
        self.total
    }
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }
    /// Entries per row of the block table.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }
    pub fn slots(&self) -> usize {
        self.owned.len()
    }
    /// Positions the slot's blocks cover (`owned x block_size`; may pass the capacity, which
    /// still bounds the positions a step takes). 0 for a slot out of range.
    pub fn reserved_len(&self, slot: usize) -> usize {
        self.owned.get(slot).map_or(0, |&n| n * self.block_size)
    }
    /// The blocks the slot owns, in position order.
    pub fn blocks(&self, slot: usize) -> &[u32] {
        match self.owned.get(slot) {
            Some(&n) => &self.table[slot * self.max_blocks..][..n],
            None => &[],
        }
    }
    /// The block table `[slots, max_blocks]`, row-major.
    pub fn table(&self) -> &[u32] {
        &self.table
    }

    /// Grows the slot's blocks to cover positions `0..len`, all or nothing.
    pub fn reserve(&mut self, slot: usize, len: usize) -> Result<()> {
        if slot >= self.owned.len() {
            return Err(ModelError::BatchTooLarge { got: slot + 1, allocated: self.owned.len() });
        }
        if len > self.capacity {
            return Err(ModelError::CacheTooShort {
                seq: slot,
                prompt: len,
                new: 0,
                needed: len,
                capacity: self.capacity,
            });
        }
        let have = self.owned[slot];
        let needed = len.div_ceil(self.block_size).saturating_sub(have);
        if needed > self.free.len() {
            return Err(ModelError::OutOfBlocks { slot, needed, free: self.free.len() });
        }
        let row = &mut self.table[slot * self.max_blocks..][..self.max_blocks];
        for entry in &mut row[have..have + needed] {
            // Checked above: the free list holds at least `needed` blocks.
            *entry = self.free.pop().unwrap_or(BlockPool::UNASSIGNED);
        }
        self.owned[slot] = have + needed;
        self.dirty |= needed > 0;
        Ok(())
    }

    /// Returns every block of the slot to the free list (nothing for a slot that owns none or is
    /// out of range).
    pub fn release(&mut self, slot: usize) {
        let Some(&n) = self.owned.get(slot) else { return };
        let row = &mut self.table[slot * self.max_blocks..][..n];
        // Last block first, so a slot that reserves the same length again gets the same blocks.
        for entry in row.iter_mut().rev() {
            self.free.push(*entry);
            *entry = BlockPool::UNASSIGNED;
        }
        self.owned[slot] = 0;
        self.dirty |= n > 0;
    }

    /// Whether the table changed since the last call (and clears the mark).
    pub fn take_dirty(&mut self) -> bool {
        std::mem::replace(&mut self.dirty, false)
    }
}

/// One row of a step: a token of a sequence at a position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub token: u32,
    pub slot: u32,
    pub pos: u32,
}

/// What [`Session::step`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    /// One picked token per sequence.
    pub tokens: Vec<u32>,
    /// `[seqs, vocab]`: the logits the tokens were picked from, when asked for.
    pub logits: Option<Vec<f32>>,
    /// `[rows, vocab]`: the logits of every row, when asked for.
    pub all_logits: Option<Vec<f32>>,
}

/// A model with its KV cache and workspace.
pub struct Session<'m, B: Backend> {
    model: &'m Model<B>,
    options: SessionOptions,
    caches: Vec<KvCacheLayer<B::Storage>>,
    /// The blocks of the caches and each slot's table row.
    pool: BlockPool,
    /// The pool's block table on the backend, u32 `[max_batch, max_blocks]`.
    block_table: Tensor<B::Storage>,
    /// `None` only while a step runs.
    workspace: Option<Workspace<B::Storage>>,
    /// Rows routed to each expert of each layer in the last step (Mixtral).
    last_expert_rows: Vec<Vec<usize>>,
    /// The shape of the last step run, for costing it.
    last_shape: Option<(StepShape, bool)>,
    /// Recorded decode steps, by shape.
    graphs: Vec<(GraphKey, B::Graph)>,
    /// Decode shapes that ran once op by op: their launchers' scratch exists, so they can be
    /// recorded.
    warmed: Vec<GraphKey>,
    /// Whether a decode step of so many rows reads nothing back mid-step, by rows (fixed for the
    /// session: it follows the model's weights and the backend), so `graph_key` asks the backend
    /// once per shape rather than every step.
    host_free: Vec<(usize, bool)>,
    stats: GraphStats,
}

/// What makes two decode steps' launches identical: the rows (one per sequence) and the
/// sampling parameters the pick kernel was launched with (`None`: greedy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GraphKey {
    rows: usize,
    sampling: Option<(u32, usize, u32)>,
}

/// How a session's decode steps ran ([`Session::graph_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs recorded (a shape recorded again after its graph went stale counts again).
    pub recorded: usize,
    /// Steps run by replaying a graph.
    pub replayed_steps: usize,
    /// Kernel launches in the graphs recorded, summed (0 where the backend does not say).
    pub recorded_launches: usize,
}

impl<'m, B: Backend> Session<'m, B> {
    /// Allocates everything a step uses: the KV cache (`num_layers` x
    /// `[num_blocks, block_size, kv_heads, head_dim]` of `cache_dtype`), the block table
    /// `[max_batch, ceil(capacity / block_size)]` and the workspace at its largest shape. No step
    /// allocates afterwards. Every block starts free: reserve a slot's positions before a step
    /// uses them ([`Session::generate`] does).
    pub fn new(model: &'m Model<B>, mut options: SessionOptions) -> Result<Self> {
        let c = &model.config;
        options.capacity = options.capacity.min(c.max_position_embeddings);
        if options.max_batch == 0 || options.capacity == 0 || options.max_prefill_rows == 0 {
            return Err(ModelError::Session(
                "a session needs at least one slot, one position and one prefill row".into(),
            ));
        }
        options.max_prefill_rows =
            options.max_prefill_rows.min(options.max_batch.saturating_mul(options.capacity));
        if options.block_size == 0 {
            return Err(ModelError::Session("a KV cache block needs at least one position".into()));
        }
        if options.num_blocks == 0 {
            options.num_blocks =
                options.max_batch.saturating_mul(options.capacity.div_ceil(options.block_size));
        }
        let pool =
            BlockPool::new(options.max_batch, options.capacity, options.block_size, options.num_blocks)?;
        let block_table = model.backend.alloc(DType::U32, &[options.max_batch, pool.max_blocks()])?;
        let shape = [options.num_blocks, options.block_size, c.num_kv_heads, c.head_dim];
        let mut caches = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            caches.push(KvCacheLayer {
                k: model.backend.alloc(options.cache_dtype, &shape)?,
                v: model.backend.alloc(options.cache_dtype, &shape)?,
            });
        }
        let rows = options.max_prefill_rows.max(options.max_batch);
        let workspace = Workspace::new(&model.backend, c, rows, options.max_batch, options.max_prefill_rows)?;
        Ok(Session {
            model,
            options,
            caches,
            pool,
            block_table,
            workspace: Some(workspace),
            last_expert_rows: Vec::new(),
            last_shape: None,
            graphs: Vec::new(),
            warmed: Vec::new(),
            host_free: Vec::new(),
            stats: GraphStats::default(),
        })
    }

    /// How the decode steps so far ran: graphs recorded, steps replayed.
    pub fn graph_stats(&self) -> GraphStats {
        self.stats
    }

    /// The bytes read and FLOPs of the last step, from the op list, with the experts the router
    /// actually picked.
    pub fn last_step_cost(&self) -> Option<OpCost> {
        let (shape, all) = self.last_shape.as_ref()?;
        Some(self.model.step_cost(shape, *all, self.options.cache_dtype))
    }

    /// The options as allocated (`capacity` and `max_prefill_rows` capped, `num_blocks` resolved).
    pub fn options(&self) -> SessionOptions {
        self.options
    }

    /// Grows `slot`'s blocks to cover positions `0..len`, all or nothing: `OutOfBlocks` (nothing
    /// taken) when the pool has too few free blocks, `CacheTooShort` when `len > capacity`,
    /// `BatchTooLarge` for a slot beyond `max_batch`. A shorter `len` than reserved is a no-op.
    pub fn reserve(&mut self, slot: usize, len: usize) -> Result<()> {
        self.pool.reserve(slot, len)
    }

    /// Stores random keys and values (uniform in [-1, 1), rounded to the cache dtype; a stream per
    /// `seed`, layer and slot) at positions `0..len` of `slot` in every layer: the bytes a prefill of
    /// `len` tokens leaves for a step to read, though not a model's keys. For timing decode at a
    /// long context without paying for its prefill (`benches/decode.rs`): a step at position `len`
    /// then attends to them.
    ///
    /// Errors: `BatchTooLarge` for a slot beyond `max_batch`, `NotReserved` when the slot's
    /// reserved positions do not cover `0..len` ([`Session::reserve`]); the backend's errors.
    pub fn fill_context(&mut self, slot: usize, len: usize, seed: u64) -> Result<()> {
        if slot >= self.options.max_batch {
            return Err(ModelError::BatchTooLarge { got: slot + 1, allocated: self.options.max_batch });
        }
        let reserved = self.pool.reserved_len(slot);
        if len > reserved {
            return Err(ModelError::NotReserved { slot, pos: len - 1, reserved });
        }
        self.sync_table()?;
        let c = &self.model.config;
        let b = &self.model.backend;
        let shape = |n| [n, c.num_kv_heads, c.head_dim];
        let width = c.num_kv_heads * c.head_dim;
        // Positions per kv_store: a few MB of f32 per call.
        let chunk = (1usize << 20).div_ceil(width.max(1));
        for p0 in (0..len).step_by(chunk) {
            let n = chunk.min(len - p0);
            let slots = b.upload_u32(&[n], &vec![slot as u32; n])?;
            let positions: Vec<u32> = (p0..p0 + n).map(|p| p as u32).collect();
            let positions = b.upload_u32(&[n], &positions)?;
            for (layer, cache) in self.caches.iter_mut().enumerate() {
                // Element i of position p: index p * width + i of its stream.
                let stream = |kv: u64| {
                    let key = mix64(seed ^ mix64((((layer as u64) << 32) | (slot as u64) << 1) | kv));
                    let values: Vec<f32> =
                        (p0 * width..(p0 + n) * width).map(|i| unit(key, i as u64)).collect();
                    b.upload_f32(DType::F32, &shape(n), &values)
                };
                let (k, v) = (stream(0)?, stream(1)?);
                b.kv_store(&k, &v, cache, &self.block_table, &slots, &positions)?;
            }
        }
        Ok(())
    }

    /// Writes the block table to the backend if the pool changed it since the last write.
    fn sync_table(&mut self) -> Result<()> {
        if self.pool.take_dirty()
            && let Err(e) =
                self.model.backend.write(&mut self.block_table, bytemuck::cast_slice(self.pool.table()))
        {
            self.pool.dirty = true;
            return Err(e.into());
        }
        Ok(())
    }

    /// Returns every block of `slot` to the pool (idempotent; nothing for a slot out of range).
    pub fn release(&mut self, slot: usize) {
        self.pool.release(slot)
    }

    /// Blocks not reserved by any slot.
    pub fn free_blocks(&self) -> usize {
        self.pool.free_blocks()
    }

    /// Blocks of the pool.
    pub fn total_blocks(&self) -> usize {
        self.pool.total_blocks()
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Positions `slot`'s blocks cover (a multiple of the block size; 0 for none).
    pub fn reserved_len(&self, slot: usize) -> usize {
        self.pool.reserved_len(slot)
    }

    /// The block pool (its table and free list), for inspection.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The most rows one [`Session::step`] takes: `max(max_prefill_rows, max_batch)`.
    pub fn max_step_rows(&self) -> usize {
        self.options.max_prefill_rows.max(self.options.max_batch)
    }

    /// Rows routed to each expert of each layer in the last step (empty for a dense model).
    pub fn last_expert_rows(&self) -> &[Vec<usize>] {
        &self.last_expert_rows
    }

    /// Runs the graph over `rows` and picks one token for each sequence, from the logits of the
    /// row `last[s]`. Returns the picked tokens, the `[seqs, vocab]` logits they were picked from
    /// (if `read_logits`) and, if `all_logits`, the `[rows, vocab]` logits of every row.
    ///
    /// `last` may be empty: a step in which no sequence ends (a chunk inside a long prompt) only
    /// fills the cache (and, with `all_logits`, computes the logits of its rows); it picks nothing.
    ///
    /// Sampling: `sampling = (params, seeds, steps)` with one seed and one step per sequence
    /// (per entry of `last`); sequence s draws `ops::sample_uniform(seeds[s], steps[s], 0)`, its
    /// own stream, whatever else runs in the step.
    ///
    /// Limits: at most [`Session::max_step_rows`] rows (at most `max_prefill_rows` with
    /// `all_logits`) and `max_batch` sequences.
    ///
    /// Low level: the caller keeps positions consistent (a row at position p attends to the cached
    /// positions 0..=p of its slot, which earlier steps or earlier rows of this step stored).
    pub fn step(
        &mut self,
        rows: &[Row],
        last: &[u32],
        all_logits: bool,
        read_logits: bool,
        sampling: (&SamplingParams, &[u32], &[u32]),
    ) -> Result<StepOutput> {
        let c = &self.model.config;
        if rows.is_empty() {
            return Err(ModelError::EmptyBatch);
        }
        let most = if all_logits { self.options.max_prefill_rows } else { self.max_step_rows() };
        if rows.len() > most {
            return Err(ModelError::Session(format!(
                "a step of {} rows{}; this session runs at most {most} (SessionOptions::max_prefill_rows)",
                rows.len(),
                if all_logits { " with the logits of every row" } else { "" },
            )));
        }
        if last.len() > self.options.max_batch {
            return Err(ModelError::BatchTooLarge { got: last.len(), allocated: self.options.max_batch });
        }
        for (r, row) in rows.iter().enumerate() {
            if row.token as usize >= c.vocab_size {
                return Err(ModelError::TokenOutOfRange {
                    seq: row.slot as usize,
                    index: r,
                    id: row.token,
                    vocab: c.vocab_size,
                });
            }
            if row.slot as usize >= self.options.max_batch {
                return Err(ModelError::BatchTooLarge {
                    got: row.slot as usize + 1,
                    allocated: self.options.max_batch,
                });
            }
            if row.pos as usize >= self.options.capacity {
                return Err(ModelError::CacheTooShort {
                    seq: row.slot as usize,
                    prompt: row.pos as usize,
                    new: 1,
                    needed: row.pos as usize + 1,
                    capacity: self.options.capacity,
                });
            }
            let reserved = self.pool.reserved_len(row.slot as usize);
            if row.pos as usize >= reserved {
                return Err(ModelError::NotReserved {
                    slot: row.slot as usize,
                    pos: row.pos as usize,
                    reserved,
                });
            }
        }
        if sampling.1.len() != last.len() || sampling.2.len() != last.len() {
            return Err(ModelError::Session(format!(
                "{} seeds and {} steps for {} sequences",
                sampling.1.len(),
                sampling.2.len(),
                last.len()
            )));
        }
        if let Some(&bad) = last.iter().find(|&&l| l as usize >= rows.len()) {
            return Err(ModelError::Session(format!("last row {bad} of a step of {} rows", rows.len())));
        }
        let mut ws = self
            .workspace
            .take()
            .ok_or_else(|| ModelError::Session("the workspace is in use by another step".into()))?;
        let result = self.run_step(&mut ws, rows, last, all_logits, read_logits, sampling);
        self.workspace = Some(ws);
        self.last_shape = Some((step_shape(rows, last.len(), &self.last_expert_rows), all_logits));
        result
    }

    fn run_step(
        &mut self,
        ws: &mut Workspace<B::Storage>,
        rows: &[Row],
        last: &[u32],
        all_logits: bool,
        read_logits: bool,
        (params, seeds, steps): (&SamplingParams, &[u32], &[u32]),
    ) -> Result<StepOutput> {
        let model = self.model;
        let b = &model.backend;
        // Checked by `step`; a workspace allocated smaller would fail `set_rows` anyway.
        debug_assert!(rows.len() <= ws.rows && last.len() <= ws.seqs);
        debug_assert!(!all_logits || rows.len() <= ws.all_rows);
        ws.set_rows(rows.len(), last.len(), all_logits)?;
        let write_u32 = |ws: &mut Workspace<B::Storage>, buf: Buf, vals: Vec<u32>| -> Result<()> {
            let mut t = ws.take(buf)?;
            let r = b.write(&mut t, bytemuck::cast_slice(&vals));
            ws.put(buf, t);
            Ok(r?)
        };
        write_u32(ws, Buf::Ids, rows.iter().map(|r| r.token).collect())?;
        write_u32(ws, Buf::Positions, rows.iter().map(|r| r.pos).collect())?;
        write_u32(ws, Buf::Slots, rows.iter().map(|r| r.slot).collect())?;
        self.sync_table()?;
        let picks = !last.is_empty();
        if picks {
            write_u32(ws, Buf::LastIdx, last.to_vec())?;
            write_u32(ws, Buf::Seeds, seeds.to_vec())?;
            write_u32(ws, Buf::Steps, steps.to_vec())?;
        }
        self.last_expert_rows.clear();
        match self.graph_key(rows.len(), last.len(), all_logits, params) {
            Some(key) => self.launch_recorded(ws, key, params)?,
            None => self.launch_step(ws, all_logits, picks, params)?,
        }
        let all = if all_logits { Some(b.read_f32(ws.get(Buf::AllLogits)?)?) } else { None };
        if !picks {
            return Ok(StepOutput {
                tokens: Vec::new(),
                logits: read_logits.then(Vec::new),
                all_logits: all,
            });
        }
        let tokens = b.read_u32(ws.get(Buf::Next)?)?;
        let logits = if read_logits { Some(b.read_f32(ws.get(Buf::Logits)?)?) } else { None };
        Ok(StepOutput { tokens, logits, all_logits: all })
    }

    /// Queues the step's ops and, if sequences end in it (`picks`), the pick of their next
    /// tokens into `Next`.
    fn launch_step(
        &mut self,
        ws: &mut Workspace<B::Storage>,
        all_logits: bool,
        picks: bool,
        params: &SamplingParams,
    ) -> Result<()> {
        let model = self.model;
        let b = &model.backend;
        for op in model.graph.step_ops(all_logits) {
            if !picks && writes_per_sequence(op) {
                continue;
            }
            self.exec(ws, op)?;
        }
        if !picks {
            return Ok(());
        }
        let mut next = ws.take(Buf::Next)?;
        let logits = ws.get(Buf::Logits)?;
        let picked = if params.temperature == 0.0 {
            b.argmax(logits, &mut next)
        } else {
            b.sample(logits, params, ws.get(Buf::Seeds)?, ws.get(Buf::Steps)?, &mut next)
        };
        ws.put(Buf::Next, next);
        Ok(picked?)
    }

    /// The graph key of a step that may be replayed: a decode step (one row per sequence, every
    /// sequence picking) of a session with graphs on, whose ops read nothing back mid-step
    /// (host-routed experts do).
    fn graph_key(
        &mut self,
        rows: usize,
        seqs: usize,
        all_logits: bool,
        params: &SamplingParams,
    ) -> Option<GraphKey> {
        let decode = rows == seqs && !all_logits;
        (self.options.graphs && decode && self.host_free(rows)).then(|| GraphKey {
            rows,
            sampling: (params.temperature != 0.0)
                .then(|| (params.temperature.to_bits(), params.top_k, params.top_p.to_bits())),
        })
    }

    /// Whether a step of `rows` rows reads nothing back mid-step: every `Experts` op of the graph
    /// routes on the device (`Backend::experts_on_device`). Asked once per `rows`.
    fn host_free(&mut self, rows: usize) -> bool {
        if let Some(&(_, free)) = self.host_free.iter().find(|(r, _)| *r == rows) {
            return free;
        }
        let model = self.model;
        let free = model.graph.step_ops(false).all(|op| match op {
            Op::Experts { layer, .. } => model.experts(*layer).is_ok_and(|list| {
                let experts: Vec<Expert<'_, B::Storage>> = list.iter().map(Mlp::expert).collect();
                model.backend.experts_on_device(self.experts_dims(rows, experts.len()), &experts)
            }),
            _ => true,
        });
        self.host_free.push((rows, free));
        free
    }

    /// Queues a decode step of shape `key`: its graph replayed; recorded first if the shape ran
    /// before (or its graph went stale); op by op the first time (so that every launcher's
    /// scratch exists before a recording) or where the backend records nothing.
    fn launch_recorded(
        &mut self,
        ws: &mut Workspace<B::Storage>,
        key: GraphKey,
        params: &SamplingParams,
    ) -> Result<()> {
        let model = self.model;
        let b = &model.backend;
        if let Some(at) = self.graphs.iter().position(|(k, _)| *k == key) {
            if b.replay(&self.graphs[at].1)? {
                self.stats.replayed_steps += 1;
                return Ok(());
            }
            // A launcher's scratch moved (a larger step ran since): record again.
            self.graphs.swap_remove(at);
        } else if !self.warmed.contains(&key) {
            self.warmed.push(key);
            return self.launch_step(ws, false, true, params);
        }
        // An op's own error (not a runtime one) is kept whole and handed on after the capture.
        let mut op_error = None;
        let recorded = b.capture(&mut || {
            self.launch_step(ws, false, true, params).map_err(|e| match e {
                ModelError::Runtime(e) => e,
                other => {
                    let msg = other.to_string();
                    op_error = Some(other);
                    memwall_runtime::Error::Device { device: b.name().into(), msg }
                }
            })
        });
        if let Some(e) = op_error {
            return Err(e);
        }
        let recorded = recorded.map_err(|e| {
            ModelError::Session(format!(
                "recording a decode step of {} rows as a graph: {e} (SessionOptions::graphs = false \
                 runs op by op)",
                key.rows
            ))
        })?;
        let Some(graph) = recorded else {
            // The backend records nothing: op by op, always.
            return self.launch_step(ws, false, true, params);
        };
        if !b.replay(&graph)? {
            return Err(ModelError::Session("a graph went stale as it was recorded".into()));
        }
        self.stats.recorded += 1;
        self.stats.replayed_steps += 1;
        self.stats.recorded_launches += graph.launches();
        self.graphs.push((key, graph));
        Ok(())
    }

    /// Interprets one op.
    fn exec(&mut self, ws: &mut Workspace<B::Storage>, op: &Op) -> Result<()> {
        let model = self.model;
        let b = &model.backend;
        let c = &model.config;
        match op {
            Op::Embedding { ids, out } => {
                let mut o = ws.take(*out)?;
                let r = b.embedding(&model.weights.embed, ws.get(*ids)?, &mut o);
                ws.put(*out, o);
                r?;
            }
            Op::RmsNorm { x, weight, out } => {
                let mut o = ws.take(*out)?;
                let r = b.rms_norm(ws.get(*x)?, model.norm(*weight)?, c.rms_norm_eps as f32, &mut o);
                ws.put(*out, o);
                r?;
            }
            Op::Linear { x, w, y } => {
                let mut o = ws.take(*y)?;
                let r = b.linear(ws.get(*x)?, model.matrix(*w)?, &mut o);
                ws.put(*y, o);
                r?;
            }
            Op::Rope { x, heads } => {
                let t = ws.take(*x)?;
                let shape = t.shape().to_vec();
                let mut t3 = t.reshape(&[shape[0], *heads, c.head_dim])?;
                let r = b.rope(&mut t3, ws.get(Buf::Positions)?, &c.rope());
                ws.put(*x, t3.reshape(&shape)?);
                r?;
            }
            Op::KvStore { layer } => {
                let (k, v) = (ws.take(Buf::K)?, ws.take(Buf::V)?);
                let shape = k.shape().to_vec();
                let k3 = k.reshape(&[shape[0], c.num_kv_heads, c.head_dim])?;
                let v3 = v.reshape(&[shape[0], c.num_kv_heads, c.head_dim])?;
                let cache = self
                    .caches
                    .get_mut(*layer)
                    .ok_or_else(|| ModelError::Session(format!("no cache for layer {layer}")))?;
                let r = b.kv_store(
                    &k3,
                    &v3,
                    cache,
                    &self.block_table,
                    ws.get(Buf::Slots)?,
                    ws.get(Buf::Positions)?,
                );
                ws.put(Buf::K, k3.reshape(&shape)?);
                ws.put(Buf::V, v3.reshape(&shape)?);
                r?;
            }
            Op::Attention { layer } => {
                let (q, out) = (ws.take(Buf::Q)?, ws.take(Buf::Attn)?);
                let shape = q.shape().to_vec();
                let q3 = q.reshape(&[shape[0], c.num_heads, c.head_dim])?;
                let mut o3 = out.reshape(&[shape[0], c.num_heads, c.head_dim])?;
                let cache = self
                    .caches
                    .get(*layer)
                    .ok_or_else(|| ModelError::Session(format!("no cache for layer {layer}")))?;
                let scale = 1.0 / (c.head_dim as f32).sqrt();
                let (table, slots, positions) =
                    (&self.block_table, ws.get(Buf::Slots)?, ws.get(Buf::Positions)?);
                let r = b.attention(&q3, cache, table, slots, positions, scale, &mut o3);
                ws.put(Buf::Q, q3.reshape(&shape)?);
                ws.put(Buf::Attn, o3.reshape(&shape)?);
                r?;
            }
            Op::Qkv { x, w, y } => {
                let (mut q, mut k, mut v) = (ws.take(y[0])?, ws.take(y[1])?, ws.take(y[2])?);
                let r = match (model.matrix(w[0]), model.matrix(w[1]), model.matrix(w[2])) {
                    (Ok(wq), Ok(wk), Ok(wv)) => {
                        ws.get(*x).and_then(|x| Ok(b.qkv(x, [wq, wk, wv], [&mut q, &mut k, &mut v])?))
                    }
                    (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => Err(e),
                };
                ws.put(y[0], q);
                ws.put(y[1], k);
                ws.put(y[2], v);
                r?;
            }
            Op::GateUpSilu { x, gate, up, scratch, out } => {
                let (mut g, mut u, mut o) = (ws.take(scratch.0)?, ws.take(scratch.1)?, ws.take(*out)?);
                let r = b.gate_up_silu(
                    ws.get(*x)?,
                    model.matrix(*gate)?,
                    model.matrix(*up)?,
                    (&mut g, &mut u),
                    &mut o,
                );
                ws.put(scratch.0, g);
                ws.put(scratch.1, u);
                ws.put(*out, o);
                r?;
            }
            Op::AddAssign { x, y } => {
                let mut o = ws.take(*x)?;
                let r = b.add_assign(&mut o, ws.get(*y)?);
                ws.put(*x, o);
                r?;
            }
            Op::RouterTopk { logits, k, ids, weights } => {
                let (mut i, mut w) = (ws.take(*ids)?, ws.take(*weights)?);
                let r = b.router_topk(ws.get(*logits)?, *k, &mut i, &mut w);
                ws.put(*ids, i);
                ws.put(*weights, w);
                r?;
            }
            Op::GatherRows { src, idx, out } => {
                let mut o = ws.take(*out)?;
                let r = b.gather_rows(ws.get(*src)?, ws.get(*idx)?, &mut o);
                ws.put(*out, o);
                r?;
            }
            Op::Experts { layer, x, ids, weights, out } => {
                self.experts(ws, *layer, *x, *ids, *weights, *out)?
            }
        }
        Ok(())
    }

    /// Mixtral's sparse MLP: the backend's `experts` op (each picked expert on the rows that
    /// picked it, added into `out` times the router weight in expert order, the order of
    /// transformers' `index_add_`; experts no row picked are not read). Where the backend routes
    /// on the host it reads the picks back anyway, and the rows per expert are kept for the
    /// step's cost; a device-routed step reads nothing back, and its cost counts the expected
    /// experts.
    fn experts(
        &mut self,
        ws: &mut Workspace<B::Storage>,
        layer: usize,
        x: Buf,
        ids: Buf,
        weights: Buf,
        out: Buf,
    ) -> Result<()> {
        let model = self.model;
        let b = &model.backend;
        let experts: Vec<Expert<'_, B::Storage>> = model.experts(layer)?.iter().map(Mlp::expert).collect();
        let d = self.experts_dims(ws.get(x)?.shape()[0], experts.len());
        if !b.experts_on_device(d, &experts) {
            let mut rows = vec![0usize; experts.len()];
            for e in b.read_u32(ws.get(ids)?)? {
                // An id beyond the experts is the op's error, below.
                if let Some(n) = rows.get_mut(e as usize) {
                    *n += 1;
                }
            }
            self.last_expert_rows.push(rows);
        }
        // Present, so that none of the takes below fails with another buffer taken.
        for buf in [x, ids, weights, out] {
            ws.get(buf)?;
        }
        let (src, picks, pick_w, mut dst) = (ws.take(x)?, ws.take(ids)?, ws.take(weights)?, ws.take(out)?);
        let result = match ws.experts.as_mut() {
            Some(scratch) => {
                b.experts(&src, &picks, &pick_w, &experts, scratch, &mut dst).map_err(Into::into)
            }
            None => Err(ModelError::Session("the workspace has no expert buffers for this step".into())),
        };
        ws.put(out, dst);
        ws.put(weights, pick_w);
        ws.put(ids, picks);
        ws.put(x, src);
        result
    }

    /// The `experts` op's dims at `rows` rows of a layer of `experts` experts.
    fn experts_dims(&self, rows: usize, experts: usize) -> ExpertsDims {
        let c = &self.model.config;
        let k = c.moe.map_or(0, |m| m.experts_per_token);
        ExpertsDims { rows, k, experts, hidden: c.hidden_size, inter: c.intermediate_size }
    }

    /// Checks a batch request against the session and the model before any compute.
    pub fn check_request(&self, prompts: &[Vec<u32>], max_new_tokens: usize) -> Result<()> {
        let c = &self.model.config;
        if prompts.is_empty() {
            return Err(ModelError::EmptyBatch);
        }
        if prompts.len() > self.options.max_batch {
            return Err(ModelError::BatchTooLarge { got: prompts.len(), allocated: self.options.max_batch });
        }
        for (seq, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                return Err(ModelError::EmptyPrompt { seq });
            }
            if let Some((index, &id)) = p.iter().enumerate().find(|(_, id)| **id as usize >= c.vocab_size) {
                return Err(ModelError::TokenOutOfRange { seq, index, id, vocab: c.vocab_size });
            }
            let needed = p.len().saturating_add(max_new_tokens);
            if needed > c.max_position_embeddings {
                return Err(ModelError::BeyondMaxPositions {
                    seq,
                    prompt: p.len(),
                    new: max_new_tokens,
                    needed,
                    max_positions: c.max_position_embeddings,
                });
            }
            if needed > self.options.capacity {
                return Err(ModelError::CacheTooShort {
                    seq,
                    prompt: p.len(),
                    new: max_new_tokens,
                    needed,
                    capacity: self.options.capacity,
                });
            }
        }
        Ok(())
    }

    /// Generates up to `max_new_tokens` tokens for each prompt (one sequence per prompt, slot =
    /// its index): a prefill of every prompt position, in steps of at most `max_prefill_rows`
    /// rows, then one decode step per token. Slot s is reserved for `prompts[s].len() +
    /// max_new_tokens` positions first (`OutOfBlocks` when the pool cannot hold them all; nothing
    /// stays reserved then) and released at the end, whatever the outcome.
    pub fn generate(&mut self, prompts: &[Vec<u32>], opts: &GenerateOptions) -> Result<Generation> {
        self.check_request(prompts, opts.max_new_tokens)?;
        opts.sampling.check()?;
        let mut result = Ok(());
        for (s, p) in prompts.iter().enumerate() {
            result = self.pool.reserve(s, p.len() + opts.max_new_tokens);
            if result.is_err() {
                break;
            }
        }
        let out = result.and_then(|()| self.generate_reserved(prompts, opts));
        for s in 0..prompts.len() {
            self.pool.release(s);
        }
        out
    }

    fn generate_reserved(&mut self, prompts: &[Vec<u32>], opts: &GenerateOptions) -> Result<Generation> {
        let vocab = self.model.config.vocab_size;
        let eos = self.model.config.eos_token_ids.clone();
        let n = prompts.len();
        let mut out = Generation {
            tokens: vec![Vec::new(); n],
            prefill_logits: vec![Vec::new(); n],
            decode_logits: vec![Vec::new(); n],
            timing: Timing::default(),
        };

        // Prefill: the prompt positions of every sequence, in order, cut into chunks of at most
        // `max_prefill_rows` rows. A chunk's rows attend to the cache the earlier chunks wrote;
        // a sequence picks its first token in the chunk that holds its last prompt position.
        let t0 = Instant::now();
        let mut rows = Vec::new();
        let mut ends = Vec::with_capacity(n);
        for (s, p) in prompts.iter().enumerate() {
            for (pos, &token) in p.iter().enumerate() {
                rows.push(Row { token, slot: s as u32, pos: pos as u32 });
            }
            ends.push(rows.len() - 1);
        }
        // Every sequence draws its own stream: its seed, and its count of generated tokens.
        let seeds = vec![opts.seed; n];
        let zeros = vec![0u32; n];
        let mut first = vec![0u32; n];
        let mut first_logits: Vec<Vec<f32>> = vec![Vec::new(); n];
        let chunk = self.options.max_prefill_rows;
        for (c, chunk_rows) in rows.chunks(chunk).enumerate() {
            let start = c * chunk;
            let ending: Vec<usize> =
                (0..n).filter(|&s| (start..start + chunk_rows.len()).contains(&ends[s])).collect();
            let last: Vec<u32> = ending.iter().map(|&s| (ends[s] - start) as u32).collect();
            let m = ending.len();
            let StepOutput { tokens, logits, all_logits } = self.step(
                chunk_rows,
                &last,
                opts.record_logits,
                opts.record_logits,
                (&opts.sampling, &seeds[..m], &zeros[..m]),
            )?;
            out.timing.prefill_steps += 1;
            if let Some(all) = all_logits {
                for (row, logits) in chunk_rows.iter().zip(all.chunks_exact(vocab)) {
                    out.prefill_logits[row.slot as usize].extend_from_slice(logits);
                }
            }
            for (j, &s) in ending.iter().enumerate() {
                first[s] = tokens[j];
                if let Some(l) = &logits {
                    first_logits[s] = l[j * vocab..(j + 1) * vocab].to_vec();
                }
            }
        }
        out.timing.prefill_s = t0.elapsed().as_secs_f64();
        out.timing.prefill_tokens = rows.len();
        if opts.max_new_tokens == 0 {
            return Ok(out);
        }
        let mut live: Vec<usize> = Vec::new();
        for s in 0..n {
            out.tokens[s].push(first[s]);
            out.decode_logits[s].append(&mut first_logits[s]);
            let stopped = opts.stop_at_eos && eos.contains(&first[s]);
            if !stopped && opts.max_new_tokens > 1 {
                live.push(s);
            }
        }

        // Decode: one row per live sequence.
        let t1 = Instant::now();
        while !live.is_empty() {
            let rows: Vec<Row> = live
                .iter()
                .map(|&s| Row {
                    token: *out.tokens[s].last().unwrap_or(&0),
                    slot: s as u32,
                    pos: (prompts[s].len() + out.tokens[s].len() - 1) as u32,
                })
                .collect();
            let last: Vec<u32> = (0..rows.len() as u32).collect();
            let steps: Vec<u32> = live.iter().map(|&s| out.tokens[s].len() as u32).collect();
            let StepOutput { tokens: next, logits, .. } = self.step(
                &rows,
                &last,
                false,
                opts.record_logits,
                (&opts.sampling, &seeds[..rows.len()], &steps),
            )?;
            out.timing.decode_steps += 1;
            out.timing.decode_tokens += rows.len();
            let mut still = Vec::with_capacity(live.len());
            for (r, &s) in live.iter().enumerate() {
                out.tokens[s].push(next[r]);
                if let Some(l) = &logits {
                    out.decode_logits[s].extend_from_slice(&l[r * vocab..(r + 1) * vocab]);
                }
                let stopped = opts.stop_at_eos && eos.contains(&next[r]);
                if !stopped && out.tokens[s].len() < opts.max_new_tokens {
                    still.push(s);
                }
            }
            live = still;
        }
        out.timing.decode_s = t1.elapsed().as_secs_f64();
        Ok(out)
    }
}

/// The shape of a step over `rows`, for [`Model::op_cost`].
pub fn step_shape(rows: &[Row], seqs: usize, expert_rows: &[Vec<usize>]) -> StepShape {
    StepShape {
        rows: rows.len(),
        seqs,
        attended: rows.iter().map(|r| r.pos as u64 + 1).sum(),
        expert_rows: expert_rows.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block is free or owned by exactly one slot, once; the table names exactly the owned
    /// blocks, then UNASSIGNED.
    fn check_invariants(p: &BlockPool) {
        let mut seen = vec![0u32; p.total_blocks()];
        for &b in &p.free {
            seen[b as usize] += 1;
        }
        for s in 0..p.slots() {
            let row = &p.table()[s * p.max_blocks()..][..p.max_blocks()];
            let n = p.blocks(s).len();
            assert_eq!(n * p.block_size(), p.reserved_len(s));
            for &b in &row[..n] {
                seen[b as usize] += 1;
            }
            assert!(row[n..].iter().all(|&e| e == BlockPool::UNASSIGNED), "slot {s}: {row:?}");
        }
        assert!(seen.iter().all(|&c| c == 1), "block counts {seen:?}");
    }

    #[test]
    fn reserve_takes_blocks_all_or_nothing() {
        // 3 slots of 10 positions in blocks of 4 (3 entries each), 7 blocks.
        let mut p = BlockPool::new(3, 10, 4, 7).unwrap();
        assert_eq!((p.max_blocks(), p.free_blocks(), p.total_blocks()), (3, 7, 7));
        p.reserve(0, 5).unwrap(); // 2 blocks
        assert_eq!((p.reserved_len(0), p.free_blocks()), (8, 5));
        assert_eq!(p.blocks(0), [0, 1]);
        p.reserve(0, 8).unwrap(); // covered already
        assert_eq!(p.free_blocks(), 5);
        p.reserve(1, 10).unwrap(); // 3 blocks
        assert_eq!(p.free_blocks(), 2);
        check_invariants(&p);
        // 3 needed, 2 free: refused, nothing taken.
        let e = p.reserve(2, 9).unwrap_err();
        assert!(matches!(e, ModelError::OutOfBlocks { slot: 2, needed: 3, free: 2 }), "{e}");
        assert_eq!((p.free_blocks(), p.reserved_len(2)), (2, 0));
        // Growing by one block of the two still free works.
        p.reserve(0, 9).unwrap();
        assert_eq!((p.reserved_len(0), p.free_blocks()), (12, 1));
        let e = p.reserve(2, 11).unwrap_err();
        assert!(matches!(e, ModelError::CacheTooShort { needed: 11, capacity: 10, .. }), "{e}");
        let e = p.reserve(3, 1).unwrap_err();
        assert!(matches!(e, ModelError::BatchTooLarge { got: 4, allocated: 3 }), "{e}");
        check_invariants(&p);
    }

    #[test]
    fn release_returns_every_block_once_and_blocks_are_reused() {
        let mut p = BlockPool::new(2, 8, 2, 6).unwrap();
        p.reserve(0, 3).unwrap();
        p.reserve(1, 8).unwrap();
        assert_eq!(p.free_blocks(), 0);
        assert!(p.take_dirty());
        assert!(!p.take_dirty(), "the mark clears");
        let slot1: Vec<u32> = p.blocks(1).to_vec();
        p.release(1);
        assert!(p.take_dirty());
        assert_eq!((p.free_blocks(), p.reserved_len(1)), (4, 0));
        check_invariants(&p);
        // Idempotent: no double free, and no change to mark.
        p.release(1);
        p.release(7);
        assert!(!p.take_dirty());
        assert_eq!(p.free_blocks(), 4);
        check_invariants(&p);
        // Slot 0 grows into the blocks slot 1 gave back (the first one it gave).
        p.reserve(0, 5).unwrap();
        assert_eq!(p.blocks(0)[2], slot1[0]);
        p.reserve(1, 4).unwrap();
        check_invariants(&p);
        // Churn: many reserve/release rounds leave every block accounted for.
        for i in 0..200usize {
            let s = i % 2;
            p.release(s);
            let _ = p.reserve(s, 1 + (i * 7) % 8);
            check_invariants(&p);
        }
        p.release(0);
        p.release(1);
        assert_eq!(p.free_blocks(), 6);
        check_invariants(&p);
    }

    #[test]
    fn pool_limits_are_typed_errors() {
        assert!(BlockPool::new(0, 8, 2, 4).is_err());
        assert!(BlockPool::new(1, 8, 0, 4).is_err());
        assert!(BlockPool::new(1, 8, 2, 0).is_err());
        assert!(BlockPool::new(1, 8, 2, u32::MAX as usize).is_err());
    }
}

//! The static graph of a Llama / Mixtral forward pass, as data: a flat list of ops over named
//! buffers, fixed at load. A prefill (all prompt positions of a batch, one row each) and a decode
//! step (one row per sequence) run the same list; only the number of rows differs. Each op can
//! report the bytes it reads and the FLOPs it does for a given step (see [`OpCost`]), which the
//! benches and the memory-wall report use.
//!
//! The body, for each layer `l` (dense MLP or Mixtral experts):
//!
//! ```text
//! Hidden = embed[Ids]
//! Normed = rms_norm(Hidden, attn_norm[l]);  Q, K, V = Normed . Wq/Wk/Wv^T   (one qkv op)
//! rope(Q), rope(K);  kv_store(K, V -> cache[l]);  Attn = attention(Q, cache[l])
//! Proj = Attn . Wo^T;  Hidden += Proj
//! Normed = rms_norm(Hidden, mlp_norm[l])
//! dense:   Act = gate_up_silu(Normed, Wgate, Wup) = silu(Normed . Wgate^T) * (Normed . Wup^T)
//!          Proj = Act . Wdown^T
//! mixtral: RouterIds, RouterWeights = router_topk(Normed . Wrouter^T);
//!          Proj = sum over picked experts of weight * expert(Normed)   (Experts op)
//! Hidden += Proj
//! ```
//!
//! then `Normed = rms_norm(Hidden, final_norm)` and the head: either the last row of each sequence
//! is gathered and multiplied by `lm_head` (`head_last`), or every row is (`head_all`, for the
//! logits at every prompt position) and the last rows gathered from the result.

use crate::config::ModelConfig;

/// A buffer of a step's workspace. Shapes for a step of `R` rows and `B` sequences.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// u32 `[R]`: token ids.
    Ids,
    /// u32 `[R]`: position of each row in its sequence.
    Positions,
    /// u32 `[R]`: KV cache slot (sequence) of each row.
    Slots,
    /// f32 `[R, hidden]`: the residual stream.
    Hidden,
    /// f32 `[R, hidden]`: the normalised residual.
    Normed,
    /// f32 `[R, heads * head_dim]`.
    Q,
    /// f32 `[R, kv_heads * head_dim]`.
    K,
    /// f32 `[R, kv_heads * head_dim]`.
    V,
    /// f32 `[R, heads * head_dim]`: attention output.
    Attn,
    /// f32 `[R, hidden]`: output of o_proj and of the MLP.
    Proj,
    /// f32 `[R, intermediate]` (dense models): scratch of `GateUpSilu` (the gate product where the
    /// backend composes the op).
    Gate,
    /// f32 `[R, intermediate]` (dense models): scratch of `GateUpSilu` (the up product).
    Up,
    /// f32 `[R, intermediate]` (dense models).
    Act,
    /// f32 `[R, experts]` (Mixtral).
    RouterLogits,
    /// u32 `[R, experts_per_token]` (Mixtral).
    RouterIds,
    /// f32 `[R, experts_per_token]` (Mixtral).
    RouterWeights,
    /// u32 `[B]`: the row of each sequence's last token.
    LastIdx,
    /// f32 `[B, hidden]`.
    LastHidden,
    /// f32 `[B, vocab]`: the logits the next tokens are picked from.
    Logits,
    /// f32 `[R, vocab]`: logits at every row (only in steps that ask for them).
    AllLogits,
    /// u32 `[B]`: the picked tokens.
    Next,
    /// u32 `[B]`: each sequence's sampling seed.
    Seeds,
    /// u32 `[B]`: each sequence's sampling step (the tokens it generated before this one).
    Steps,
}

impl Buf {
    pub const ALL: [Buf; 23] = [
        Buf::Ids,
        Buf::Positions,
        Buf::Slots,
        Buf::Hidden,
        Buf::Normed,
        Buf::Q,
        Buf::K,
        Buf::V,
        Buf::Attn,
        Buf::Proj,
        Buf::Gate,
        Buf::Up,
        Buf::Act,
        Buf::RouterLogits,
        Buf::RouterIds,
        Buf::RouterWeights,
        Buf::LastIdx,
        Buf::LastHidden,
        Buf::Logits,
        Buf::AllLogits,
        Buf::Next,
        Buf::Seeds,
        Buf::Steps,
    ];

    pub fn index(self) -> usize {
        self as usize
    }
}

/// A weight matrix of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatRef {
    Embed,
    /// `lm_head`, or the embedding when tied.
    LmHead,
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    /// Dense `gate_proj`.
    Gate(usize),
    /// Dense `up_proj`.
    Up(usize),
    /// Dense `down_proj`.
    Down(usize),
    /// Mixtral `block_sparse_moe.gate`.
    Router(usize),
}

/// A norm weight of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormRef {
    Attn(usize),
    Mlp(usize),
    Final,
}

/// One op of the graph.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `out = embed[ids]`.
    Embedding { ids: Buf, out: Buf },
    /// `out = rms_norm(x) * weight`.
    RmsNorm { x: Buf, weight: NormRef, out: Buf },
    /// `y = x . W^T`.
    Linear { x: Buf, w: MatRef, y: Buf },
    /// `y[i] = x . W[i]^T` for the q, k and v projections, one op (the backend's `qkv`: on a GPU
    /// one launch for decode rows).
    Qkv { x: Buf, w: [MatRef; 3], y: [Buf; 3] },
    /// Rotary embedding of `x` viewed as `[R, heads, head_dim]`, at `Positions`.
    Rope { x: Buf, heads: usize },
    /// `K`, `V` into layer `layer`'s cache at (`Slots`, `Positions`).
    KvStore { layer: usize },
    /// `Attn = attention(Q, cache[layer])`.
    Attention { layer: usize },
    /// `out = silu(x . W_gate^T) * (x . W_up^T)`, one op (the backend's `gate_up_silu`: on a GPU
    /// one pass over both weights for decode rows); `scratch` holds the two products where the
    /// backend composes it from `linear` and `silu_mul`.
    GateUpSilu { x: Buf, gate: MatRef, up: MatRef, scratch: (Buf, Buf), out: Buf },
    /// `x += y`.
    AddAssign { x: Buf, y: Buf },
    /// Router softmax in f32 over all experts, top-k, renormalised.
    RouterTopk { logits: Buf, k: usize, ids: Buf, weights: Buf },
    /// Mixtral's experts (the backend's `experts` op): each picked expert of `layer` runs on the
    /// rows of `x` that picked it, and `out` is the sum of `weight * expert(x)` in order of expert.
    /// Routed on the device where the backend can (`Backend::experts_on_device`), else the picks
    /// are read back.
    Experts { layer: usize, x: Buf, ids: Buf, weights: Buf, out: Buf },
    /// `out[i] = src[idx[i]]`.
    GatherRows { src: Buf, idx: Buf, out: Buf },
}

/// The ops of a model: the body (embedding, layers, final norm) and the two heads.
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    pub body: Vec<Op>,
    /// lm_head on the last row of each sequence only.
    pub head_last: Vec<Op>,
    /// lm_head on every row, then the last rows gathered.
    pub head_all: Vec<Op>,
}

impl Graph {
    pub fn build(c: &ModelConfig) -> Graph {
        let mut body = vec![Op::Embedding { ids: Buf::Ids, out: Buf::Hidden }];
        for l in 0..c.num_layers {
            body.extend([
                Op::RmsNorm { x: Buf::Hidden, weight: NormRef::Attn(l), out: Buf::Normed },
                Op::Qkv {
                    x: Buf::Normed,
                    w: [MatRef::Q(l), MatRef::K(l), MatRef::V(l)],
                    y: [Buf::Q, Buf::K, Buf::V],
                },
                Op::Rope { x: Buf::Q, heads: c.num_heads },
                Op::Rope { x: Buf::K, heads: c.num_kv_heads },
                Op::KvStore { layer: l },
                Op::Attention { layer: l },
                Op::Linear { x: Buf::Attn, w: MatRef::O(l), y: Buf::Proj },
                Op::AddAssign { x: Buf::Hidden, y: Buf::Proj },
                Op::RmsNorm { x: Buf::Hidden, weight: NormRef::Mlp(l), out: Buf::Normed },
            ]);
            match c.moe {
                None => body.extend([
                    Op::GateUpSilu {
                        x: Buf::Normed,
                        gate: MatRef::Gate(l),
                        up: MatRef::Up(l),
                        scratch: (Buf::Gate, Buf::Up),
                        out: Buf::Act,
                    },
                    Op::Linear { x: Buf::Act, w: MatRef::Down(l), y: Buf::Proj },
                ]),
                Some(moe) => body.extend([
                    Op::Linear { x: Buf::Normed, w: MatRef::Router(l), y: Buf::RouterLogits },
                    Op::RouterTopk {
                        logits: Buf::RouterLogits,
                        k: moe.experts_per_token,
                        ids: Buf::RouterIds,
                        weights: Buf::RouterWeights,
                    },
                    Op::Experts {
                        layer: l,
                        x: Buf::Normed,
                        ids: Buf::RouterIds,
                        weights: Buf::RouterWeights,
                        out: Buf::Proj,
                    },
                ]),
            }
            body.push(Op::AddAssign { x: Buf::Hidden, y: Buf::Proj });
        }
        body.push(Op::RmsNorm { x: Buf::Hidden, weight: NormRef::Final, out: Buf::Normed });
        let head_last = vec![
            Op::GatherRows { src: Buf::Normed, idx: Buf::LastIdx, out: Buf::LastHidden },
            Op::Linear { x: Buf::LastHidden, w: MatRef::LmHead, y: Buf::Logits },
        ];
        let head_all = vec![
            Op::Linear { x: Buf::Normed, w: MatRef::LmHead, y: Buf::AllLogits },
            Op::GatherRows { src: Buf::AllLogits, idx: Buf::LastIdx, out: Buf::Logits },
        ];
        Graph { body, head_last, head_all }
    }

    /// The ops of one step, in order.
    pub fn step_ops(&self, all_logits: bool) -> impl Iterator<Item = &Op> {
        let head = if all_logits { &self.head_all } else { &self.head_last };
        self.body.iter().chain(head.iter())
    }
}

/// Bytes read and FLOPs of an op in one step. Bytes are what the op reads: the weights it
/// actually touches (the embedding rows gathered, the experts picked), its activations, and the
/// live KV positions (never the whole allocated cache). A multiply-add counts as 2 FLOPs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OpCost {
    pub bytes_read: u64,
    pub flops: u64,
}

impl std::ops::AddAssign for OpCost {
    fn add_assign(&mut self, o: OpCost) {
        self.bytes_read += o.bytes_read;
        self.flops += o.flops;
    }
}

/// What a step looks like, for costing its ops.
#[derive(Clone, Debug, PartialEq)]
pub struct StepShape {
    /// Rows (tokens) of the step.
    pub rows: usize,
    /// Sequences (rows of the head).
    pub seqs: usize,
    /// Sum over rows of the positions each attends to (`position + 1`).
    pub attended: u64,
    /// Per layer, per expert: rows routed to it. Empty for a dense model, or to use the
    /// expectation under uniform routing.
    pub expert_rows: Vec<Vec<usize>>,
}

impl Op {
    /// The op's name, as the backend calls it (`Experts` is Mixtral's gather / expert MLPs /
    /// scatter sequence).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embedding { .. } => "embedding",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Linear { .. } => "linear",
            Op::Qkv { .. } => "qkv",
            Op::Rope { .. } => "rope",
            Op::KvStore { .. } => "kv_store",
            Op::Attention { .. } => "attention",
            Op::GateUpSilu { .. } => "gate_up_silu",
            Op::AddAssign { .. } => "add_assign",
            Op::RouterTopk { .. } => "router_topk",
            Op::Experts { .. } => "experts",
            Op::GatherRows { .. } => "gather_rows",
        }
    }
}

/// One line per op: `linear Normed . Q(0) -> Q`.
impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.name();
        match self {
            Op::Embedding { ids, out } => write!(f, "{n} Embed[{ids:?}] -> {out:?}"),
            Op::RmsNorm { x, weight, out } => write!(f, "{n} {x:?} * {weight:?} -> {out:?}"),
            Op::Linear { x, w, y } => write!(f, "{n} {x:?} . {w:?} -> {y:?}"),
            Op::Qkv { x, w, y } => write!(f, "{n} {x:?} . {w:?} -> {y:?}"),
            Op::Rope { x, heads } => write!(f, "{n} {x:?} ({heads} heads) at Positions"),
            Op::KvStore { layer } => write!(f, "{n} K, V -> cache[{layer}] at Slots, Positions"),
            Op::Attention { layer } => write!(f, "{n} Q over cache[{layer}] -> Attn"),
            Op::GateUpSilu { x, gate, up, out, .. } => {
                write!(f, "{n} silu({x:?} . {gate:?}) * ({x:?} . {up:?}) -> {out:?}")
            }
            Op::AddAssign { x, y } => write!(f, "{n} {x:?} += {y:?}"),
            Op::RouterTopk { logits, k, ids, weights } => {
                write!(f, "{n} top-{k} of {logits:?} -> {ids:?}, {weights:?}")
            }
            Op::Experts { layer, x, ids, weights, out } => {
                write!(f, "{n} experts[{layer}]({x:?}) by {ids:?}, {weights:?} -> {out:?}")
            }
            Op::GatherRows { src, idx, out } => write!(f, "{n} {src:?}[{idx:?}] -> {out:?}"),
        }
    }
}

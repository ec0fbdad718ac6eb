// attention.cu: the KV cache store and causal grouped-query attention over it.
//
// Math (runtime/src/cpu/reference/attention.rs is the oracle):
//   kv_store:  K[s][t] = k[r], V[s][t] = v[r] for s = slots[r], t = positions[r], rounded to the
//              cache dtype (RNE), rows in order: of rows naming the same place of the cache the
//              last one wins.
//   attention: for query row r, head h, kv head g = h / (heads / kv_heads), slot s = slots[r],
//              positions t = 0..=positions[r] (causal):
//              out[r][h] = sum_t softmax_t(scale * q[r][h] . K[s][t][g]) V[s][t][g].
// Shapes: q, out [rows, heads, head_dim] f32; k, v [rows, kv_heads, head_dim] f32; the caches are
// paged, [num_blocks, block_size, kv_heads, head_dim], f32, bf16 or f16 (k and v independently),
// through the block table u32 [n_slots, max_blocks]: K[s][t][g][e] is element
// ((table[s][t / block_size] * block_size + t % block_size) * kv_heads + g) * head_dim + e, and
// capacity = max_blocks * block_size. A block is contiguous, so a key row is still one contiguous
// run of head_dim elements (the loads below stay coalesced whatever the block size); the kernels
// look up the block of each key position they load (one L1-resident u32 read per position and
// lane group, a shift for power-of-two block sizes, else a division), so any block size >= 1 works
// and a tile or split may straddle blocks. slots, positions u32 [rows]. Rows may name any slots in
// any order (a prefill is rows p0..p0+T-1 of one slot, a decode step one row per sequence; a
// batch may mix both).
// Data-dependent errors: a slot >= n_slots (MW_SLOT_OUT_OF_RANGE), a position >= capacity
// (MW_CONTEXT_OVERFLOW) or a table entry the row needs >= num_blocks (MW_BLOCK_OUT_OF_RANGE: the
// entry of the row's position for kv_store; of every block up to it for attention, which every
// block of the row checks before loading any key, so no split goes ahead alone) is reported
// through mw::report and the row is skipped (its output, or the cache, is left as it was); no
// kernel reads or writes through an unchecked entry.
//
// Kernels (runtime/src/gpu/ops/attention.rs picks them, from shapes and dtypes only):
// - kv_store_<k>_<v>: a block per row; the block first scans the later rows for one naming the
//   same place (then it writes nothing), so the last row wins on any schedule.
// - attention_decode_<t>_hd<64|128>_g<4|8> (k and v of dtype t, head_dim exactly 64 or 128) and
//   attention_decode_<k>_<v>_even (any even head_dim <= 256): flash-decoding. A block per (row,
//   split of the row's positions, kv head, chunk of <= G of its query heads), so K and V are read
//   once per group. The block's threads form groups of LANES lanes; each group takes one key
//   position at a time (U positions per step, the next step's loads in flight while this one
//   computes), each lane 16-byte loads (8 bf16, 4 f32) of its part of the head dimension
//   (coalesced: a group reads a whole key row). Online softmax per group in f32 (running max and
//   sum, log2 units), merged across the block's groups in shared memory; with one split per row
//   the block writes the output, else its partial (unnormalised sum, max, weight sum) goes to
//   scratch and the last block of the row to arrive (an atomic counter) merges the splits
//   (log-sum-exp weights) into the output and resets the counter.
//   The split count is a launch parameter; each row splits its own length n = position + 1 into
//   chunks of max(ceil(n / splits), min_split) positions, so short rows use fewer blocks. The
//   merge lives in the decode kernel's last block rather than in a combine kernel: the same
//   reads, one launch (and its gap) less per layer.
// - attention_prefill_<t>_hd<64|128|256> (k and v of dtype t, even head_dim up to the suffix): a
//   block per (tile of prefill_rows consecutive rows, kv head, chunk of its query heads); K and V
//   tiles of the tile's slot are converted to f32 in shared memory and serve all the block's
//   query vectors (rows x heads). A tile whose rows are not all in one slot is left to the decode
//   kernel (launched beside it, which skips the rows a prefill tile owns): so any row order
//   works, and each row is handled once.
// Exactly causal for any positions; head_dim even and <= 256; capacity and counts of positions
// need not be multiples of any tile.
// Tests: tests/gpu_attention.rs against cpu::Reference (emulated under every schedule in CI; on a
// GPU with `cargo test --features cuda --test gpu_attention -- --ignored`); plans are forced
// there through attention::attention_planned (one split, many splits, prefill beside decode).
// Bench: bytes moved by decode attention are the live K and V, sum over rows of (position + 1) x
// kv_heads x head_dim x (k + v element sizes), plus q and out; never the allocated capacity.
#include "common.cuh"
#include "params/attention.h"

namespace attn {

MW_DEV float neg_inf() { return __uint_as_float(0xff800000u); }
MW_DEV uint32_t umin(uint32_t a, uint32_t b) { return a < b ? a : b; }
MW_DEV uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// ---- loads ---------------------------------------------------------------------------------------

// WORDS 32-bit words from a (4 * WORDS)-byte aligned global address, as one load.
template <int WORDS>
MW_DEV void load_words(const void* src, uint32_t (&w)[WORDS]);
template <>
MW_DEV void load_words<1>(const void* src, uint32_t (&w)[1]) {
    w[0] = __ldg(reinterpret_cast<const unsigned int*>(src));
}
template <>
MW_DEV void load_words<2>(const void* src, uint32_t (&w)[2]) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
    w[0] = v.x;
    w[1] = v.y;
}
template <>
MW_DEV void load_words<4>(const void* src, uint32_t (&w)[4]) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
}

// Floats another block of this launch wrote: through L2 (never a stale L1 line).
MW_DEV float load_shared_global(const float* p) { return __ldcg(p); }
MW_DEV void load_shared_global4(const float* p, float (&out)[4]) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p));
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
}

// Cache element type -> f32, a 32-bit word at a time (element 2i in the low half: little endian).
template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
    static constexpr int PER_WORD = 1;
    MW_DEV static void word(uint32_t w, float* o) { o[0] = __uint_as_float(w); }
};
template <>
struct Cvt<bf16> {
    static constexpr int PER_WORD = 2;
    MW_DEV static void word(uint32_t w, float* o) {
        o[0] = __uint_as_float(w << 16);
        o[1] = __uint_as_float(w & 0xffff0000u);
    }
};
template <>
struct Cvt<f16> {
    static constexpr int PER_WORD = 2;
    MW_DEV static void word(uint32_t w, float* o) {
        o[0] = mw::to_f32(f16{uint16_t(w & 0xffffu)});
        o[1] = mw::to_f32(f16{uint16_t(w >> 16)});
    }
};

// ---- rows ----------------------------------------------------------------------------------------

// Whether (slot, pos) lies in the cache; if not, `report` says whether this thread records it.
MW_DEV bool row_in_cache(unsigned int* status, unsigned int op, uint32_t n_slots, uint32_t capacity,
                         uint64_t row, uint32_t slot, uint32_t pos, bool report) {
    if (slot >= n_slots) {
        if (report) mw::report(status, op, MW_SLOT_OUT_OF_RANGE, row, slot, n_slots);
        return false;
    }
    if (pos >= capacity) {
        if (report) mw::report(status, op, MW_CONTEXT_OVERFLOW, row, pos, capacity);
        return false;
    }
    return true;
}

// Paging: position t of a slot lies at element offset(t) of the cache (plus the kv head's and
// element's offsets). Only called for positions whose table entries were checked.
struct Pages {
    const uint32_t* table_row;  // the slot's row of the block table
    uint32_t block_size;
    uint32_t shift;             // log2(block_size), or 32: divide
    uint64_t pos_stride;        // elements per position: kv_heads * head_dim
    MW_DEV uint64_t offset(uint32_t t) const {
        const uint32_t b = shift < 32u ? t >> shift : t / block_size;
        const uint32_t o = t - b * block_size;
        return (uint64_t(__ldg(table_row + b)) * block_size + o) * pos_stride;
    }
};

// The index of the first entry of table_row[0..n) that names no block of the cache, or
// 0xffffffff. Every thread of the block calls it (it synchronises).
template <int THREADS>
MW_DEV uint32_t first_bad_entry(const uint32_t* table_row, uint32_t n, uint32_t num_blocks) {
    __shared__ uint32_t bad_smem;
    if (threadIdx.x == 0) bad_smem = 0xffffffffu;
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < n; j += THREADS) {
        if (__ldg(table_row + j) >= num_blocks) atomicMin(&bad_smem, j);
    }
    __syncthreads();
    const uint32_t bad = bad_smem;
    __syncthreads();  // the next call may reset it
    return bad;
}

// Whether row r belongs to a prefill tile (prefill_rows consecutive rows, all in one slot) that
// the prefill kernel of this call handles; the decode kernel skips those rows. Both kernels
// decide with this one function.
MW_DEV bool prefill_owns(const AttentionParams& p, uint64_t r) {
    if (p.prefill_rows == 0) return false;
    const uint64_t first = r - r % p.prefill_rows;
    const uint64_t end = first + p.prefill_rows < p.rows ? first + p.prefill_rows : p.rows;
    const uint32_t slot = p.slots[first];
    for (uint64_t i = first + 1; i < end; ++i) {
        if (p.slots[i] != slot) return false;
    }
    return true;
}

// Positions per split of a row of n positions: each of the first ceil(n / len) splits takes len.
MW_DEV uint32_t split_len(uint32_t n, uint32_t splits, uint32_t min_split) {
    return umax((n + splits - 1) / splits, umax(min_split, 1u));
}

// ---- decode: flash-decoding ----------------------------------------------------------------------

// One decode configuration: LANES lanes per key row, each holding CHUNKS chunks of CHUNK
// consecutive elements (chunk c of lane l starts at element (c * LANES + l) * CHUNK), G query
// heads per block, U key positions per group and step.
template <typename KT_, typename VT_, int CHUNK_, int CHUNKS_, int LANES_, int G_, int U_, bool FIXED_>
struct DecodeCfg {
    using KT = KT_;
    using VT = VT_;
    static constexpr int THREADS = 128;
    static constexpr int CHUNK = CHUNK_, CHUNKS = CHUNKS_, LANES = LANES_, G = G_, U = U_;
    static constexpr int GROUPS = THREADS / LANES;
    static constexpr int E = CHUNK * CHUNKS;  // elements per lane of one key row
    static constexpr int HD_MAX = E * LANES;
    static constexpr int KW = CHUNK * int(sizeof(KT)) / 4;  // 32-bit words per K chunk
    static constexpr int VW = CHUNK * int(sizeof(VT)) / 4;
    static constexpr bool FIXED = FIXED_;  // head_dim == HD_MAX (else any even head_dim <= it)
    static constexpr uint32_t STEP = uint32_t(GROUPS * U);  // positions per block step
    // Dynamic shared memory: per group and head, the output row and (max, sum). Mirrored by
    // `decode_shared_bytes` in runtime/src/gpu/ops/attention.rs.
    static constexpr uint32_t SMEM = uint32_t(GROUPS * G * (HD_MAX + 2) * 4);
    // The last block's merge of the splits keeps one weight per (head, split) there.
    static constexpr int MAX_SPLITS = 128;
    static_assert(LANES <= MW_WARP && (LANES & (LANES - 1)) == 0, "a group is a power of two within a warp");
    static_assert(THREADS % MW_WARP == 0, "whole warps");
    static_assert(KW >= 1 && VW >= 1 && KW <= 4 && VW <= 4 && KW != 3 && VW != 3, "1, 2 or 4 words per load");
    static_assert(G * MAX_SPLITS <= GROUPS * G * (HD_MAX + 2), "merge weights fit the shared memory");
};

// Raw K and V chunks of the U positions of one step (zeros past the split or the head).
template <class C>
struct KvRaw {
    uint32_t k[C::U][C::CHUNKS][C::KW];
    uint32_t v[C::U][C::CHUNKS][C::VW];
};

template <class C>
MW_DEV void load_step(KvRaw<C>& raw, const typename C::KT* kc, const typename C::VT* vc, const Pages& pages,
                      uint32_t base, uint32_t t_end, uint32_t gi, uint32_t lane, uint32_t hd) {
#pragma unroll
    for (int u = 0; u < C::U; ++u) {
        const uint32_t t = base + uint32_t(u * C::GROUPS) + gi;
        const uint64_t at = t < t_end ? pages.offset(t) : 0;
#pragma unroll
        for (int c = 0; c < C::CHUNKS; ++c) {
            const uint32_t e0 = (uint32_t(c * C::LANES) + lane) * C::CHUNK;
            if (t < t_end && (C::FIXED || e0 < hd)) {
                load_words<C::KW>(kc + at + e0, raw.k[u][c]);
                load_words<C::VW>(vc + at + e0, raw.v[u][c]);
            } else {
#pragma unroll
                for (int w = 0; w < C::KW; ++w) raw.k[u][c][w] = 0u;
#pragma unroll
                for (int w = 0; w < C::VW; ++w) raw.v[u][c][w] = 0u;
            }
        }
    }
}

template <typename T, int CHUNKS, int W, int E>
MW_DEV void unpack(const uint32_t (&raw)[CHUNKS][W], float (&out)[E]) {
    constexpr int PER = Cvt<T>::PER_WORD;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
#pragma unroll
        for (int w = 0; w < W; ++w) Cvt<T>::word(raw[c][w], &out[(c * W + w) * PER]);
    }
}

template <class C>
MW_DEV void decode(const AttentionParams& p) {
    using KT = typename C::KT;
    using VT = typename C::VT;
    constexpr int G = C::G, E = C::E, U = C::U, LANES = C::LANES, GROUPS = C::GROUPS;
    const uint32_t tid = threadIdx.x, lane = tid % LANES, gi = tid / LANES;
    const uint64_t r = blockIdx.x;
    const uint32_t split = blockIdx.y;
    const uint32_t kv_head = blockIdx.z / p.head_chunks, hc = blockIdx.z % p.head_chunks;
    if (prefill_owns(p, r)) return;
    const uint32_t slot = p.slots[r], pos = p.positions[r];
    const bool reporter = split == 0 && blockIdx.z == 0 && tid == 0;
    if (!row_in_cache(p.status, MW_OP_ATTENTION, p.n_slots, p.capacity, r, slot, pos, reporter)) return;
    // Every block of the row checks the row's whole table (the same answer for all its splits).
    const uint32_t* table_row = p.block_table + uint64_t(slot) * p.max_blocks;
    const uint32_t bad = first_bad_entry<C::THREADS>(table_row, pos / p.block_size + 1, p.num_blocks);
    if (bad != 0xffffffffu) {
        if (reporter) mw::report(p.status, MW_OP_ATTENTION, MW_BLOCK_OUT_OF_RANGE, r, table_row[bad], p.num_blocks);
        return;
    }

    // This block's positions [t_begin, t_end) of the row's n.
    const uint32_t n = pos + 1;
    const uint32_t len = split_len(n, p.splits, p.min_split);
    if (uint64_t(split) * len >= n) return;
    const uint32_t t_begin = split * len;
    const uint32_t t_end = t_begin + umin(len, n - t_begin);
    const uint32_t active = (n + len - 1) / len;

    const uint32_t hd = C::FIXED ? uint32_t(C::HD_MAX) : p.head_dim;
    const uint32_t group = p.heads / p.kv_heads;
    const uint32_t g_first = hc * p.head_chunk;
    const uint32_t ng = umin(uint32_t(G), umin(p.head_chunk, group - g_first));
    const uint64_t h0 = uint64_t(kv_head) * group + g_first;

    // The block's query heads, scaled into log2 units (exp2 below); zero past ng or hd.
    float q[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qh = p.q + (r * p.heads + h0 + uint64_t(g)) * hd;
#pragma unroll
        for (int c = 0; c < C::CHUNKS; ++c) {
            const uint32_t e0 = (uint32_t(c * LANES) + lane) * C::CHUNK;
#pragma unroll
            for (int i = 0; i < C::CHUNK; ++i) {
                const bool ok = uint32_t(g) < ng && (C::FIXED || e0 < hd);
                q[g][c * C::CHUNK + i] = ok ? qh[e0 + i] * p.scale_log2 : 0.0f;
            }
        }
    }

    float m[G], l[G], acc[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = neg_inf();
        l[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < E; ++j) acc[g][j] = 0.0f;
    }

    const Pages pages{table_row, p.block_size, p.block_shift, uint64_t(p.kv_heads) * hd};
    const KT* kc = static_cast<const KT*>(p.k_cache) + uint64_t(kv_head) * hd;
    const VT* vc = static_cast<const VT*>(p.v_cache) + uint64_t(kv_head) * hd;

    KvRaw<C> cur;
    load_step<C>(cur, kc, vc, pages, t_begin, t_end, gi, lane, hd);
    for (uint32_t base = t_begin; base < t_end; base += C::STEP) {
        // The next step's loads go out before this step's arithmetic.
        KvRaw<C> next;
        load_step<C>(next, kc, vc, pages, base + C::STEP, t_end, gi, lane, hd);

        // Scores of the U positions for each head: the lane's partial dot, summed over the group.
        float s[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[E];
            unpack<KT>(cur.k[u], kf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.0f;
#pragma unroll
                for (int j = 0; j < E; ++j) dot = fmaf(q[g][j], kf[j], dot);
                s[u][g] = dot;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
#pragma unroll
                for (int o = LANES / 2; o > 0; o /= 2) s[u][g] += __shfl_xor_sync(MW_FULL_MASK, s[u][g], o);
            }
            const bool valid = base + uint32_t(u * GROUPS) + gi < t_end;
#pragma unroll
            for (int g = 0; g < G; ++g) s[u][g] = valid ? s[u][g] : neg_inf();
        }

        // Online softmax: rescale the running sums once per step.
        float vf[U][E];
#pragma unroll
        for (int u = 0; u < U; ++u) unpack<VT>(cur.v[u], vf[u]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float step_max = s[0][g];
#pragma unroll
            for (int u = 1; u < U; ++u) step_max = fmaxf(step_max, s[u][g]);
            const float m_new = fmaxf(m[g], step_max);
            // exp2(-inf) = 0 takes care of an empty running sum; both -inf: nothing seen yet.
            const float corr = m_new == neg_inf() ? 1.0f : exp2f(m[g] - m_new);
            float w[U], w_sum = 0.0f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                w[u] = s[u][g] == neg_inf() ? 0.0f : exp2f(s[u][g] - m_new);
                w_sum += w[u];
            }
            l[g] = fmaf(l[g], corr, w_sum);
#pragma unroll
            for (int j = 0; j < E; ++j) {
                float a = acc[g][j] * corr;
#pragma unroll
                for (int u = 0; u < U; ++u) a = fmaf(w[u], vf[u][j], a);
                acc[g][j] = a;
            }
            m[g] = m_new;
        }
        cur = next;
    }

    // Merge the groups: each scales its sums to the block's max; then a fixed-order sum.
    MW_DYNAMIC_SHARED(float, smem);
    float* acc_smem = smem;                            // [GROUPS][G][HD_MAX]
    float* m_smem = smem + GROUPS * G * C::HD_MAX;     // [GROUPS][G]
    float* l_smem = m_smem + GROUPS * G;               // [GROUPS][G]
    __shared__ float total_m_smem[G], total_l_smem[G];
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            m_smem[gi * G + g] = m[g];
            l_smem[gi * G + g] = l[g];
        }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float block_m = neg_inf();
        for (int k = 0; k < GROUPS; ++k) block_m = fmaxf(block_m, m_smem[k * G + g]);
        // A group that saw no position has m = -inf and sums 0: weight 0.
        const float f = m[g] == neg_inf() ? 0.0f : exp2f(m[g] - block_m);
#pragma unroll
        for (int c = 0; c < C::CHUNKS; ++c) {
            const uint32_t e0 = (uint32_t(c * LANES) + lane) * C::CHUNK;
            if (C::FIXED || e0 < hd) {
#pragma unroll
                for (int i = 0; i < C::CHUNK; ++i) {
                    acc_smem[(gi * G + g) * C::HD_MAX + e0 + i] = acc[g][c * C::CHUNK + i] * f;
                }
            }
        }
        if (tid == 0) {
            float total_l = 0.0f;
            for (int k = 0; k < GROUPS; ++k) {
                const float mk = m_smem[k * G + g];
                total_l += mk == neg_inf() ? 0.0f : l_smem[k * G + g] * exp2f(mk - block_m);
            }
            total_m_smem[g] = block_m;
            total_l_smem[g] = total_l;
        }
    }
    __syncthreads();

    const uint64_t hd4 = (hd + 3) / 4 * 4;
    for (uint32_t idx = tid; idx < ng * hd; idx += C::THREADS) {
        const uint32_t g = idx / hd, e = idx % hd;
        float a = 0.0f;
        for (int k = 0; k < GROUPS; ++k) a += acc_smem[(k * G + g) * C::HD_MAX + e];
        const uint64_t rh = r * p.heads + h0 + g;
        if (active == 1) {
            p.out[rh * hd + e] = a / total_l_smem[g];
        } else {
            p.partial_acc[(rh * p.splits + split) * hd4 + e] = a;
            if (e == 0) {
                p.partial_ml[(rh * p.splits + split) * 2] = total_m_smem[g];
                p.partial_ml[(rh * p.splits + split) * 2 + 1] = total_l_smem[g];
            }
        }
    }
    if (active == 1) return;

    // The last block of (row, kv head, head chunk) to arrive merges the splits.
    __shared__ bool last_smem;
    __threadfence();
    __syncthreads();
    unsigned int* arrivals = p.arrivals + r * (uint64_t(p.kv_heads) * p.head_chunks) + blockIdx.z;
    if (tid == 0) last_smem = atomicAdd(arrivals, 1u) + 1u == active;
    __syncthreads();
    if (!last_smem) return;
    __threadfence();

    // Weights w[g][s] = exp2(m_s - max m) and totals L[g] = sum_s w l_s: a warp per head.
    float* w_smem = smem;  // [G][MAX_SPLITS]; the group sums above are no longer needed
    const uint32_t warp = tid / MW_WARP, wl = tid % MW_WARP;
    for (uint32_t g = warp; g < ng; g += C::THREADS / MW_WARP) {
        const uint64_t rh = r * p.heads + h0 + g;
        const float* ml = p.partial_ml + rh * p.splits * 2;
        float mx = neg_inf();
        for (uint32_t s = wl; s < active; s += MW_WARP) mx = fmaxf(mx, load_shared_global(ml + 2 * s));
        mx = mw::warp_max(mx);
        float lsum = 0.0f;
        for (uint32_t s = wl; s < active; s += MW_WARP) {
            const float w = exp2f(load_shared_global(ml + 2 * s) - mx);
            w_smem[g * C::MAX_SPLITS + s] = w;
            lsum += w * load_shared_global(ml + 2 * s + 1);
        }
        lsum = mw::warp_sum(lsum);
        if (wl == 0) total_l_smem[g] = lsum;
    }
    __syncthreads();
    // out = sum_s w_s acc_s / L, four elements per thread and item.
    const uint32_t quads = uint32_t(hd4 / 4);
    for (uint32_t idx = tid; idx < ng * quads; idx += C::THREADS) {
        const uint32_t g = idx / quads, e0 = (idx % quads) * 4;
        const uint64_t rh = r * p.heads + h0 + g;
        const float* part = p.partial_acc + rh * p.splits * hd4 + e0;
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8
        for (uint32_t s = 0; s < active; ++s) {
            float x[4];
            load_shared_global4(part + s * hd4, x);
            const float w = w_smem[g * C::MAX_SPLITS + s];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = fmaf(w, x[i], a[i]);
        }
        const float total = total_l_smem[g];
        for (uint32_t i = 0; i < 4 && e0 + i < hd; ++i) p.out[rh * hd + e0 + i] = a[i] / total;
    }
    if (tid == 0) atomicExch(arrivals, 0u);  // ready for the next launch
}

// ---- prefill: query tiles over shared K/V tiles --------------------------------------------------

// One prefill configuration: 8 lanes per query vector, each holding HD_MAX / 32 float4 chunks of
// the head dimension (chunk k of lane l at element 4 * (l + 8 k)); QPT query vectors per group,
// NQV per block; K and V tiles of BK positions (32 KB of f32 together).
template <typename CT_, int HD_MAX_>
struct PrefillCfg {
    using CT = CT_;
    static constexpr int THREADS = 128, LANES = 8, GROUPS = THREADS / LANES;
    static constexpr int HD_MAX = HD_MAX_;
    static constexpr int CH = HD_MAX / (4 * LANES);  // float4 chunks per lane
    static constexpr int E = 4 * CH;
    static constexpr int QPT = 256 / HD_MAX;  // 32 q and 32 accumulator registers per thread
    static constexpr int NQV = GROUPS * QPT;
    static constexpr int BK = 4096 / HD_MAX;
    static constexpr int KC = 8;  // positions per online-softmax step
    // Mirrored by `prefill_shared_bytes` in runtime/src/gpu/ops/attention.rs.
    static constexpr uint32_t SMEM = uint32_t(2 * BK * HD_MAX * 4);
    static_assert(BK % KC == 0 && CH >= 1, "tile shapes");
};

// Converts positions [t0, t0 + nk) of one kv head into a row-major f32 tile [BK][HD_MAX] (the
// tile may straddle cache blocks: each key row is looked up).
template <class C>
MW_DEV void load_tile(const typename C::CT* src, const Pages& pages, uint32_t t0, uint32_t nk, uint32_t hd,
                      float* tile) {
    using CT = typename C::CT;
    constexpr int VEC = 16 / int(sizeof(CT));  // elements per 16-byte load
    if (hd % VEC == 0) {
        const uint32_t per_row = hd / VEC;
        for (uint32_t idx = threadIdx.x; idx < nk * per_row; idx += C::THREADS) {
            const uint32_t key = idx / per_row, e0 = (idx % per_row) * VEC;
            uint32_t w[4];
            load_words<4>(src + pages.offset(t0 + key) + e0, w);
            float f[VEC];
#pragma unroll
            for (int i = 0; i < 4; ++i) Cvt<CT>::word(w[i], &f[i * Cvt<CT>::PER_WORD]);
#pragma unroll
            for (int i = 0; i < VEC; ++i) tile[key * C::HD_MAX + e0 + i] = f[i];
        }
    } else {
        // Even head_dim: pairs of elements (4 or 8 bytes, aligned since every row starts at an
        // even element).
        constexpr int W = 2 * int(sizeof(CT)) / 4;
        const uint32_t per_row = hd / 2;
        for (uint32_t idx = threadIdx.x; idx < nk * per_row; idx += C::THREADS) {
            const uint32_t key = idx / per_row, e0 = (idx % per_row) * 2;
            uint32_t w[W];
            load_words<W>(src + pages.offset(t0 + key) + e0, w);
            float f[2];
#pragma unroll
            for (int i = 0; i < W; ++i) Cvt<CT>::word(w[i], &f[i * Cvt<CT>::PER_WORD]);
            tile[key * C::HD_MAX + e0] = f[0];
            tile[key * C::HD_MAX + e0 + 1] = f[1];
        }
    }
}

// The lane's chunks of one f32 row of a shared-memory tile (16-byte loads).
template <class C>
MW_DEV void load_chunks(const float* row, uint32_t lane, float (&out)[C::E]) {
#pragma unroll
    for (int k = 0; k < C::CH; ++k) {
        const float4 v = *reinterpret_cast<const float4*>(row + 4 * (lane + C::LANES * k));
        out[4 * k] = v.x;
        out[4 * k + 1] = v.y;
        out[4 * k + 2] = v.z;
        out[4 * k + 3] = v.w;
    }
}

template <class C>
MW_DEV void prefill(const AttentionParams& p) {
    constexpr int QPT = C::QPT, E = C::E, KC = C::KC, LANES = C::LANES;
    const uint64_t first = uint64_t(blockIdx.x) * p.prefill_rows;
    if (first >= p.rows || !prefill_owns(p, first)) return;  // mixed slots: the decode kernel's
    const uint32_t tid = threadIdx.x, lane = tid % LANES, gi = tid / LANES;
    const uint32_t kv_head = blockIdx.y / p.head_chunks, hc = blockIdx.y % p.head_chunks;
    const uint32_t tile_rows = uint32_t(p.rows - first < p.prefill_rows ? p.rows - first : p.prefill_rows);
    const uint32_t slot = p.slots[first];
    const bool reporter = blockIdx.y == 0;
    if (slot >= p.n_slots) {
        if (reporter && tid == 0) mw::report(p.status, MW_OP_ATTENTION, MW_SLOT_OUT_OF_RANGE, first, slot, p.n_slots);
        return;
    }
    uint32_t n_keys = 0;  // positions 0..n_keys cover every valid row of the tile
    for (uint32_t i = 0; i < tile_rows; ++i) {
        const uint32_t pos = p.positions[first + i];
        if (pos < p.capacity) {
            n_keys = umax(n_keys, pos + 1);
        } else if (reporter && i % C::THREADS == tid) {
            mw::report(p.status, MW_OP_ATTENTION, MW_CONTEXT_OVERFLOW, first + i, pos, p.capacity);
        }
    }
    if (n_keys == 0) return;
    // The tile reads positions 0..n_keys of its slot: every entry up to the last one's block.
    const uint32_t* table_row = p.block_table + uint64_t(slot) * p.max_blocks;
    const uint32_t bad = first_bad_entry<C::THREADS>(table_row, (n_keys - 1) / p.block_size + 1, p.num_blocks);
    if (bad != 0xffffffffu) {
        // The first row of the tile that needs the entry (the reference's row).
        if (reporter && tid == 0) {
            for (uint32_t i = 0; i < tile_rows; ++i) {
                const uint32_t pos = p.positions[first + i];
                if (pos < p.capacity && pos / p.block_size >= bad) {
                    mw::report(p.status, MW_OP_ATTENTION, MW_BLOCK_OUT_OF_RANGE, first + i, table_row[bad],
                               p.num_blocks);
                    break;
                }
            }
        }
        return;
    }

    const uint32_t hd = p.head_dim;
    const uint32_t group = p.heads / p.kv_heads;
    const uint32_t g_first = hc * p.head_chunk;
    const uint32_t ng = umin(p.head_chunk, group - g_first);

    // This group's query vectors (row, head): v = gi * QPT + j, row first + v / ng, head v % ng.
    float q[QPT][E];
    bool live[QPT];
    uint32_t qpos[QPT];
    uint64_t qrow[QPT];
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
        const uint32_t v = gi * QPT + j;
        const uint32_t row_l = v / ng;
        qrow[j] = (first + row_l) * p.heads + uint64_t(kv_head) * group + g_first + v % ng;
        qpos[j] = row_l < tile_rows ? p.positions[first + row_l] : 0u;
        live[j] = row_l < tile_rows && qpos[j] < p.capacity;
#pragma unroll
        for (int k = 0; k < C::CH; ++k) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t e = 4 * (lane + LANES * k) + i;
                q[j][4 * k + i] = live[j] && e < hd ? p.q[qrow[j] * hd + e] * p.scale_log2 : 0.0f;
            }
        }
    }
    float m[QPT], l[QPT], acc[QPT][E];
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
        m[j] = neg_inf();
        l[j] = 0.0f;
#pragma unroll
        for (int x = 0; x < E; ++x) acc[j][x] = 0.0f;
    }

    MW_DYNAMIC_SHARED(float, smem);
    float* k_smem = smem;                    // [BK][HD_MAX]
    float* v_smem = smem + C::BK * C::HD_MAX;  // [BK][HD_MAX]
    // Columns past hd stay zero; rows past the last tile's end keep finite values (and are masked).
    for (uint32_t i = tid; i < uint32_t(2 * C::BK * C::HD_MAX); i += C::THREADS) smem[i] = 0.0f;
    __syncthreads();

    const Pages pages{table_row, p.block_size, p.block_shift, uint64_t(p.kv_heads) * hd};
    const typename C::CT* kc = static_cast<const typename C::CT*>(p.k_cache) + uint64_t(kv_head) * hd;
    const typename C::CT* vc = static_cast<const typename C::CT*>(p.v_cache) + uint64_t(kv_head) * hd;

    for (uint32_t t0 = 0; t0 < n_keys; t0 += C::BK) {
        const uint32_t nk = umin(uint32_t(C::BK), n_keys - t0);
        load_tile<C>(kc, pages, t0, nk, hd, k_smem);
        load_tile<C>(vc, pages, t0, nk, hd, v_smem);
        __syncthreads();
        for (uint32_t k0 = 0; k0 < nk; k0 += KC) {
            float s[QPT][KC];
#pragma unroll
            for (int kk = 0; kk < KC; ++kk) {
                float kf[E];
                load_chunks<C>(k_smem + (k0 + kk) * C::HD_MAX, lane, kf);
#pragma unroll
                for (int j = 0; j < QPT; ++j) {
                    float dot = 0.0f;
#pragma unroll
                    for (int x = 0; x < E; ++x) dot = fmaf(q[j][x], kf[x], dot);
                    s[j][kk] = dot;
                }
            }
            // Sum over the 8 lanes; mask positions past each query's own (causal). Then s holds
            // the weights exp2(s - m_new) of the step.
#pragma unroll
            for (int j = 0; j < QPT; ++j) {
#pragma unroll
                for (int kk = 0; kk < KC; ++kk) {
#pragma unroll
                    for (int o = LANES / 2; o > 0; o /= 2) s[j][kk] += __shfl_xor_sync(MW_FULL_MASK, s[j][kk], o);
                    const bool keep = live[j] && t0 + k0 + kk <= qpos[j];
                    s[j][kk] = keep ? s[j][kk] : neg_inf();
                }
                float step_max = s[j][0];
#pragma unroll
                for (int kk = 1; kk < KC; ++kk) step_max = fmaxf(step_max, s[j][kk]);
                const float m_new = fmaxf(m[j], step_max);
                const float corr = m_new == neg_inf() ? 1.0f : exp2f(m[j] - m_new);
                float w_sum = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KC; ++kk) {
                    s[j][kk] = s[j][kk] == neg_inf() ? 0.0f : exp2f(s[j][kk] - m_new);
                    w_sum += s[j][kk];
                }
                l[j] = fmaf(l[j], corr, w_sum);
#pragma unroll
                for (int x = 0; x < E; ++x) acc[j][x] *= corr;
                m[j] = m_new;
            }
#pragma unroll
            for (int kk = 0; kk < KC; ++kk) {
                float vf[E];
                load_chunks<C>(v_smem + (k0 + kk) * C::HD_MAX, lane, vf);
#pragma unroll
                for (int j = 0; j < QPT; ++j) {
                    // Masked positions add nothing, not even 0 * (a NaN of an unwritten cache entry).
                    if (live[j] && t0 + k0 + kk <= qpos[j]) {
#pragma unroll
                        for (int x = 0; x < E; ++x) acc[j][x] = fmaf(s[j][kk], vf[x], acc[j][x]);
                    }
                }
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int j = 0; j < QPT; ++j) {
        if (!live[j]) continue;
#pragma unroll
        for (int k = 0; k < C::CH; ++k) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t e = 4 * (lane + LANES * k) + i;
                if (e < hd) p.out[qrow[j] * hd + e] = acc[j][4 * k + i] / l[j];
            }
        }
    }
}

// ---- kv_store ------------------------------------------------------------------------------------

constexpr int STORE_THREADS = 128;

// The cache row (block * block_size + offset) that (slot, pos) maps to, or 0xffffffffffffffff when
// the slot, the position or the table entry is out of range.
MW_DEV uint64_t store_place(const KvStoreParams& p, uint32_t slot, uint32_t pos) {
    if (slot >= p.n_slots || pos >= p.capacity) return ~uint64_t(0);
    const uint32_t block = p.block_table[uint64_t(slot) * p.max_blocks + pos / p.block_size];
    if (block >= p.num_blocks) return ~uint64_t(0);
    return uint64_t(block) * p.block_size + pos % p.block_size;
}

template <typename KT, typename VT>
MW_DEV void kv_store(const KvStoreParams& p) {
    const uint64_t r = blockIdx.x;
    const uint32_t slot = p.slots[r], pos = p.positions[r];
    if (!row_in_cache(p.status, MW_OP_KV_STORE, p.n_slots, p.capacity, r, slot, pos, threadIdx.x == 0)) return;
    const uint64_t place = store_place(p, slot, pos);
    if (place == ~uint64_t(0)) {
        if (threadIdx.x == 0) {
            const uint32_t block = p.block_table[uint64_t(slot) * p.max_blocks + pos / p.block_size];
            mw::report(p.status, MW_OP_KV_STORE, MW_BLOCK_OUT_OF_RANGE, r, block, p.num_blocks);
        }
        return;
    }
    // A later row naming the same place of the cache (through the table) wins: then this one
    // writes nothing.
    __shared__ int later_smem;
    if (threadIdx.x == 0) later_smem = 0;
    __syncthreads();
    for (uint64_t i = r + 1 + threadIdx.x; i < p.rows; i += STORE_THREADS) {
        if (store_place(p, p.slots[i], p.positions[i]) == place) later_smem = 1;
    }
    __syncthreads();
    if (later_smem) return;
    const uint64_t at = place * p.width;
    KT* kc = static_cast<KT*>(p.k_cache) + at;
    VT* vc = static_cast<VT*>(p.v_cache) + at;
    const float* k = p.k + r * p.width;
    const float* v = p.v + r * p.width;
    for (uint64_t e = threadIdx.x; e < p.width; e += STORE_THREADS) {
        kc[e] = mw::from_f32<KT>(k[e]);
        vc[e] = mw::from_f32<VT>(v[e]);
    }
}

// ---- configurations ------------------------------------------------------------------------------

// head_dim 128 / 64 with 16-byte chunks: 8 bf16/f16 (16 or 8 lanes per row), or 4 f32 twice (16 or
// 8 lanes per row). G = 4 holds U = 4 positions per step; G = 8 (twice the q and accumulator
// registers) U = 2.
template <typename T, int HD, int G>
using DecodeFast = DecodeCfg<T, T, 16 / int(sizeof(T)), 8 / (16 / int(sizeof(T))), HD / 8, G, G == 4 ? 4 : 2, true>;
// Any even head_dim up to 256: pairs of elements, 32 lanes, 4 chunks each.
template <typename KT, typename VT>
using DecodeEven = DecodeCfg<KT, VT, 2, 4, 32, 4, 2, false>;

}  // namespace attn

#define MW_ATTN_DECODE_FAST(t, T, hd, g)                                                             \
    MW_KERNEL_BOUNDS(attention_decode_##t##_hd##hd##_g##g, AttentionParams, 128) {                   \
        attn::decode<attn::DecodeFast<T, hd, g>>(p);                                                 \
    }
#define MW_ATTN_DECODE_FAST_ALL(t, T)                                                                \
    MW_ATTN_DECODE_FAST(t, T, 64, 4)                                                                 \
    MW_ATTN_DECODE_FAST(t, T, 64, 8)                                                                 \
    MW_ATTN_DECODE_FAST(t, T, 128, 4)                                                                \
    MW_ATTN_DECODE_FAST(t, T, 128, 8)
MW_ATTN_DECODE_FAST_ALL(f32, float)
MW_ATTN_DECODE_FAST_ALL(bf16, bf16)
MW_ATTN_DECODE_FAST_ALL(f16, f16)

#define MW_ATTN_PAIR(kt, KT, vt, VT)                                                                 \
    MW_KERNEL_BOUNDS(attention_decode_##kt##_##vt##_even, AttentionParams, 128) {                    \
        attn::decode<attn::DecodeEven<KT, VT>>(p);                                                   \
    }                                                                                                \
    MW_KERNEL_BOUNDS(kv_store_##kt##_##vt, KvStoreParams, attn::STORE_THREADS) {                     \
        attn::kv_store<KT, VT>(p);                                                                   \
    }
#define MW_ATTN_PAIRS(kt, KT)                                                                        \
    MW_ATTN_PAIR(kt, KT, f32, float)                                                                 \
    MW_ATTN_PAIR(kt, KT, bf16, bf16)                                                                 \
    MW_ATTN_PAIR(kt, KT, f16, f16)
MW_ATTN_PAIRS(f32, float)
MW_ATTN_PAIRS(bf16, bf16)
MW_ATTN_PAIRS(f16, f16)

// No __launch_bounds__ here: with it ptxas trades registers for occupancy and spills.
#define MW_ATTN_PREFILL(t, T, hd)                                                                    \
    MW_KERNEL(attention_prefill_##t##_hd##hd, AttentionParams) {                                     \
        attn::prefill<attn::PrefillCfg<T, hd>>(p);                                                   \
    }
#define MW_ATTN_PREFILL_ALL(t, T)                                                                    \
    MW_ATTN_PREFILL(t, T, 64)                                                                        \
    MW_ATTN_PREFILL(t, T, 128)                                                                       \
    MW_ATTN_PREFILL(t, T, 256)
MW_ATTN_PREFILL_ALL(f32, float)
MW_ATTN_PREFILL_ALL(bf16, bf16)
MW_ATTN_PREFILL_ALL(f16, f16)

// rows.cu: row gathers and scatters (token embedding, Mixtral's expert dispatch and combine).
//
// embedding_<w>               out[r][c] = table[ids[r]][c] * scale           (unscaled: scale = 1,
//                             or the per-tensor scale)
// embedding_<w>_block_<s>     out[r][c] = table[j][c] * scales[j / br][c / bc], j = ids[r]
//                             (block scales; a per-channel scale, one per token, is br = 1,
//                             bc = cols); scales of dtype <s>: f32 or bf16
//                             table [vocab, cols] of dtype <w>: f32, f16, bf16, e4m3fn, e4m3fnuz,
//                             e5m2, e5m2fnuz; ids u32 [picked]; out f32 [picked, cols]
// gather_rows_f32             out[i] = src[idx[i]]; src f32 [rows, cols], idx u32 [picked]
// scatter_add_rows_f32        dst[idx[i]] += weights[i] * src[i] for i = 0 .. picked - 1 in order;
//                             dst f32 [rows, cols], src f32 [picked, cols], weights f32 [picked]
// experts_route               Mixtral's picks (ids u32 [rows, k]) sorted by expert on the device,
//                             for the device-routed `experts` (params/rows.h): one block, a
//                             counting sort (stable: the order of (expert, pick)) of any number
//                             of picks, each thread counting and then placing a run of them
// experts_combine_f32         out[r] = sum over row r's picks in order of expert of weight * the
//                             expert's output row, from +0, one fma each: scatter_add_rows_f32's
//                             order and rounding into a zeroed out, without the zeroing copy
//
// Data-dependent errors: an id or index beyond its table is reported through mw::report on
// p.status (embedding: MW_TOKEN_OUT_OF_RANGE; gather, scatter: MW_INDEX_OUT_OF_RANGE; row = the
// position in ids/idx, value = the id, limit = the table's rows) and that row (or that i) is
// skipped: nothing is written for it. experts_route reports an expert id beyond the experts
// (MW_INDEX_OUT_OF_RANGE, row = the row of ids) and routes it to the last expert, and a row
// naming one expert twice (MW_DUPLICATE_INDEX). The runtime turns the report into the typed error
// at the next read or synchronize.
//
// Launch (runtime/src/gpu/ops/rows.rs sizes the grids; every kernel grid-strides, so any grid is
// correct):
// - embedding, gather_rows: one block per output row, its threads over the columns in 16-byte
//   loads of the table (16 / sizeof(w) elements, written as float4) when cols is a multiple of
//   that and the pointers are 16-byte aligned, else one element at a time. The dequantisation is
//   one f32 product, w * scale: the correctly rounded product, as the reference's.
// - scatter_add_rows: deterministic and race-free without atomics. Block (x, y) owns the
//   destination rows of group y and a range of columns (float4 groups when cols % 4 == 0 and the
//   pointers are aligned); each thread owns its columns of those rows and walks i in order, so
//   every destination element accumulates its contributions in order of i, in f32, one fma each.
//   A warp reads MW_WARP indices at a time and ballots the ones in its row group, then visits only
//   those. More row groups give more blocks (enough to fill the GPU) at the price of each block
//   scanning all of idx (picked / MW_WARP coalesced loads per warp).
//
// Tests: tests/gpu_rows.rs against cpu::Reference (emulated in CI; on a GPU with
// `cargo test --features cuda -- --ignored`), tolerances derived there.
#include "common.cuh"
#include "params/rows.h"

namespace mw_rows {

// N elements of T moved as one access of N * sizeof(T) bytes (16 at most).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T e[N];
};

MW_DEV bool aligned16(const void* ptr) { return (reinterpret_cast<unsigned long long>(ptr) & 15u) == 0; }

// Threads of a gather block and of a scatter block.
constexpr int ROW_THREADS = 256;
constexpr int SCATTER_THREADS = 256;

// Element k of 16 bytes of W held as four 32-bit words, widened to f32.
template <typename W>
MW_DEV float element(const Vec<uint32_t, 4>& words, int k) {
    if constexpr (sizeof(W) == 4) {
        return __uint_as_float(words.e[k]);
    } else if constexpr (sizeof(W) == 2) {
        return mw::to_f32(W{uint16_t(words.e[k / 2] >> (16 * (k % 2)))});
    } else {
        static_assert(sizeof(W) == 1, "f32, 16-bit or fp8 elements");
        return mw::to_f32(W{uint8_t(words.e[k / 4] >> (8 * (k % 4)))});
    }
}

// Scales: `row(j)` is the scale of table row j, whose `at(c)` is the scale of column c.
struct NoScale {
    MW_DEV NoScale row(uint32_t) const { return *this; }
    MW_DEV float apply(float v, uint64_t) const { return v; }
};
struct UniformScale {
    float s;
    MW_DEV UniformScale row(uint32_t) const { return *this; }
    MW_DEV float apply(float v, uint64_t) const { return v * s; }
};
template <typename S>
struct BlockScale {
    const S* scales;  // the row of the scale grid, once `row` picked it
    uint32_t block_rows;
    uint32_t block_cols;
    uint64_t grid_cols;
    MW_DEV BlockScale row(uint32_t j) const {
        return BlockScale{scales + uint64_t(j / block_rows) * grid_cols, block_rows, block_cols, grid_cols};
    }
    MW_DEV float apply(float v, uint64_t c) const { return v * mw::to_f32(scales[c / block_cols]); }
};

// out[r] = scale(table[ids[r]]) for r < picked; an id >= limit is reported and its row skipped.
template <typename W, typename Scale, bool VEC>
MW_DEV void gather(float* out, const W* table, const uint32_t* ids, uint64_t picked, uint64_t limit,
                   uint64_t cols, Scale scale, unsigned int* status, unsigned int op, unsigned int kind) {
    constexpr int PER = 16 / sizeof(W);  // elements per 16-byte load
    for (uint64_t r = blockIdx.x; r < picked; r += gridDim.x) {
        const uint32_t id = ids[r];
        if (id >= limit) {  // uniform over the block
            if (threadIdx.x == 0) mw::report(status, op, kind, r, id, limit);
            continue;
        }
        const W* src = table + uint64_t(id) * cols;
        float* dst = out + r * cols;
        const Scale s = scale.row(id);
        if (VEC) {
            const Vec<uint32_t, 4>* src16 = reinterpret_cast<const Vec<uint32_t, 4>*>(src);
            Vec<float, 4>* dst4 = reinterpret_cast<Vec<float, 4>*>(dst);
            for (uint64_t g = threadIdx.x; g < cols / PER; g += blockDim.x) {
                const Vec<uint32_t, 4> words = src16[g];
#pragma unroll
                for (int q = 0; q < PER / 4; ++q) {
                    Vec<float, 4> o;
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        o.e[k] = s.apply(element<W>(words, 4 * q + k), g * PER + 4 * q + k);
                    }
                    dst4[g * (PER / 4) + q] = o;
                }
            }
        } else {
            for (uint64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = s.apply(mw::to_f32(src[c]), c);
        }
    }
}

template <typename W, typename Scale>
MW_DEV void gather_any(float* out, const W* table, const uint32_t* ids, uint64_t picked, uint64_t limit,
                       uint64_t cols, Scale scale, unsigned int* status, unsigned int op, unsigned int kind) {
    constexpr int PER = 16 / sizeof(W);
    if (cols % PER == 0 && aligned16(table) && aligned16(out)) {
        gather<W, Scale, true>(out, table, ids, picked, limit, cols, scale, status, op, kind);
    } else {
        gather<W, Scale, false>(out, table, ids, picked, limit, cols, scale, status, op, kind);
    }
}

template <typename W>
MW_DEV void embedding_uniform(const EmbeddingParams& p) {
    gather_any(p.out, static_cast<const W*>(p.table), p.ids, p.picked, p.vocab, p.cols, UniformScale{p.scale},
               p.status, MW_OP_EMBEDDING, MW_TOKEN_OUT_OF_RANGE);
}

template <typename W, typename S>
MW_DEV void embedding_block(const EmbeddingParams& p) {
    const uint64_t grid_cols = (p.cols + p.block_cols - 1) / p.block_cols;
    const BlockScale<S> scale{static_cast<const S*>(p.scales), p.block_rows, p.block_cols, grid_cols};
    gather_any(p.out, static_cast<const W*>(p.table), p.ids, p.picked, p.vocab, p.cols, scale, p.status,
               MW_OP_EMBEDDING, MW_TOKEN_OUT_OF_RANGE);
}

}  // namespace mw_rows

#define MW_EMBEDDING(wname, W)                                                                             \
    MW_KERNEL_BOUNDS(embedding_##wname, EmbeddingParams, mw_rows::ROW_THREADS) {                           \
        mw_rows::embedding_uniform<W>(p);                                                                  \
    }                                                                                                      \
    MW_KERNEL_BOUNDS(embedding_##wname##_block_f32, EmbeddingParams, mw_rows::ROW_THREADS) {               \
        mw_rows::embedding_block<W, float>(p);                                                             \
    }                                                                                                      \
    MW_KERNEL_BOUNDS(embedding_##wname##_block_bf16, EmbeddingParams, mw_rows::ROW_THREADS) {              \
        mw_rows::embedding_block<W, bf16>(p);                                                              \
    }

MW_EMBEDDING(f32, float)
MW_EMBEDDING(f16, f16)
MW_EMBEDDING(bf16, bf16)
MW_EMBEDDING(e4m3fn, e4m3fn)
MW_EMBEDDING(e4m3fnuz, e4m3fnuz)
MW_EMBEDDING(e5m2, e5m2)
MW_EMBEDDING(e5m2fnuz, e5m2fnuz)

#undef MW_EMBEDDING

MW_KERNEL_BOUNDS(gather_rows_f32, GatherRowsParams, mw_rows::ROW_THREADS) {
    mw_rows::gather_any(p.out, p.src, p.idx, p.picked, p.rows, p.cols, mw_rows::NoScale{}, p.status,
                        MW_OP_GATHER_ROWS, MW_INDEX_OUT_OF_RANGE);
}

// ---- scatter_add_rows --------------------------------------------------------------------------

namespace mw_rows {

// The lowest set lane of a non-empty lane mask.
MW_DEV int lowest_lane(mw_lanemask m) {
#if MW_WARP == 64
    return __ffsll((long long)m) - 1;
#else
    return __ffs((int)m) - 1;
#endif
}

// Adds w * s into d, one fma per element.
MW_DEV void add_scaled(Vec<float, 4>* d, const Vec<float, 4>* s, float w) {
    Vec<float, 4> dv = *d;
    const Vec<float, 4> sv = *s;
#pragma unroll
    for (int k = 0; k < 4; ++k) dv.e[k] = fmaf(w, sv.e[k], dv.e[k]);
    *d = dv;
}
MW_DEV void add_scaled(float* d, const float* s, float w) { *d = fmaf(w, *s, *d); }

// T: float4 groups (Vec<float, 4>) or single floats.
template <typename T>
MW_DEV void scatter_add(const ScatterAddRowsParams& p) {
    constexpr uint64_t PER = sizeof(T) / sizeof(float);
    const uint64_t units = p.cols / PER;  // column groups of a row
    const uint64_t r0 = uint64_t(blockIdx.y) * p.rows_per_group;
    const uint64_t r1 = r0 + p.rows_per_group < p.rows ? r0 + p.rows_per_group : p.rows;
    const uint32_t lane = threadIdx.x % MW_WARP;
    // Warp 0 of block (0, 0) reports the first bad index (the others skip it silently).
    const bool reporter = blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < MW_WARP;
    T* dst = reinterpret_cast<T*>(p.dst);
    const T* src = reinterpret_cast<const T*>(p.src);
    // The column loop is uniform over the block: every lane of a warp reaches each ballot.
    for (uint64_t base = uint64_t(blockIdx.x) * blockDim.x; base < units; base += uint64_t(gridDim.x) * blockDim.x) {
        const uint64_t u = base + threadIdx.x;
        const bool active = u < units;
        const bool report_here = reporter && base == uint64_t(blockIdx.x) * blockDim.x;
        for (uint64_t i0 = 0; i0 < p.picked; i0 += MW_WARP) {
            const uint64_t i = i0 + lane;
            const uint32_t id = i < p.picked ? p.idx[i] : 0u;
            if (report_here) {
                const mw_lanemask bad = __ballot_sync(MW_FULL_MASK, i < p.picked && id >= p.rows);
                if (bad != 0 && lane == uint32_t(lowest_lane(bad))) {
                    mw::report(p.status, MW_OP_SCATTER_ADD_ROWS, MW_INDEX_OUT_OF_RANGE, i, id, p.rows);
                }
            }
            mw_lanemask hits = __ballot_sync(MW_FULL_MASK, i < p.picked && id >= r0 && id < r1);
            while (hits != 0) {  // in order of i
                const int j = lowest_lane(hits);
                hits &= hits - 1;
                const uint32_t row = __shfl_sync(MW_FULL_MASK, id, j);
                if (active) {
                    const uint64_t at = i0 + uint64_t(j);
                    add_scaled(dst + uint64_t(row) * units + u, src + at * units + u, p.weights[at]);
                }
            }
        }
    }
}

}  // namespace mw_rows

MW_KERNEL_BOUNDS(scatter_add_rows_f32, ScatterAddRowsParams, mw_rows::SCATTER_THREADS) {
    if (p.cols % 4 == 0 && mw_rows::aligned16(p.dst) && mw_rows::aligned16(p.src)) {
        mw_rows::scatter_add<mw_rows::Vec<float, 4>>(p);
    } else {
        mw_rows::scatter_add<float>(p);
    }
}

// ---- experts: Mixtral's routing on the device --------------------------------------------------

namespace mw_rows {

// Threads of experts_route; thread t owns the pairs [t per, (t + 1) per), per = ceil(pairs /
// ROUTE_THREADS), so one block sorts any number of pairs in ceil(pairs / ROUTE_THREADS) steps.
constexpr int ROUTE_THREADS = 256;

// Pair q's expert: its id, or, for an id beyond the experts, the last expert (reported once, by
// the counting pass, `report`).
MW_DEV uint32_t pair_expert(const ExpertsRouteParams& p, uint32_t q, bool report) {
    const uint32_t e = p.ids[q];
    if (e < p.experts) return e;
    if (report) mw::report(p.status, MW_OP_EXPERTS, MW_INDEX_OUT_OF_RANGE, q / p.k, e, p.experts);
    return p.experts - 1;
}

// A counting sort, stable in pair order: each thread counts its pairs per expert; a scan over the
// threads (one thread per expert) turns the counts into each thread's first place among its
// expert's pairs; thread 0 adds the experts' bases (offsets) and lists the experts with pairs;
// then each thread places its pairs in order. A pair's rank among its row's picks by expert gives
// row_pos.
MW_DEV void experts_route(const ExpertsRouteParams& p) {
    MW_SHARED(uint32_t[ROUTE_THREADS][MW_MAX_EXPERTS], counts);
    MW_SHARED(uint32_t[MW_MAX_EXPERTS + 1], base);
    const uint32_t pairs = p.rows * p.k, t = threadIdx.x;
    const uint32_t per = (pairs + ROUTE_THREADS - 1) / ROUTE_THREADS;
    const uint32_t lo = min(pairs, t * per), hi = min(pairs, lo + per);
    for (uint32_t e = 0; e < MW_MAX_EXPERTS; ++e) counts[t][e] = 0;
    for (uint32_t q = lo; q < hi; ++q) counts[t][pair_expert(p, q, true)] += 1;
    __syncthreads();
    if (t < MW_MAX_EXPERTS) {
        uint32_t sum = 0;
        for (uint32_t u = 0; u < ROUTE_THREADS; ++u) {
            const uint32_t c = counts[u][t];
            counts[u][t] = sum;
            sum += c;
        }
        base[t] = sum;  // the expert's total until thread 0 turns it into its first place
    }
    __syncthreads();
    if (t == 0) {
        uint32_t first = 0, listed = 0;
        for (uint32_t e = 0; e < p.experts; ++e) {
            const uint32_t total = base[e];
            base[e] = first;
            p.offsets[e] = first;
            if (total > 0) p.active[1 + listed++] = e;
            first += total;
        }
        p.offsets[p.experts] = first;
        p.active[0] = listed;
    }
    __syncthreads();
    for (uint32_t q = lo; q < hi; ++q) {
        const uint32_t e = pair_expert(p, q, false), r = q / p.k, s = q % p.k;
        const uint32_t pos = base[e] + counts[t][e]++;
        uint32_t rank = 0;
        for (uint32_t s2 = 0; s2 < p.k; ++s2) {
            const uint32_t f = pair_expert(p, r * p.k + s2, false);
            rank += f < e || (f == e && s2 < s) ? 1u : 0u;
            if (f == e && s2 < s) mw::report(p.status, MW_OP_EXPERTS, MW_DUPLICATE_INDEX, r, e, p.experts);
        }
        p.order[pos] = r;
        p.sorted_w[pos] = p.weights[q];
        p.row_pos[r * p.k + rank] = pos;
    }
}

MW_DEV void experts_combine(const ExpertsCombineParams& p) {
    const uint64_t n = p.rows * p.cols, stride = uint64_t(gridDim.x) * blockDim.x;
    for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint64_t r = i / p.cols, c = i % p.cols;
        float acc = 0.0f;
        for (uint32_t t = 0; t < p.k; ++t) {
            const uint64_t at = p.row_pos[r * p.k + t];
            acc = fmaf(p.sorted_w[at], p.ys[at * p.cols + c], acc);
        }
        p.out[i] = acc;
    }
}

}  // namespace mw_rows

MW_KERNEL_BOUNDS(experts_route, ExpertsRouteParams, mw_rows::ROUTE_THREADS) { mw_rows::experts_route(p); }
MW_KERNEL_BOUNDS(experts_combine_f32, ExpertsCombineParams, mw_rows::SCATTER_THREADS) {
    mw_rows::experts_combine(p);
}

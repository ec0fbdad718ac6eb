/* Params of kernels-cuda/rows.cu. C only; include after common.cuh. Mirrored in
 * runtime/src/gpu/ops/rows.rs; MW_LAYOUT lets a test compare the two. */
#pragma once

/* embedding_<w>[_block_<s>]: out[r] = table[ids[r]] * scale, r < picked.
 * table [vocab, cols] of dtype <w>; out f32 [picked, cols]; ids u32 [picked].
 * embedding_<w>: one scale for every element (`scale`: 1 for an unscaled table, else the
 * per-tensor scale); `scales`, `block_rows`, `block_cols` unused.
 * embedding_<w>_block_<s>: element (j, c) times scales[(j / block_rows) * ceil(cols / block_cols)
 * + c / block_cols], scales of dtype <s> (f32 or bf16); a per-channel scale is the block scale with
 * block_rows = 1, block_cols = cols. `scale` unused.
 * An id >= vocab: the row is skipped and reported (MW_OP_EMBEDDING, MW_TOKEN_OUT_OF_RANGE). */
struct EmbeddingParams {
    float* out;
    const void* table;
    const uint32_t* ids;
    const void* scales;
    unsigned int* status;
    uint64_t picked;
    uint64_t vocab;
    uint64_t cols;
    uint32_t block_rows;
    uint32_t block_cols;
    float scale;
    uint32_t pad;
};
MW_LAYOUT(EmbeddingParams, out, table, ids, scales, status, picked, vocab, cols, block_rows, block_cols, scale, pad)

/* gather_rows_f32: out[i] = src[idx[i]], i < picked; src f32 [rows, cols], out f32
 * [picked, cols], idx u32 [picked]. An index >= rows: the row is skipped and reported
 * (MW_OP_GATHER_ROWS, MW_INDEX_OUT_OF_RANGE). */
struct GatherRowsParams {
    float* out;
    const float* src;
    const uint32_t* idx;
    unsigned int* status;
    uint64_t picked;
    uint64_t rows;
    uint64_t cols;
};
MW_LAYOUT(GatherRowsParams, out, src, idx, status, picked, rows, cols)

/* scatter_add_rows_f32: dst[idx[i]] += weights[i] * src[i] for i = 0, 1, ... picked - 1 in order;
 * dst f32 [rows, cols], src f32 [picked, cols], idx u32 [picked], weights f32 [picked].
 * Block (x, y) owns dst rows [y * rows_per_group, (y + 1) * rows_per_group) and a range of
 * columns. An index >= rows: that i is skipped and reported (MW_OP_SCATTER_ADD_ROWS,
 * MW_INDEX_OUT_OF_RANGE). */
struct ScatterAddRowsParams {
    float* dst;
    const uint32_t* idx;
    const float* src;
    const float* weights;
    unsigned int* status;
    uint64_t rows;
    uint64_t picked;
    uint64_t cols;
    uint64_t rows_per_group;
};
MW_LAYOUT(ScatterAddRowsParams, dst, idx, src, weights, status, rows, picked, cols, rows_per_group)

/* experts_route (one block of ROUTE_THREADS, rows.cu): Mixtral's picks sorted by expert on the
 * device. ids u32 [rows, k] (pair p = r k + s is row r's s-th pick), weights f32 [rows, k]; any
 * number of pairs (rows k, below 2^32) and experts <= MW_MAX_EXPERTS (common.cuh). Writes, with
 * the pairs in order of (expert, p):
 *   order[i]       the row of x sorted pair i reads (for gather_rows_f32)
 *   sorted_w[i]    its router weight
 *   offsets[e]     the first sorted pair of expert e, e <= experts (offsets[experts] = pairs)
 *   active[0]      how many experts have pairs; active[1 + a] the a-th of them, ascending
 *   row_pos[r k + t]  the sorted index of row r's t-th pick in order of expert (for
 *                  experts_combine_f32)
 * An id >= experts is reported (MW_OP_EXPERTS, MW_INDEX_OUT_OF_RANGE, row r, the id) and routed
 * as experts - 1; a row naming one expert twice is reported (MW_DUPLICATE_INDEX). */
struct ExpertsRouteParams {
    uint32_t* order;
    float* sorted_w;
    uint32_t* offsets;
    uint32_t* active;
    uint32_t* row_pos;
    const uint32_t* ids;
    const float* weights;
    unsigned int* status;
    uint32_t rows;
    uint32_t k;
    uint32_t experts;
    uint32_t pad;
};
MW_LAYOUT(ExpertsRouteParams, order, sorted_w, offsets, active, row_pos, ids, weights, status, rows, k, experts, pad)

/* experts_combine_f32: out[r][c] = sum over t < k, in order, of sorted_w[i] * ys[i][c], i =
 * row_pos[r k + t] (one fma each from +0: the order and rounding of scatter_add_rows_f32 into a
 * zeroed out, expert by expert); ys f32 [rows k, cols], out f32 [rows, cols]. */
struct ExpertsCombineParams {
    float* out;
    const float* ys;
    const float* sorted_w;
    const uint32_t* row_pos;
    uint64_t rows;
    uint64_t cols;
    uint32_t k;
    uint32_t pad;
};
MW_LAYOUT(ExpertsCombineParams, out, ys, sorted_w, row_pos, rows, cols, k, pad)

/* Params of kernels-cuda/gemv.cu and kernels-cuda/gemm.cu (the `linear` op). C only; include after
 * common.cuh. Mirrored in runtime/src/gpu/ops/linear.rs; MW_LAYOUT lets a test compare the two. */
#pragma once

/* Output element types of y (`y_dtype`). */
#define MW_Y_F32 0u
#define MW_Y_BF16 1u
#define MW_Y_F16 2u

/* gemv_<w>[_block_<s>]_r<R> and gemm_<w>[_block_<s>]:
 * y[i][j] = sum_l x[i][l] * W_real[j][l], i < m, j < n, l < k.
 * x f32 [m, k] (the launcher widens bf16 / f16 activations into f32 scratch first); y [m, n] of
 * `y_dtype`; weight [n, k] of dtype <w>.
 * Plain kernels: W_real = weight * `scale` (1 for an unscaled weight, else the per-tensor scale),
 * applied to each row's sum. _block_<s> kernels: W_real[j][l] = weight[j][l] * scales[(j /
 * block_rows) * ceil(k / block_cols) + l / block_cols], scales of dtype <s> (f32 or bf16); a
 * per-channel scale is block_rows = 1, block_cols = k. `scale` unused there. */
struct LinearParams {
    void* y;
    const float* x;
    const void* weight;
    const void* scales;
    uint64_t m;
    uint64_t n;
    uint64_t k;
    uint32_t block_rows;
    uint32_t block_cols;
    float scale;
    uint32_t y_dtype;
};
MW_LAYOUT(LinearParams, y, x, weight, scales, m, n, k, block_rows, block_cols, scale, y_dtype)

/* linear_x_f32_<t>: out[i] = float(x[i]), i < n; x of dtype <t> (bf16 or f16). */
struct WidenParams {
    float* out;
    const void* x;
    uint64_t n;
};
MW_LAYOUT(WidenParams, out, x, n)

/* gate_up_silu_<w>[_block_<s>]_r<R>: out[i][j] = silu(g) * u, g = sum_l x[i][l] * Gate_real[j][l],
 * u = sum_l x[i][l] * Up_real[j][l], i < m, j < n, l < k; silu(g) = g / (1 + exp(-g)).
 * `gate` is the LinearParams of the gate projection (x f32 [m, k], widened first as for linear;
 * weight [n, k] of dtype <w>; its scale; y = out, f32 [m, n], y_dtype MW_Y_F32); the up weight
 * [n, k] is `up`, of the same dtype and scaled alike: plain kernels multiply its sums by
 * `up_scale`, _block_<s> kernels read `up_scales` in gate's blocks (block_rows x block_cols). */
struct GateUpParams {
    struct LinearParams gate;
    const void* up;
    const void* up_scales;
    float up_scale;
    uint32_t pad;
};
MW_LAYOUT(GateUpParams, gate, up, up_scales, up_scale, pad)

/* qkv_<w>[_block_<s>]_r1: three GEMVs over one x row (m = 1), one launch (attention's q, k and v
 * projections): part[i] is the LinearParams of product i as for gemv_<w>[_block_<s>]_r1 (its own
 * weight, scales or scale, n, y and y_dtype; x, m and k the same in all three; the weights of
 * one dtype <w> and scale kind). Blocks [0, blocks[0]) compute part 0, the next blocks[1] part 1,
 * the rest of the grid part 2. */
struct QkvParams {
    struct LinearParams part[3];
    uint32_t blocks[2];
};
MW_LAYOUT(QkvParams, part, blocks)

/* gemv_tc_<w>[_block_<s>]_r<R> (gemv_tc.cu): the product of `lin` (as gemv_<w>[_block_<s>]_r<R>,
 * m <= R) on tensor cores, k cut into `splits` runs of `split_cols` columns (grid.y). With splits
 * > 1, `partials` is f32 [splits, m, n] scratch and `arrivals` one counter per block column of the
 * grid, zero before the launch and after it; unused (may be null) with one split. */
struct GemvTcParams {
    struct LinearParams lin;
    float* partials;
    unsigned int* arrivals;
    uint32_t split_cols;
    uint32_t splits;
};
MW_LAYOUT(GemvTcParams, lin, partials, arrivals, split_cols, splits)

/* One expert's matrix: its weight [n, k] of the kernel's dtype <w>, and its scales as for
 * LinearParams (block scales of the kernel's dtype <s> in the base's block shape, or null; the
 * per-tensor `scale`, 1 when unscaled). */
struct ExpertMatrix {
    const void* weight;
    const void* scales;
    float scale;
    uint32_t pad;
};
MW_LAYOUT(ExpertMatrix, weight, scales, scale, pad)

/* experts_gemv_<w>[_block_<s>]_r<R> (gemv.cu): the GEMV of each expert on its own rows of x.
 * experts_route (rows.cu) sorted the routed rows by expert: expert e owns rows [offsets[e],
 * offsets[e + 1]) of x (f32 [rows, k]) and of y (f32 [rows, n]); active[0] experts have rows,
 * active[1], active[2], ... Block b works for active[1 + b / blocks_per_expert] (blocks past the
 * count return at once), as gemv_<w>[_block_<s>]_r<R> over blocks_per_expert blocks with
 * `base` (its n, k, block shape and y_dtype MW_Y_F32; x and y the bases above) and that expert's
 * mat[e]. An expert owns at most R rows when no row of ids repeats an expert (experts_route
 * reports one that does; rows past R are then left unwritten).
 * The grouped GEMMs gemm_experts_*, gemm_tc_experts_* and gemm_mfma_experts_* (gemm.cu,
 * gemm_tc.cu, gemm_mfma.cu) take the same params for any number of rows: block (x, y) computes
 * row tile y of the experts' row tiles in order of expert (from offsets; active and
 * blocks_per_expert unused), column tile x, with the expert's mat[e]. */
struct ExpertsGemvParams {
    struct LinearParams base;
    const uint32_t* offsets;
    const uint32_t* active;
    uint32_t experts;
    uint32_t blocks_per_expert;
    struct ExpertMatrix mat[MW_MAX_EXPERTS];
};
MW_LAYOUT(ExpertsGemvParams, base, offsets, active, experts, blocks_per_expert, mat)

/* experts_gate_up_<w>[_block_<s>]_r<R> (gemv.cu): gate_up_silu_<w>[_block_<s>]_r<R> of each
 * expert on its own rows, routed as for experts_gemv: out = base's y (f32 [rows, n]), gate[e]
 * and up[e] the expert's two matrices, scaled alike. */
struct ExpertsGateUpParams {
    struct LinearParams base;
    const uint32_t* offsets;
    const uint32_t* active;
    uint32_t experts;
    uint32_t blocks_per_expert;
    struct ExpertMatrix gate[MW_MAX_EXPERTS];
    struct ExpertMatrix up[MW_MAX_EXPERTS];
};
MW_LAYOUT(ExpertsGateUpParams, base, offsets, active, experts, blocks_per_expert, gate, up)

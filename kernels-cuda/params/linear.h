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
 * x f32 [m, k] (widened first, as for linear); out f32 [m, n]; gate and up [n, k] of dtype <w>,
 * scaled alike: plain kernels multiply the sums by `gate_scale` and `up_scale` (1 when unscaled);
 * _block_<s> kernels scale as linear's with `gate_scales` and `up_scales`, both in blocks of
 * block_rows x block_cols (per channel: 1 x k). */
struct GateUpParams {
    float* out;
    const float* x;
    const void* gate;
    const void* up;
    const void* gate_scales;
    const void* up_scales;
    uint64_t m;
    uint64_t n;
    uint64_t k;
    uint32_t block_rows;
    uint32_t block_cols;
    float gate_scale;
    float up_scale;
};
MW_LAYOUT(GateUpParams, out, x, gate, up, gate_scales, up_scales, m, n, k, block_rows, block_cols, gate_scale,
          up_scale)

/* Params of kernels-cuda/elementwise.cu. C only; include after common.cuh. Mirrored in
 * runtime/src/gpu/ops/elementwise.rs; MW_LAYOUT lets a test compare the two. */
#pragma once

/* add_assign_f32: x[i] += y[i] for i < n. */
struct AddAssignParams {
    float* x;
    const float* y;
    uint64_t n;
};
MW_LAYOUT(AddAssignParams, x, y, n)

/* silu_mul_f32: out[i] = silu(gate[i]) * up[i] for i < n. */
struct SiluMulParams {
    float* out;
    const float* gate;
    const float* up;
    uint64_t n;
};
MW_LAYOUT(SiluMulParams, out, gate, up, n)

/* rms_norm_f32_<w>[_warp]: y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, r < rows.
 * x, y f32 [rows, cols]; weight [cols] of the kernel's dtype <w>. */
struct RmsNormParams {
    float* y;
    const float* x;
    const void* weight;
    uint64_t rows;
    uint64_t cols;
    float eps;
    uint32_t pad;
};
MW_LAYOUT(RmsNormParams, y, x, weight, rows, cols, eps, pad)

/* The most pairs (head_dim / 2) rope_f32 takes: inv_freq travels in the params. */
#define MW_ROPE_MAX_HALF 256

/* rope_f32: x [rows, heads, 2 * half] rotated in place; pair i (dimensions i and i + half) of
 * row r by the angle positions[r] * inv_freq[i] (f64, exactly as Rope::inv_freq computes it).
 * Block b.y handles heads [b.y * heads_per_block, min(heads, (b.y + 1) * heads_per_block)). */
struct RopeParams {
    float* x;
    const uint32_t* positions;
    uint64_t rows;
    uint32_t heads;
    uint32_t half;
    uint32_t heads_per_block;
    uint32_t pad;
    double inv_freq[MW_ROPE_MAX_HALF];
};
MW_LAYOUT(RopeParams, x, positions, rows, heads, half, heads_per_block, pad, inv_freq)

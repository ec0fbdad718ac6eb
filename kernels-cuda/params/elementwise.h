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

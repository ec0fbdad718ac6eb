// elementwise.cu: the small per-element and per-row ops of the Llama and Mixtral graphs.
//
// add_assign_f32   x[i] += y[i], i < n (the residual connection; x, y f32, any n >= 1)
//
// Layout: dense row-major f32; the ops see [rows, cols] as n = rows * cols elements.
// Launch: 1-D grid-stride over elements (runtime/src/gpu/ops/elementwise.rs sizes it).
// Tests: tests/gpu_elementwise.rs against cpu::Reference (emulated in CI; on a GPU with
// `cargo test --features cuda -- --ignored`).
#include "common.cuh"
#include "params/elementwise.h"

MW_KERNEL(add_assign_f32, AddAssignParams) {
    const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
    for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += stride) {
        p.x[i] += p.y[i];
    }
}

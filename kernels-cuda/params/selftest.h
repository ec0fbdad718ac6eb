/* Params of kernels-cuda/selftest.cu. C only; include after common.cuh. Mirrored in tests/simt.rs;
 * MW_LAYOUT lets a test compare the two. */
#pragma once

/* Every selftest kernel: what each field means depends on the kernel (see selftest.cu). */
struct SelftestParams {
    float* out;               /* f32 results, one per thread unless the kernel says otherwise */
    const float* in;          /* f32 inputs, n elements */
    unsigned int* words;      /* u32 results */
    unsigned long long* wide; /* u64 results (ballots, 64-bit shuffles) */
    uint64_t n;               /* elements: threads with a global index >= n only synchronise */
    int32_t arg;              /* shuffle source lane / delta / lane mask; rounds; trap index */
    int32_t width;            /* shuffle width */
};
MW_LAYOUT(SelftestParams, out, in, words, wide, n, arg, width)

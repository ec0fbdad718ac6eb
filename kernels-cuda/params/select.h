/* Params of kernels-cuda/select.cu. C only; include after common.cuh. Mirrored in
 * runtime/src/gpu/ops/select.rs; MW_LAYOUT lets a test compare the two. */
#pragma once

/* argmax_f32: out[r] = the index of the largest of logits[r][0 .. cols) (lowest index among equals,
 * -0 equal to +0, NaN never wins, a row of NaN gives 0); logits f32 [rows, cols], out u32 [rows]. */
struct ArgmaxParams {
    const float* logits;
    uint32_t* out;
    uint64_t rows;
    uint64_t cols;
};
MW_LAYOUT(ArgmaxParams, logits, out, rows, cols)

/* router_topk_f32: the k most probable of `experts` under softmax(logits[r]) (probability
 * descending, then index ascending) with their probabilities renormalised over the k;
 * logits f32 [rows, experts], ids u32 [rows, k], weights f32 [rows, k]. */
struct RouterParams {
    const float* logits;
    uint32_t* ids;
    float* weights;
    uint64_t rows;
    uint64_t experts;
    uint64_t k;
};
MW_LAYOUT(RouterParams, logits, ids, weights, rows, experts, k)

/* sample_f32: out[r] drawn from softmax(logits[r] / temperature) cut to top_k (0: all) and top_p,
 * with the uniform sample_uniform(seeds[r], steps[r], 0); temperature 0 is argmax_f32. */
struct SampleParams {
    const float* logits;
    const uint32_t* seeds;
    const uint32_t* steps;
    uint32_t* out;
    uint64_t rows;
    uint64_t cols;
    uint64_t top_k;
    float temperature;
    float top_p;
};
MW_LAYOUT(SampleParams, logits, seeds, steps, out, rows, cols, top_k, temperature, top_p)

/* Params of kernels-cuda/stream.cu. C only; include after common.cuh. Mirrored in
 * runtime/src/gpu/ops/stream.rs; MW_LAYOUT lets a test compare the two. */
#pragma once

/* stream_read_u32: *sum += the wrapping u32 sum of the words of src[0 .. 16 vecs) (read as
 * little-endian u32); stream_copy_u32: dst[0 .. 16 vecs) = src[0 .. 16 vecs) (dst and sum unused
 * by read and copy respectively). src, dst 16-byte aligned; dst and src do not overlap. */
struct StreamParams {
    void* dst;
    const void* src;
    unsigned int* sum;
    uint64_t vecs;
};
MW_LAYOUT(StreamParams, dst, src, sum, vecs)

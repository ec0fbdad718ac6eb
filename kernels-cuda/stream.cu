// stream.cu: the memory ceiling of the device as its SMs see it (not the copy engine), for
// `memwall peak --backend cuda` and the benches' ceiling.
//
// stream_read_u32   *p.sum += sum of the u32 words of src[0 .. 16 p.vecs) (wrapping): every byte
//                   is read once with 16-byte loads and feeds the result, so no load can be
//                   dropped by the compiler; the sum is exact and order-free (mod 2^32), so a
//                   test checks it against the host's.
// stream_copy_u32   dst[0 .. 16 p.vecs) = src[0 .. 16 p.vecs): one 16-byte load and one 16-byte
//                   store per vector.
//
// Layout: byte buffers seen as p.vecs 16-byte vectors; src and dst 16-byte aligned (the host
// checks; device allocations are 256-byte aligned), not overlapping.
//
// Algorithm: a 1-D grid-stride loop over the vectors with STREAM_UNROLL independent loads in
// flight per thread (each thread's vectors are a grid stride apart, so a warp's loads cover 512
// consecutive bytes), then a scalar-count tail. The read kernel folds its words per thread, sums
// them over the warp by shuffles and adds one word per warp with atomicAdd.
//
// Launch: runtime/src/gpu/ops/stream.rs; STREAM_THREADS per block (whole warps: the warp sum
// needs every lane), grid sm_count x STREAM_BLOCKS_PER_SM capped by the work; any grid is correct.
//
// Tests: tests/gpu_stream.rs (the sum and the copy against the host, odd vector counts, a guard
// past the copy's end); bytes moved: read 16 vecs, copy 32 vecs (read + written).
#include "common.cuh"
#include "params/stream.h"

namespace mw_stream {

constexpr int STREAM_UNROLL = 4;

MW_DEV unsigned int word_sum(uint4 v) { return v.x + v.y + v.z + v.w; }

}  // namespace mw_stream

MW_KERNEL(stream_read_u32, StreamParams) {
    using namespace mw_stream;
    const uint4* src = reinterpret_cast<const uint4*>(p.src);
    const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
    uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    for (; i + (STREAM_UNROLL - 1) * stride < p.vecs; i += STREAM_UNROLL * stride) {
        uint4 v_reg[STREAM_UNROLL];
#pragma unroll
        for (int u = 0; u < STREAM_UNROLL; ++u) v_reg[u] = src[i + u * stride];
#pragma unroll
        for (int u = 0; u < STREAM_UNROLL; ++u) acc += word_sum(v_reg[u]);
    }
    for (; i < p.vecs; i += stride) acc += word_sum(src[i]);
#pragma unroll
    for (int o = MW_WARP / 2; o > 0; o /= 2) acc += __shfl_xor_sync(MW_FULL_MASK, acc, o);
    if (threadIdx.x % MW_WARP == 0) atomicAdd(p.sum, acc);
}

MW_KERNEL(stream_copy_u32, StreamParams) {
    using namespace mw_stream;
    const uint4* src = reinterpret_cast<const uint4*>(p.src);
    uint4* dst = reinterpret_cast<uint4*>(p.dst);
    const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
    uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + (STREAM_UNROLL - 1) * stride < p.vecs; i += STREAM_UNROLL * stride) {
        uint4 v_reg[STREAM_UNROLL];
#pragma unroll
        for (int u = 0; u < STREAM_UNROLL; ++u) v_reg[u] = src[i + u * stride];
#pragma unroll
        for (int u = 0; u < STREAM_UNROLL; ++u) dst[i + u * stride] = v_reg[u];
    }
    for (; i < p.vecs; i += stride) dst[i] = src[i];
}

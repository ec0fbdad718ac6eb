// selftest.cu: kernels that exercise the built-ins the other kernels rely on, one property each.
// They are plain CUDA (they run on a GPU too); tests/simt.rs runs them on the SIMT layer of
// simt/ under every schedule against host references, and the error-case kernels check that the
// layer turns a kernel's fault into a launch error.
//
// Conventions: the global index of a thread is g = (linear block) * (threads per block) + (linear
// thread), linear over x, then y, then z, as CUDA numbers them; threads with g >= p.n only take
// part in barriers and collectives. The shuffle and vote kernels' blocks are whole warps unless
// they say otherwise.
//
// selftest_reverse_f32          p.arg rounds of: every thread writes its value to shared memory,
//                               barrier, reads the value of thread T-1-t, barrier. out = in
//                               reversed within each block when p.arg is odd (2 p.arg barriers).
// selftest_reverse_nobarrier_f32 one round without the barriers: a race, wrong under some order.
// selftest_reverse_dynamic_f32  selftest_reverse_f32 (one round) through dynamic shared memory of
//                               T floats; words[g] = the bits the thread found in its slot first
//                               (uninitialised: the emulator's poison is 0xffffffff).
// selftest_barrier_vote         words[g] = __syncthreads_count(pred) | and << 16 | or << 17,
//                               pred = in[g] > 0 (false past n).
// selftest_shfl_{idx,up,down,xor}_f32  out[g] = __shfl*_sync(full, in[g], p.arg, p.width).
// selftest_shfl_idx_u64         wide[g] = __shfl_sync(full, wide[g], p.arg, p.width).
// selftest_shfl_down_f64        wide[g] = bits of __shfl_down_sync(full, double(bits wide[g]), ...).
// selftest_shfl_xor_active_f32  out[g] = __shfl_xor_sync(__activemask(), in[g], p.arg): any block
//                               size; a lane beyond the block reads the emulator's poison (NaN).
// selftest_vote                 wide[g] = __ballot_sync(__activemask(), in[g] > 0),
//                               words[g] = __any_sync(..) | __all_sync(..) << 1: any block size.
// selftest_syncwarp_f32         out[g] = in[g ^ 1] through shared memory ordered by __syncwarp.
// selftest_atomics              every thread of every block: words[0] += 1, out[0] += 1.0f,
//                               words[1] = max(g), words[2] = min(g + 5), wide[0] += g,
//                               words[3] += 1 by an atomicCAS loop, words[4] = exch(g),
//                               words[5] -= 1, words[6] |= 1 << (g % 32), words[7] =
//                               atomicInc(words[7], 2) (counts 0, 1, 2, 0, ...).
// selftest_grid_u32             words[8g..8g+8] = blockIdx.xyz, threadIdx.xyz, gridDim and
//                               blockDim packed as x | y << 8 | z << 16.
// selftest_bounded_128          launch bounds 128: words[g] = 1.
// Error cases (the emulator must fail the launch; on a GPU they hang or are undefined):
// selftest_deadlock             lane 0 waits at __syncthreads, the other lanes in __shfl_sync.
// selftest_exited_lane          lane 5 returns; the others __shfl_sync with the full mask.
// selftest_mixed_collectives    even lanes __ballot_sync, odd lanes __shfl_sync (full masks).
// selftest_trap                 thread g == p.arg calls __trap().
// selftest_oob_read             out[0] = in[p.n]: one element past the input (AddressSanitizer).
#include "common.cuh"
#include "params/selftest.h"

namespace selftest {

constexpr int MAX_THREADS = 1024;

MW_DEV unsigned block_threads() { return blockDim.x * blockDim.y * blockDim.z; }
MW_DEV unsigned linear_thread() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
MW_DEV uint64_t linear_block() {
    return blockIdx.x + uint64_t(gridDim.x) * (blockIdx.y + uint64_t(gridDim.y) * blockIdx.z);
}
MW_DEV uint64_t global_index() { return linear_block() * block_threads() + linear_thread(); }

}  // namespace selftest

MW_KERNEL(selftest_reverse_f32, SelftestParams) {
    MW_SHARED(float[selftest::MAX_THREADS], buf_smem);
    const unsigned t = selftest::linear_thread(), T = selftest::block_threads();
    const uint64_t g = selftest::global_index();
    float v = g < p.n ? p.in[g] : 0.0f;
    for (int round = 0; round < p.arg; ++round) {
        buf_smem[t] = v;
        __syncthreads();
        v = buf_smem[T - 1 - t];
        __syncthreads();  // buf_smem is rewritten by the next round
    }
    if (g < p.n) p.out[g] = v;
}

// MW_SHARED arrays: block b of T threads writes to words[3 T b ..]: [t] what thread t reads from
// `second[t]` before any thread writes it (the poison), [T + t] first[T - 1 - t] and [2 T + t]
// second[(t + 1) % T] after each thread t stored t + 0.5 and 7 t + b; with arg != 0 it also
// declares a third array that takes the block past the static shared memory limit.
MW_KERNEL(selftest_shared_arrays, SelftestParams) {
    MW_SHARED(float[selftest::MAX_THREADS], first);
    MW_SHARED(uint32_t[selftest::MAX_THREADS], second);
    const unsigned t = selftest::linear_thread(), T = selftest::block_threads();
    const uint64_t at = 3 * T * selftest::linear_block();
    p.words[at + t] = second[t];
    __syncthreads();
    first[t] = float(t) + 0.5f;
    second[t] = 7 * t + unsigned(selftest::linear_block());
    __syncthreads();
    p.words[at + T + t] = __float_as_uint(first[T - 1 - t]);
    p.words[at + 2 * T + t] = second[(t + 1) % T];
    if (p.arg) {
        MW_SHARED(float[16 * 1024], too_many);
        too_many[t] = 0.0f;
    }
}

MW_KERNEL(selftest_reverse_nobarrier_f32, SelftestParams) {
    MW_SHARED(float[selftest::MAX_THREADS], buf_smem);
    const unsigned t = selftest::linear_thread(), T = selftest::block_threads();
    const uint64_t g = selftest::global_index();
    buf_smem[t] = g < p.n ? p.in[g] : 0.0f;
    // Missing __syncthreads(): thread T-1-t may not have written its value yet.
    const float v = buf_smem[T - 1 - t];
    if (g < p.n) p.out[g] = v;
}

MW_KERNEL(selftest_reverse_dynamic_f32, SelftestParams) {
    MW_DYNAMIC_SHARED(float, buf_smem);
    const unsigned t = selftest::linear_thread(), T = selftest::block_threads();
    const uint64_t g = selftest::global_index();
    const float before = buf_smem[t];
    __syncthreads();
    buf_smem[t] = g < p.n ? p.in[g] : 0.0f;
    __syncthreads();
    const float v = buf_smem[T - 1 - t];
    if (g < p.n) {
        p.out[g] = v;
        p.words[g] = __float_as_uint(before);
    }
}

MW_KERNEL(selftest_barrier_vote, SelftestParams) {
    const uint64_t g = selftest::global_index();
    const int pred = g < p.n && p.in[g] > 0.0f;
    const int count = __syncthreads_count(pred);
    const int all = __syncthreads_and(pred);
    const int any = __syncthreads_or(pred);
    if (g < p.n) p.words[g] = unsigned(count) | unsigned(all != 0) << 16 | unsigned(any != 0) << 17;
}

MW_KERNEL(selftest_shfl_idx_f32, SelftestParams) {
    const uint64_t g = selftest::global_index();
    const float v = __shfl_sync(MW_FULL_MASK, g < p.n ? p.in[g] : 0.0f, p.arg, p.width);
    if (g < p.n) p.out[g] = v;
}

MW_KERNEL(selftest_shfl_up_f32, SelftestParams) {
    const uint64_t g = selftest::global_index();
    const float v = __shfl_up_sync(MW_FULL_MASK, g < p.n ? p.in[g] : 0.0f, unsigned(p.arg), p.width);
    if (g < p.n) p.out[g] = v;
}

MW_KERNEL(selftest_shfl_down_f32, SelftestParams) {
    const uint64_t g = selftest::global_index();
    const float v = __shfl_down_sync(MW_FULL_MASK, g < p.n ? p.in[g] : 0.0f, unsigned(p.arg), p.width);
    if (g < p.n) p.out[g] = v;
}

MW_KERNEL(selftest_shfl_xor_f32, SelftestParams) {
    const uint64_t g = selftest::global_index();
    const float v = __shfl_xor_sync(MW_FULL_MASK, g < p.n ? p.in[g] : 0.0f, p.arg, p.width);
    if (g < p.n) p.out[g] = v;
}

MW_KERNEL(selftest_shfl_idx_u64, SelftestParams) {
    const uint64_t g = selftest::global_index();
    const unsigned long long v = __shfl_sync(MW_FULL_MASK, g < p.n ? p.wide[g] : 0ull, p.arg, p.width);
    if (g < p.n) p.wide[g] = v;
}

MW_KERNEL(selftest_shfl_down_f64, SelftestParams) {
    const uint64_t g = selftest::global_index();
    const double d = __longlong_as_double(g < p.n ? (long long)p.wide[g] : 0ll);
    const double v = __shfl_down_sync(MW_FULL_MASK, d, unsigned(p.arg), p.width);
    if (g < p.n) p.wide[g] = (unsigned long long)__double_as_longlong(v);
}

MW_KERNEL(selftest_shfl_xor_active_f32, SelftestParams) {
    const uint64_t g = selftest::global_index();
    const float v = __shfl_xor_sync(__activemask(), g < p.n ? p.in[g] : 0.0f, p.arg);
    if (g < p.n) p.out[g] = v;
}

MW_KERNEL(selftest_vote, SelftestParams) {
    const uint64_t g = selftest::global_index();
    const int pred = g < p.n && p.in[g] > 0.0f;
    const mw_lanemask active = __activemask();
    const mw_lanemask ballot = __ballot_sync(active, pred);
    const int any = __any_sync(active, pred);
    const int all = __all_sync(active, pred);
    if (g < p.n) {
        p.wide[g] = ballot;
        p.words[g] = unsigned(any != 0) | unsigned(all != 0) << 1;
    }
}

MW_KERNEL(selftest_syncwarp_f32, SelftestParams) {
    __shared__ float buf_smem[selftest::MAX_THREADS];
    const unsigned t = selftest::linear_thread();
    const uint64_t g = selftest::global_index();
    buf_smem[t] = g < p.n ? p.in[g] : 0.0f;
    __syncwarp();
    const float v = buf_smem[t ^ 1u];
    if (g < p.n) p.out[g] = v;
}

MW_KERNEL(selftest_atomics, SelftestParams) {
    const uint64_t g = selftest::global_index();
    atomicAdd(&p.words[0], 1u);
    atomicAdd(&p.out[0], 1.0f);
    atomicMax(reinterpret_cast<int*>(&p.words[1]), int(g));
    atomicMin(&p.words[2], unsigned(g) + 5u);
    atomicAdd(&p.wide[0], (unsigned long long)g);
    unsigned seen = p.words[3];
    for (;;) {
        const unsigned old = atomicCAS(&p.words[3], seen, seen + 1u);
        if (old == seen) break;
        seen = old;
    }
    atomicExch(&p.words[4], unsigned(g));
    atomicSub(&p.words[5], 1u);
    atomicOr(&p.words[6], 1u << (g % 32));
    atomicInc(&p.words[7], 2u);
}

MW_KERNEL(selftest_grid_u32, SelftestParams) {
    const uint64_t g = selftest::global_index();
    unsigned* w = p.words + 8 * g;
    w[0] = blockIdx.x;
    w[1] = blockIdx.y;
    w[2] = blockIdx.z;
    w[3] = threadIdx.x;
    w[4] = threadIdx.y;
    w[5] = threadIdx.z;
    w[6] = gridDim.x | gridDim.y << 8 | gridDim.z << 16;
    w[7] = blockDim.x | blockDim.y << 8 | blockDim.z << 16;
}

MW_KERNEL_BOUNDS(selftest_bounded_128, SelftestParams, 128) {
    const uint64_t g = selftest::global_index();
    if (g < p.n) p.words[g] = 1u;
}

MW_KERNEL(selftest_deadlock, SelftestParams) {
    float v = p.in[0];
    if (threadIdx.x % MW_WARP == 0) {
        __syncthreads();
    } else {
        v = __shfl_sync(MW_FULL_MASK, v, 0);
    }
    p.out[threadIdx.x] = v;
}

MW_KERNEL(selftest_exited_lane, SelftestParams) {
    if (threadIdx.x % MW_WARP == 5) return;
    const float v = __shfl_sync(MW_FULL_MASK, p.in[threadIdx.x], 0);
    p.out[threadIdx.x] = v;
}

MW_KERNEL(selftest_mixed_collectives, SelftestParams) {
    if (threadIdx.x % 2 == 0) {
        p.wide[threadIdx.x] = __ballot_sync(MW_FULL_MASK, 1);
    } else {
        p.out[threadIdx.x] = __shfl_sync(MW_FULL_MASK, p.in[threadIdx.x], 0);
    }
}

MW_KERNEL(selftest_trap, SelftestParams) {
    if (selftest::global_index() == uint64_t(p.arg)) __trap();
}

MW_KERNEL(selftest_oob_read, SelftestParams) {
    if (selftest::global_index() == 0) p.out[0] = p.in[p.n];
}

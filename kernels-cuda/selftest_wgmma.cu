// selftest_wgmma.cu: the warpgroup MMA of wgmma.cuh, one warpgroup per launch (a block of 128
// threads, 4096 bytes of dynamic shared memory). Plain CUDA for sm_90a; tests/simt.rs runs it on
// the SIMT layer against host products.
//
// selftest_wgmma_bf16
//     in = A (64x16 row-major) | B (16x128, [k][n] row-major) | C (64x128 row-major), values exact
//     in bf16 whose products sum exactly in f32. B is staged in dynamic shared memory in the
//     no-swizzle K-major layout with the core matrix of (k / 8, n / 8) at (2 (n / 8) + k / 8) 128
//     bytes (lbo 128, sbo 256: the opposite order to gemm_wg.cu's); each lane packs its A fragment
//     from global memory by the layout of wgmma.cuh, starts from its part of C, and stores D = A B
//     + (width != 0 ? C : 0) to out (64x128 row-major).
//     arg 1: thread 0 writes B's first element after the commit, before wgmma_wait<0> (the race
//     the emulator reports); arg 2: the descriptor gets 128-byte swizzling (not emulated); arg 3:
//     the descriptor is made of a pointer into global memory.
#include "common.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "params/selftest.h"

namespace selftest_wgmma {

MW_DEV uint32_t pack2(float lo, float hi) {
    return uint32_t(mw::from_f32<bf16>(lo).bits) | uint32_t(mw::from_f32<bf16>(hi).bits) << 16;
}

MW_DEV void wgmma_bf16(const SelftestParams& p) {
    constexpr int N = mw::WGMMA_N;
    MW_DYNAMIC_SHARED(bf16, b_smem);
    const float* a_gmem = p.in;
    const float* b_gmem = p.in + 64 * 16;
    const float* c_gmem = b_gmem + 16 * N;
    for (int e = threadIdx.x; e < 16 * N; e += 128) {
        const int k = e / N, n = e % N;
        b_smem[(2 * (n / 8) + k / 8) * 64 + (n % 8) * 8 + k % 8] = mw::from_f32<bf16>(b_gmem[e]);
    }
    mw::fence_proxy_async();
    __syncthreads();
    const int lane = threadIdx.x % MW_WARP, warp = threadIdx.x / MW_WARP, g = lane >> 2, t = lane % 4;
    const int r0 = 16 * warp + g, r1 = r0 + 8;
    const uint32_t a[4] = {
        pack2(a_gmem[r0 * 16 + 2 * t], a_gmem[r0 * 16 + 2 * t + 1]),
        pack2(a_gmem[r1 * 16 + 2 * t], a_gmem[r1 * 16 + 2 * t + 1]),
        pack2(a_gmem[r0 * 16 + 2 * t + 8], a_gmem[r0 * 16 + 2 * t + 9]),
        pack2(a_gmem[r1 * 16 + 2 * t + 8], a_gmem[r1 * 16 + 2 * t + 9]),
    };
    float d[N / 2];
    for (int e = 0; e < N / 2; ++e) d[e] = c_gmem[(e / 2 % 2 ? r1 : r0) * N + 8 * (e / 4) + 2 * t + e % 2];
    uint64_t desc = mw::smem_desc(p.arg == 3 ? static_cast<const void*>(p.in) : b_smem, 128, 256);
    if (p.arg == 2) desc |= 1ull << 62;
    mw::wgmma_fence();
    mw::wgmma_m64n128k16_bf16(d, a, desc, p.width != 0);
    mw::wgmma_commit();
    if (p.arg == 1 && threadIdx.x == 0) b_smem[0] = mw::from_f32<bf16>(1.0f);
    mw::wgmma_wait<0>();
    mw::wgmma_fence_operand(d);
    for (int e = 0; e < N / 2; ++e) p.out[(e / 2 % 2 ? r1 : r0) * N + 8 * (e / 4) + 2 * t + e % 2] = d[e];
}

}  // namespace selftest_wgmma

MW_KERNEL_BOUNDS(selftest_wgmma_bf16, SelftestParams, 128) { selftest_wgmma::wgmma_bf16(p); }

// selftest_mfma.cu: the matrix-core wrapper of mfma.cuh, one wavefront per launch (block of 64),
// on the SIMT layer at warp 64 (simt/image_selftest64.cpp); tests/simt.rs checks it against host
// products. (The warp-32 image compiles it too, as a trap: MFMA is a wave-64 instruction.)
// Index-revealing inputs: A[i][k] = 16 i + k, B[k][n] = (16 k + n) / 256, C[i][n] = 16 i + n +
// 0.5: exact in bf16 and f32, and every sum of products is exact in f32, so a fragment index off
// by one changes the result.
//
// selftest_mfma_bf16
//     in = A (16x16 row-major) | B (16x16, [k][n] row-major) | C (16x16 row-major), 768 floats;
//     lane l (r = l % 16, q = l / 16) packs A[r][4q + e] and B[4q + e][r] (e = 0..3) as bf16 and
//     takes C[4q + e][r] as its accumulators, by mfma.cuh's layout, and stores D = A B + C back
//     to out (16x16 row-major) from the same places.
#include "common.cuh"
#include "mfma.cuh"
#include "params/selftest.h"

MW_KERNEL(selftest_mfma_bf16, SelftestParams) {
#if defined(MW_MFMA_UNSUPPORTED)
    (void)p;
    __trap();
#else
    const int lane = threadIdx.x % MW_WARP, r = lane % 16, q = lane / 16;
    const float* a = p.in;
    const float* b = p.in + 256;
    const float* c = p.in + 512;
    const auto pack2 = [](float lo, float hi) {
        return uint32_t(mw::from_f32<bf16>(lo).bits) | uint32_t(mw::from_f32<bf16>(hi).bits) << 16;
    };
    const uint32_t a_reg[2] = {pack2(a[r * 16 + 4 * q], a[r * 16 + 4 * q + 1]),
                               pack2(a[r * 16 + 4 * q + 2], a[r * 16 + 4 * q + 3])};
    const uint32_t b_reg[2] = {pack2(b[(4 * q) * 16 + r], b[(4 * q + 1) * 16 + r]),
                               pack2(b[(4 * q + 2) * 16 + r], b[(4 * q + 3) * 16 + r])};
    float d[4];
    for (int e = 0; e < 4; ++e) d[e] = c[(4 * q + e) * 16 + r];
    mw::mfma_16x16x16_bf16(d, a_reg, b_reg);
    for (int e = 0; e < 4; ++e) p.out[(4 * q + e) * 16 + r] = d[e];
#endif
}

// selftest_mma.cu: the tensor-core wrappers of mma.cuh, one warp per launch (block of 32). Plain
// CUDA for sm_80 and newer; tests/simt.rs runs them on the SIMT layer against host references.
// Index-revealing inputs: A[i][k] = 16 i + k, B[k][n] = (8 k + n) / 128 (16x8) or
// (16 k + n) / 256 (16x16), C[i][n] = 8 i + n + 0.5: exact in bf16, f16 and f32, and every sum
// of products is exact in f32, so a fragment index off by one changes the result.
//
// selftest_mma_bf16_f32, selftest_mma_f16_f32
//     in = A (16x16 row-major) | B (16x8, [k][n] row-major) | C (16x8 row-major), 512 floats;
//     every lane packs its fragments from global memory by the PTX layouts (mma.cuh) and stores
//     its part of D = A B + C to out (16x8 row-major).
// selftest_ldmatrix_u32
//     a 16x16 tile of 16-bit values t[r][c] = 16 r + c in shared memory; words[4 l + m] = the
//     register r[m] lane l receives from ldmatrix_x4 (lane l at row l % 16, column 8 (l / 16)),
//     words[128 + 4 l + m] the same from ldmatrix_x4_trans.
// selftest_ldmatrix_mma_bf16
//     in = A (16x16 row-major) | B (16x16, [k][n] row-major); A's fragment by ldmatrix_x4, B's two
//     8-column halves by one ldmatrix_x4_trans, two mma calls; out = A B (16x16 row-major).
#include "common.cuh"
#include "mma.cuh"
#include "params/selftest.h"

namespace selftest_mma {

template <typename T>
MW_DEV uint32_t pack2(float lo, float hi) {
    return uint32_t(mw::from_f32<T>(lo).bits) | uint32_t(mw::from_f32<T>(hi).bits) << 16;
}

// The wrapper for the element type T.
MW_DEV void mma(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4], bf16) {
    mw::mma_m16n8k16_bf16(d, a, b, c);
}
MW_DEV void mma(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4], f16) {
    mw::mma_m16n8k16_f16(d, a, b, c);
}

template <typename T>
MW_DEV void mma_from_global(const SelftestParams& p) {
    const int lane = threadIdx.x % MW_WARP, g = lane >> 2, t = lane % 4;
    const float* a_gmem = p.in;
    const float* b_gmem = p.in + 256;  // [k][n], 8 columns
    const float* c_gmem = p.in + 384;
    const uint32_t a_reg[4] = {
        pack2<T>(a_gmem[g * 16 + 2 * t], a_gmem[g * 16 + 2 * t + 1]),
        pack2<T>(a_gmem[(g + 8) * 16 + 2 * t], a_gmem[(g + 8) * 16 + 2 * t + 1]),
        pack2<T>(a_gmem[g * 16 + 2 * t + 8], a_gmem[g * 16 + 2 * t + 9]),
        pack2<T>(a_gmem[(g + 8) * 16 + 2 * t + 8], a_gmem[(g + 8) * 16 + 2 * t + 9]),
    };
    const uint32_t b_reg[2] = {
        pack2<T>(b_gmem[(2 * t) * 8 + g], b_gmem[(2 * t + 1) * 8 + g]),
        pack2<T>(b_gmem[(2 * t + 8) * 8 + g], b_gmem[(2 * t + 9) * 8 + g]),
    };
    const float c_reg[4] = {c_gmem[g * 8 + 2 * t], c_gmem[g * 8 + 2 * t + 1], c_gmem[(g + 8) * 8 + 2 * t],
                            c_gmem[(g + 8) * 8 + 2 * t + 1]};
    float d_reg[4];
    mma(d_reg, a_reg, b_reg, c_reg, T{});
    p.out[g * 8 + 2 * t] = d_reg[0];
    p.out[g * 8 + 2 * t + 1] = d_reg[1];
    p.out[(g + 8) * 8 + 2 * t] = d_reg[2];
    p.out[(g + 8) * 8 + 2 * t + 1] = d_reg[3];
}

}  // namespace selftest_mma

MW_KERNEL(selftest_mma_bf16_f32, SelftestParams) { selftest_mma::mma_from_global<bf16>(p); }

MW_KERNEL(selftest_mma_f16_f32, SelftestParams) { selftest_mma::mma_from_global<f16>(p); }

MW_KERNEL(selftest_ldmatrix_u32, SelftestParams) {
    __shared__ __align__(16) uint16_t tile_smem[16 * 16];
    const int lane = threadIdx.x % MW_WARP;
    for (int i = lane; i < 256; i += MW_WARP) tile_smem[i] = uint16_t(i);
    __syncwarp();
    const uint16_t* row = &tile_smem[(lane % 16) * 16 + 8 * (lane / 16)];
    uint32_t r[4];
    mw::ldmatrix_x4(r, row);
    for (int m = 0; m < 4; ++m) p.words[4 * lane + m] = r[m];
    mw::ldmatrix_x4_trans(r, row);
    for (int m = 0; m < 4; ++m) p.words[128 + 4 * lane + m] = r[m];
}

MW_KERNEL(selftest_ldmatrix_mma_bf16, SelftestParams) {
    __shared__ __align__(16) bf16 a_smem[16 * 16];
    __shared__ __align__(16) bf16 b_smem[16 * 16];
    const int lane = threadIdx.x % MW_WARP, g = lane >> 2, t = lane % 4;
    for (int i = lane; i < 256; i += MW_WARP) {
        a_smem[i] = mw::from_f32<bf16>(p.in[i]);
        b_smem[i] = mw::from_f32<bf16>(p.in[256 + i]);
    }
    __syncwarp();
    uint32_t a_reg[4], b_reg[4];
    mw::ldmatrix_x4(a_reg, &a_smem[(lane % 16) * 16 + 8 * (lane / 16)]);
    mw::ldmatrix_x4_trans(b_reg, &b_smem[((lane % 8) + 8 * ((lane / 8) % 2)) * 16 + 8 * (lane / 16)]);
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int half = 0; half < 2; ++half) {
        float d_reg[4];
        mw::mma_m16n8k16_bf16(d_reg, a_reg, &b_reg[2 * half], zero);
        const int col = 8 * half + 2 * t;
        p.out[g * 16 + col] = d_reg[0];
        p.out[g * 16 + col + 1] = d_reg[1];
        p.out[(g + 8) * 16 + col] = d_reg[2];
        p.out[(g + 8) * 16 + col + 1] = d_reg[3];
    }
}

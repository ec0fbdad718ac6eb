// linear.cuh: what the two `linear` kernel files (gemv.cu, gemm.cu) share: weight elements
// widened from 16-byte words, the scale of a weight element, and the store of y in its dtype.
#pragma once
#include "common.cuh"
#include "params/linear.h"

namespace mw_linear {

// 16 bytes moved as one access.
struct alignas(16) Words {
    uint32_t e[4];
};

MW_DEV bool aligned16(const void* ptr) { return (reinterpret_cast<unsigned long long>(ptr) & 15u) == 0; }

// Element i of 16 bytes of W, widened to f32 (exact for every dtype).
template <typename W>
MW_DEV float element(const Words& words, int i) {
    if constexpr (sizeof(W) == 4) {
        return __uint_as_float(words.e[i]);
    } else if constexpr (sizeof(W) == 2) {
        return mw::to_f32(W{uint16_t(words.e[i / 2] >> (16 * (i % 2)))});
    } else {
        static_assert(sizeof(W) == 1, "f32, 16-bit or fp8 elements");
        return mw::to_f32(W{uint8_t(words.e[i / 4] >> (8 * (i % 4)))});
    }
}

// All 16 / sizeof(W) elements of 16 bytes of W, widened to f32: fp8 a 32-bit word at a time
// (mw::to_f32x4: the packed hardware conversion where the target has one), the rest by element.
template <typename W, int VEC>
MW_DEV void widen_words(const Words& words, float (&wf)[VEC]) {
    static_assert(VEC * sizeof(W) == 16, "16 bytes of W");
    if constexpr (sizeof(W) == 1) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float four[4];
            mw::to_f32x4<W>(words.e[q], four);
#pragma unroll
            for (int k = 0; k < 4; ++k) wf[4 * q + k] = four[k];
        }
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) wf[e] = element<W>(words, e);
    }
}

// Elements 4q .. 4q + 3 of 16 bytes of W, widened to f32 (q < 16 / sizeof(W) / 4): as
// widen_words, a quarter at a time.
template <typename W>
MW_DEV void widen_quad(const Words& words, int q, float (&out)[4]) {
    if constexpr (sizeof(W) == 1) {
        mw::to_f32x4<W>(words.e[q], out);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) out[i] = element<W>(words, 4 * q + i);
    }
}

// The scale of weight element (j, l): none (the plain kernels apply p.scale to the row's sum) or
// one block scale of dtype S.
struct NoBlocks {
    static constexpr bool BLOCKS = false;
};
template <typename S>
struct Blocks {
    static constexpr bool BLOCKS = true;
    // Row j's run of block scales in a grid of p's block shape over `scales`:
    // scales + (j / block_rows) * ceil(k / block_cols). The divisions are 32-bit: the launchers
    // check n, k < 2^32 for block scales (a 64-bit division is a call to a routine, and ptxas
    // spilled around it).
    MW_DEV static const void* row(const LinearParams& p, const void* scales, uint64_t j) {
        const uint32_t k = uint32_t(p.k);
        const uint32_t grid_cols = k / p.block_cols + (k % p.block_cols != 0);
        return reinterpret_cast<const S*>(scales) + uint64_t(uint32_t(j) / p.block_rows) * grid_cols;
    }
    // The scale of block column `col` of a row's run.
    MW_DEV static float in_row(const void* row, uint32_t col) {
        return mw::to_f32(reinterpret_cast<const S*>(row)[col]);
    }
    // scales[(j / block_rows) * ceil(k / block_cols) + l / block_cols]
    MW_DEV static float at(const LinearParams& p, uint64_t j, uint64_t l) { return at(p, p.scales, j, l); }
    // The same over another scale grid of p's block shape (gate_up_silu's up scales).
    MW_DEV static float at(const LinearParams& p, const void* scales, uint64_t j, uint64_t l) {
        return in_row(row(p, scales, j), uint32_t(l) / p.block_cols);
    }
};

// The block column of a lane's chunks (runs of `per_block` chunks make one block column) as the
// lane steps along a row by `step` chunks at a time, with no division in the loop: col and rem
// are the current chunk c's c / per_block and c % per_block. Two divisions when made (once per
// kernel: every row starts at the same chunk); advance() is four instructions.
struct ChunkColumns {
    uint32_t col = 0, rem = 0;
    uint32_t per_block = 1, step_col = 0, step_rem = 0;
    ChunkColumns() = default;
    MW_DEV ChunkColumns(uint32_t first, uint32_t per_block_, uint32_t step)
        : col(first / per_block_), rem(first % per_block_), per_block(per_block_), step_col(step / per_block_),
          step_rem(step % per_block_) {}
    MW_DEV void advance() {
        col += step_col;
        rem += step_rem;
        if (rem >= per_block) {
            rem -= per_block;
            ++col;
        }
    }
};

// Whether v is finite (neither infinite nor NaN), by its exponent bits.
MW_DEV bool finite(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }

// y[i][j] = v in y's dtype (round to nearest even).
MW_DEV void store_y(const LinearParams& p, uint64_t i, uint64_t j, float v) {
    const uint64_t at = i * p.n + j;
    if (p.y_dtype == MW_Y_BF16) {
        reinterpret_cast<bf16*>(p.y)[at] = mw::from_f32<bf16>(v);
    } else if (p.y_dtype == MW_Y_F16) {
        reinterpret_cast<f16*>(p.y)[at] = mw::from_f32<f16>(v);
    } else {
        reinterpret_cast<float*>(p.y)[at] = v;
    }
}

}  // namespace mw_linear

// Every weight dtype x {plain, block f32 scales, block bf16 scales}: INSTANTIATE(suffix, W, Scale).
#define MW_LINEAR_FOR_EACH_WEIGHT(INSTANTIATE, KIND)                                                 \
    INSTANTIATE(f32, float, KIND)                                                                    \
    INSTANTIATE(f16, f16, KIND)                                                                      \
    INSTANTIATE(bf16, bf16, KIND)                                                                    \
    INSTANTIATE(e4m3fn, e4m3fn, KIND)                                                                \
    INSTANTIATE(e4m3fnuz, e4m3fnuz, KIND)                                                            \
    INSTANTIATE(e5m2, e5m2, KIND)                                                                    \
    INSTANTIATE(e5m2fnuz, e5m2fnuz, KIND)

// The weight dtypes of the tensor-core kernels (gemm_tc.cu, gemv_tc.cu): every float type but f32,
// INSTANTIATE(suffix, W, unused).
#define MW_LINEAR_FOR_EACH_TC_WEIGHT(INSTANTIATE)                                                    \
    INSTANTIATE(f16, f16, )                                                                          \
    INSTANTIATE(bf16, bf16, )                                                                        \
    INSTANTIATE(e4m3fn, e4m3fn, )                                                                    \
    INSTANTIATE(e4m3fnuz, e4m3fnuz, )                                                                \
    INSTANTIATE(e5m2, e5m2, )                                                                        \
    INSTANTIATE(e5m2fnuz, e5m2fnuz, )

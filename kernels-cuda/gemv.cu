// gemv.cu: the decode `linear`: y[m, n] = x[m, k] . W_real[n, k]^T for m <= GEMV_MAX_ROWS (16)
// rows (one token per sequence of a decode batch), the op that decides whether decode runs at the
// memory wall: every weight byte is read once per step, for all m rows together.
//
// gemv_<w>_r<R>            W_real = weight * p.scale (1 unscaled, else the per-tensor scale),
//                          applied to each sum
// gemv_<w>_block_<s>_r<R>  W_real[j][l] = weight[j][l] * scales[j / br][l / bc] (block scales of
//                          dtype <s>: f32 or bf16; per-channel scales are br = 1, bc = k), applied
//                          to the partial sum of each 16-byte chunk (vector path) or to each
//                          element (scalar path)
//                          weight [n, k] of dtype <w>: f32, f16, bf16, e4m3fn, e4m3fnuz, e5m2,
//                          e5m2fnuz; x f32 [m, k] (bf16 / f16 activations are widened first by
//                          linear_x_f32_<t>); y [m, n] f32, bf16 or f16 (p.y_dtype); R in {1, 4,
//                          16}: the kernel takes m <= R rows (the launcher picks the smallest R)
// linear_x_f32_<t>         out[i] = x[i] widened to f32, t in {bf16, f16}
//
// Launch (runtime/src/gpu/ops/linear.rs): GEMV_WARPS warps per block, one warp per output j
// (grid-stride over j, so any grid is correct). A warp streams weight row j in 16-byte loads
// (16 / sizeof(w) elements each, GEMV_UNROLL loads in flight per lane, consecutive lanes on
// consecutive chunks: fully coalesced) when the row is 16-byte aligned (k * sizeof(w) % 16 == 0,
// the base aligned, x 16-byte aligned, and for block scales bc a multiple of the chunk), widens
// the elements in registers and multiplies them with the R rows of x (read through L1/L2: x is at
// most 16 x k f32), then finishes with scalar elements; otherwise every element goes the scalar
// way (still coalesced). Each lane accumulates R f32 sums; a warp_sum per row; lane 0 scales and
// stores. No shared memory, no barriers, no atomics: deterministic.
//
// Accuracy: f32 products and sums; fp8 / 16-bit / bf16 scales widen exactly. Each term
// x * w (* s) meets at most k + 8 roundings (two products, the chunk sum, the lane's running sum,
// the warp tree), so |y - y_exact| <= gamma(k + 8) sum_l |x w s| before y's own rounding.
//
// Tests: tests/gpu_linear.rs against cpu::Reference (emulated in CI). Bench: benches/gemv.rs on
// the CPU; the GPU bench is issue 5's.
#include "linear.cuh"

namespace mw_gemv {

using namespace mw_linear;

constexpr int GEMV_WARPS = 4;
constexpr int GEMV_THREADS = GEMV_WARPS * MW_WARP;
constexpr int GEMV_UNROLL = 4;

// One chunk of VEC weights (row j, columns l0 .. l0 + VEC - 1) against the R rows of x.
template <typename W, int R>
MW_DEV void chunk_dot(const Words& w, const LinearParams& p, uint64_t l0, float (&dot)[R]) {
    constexpr int VEC = 16 / sizeof(W);
    float wf[VEC];
    widen_words<W>(w, wf);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        dot[r] = 0.0f;
        if (uint64_t(r) < p.m) {
            const float4* x4 = reinterpret_cast<const float4*>(p.x + r * p.k + l0);
#pragma unroll
            for (int q = 0; q < VEC / 4; ++q) {
                const float4 xv = x4[q];
                dot[r] += xv.x * wf[4 * q] + xv.y * wf[4 * q + 1] + xv.z * wf[4 * q + 2] + xv.w * wf[4 * q + 3];
            }
        }
    }
}

template <typename W, typename Scale, int R>
MW_DEV void gemv(const LinearParams& p) {
    constexpr int VEC = 16 / sizeof(W);
    const int lane = threadIdx.x % MW_WARP;
    const uint64_t warps = uint64_t(gridDim.x) * GEMV_WARPS;
    const bool vec = (p.k * sizeof(W)) % 16 == 0 && aligned16(p.weight) && aligned16(p.x) &&
                     (!Scale::BLOCKS || p.block_cols % VEC == 0);
    const uint64_t chunks = vec ? p.k / VEC : 0;
    for (uint64_t j = uint64_t(blockIdx.x) * GEMV_WARPS + threadIdx.x / MW_WARP; j < p.n; j += warps) {
        const W* w_row = reinterpret_cast<const W*>(p.weight) + j * p.k;
        const Words* w_words = reinterpret_cast<const Words*>(w_row);
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        for (uint64_t c0 = lane; c0 < chunks; c0 += uint64_t(MW_WARP) * GEMV_UNROLL) {
            Words w_reg[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const uint64_t c = c0 + uint64_t(u) * MW_WARP;
                if (c < chunks) w_reg[u] = w_words[c];
            }
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const uint64_t c = c0 + uint64_t(u) * MW_WARP;
                if (c >= chunks) break;
                float dot[R];
                chunk_dot<W, R>(w_reg[u], p, c * VEC, dot);
                float s = 1.0f;
                if constexpr (Scale::BLOCKS) s = Scale::at(p, j, c * VEC);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] += Scale::BLOCKS ? dot[r] * s : dot[r];
            }
        }
        // Scalar elements: all of them off the vector path, else the tail past the last chunk.
        for (uint64_t l = chunks * VEC + lane; l < p.k; l += MW_WARP) {
            float wl = mw::to_f32(w_row[l]);
            if constexpr (Scale::BLOCKS) wl *= Scale::at(p, j, l);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (uint64_t(r) < p.m) acc[r] += p.x[r * p.k + l] * wl;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float total = mw::warp_sum(acc[r]);
            if (lane == 0 && uint64_t(r) < p.m) store_y(p, r, j, Scale::BLOCKS ? total : total * p.scale);
        }
    }
}

}  // namespace mw_gemv

#define MW_GEMV_ROWS(wname, W, Scale, sname)                                                         \
    MW_KERNEL_BOUNDS(gemv_##wname##sname##_r1, LinearParams, mw_gemv::GEMV_THREADS) {                \
        mw_gemv::gemv<W, Scale, 1>(p);                                                               \
    }                                                                                                \
    MW_KERNEL_BOUNDS(gemv_##wname##sname##_r4, LinearParams, mw_gemv::GEMV_THREADS) {                \
        mw_gemv::gemv<W, Scale, 4>(p);                                                               \
    }                                                                                                \
    MW_KERNEL_BOUNDS(gemv_##wname##sname##_r16, LinearParams, mw_gemv::GEMV_THREADS) {               \
        mw_gemv::gemv<W, Scale, 16>(p);                                                              \
    }
#define MW_GEMV_PLAIN(wname, W, _) MW_GEMV_ROWS(wname, W, mw_linear::NoBlocks, )
#define MW_GEMV_BLOCK_F32(wname, W, _) MW_GEMV_ROWS(wname, W, mw_linear::Blocks<float>, _block_f32)
#define MW_GEMV_BLOCK_BF16(wname, W, _) MW_GEMV_ROWS(wname, W, mw_linear::Blocks<bf16>, _block_bf16)
MW_LINEAR_FOR_EACH_WEIGHT(MW_GEMV_PLAIN, )
MW_LINEAR_FOR_EACH_WEIGHT(MW_GEMV_BLOCK_F32, )
MW_LINEAR_FOR_EACH_WEIGHT(MW_GEMV_BLOCK_BF16, )

namespace mw_gemv {
template <typename T>
MW_DEV void widen(const WidenParams& p) {
    const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
    for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += stride)
        p.out[i] = mw::to_f32(reinterpret_cast<const T*>(p.x)[i]);
}
}  // namespace mw_gemv

MW_KERNEL(linear_x_f32_bf16, WidenParams) { mw_gemv::widen<bf16>(p); }
MW_KERNEL(linear_x_f32_f16, WidenParams) { mw_gemv::widen<f16>(p); }

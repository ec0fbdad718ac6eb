// gemm_tc.cu: the prefill / large-batch `linear` on tensor cores (mma.sync m16n8k16, sm_80+):
// y[m, n] = x[m, k] . W_real[n, k]^T, the same contract as gemm.cu (its executable spec), for
// 16-bit and fp8 weights with f32 activations and f32 accuracy.
//
// gemm_tc_<w>            W_real = weight * p.scale (1 unscaled, else the per-tensor scale), applied
//                        to each finished sum
// gemm_tc_<w>_block_<s>  W_real[j][l] = weight[j][l] * scales[j / br][l / bc] (f32 or bf16 block
//                        scales; per-channel is br = 1, bc = k): each k-block's partial sums are
//                        accumulated separately and scaled when the block ends, so the weights
//                        stay exact in bf16
//                        <w> one of bf16, f16, e4m3fn, e4m3fnuz, e5m2, e5m2fnuz (f32 weights stay on
//                        gemm.cu); x f32 [m, k] (16-bit x is widened first, as for gemm.cu); y [m, n]
//                        f32, bf16 or f16 (p.y_dtype)
// gemm_tc_experts_<w>[_block_<s>]
//                        the `experts` op's grouped form (ExpertsGemvParams, params/linear.h): row
//                        tile y of every expert's sorted rows in order of expert, with that
//                        expert's matrix (linear.cuh's expert_tile; Mixtral's prefill)
//
// Preconditions (checked by the launcher, runtime/src/gpu/ops/gemm.rs, which routes every other
// shape to gemm.cu): k a multiple of 16 / sizeof(W) elements (16-byte rows of W; x's rows are then
// 16-byte multiples too); x and the weight 16-byte aligned; block scales with bc >= k or bc a
// multiple of TILE_K; sm_80 or newer.
//
// Exact operands: every operand of the bf16 mma is exact, so only the f32 sums round.
// - Weights: bf16 as is. Every fp8 value (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz: at most 3 mantissa
//   bits, exponents 2^-17 .. 2^15) is a bf16 (7 mantissa bits, f32's exponent range), widened while
//   staging. (They are f16 values too, but bf16 keeps x's range below.) An f16 weight (11
//   significant bits) is w_hi + w_lo with w_hi = bf16(w) and w_lo = w - w_hi, whose at most 4
//   significant bits and exponent >= 2^-24 make it a bf16 too: W_PARTS = 2 for f16, else 1.
// - Activations: the model runs f32 x and its logits must match transformers' f32 run, so x is
//   split into X_PARTS = 3 bf16 parts while staging: h = bf16(x), m = bf16(x - h), l = bf16(x - h
//   - m) (each difference exact in f32); |x - (h + m + l)| <= 2^-24 |x|, as close as f32's own
//   rounding of x (2 parts would give 2^-16). Non-finite h (x infinite, NaN or above bf16's
//   largest, ~3.39e38) keeps m = l = 0.
// So each output is a sum of X_PARTS * W_PARTS * k exact products. PTX leaves the mma's internal
// order and rounding unspecified (measurements show truncation), so the bound assumed is f32
// summation with unit error 2^-23 over all N = X_PARTS W_PARTS k products: |acc - sum| <=
// gamma'(N) sum|t|, gamma'(N) = N 2^-23 / (1 - N 2^-23), sum|t| <= (1 + 2^-7) sum_l |x w| (the
// lower parts are at most 2^-8 of the part above). Then the scale: one multiply (plain), or per
// k-block a multiply and an add into the f32 total (block scales: ceil(k / bc) + 1 roundings).
// tests/gpu_linear.rs holds the kernels to this bound plus the split's 2^-24 |x|.
//
// Algorithm: block (x, y) owns the TILE_N x TILE_M outputs j in [x TILE_N, ...), i in
// [y TILE_M, ...); WARPS_M x WARPS_N warps, each a WARP_M x WARP_N tile of FRAG_M x FRAG_N
// m16n8 f32 accumulator fragments. Per TILE_K step: every thread loads its 16-byte words of the
// next x and weight tiles into registers (x_stage, w_stage) while the warps run the mma over the
// current tiles in shared memory; then it splits / widens the staged words into the other of two
// shared buffers (so one __syncthreads per step). No cp.async: it copies raw bytes, and both
// operands are converted on the way in. Shared tiles are [row][TILE_K] bf16, the 16-byte chunks of
// each row XOR-swizzled by (row / 2) % 4, so the eight 16-byte rows an ldmatrix phase reads lie
// in distinct banks. Fragments: A (x parts) by ldmatrix_x4 over [i][l]; B (weight parts) by
// ldmatrix_x4 (not .trans: W's rows are B's columns) over [j][l], two n8 fragments per call.
//
// Not yet: wgmma + TMA on sm_90a (not emulated by the SIMT layer), split-K for small grids, bf16 x
// without the split for callers that opt into bf16 accuracy.
//
// Launch: runtime/src/gpu/ops/gemm.rs; grid (ceil(n / TILE_N), ceil(m / TILE_M)), block
// WARPS_M * WARPS_N warps, no dynamic shared memory. Tests: tests/gpu_linear.rs (m > 16 cases on
// the paths gemm::gemm_path picks; exact three-part / two-part cases).
#include "linear.cuh"
#include "mma.cuh"

namespace mw_gemm_tc {

using namespace mw_linear;

constexpr int TILE_M = 64;
constexpr int TILE_N = 64;
constexpr int TILE_K = 32;
constexpr int WARPS_M = 2;
constexpr int WARPS_N = 2;
constexpr int THREADS = WARPS_M * WARPS_N * MW_WARP;
constexpr int WARP_M = TILE_M / WARPS_M;
constexpr int WARP_N = TILE_N / WARPS_N;
constexpr int MMA_M = 16, MMA_N = 8, MMA_K = 16;
constexpr int FRAG_M = WARP_M / MMA_M;
constexpr int FRAG_N = WARP_N / MMA_N;
static_assert(TILE_K == SWIZZLE_COLS, "shared tiles of linear.cuh's swizzled32 layout");
static_assert(FRAG_N % 2 == 0, "one ldmatrix_x4 yields two n8 B fragments");

template <typename W>
using Staged = TileWords<W, TILE_M, TILE_N, TILE_K, THREADS>;

// sum += the warp's part of x_tile . w_tile^T over one TILE_K step.
template <int W_PARTS>
MW_DEV void mma_tile(const bf16 (*x_smem)[TILE_M * TILE_K], const bf16 (*w_smem)[TILE_N * TILE_K], int wm, int wn,
                     float (&sum)[FRAG_M][FRAG_N][4]) {
    const int lane = threadIdx.x % MW_WARP;
#pragma unroll
    for (int kk = 0; kk < TILE_K; kk += MMA_K) {
        uint32_t a_reg[X_PARTS][FRAG_M][4];
#pragma unroll
        for (int q = 0; q < X_PARTS; ++q)
#pragma unroll
            for (int mt = 0; mt < FRAG_M; ++mt) {
                const int row = wm * WARP_M + mt * MMA_M + lane % 16, col = kk + 8 * (lane / 16);
                mw::ldmatrix_x4(a_reg[q][mt], &x_smem[q][swizzled32(row, col)]);
            }
        uint32_t b_reg[W_PARTS][FRAG_N][2];
#pragma unroll
        for (int q = 0; q < W_PARTS; ++q)
#pragma unroll
            for (int np = 0; np < FRAG_N / 2; ++np) {
                // matrices (j 0-7, l 0-7), (j 0-7, l 8-15), (j 8-15, l 0-7), (j 8-15, l 8-15)
                const int row = wn * WARP_N + np * 2 * MMA_N + lane % 8 + 8 * (lane / 16);
                const int col = kk + 8 * ((lane / 8) % 2);
                uint32_t r[4];
                mw::ldmatrix_x4(r, &w_smem[q][swizzled32(row, col)]);
                b_reg[q][2 * np][0] = r[0];
                b_reg[q][2 * np][1] = r[1];
                b_reg[q][2 * np + 1][0] = r[2];
                b_reg[q][2 * np + 1][1] = r[3];
            }
#pragma unroll
        for (int mt = 0; mt < FRAG_M; ++mt)
#pragma unroll
            for (int nt = 0; nt < FRAG_N; ++nt)
#pragma unroll
                for (int qx = 0; qx < X_PARTS; ++qx)
#pragma unroll
                    for (int qw = 0; qw < W_PARTS; ++qw)
                        mw::mma_m16n8k16_bf16(sum[mt][nt], a_reg[qx][mt], b_reg[qw][nt], sum[mt][nt]);
    }
}

// The output tile of rows [i0, i0 + TILE_M) and columns [j0, j0 + TILE_N).
template <typename W, typename Scale>
MW_DEV void gemm_tc_tile(const LinearParams& p, uint64_t i0, uint64_t j0) {
    constexpr int WP = W_PARTS<W>;
    MW_SHARED(bf16[2][X_PARTS][TILE_M * TILE_K], x_smem);
    MW_SHARED(bf16[2][WP][TILE_N * TILE_K], w_smem);
    const int lane = threadIdx.x % MW_WARP, warp = threadIdx.x / MW_WARP;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N, g = lane >> 2, tq = lane % 4;

    float acc_f32[FRAG_M][FRAG_N][4], part_f32[FRAG_M][FRAG_N][4];
#pragma unroll
    for (int mt = 0; mt < FRAG_M; ++mt)
#pragma unroll
        for (int nt = 0; nt < FRAG_N; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_f32[mt][nt][e] = part_f32[mt][nt][e] = 0.0f;

    split_tile_loop<W, Scale, Staged<W>, TILE_K>(p, i0, j0, x_smem, w_smem, [&](int buf, uint64_t tile, bool block_end) {
        if constexpr (Scale::BLOCKS) {
            mma_tile<WP>(x_smem[buf], w_smem[buf], wm, wn, part_f32);
            if (block_end) {
                // The k-block ends: acc += part * its scale, column by column: the lane's
                // columns j0 + wn WARP_N + 2 tq + e + MMA_N nt.
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const uint64_t first = j0 + wn * WARP_N + 2 * tq + e;
                    for_each_column_scale<Scale, FRAG_N>(p, first, MMA_N, tile * TILE_K, [&](int nt, float s) {
#pragma unroll
                        for (int mt = 0; mt < FRAG_M; ++mt)
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                acc_f32[mt][nt][2 * h + e] += part_f32[mt][nt][2 * h + e] * s;
                                part_f32[mt][nt][2 * h + e] = 0.0f;
                            }
                    });
                }
            }
        } else {
            mma_tile<WP>(x_smem[buf], w_smem[buf], wm, wn, acc_f32);
        }
    });
#pragma unroll
    for (int mt = 0; mt < FRAG_M; ++mt)
#pragma unroll
        for (int nt = 0; nt < FRAG_N; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint64_t i = i0 + wm * WARP_M + mt * MMA_M + g + 8 * (e / 2);
                const uint64_t j = j0 + wn * WARP_N + nt * MMA_N + 2 * tq + e % 2;
                const float v = acc_f32[mt][nt][e];
                if (i < p.m && j < p.n) store_y(p, i, j, Scale::BLOCKS ? v : v * p.scale);
            }
}

// The output tile of block (x, y): rows [y TILE_M, ...), columns [x TILE_N, ...).
template <typename W, typename Scale>
MW_DEV void gemm_tc(const LinearParams& p) {
    gemm_tc_tile<W, Scale>(p, uint64_t(blockIdx.y) * TILE_M, uint64_t(blockIdx.x) * TILE_N);
}

// The `experts` op's grouped GEMM: block (x, y) takes row tile y of the experts' sorted rows
// (mw_linear::expert_tile) and that expert's matrix.
template <typename W, typename Scale>
MW_DEV void gemm_tc_experts(const ExpertsGemvParams& q) {
    MW_SHARED(LinearParams, p_smem);
    uint64_t i0;
    if (!shared_expert_tile<TILE_M>(q, p_smem, i0)) return;
    gemm_tc_tile<W, Scale>(p_smem, i0, uint64_t(blockIdx.x) * TILE_N);
}

}  // namespace mw_gemm_tc

// gemm_tc_experts_*: at least one block per SM asked, so ptxas gives the tile the registers it
// needs (left to itself it chose 128 and spilled into the k loop, where the plain GEMM reads its
// params from the constant bank and takes 156 to 214).
#define MW_GEMM_TC(wname, W, Scale, sname)                                                           \
    MW_KERNEL_BOUNDS(gemm_tc_##wname##sname, LinearParams, mw_gemm_tc::THREADS) {                     \
        mw_gemm_tc::gemm_tc<W, Scale>(p);                                                            \
    }                                                                                                \
    MW_KERNEL_OCCUPANCY(gemm_tc_experts_##wname##sname, ExpertsGemvParams, mw_gemm_tc::THREADS, 1) {  \
        mw_gemm_tc::gemm_tc_experts<W, Scale>(p);                                                    \
    }
MW_LINEAR_FOR_EACH_TC_KERNEL(MW_GEMM_TC)

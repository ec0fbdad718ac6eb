// gemm_mfma.cu: the prefill / large-batch `linear` on AMD's matrix cores (MFMA
// v_mfma_f32_16x16x16_bf16: CDNA2 gfx90a, CDNA3 gfx94x, gfx950), with gemm_tc.cu's contract:
// y[m, n] = x[m, k] . W_real[n, k]^T for 16-bit and fp8 weights with f32 activations and f32
// accuracy.
//
// gemm_mfma_<w>            W_real = weight * p.scale, applied to each finished sum
// gemm_mfma_<w>_block_<s>  W_real[j][l] = weight[j][l] * scales[j / br][l / bc] (f32 or bf16 block
//                          scales; per-channel is br = 1, bc = k), each k-block's partial sums
//                          scaled when the block ends
//                          <w> one of bf16, f16, e4m3fn, e4m3fnuz, e5m2, e5m2fnuz; x f32 [m, k]; y
//                          [m, n] f32, bf16 or f16 (p.y_dtype)
// gemm_mfma_experts_<w>[_block_<s>]
//                          the `experts` op's grouped form, as gemm_tc_experts_* of gemm_tc.cu
//
// Preconditions (checked by the launcher, runtime/src/gpu/ops/gemm.rs, which sends other shapes to
// gemm.cu): gemm_tc.cu's (k a multiple of 16 / sizeof(W) elements, x and the weight 16-byte
// aligned, block scales with bc >= k or bc a multiple of TILE_K) and an MFMA target (mfma.cuh);
// elsewhere the kernels trap. They are compiled for NVIDIA too (traps) so that every image holds
// the same kernel names.
//
// Exact operands and the bound: as gemm_tc.cu. x is split into 3 bf16 parts, fp8 and bf16 weights
// are bf16 values, f16 weights are two bf16 parts, so every product an MFMA forms is exact and
// each output is a sum of 3 W_PARTS k exact products in f32; the ISA leaves the matrix core's
// internal order and rounding unspecified, so tests/gpu_linear.rs holds these kernels to
// gemm_tc.cu's bound (f32 summation with unit error 2^-23 over every product).
//
// Algorithm: block (x, y) owns the TILE_N x TILE_M outputs j in [x TILE_N, ...), i in [y TILE_M,
// ...); WAVES_M x WAVES_N wavefronts of 64 lanes, each a WAVE_M x WAVE_N tile of FRAG_M x FRAG_N
// 16 x 16 f32 accumulators. Staging is gemm_tc.cu's: per TILE_K step every thread loads its
// 16-byte words of the next x and weight tiles into registers while the wavefronts run the MFMAs
// over the current shared tiles, then splits / widens them into the other shared buffer, one
// barrier per step (linear.cuh's split_tile_loop and store_split_tiles; swizzled32 tiles,
// MW_SHARED). The MFMA's A operand
// is a 16-row slice of the weight parts and B a 16-row slice of x's parts, transposed: lane l
// reads A[l % 16][4 (l / 16) + e] = W[j][l'] and B[4 (l / 16) + e][l % 16] = x[i][l'], so both are
// one 8-byte read of four consecutive k from row l % 16 of a shared tile, and the lane's four
// accumulators D[4 (l / 16) + e][l % 16] are y[i][j + e] for four consecutive outputs j of one row i.
//
// Not measured: no AMD GPU has run this (its logic runs at warp 64 in the SIMT emulator, against
// mfma.cuh's emulation of the instruction's layout). Not yet: 32x32x8 MFMAs, direct-to-LDS loads,
// more than one block per CU (40 KB of LDS, 56 KB for f16 weights).
//
// Launch: runtime/src/gpu/ops/gemm.rs; grid (ceil(n / TILE_N), ceil(m / TILE_M)), THREADS threads
// (4 wavefronts), no dynamic shared memory.
#include "linear.cuh"
#include "mfma.cuh"

namespace mw_gemm_mfma {

using namespace mw_linear;

constexpr int WAVES_M = 2;
constexpr int WAVES_N = 2;
constexpr int WAVE = 64;
constexpr int THREADS = WAVES_M * WAVES_N * WAVE;

#if !defined(MW_MFMA_UNSUPPORTED)
static_assert(MW_WARP == WAVE, "MFMA runs on 64-lane wavefronts");

constexpr int TILE_M = 64;
constexpr int TILE_N = 128;
constexpr int TILE_K = 32;
constexpr int WAVE_M = TILE_M / WAVES_M;
constexpr int WAVE_N = TILE_N / WAVES_N;
constexpr int MFMA = 16;  // M = N = K of the instruction
constexpr int FRAG_M = WAVE_M / MFMA;
constexpr int FRAG_N = WAVE_N / MFMA;
static_assert(TILE_K == SWIZZLE_COLS, "shared tiles of linear.cuh's swizzled32 layout");

template <typename W>
using Staged = TileWords<W, TILE_M, TILE_N, TILE_K, THREADS>;

// Four consecutive k from row `row` of a swizzled32 tile (`col` a multiple of 4): one 8-byte read.
MW_DEV void read4(const bf16* tile, int row, int col, uint32_t (&r)[2]) {
    const Pair v = *reinterpret_cast<const Pair*>(tile + swizzled32(row, col));
    r[0] = v.e[0];
    r[1] = v.e[1];
}

// sum += the wavefront's part of (w_tile . x_tile^T) over one TILE_K step: sum[nt][mt] is the 16 x
// 16 block of outputs j in 16 nt.., i in 16 mt.. of the wavefront's tile.
template <int WP>
MW_DEV void mfma_tile(const bf16 (*x_smem)[TILE_M * TILE_K], const bf16 (*w_smem)[TILE_N * TILE_K], int wm, int wn,
                      float (&sum)[FRAG_N][FRAG_M][4]) {
    const int lane = threadIdx.x % WAVE, r16 = lane % 16, k4 = 4 * (lane / 16);
#pragma unroll
    for (int kk = 0; kk < TILE_K; kk += MFMA) {
        uint32_t xs[X_PARTS][FRAG_M][2];
#pragma unroll
        for (int q = 0; q < X_PARTS; ++q)
#pragma unroll
            for (int mt = 0; mt < FRAG_M; ++mt) read4(x_smem[q], wm * WAVE_M + mt * MFMA + r16, kk + k4, xs[q][mt]);
        uint32_t ws[WP][FRAG_N][2];
#pragma unroll
        for (int q = 0; q < WP; ++q)
#pragma unroll
            for (int nt = 0; nt < FRAG_N; ++nt) read4(w_smem[q], wn * WAVE_N + nt * MFMA + r16, kk + k4, ws[q][nt]);
#pragma unroll
        for (int nt = 0; nt < FRAG_N; ++nt)
#pragma unroll
            for (int mt = 0; mt < FRAG_M; ++mt)
#pragma unroll
                for (int qx = 0; qx < X_PARTS; ++qx)
#pragma unroll
                    for (int qw = 0; qw < WP; ++qw) mw::mfma_16x16x16_bf16(sum[nt][mt], ws[qw][nt], xs[qx][mt]);
    }
}
#endif

#if !defined(MW_MFMA_UNSUPPORTED)
// The output tile of rows [i0, i0 + TILE_M) and columns [j0, j0 + TILE_N).
template <typename W, typename Scale>
MW_DEV void gemm_mfma_tile(const LinearParams& p, uint64_t i0, uint64_t j0) {
    constexpr int WP = W_PARTS<W>;
    MW_SHARED(bf16[2][X_PARTS][TILE_M * TILE_K], x_smem);
    MW_SHARED(bf16[2][WP][TILE_N * TILE_K], w_smem);
    const int lane = threadIdx.x % WAVE, wave = threadIdx.x / WAVE;
    const int wm = wave / WAVES_N, wn = wave % WAVES_N, r16 = lane % 16, k4 = 4 * (lane / 16);
    // The lane's outputs: rows i0 + wm WAVE_M + 16 mt + r16, columns j_lane + 16 nt + e.
    const uint64_t j_lane = j0 + wn * WAVE_N + k4;

    float acc[FRAG_N][FRAG_M][4], part[FRAG_N][FRAG_M][4];
#pragma unroll
    for (int nt = 0; nt < FRAG_N; ++nt)
#pragma unroll
        for (int mt = 0; mt < FRAG_M; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][mt][e] = part[nt][mt][e] = 0.0f;

    split_tile_loop<W, Scale, Staged<W>, TILE_K>(p, i0, j0, x_smem, w_smem, [&](int buf, uint64_t tile, bool block_end) {
        if constexpr (Scale::BLOCKS) {
            mfma_tile<WP>(x_smem[buf], w_smem[buf], wm, wn, part);
            if (block_end) {
                // The k-block ends: acc += part * its scale, output column by column: the lane's
                // columns j_lane + e + 16 nt.
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    for_each_column_scale<Scale, FRAG_N>(p, j_lane + e, MFMA, tile * TILE_K, [&](int nt, float s) {
#pragma unroll
                        for (int mt = 0; mt < FRAG_M; ++mt) {
                            acc[nt][mt][e] += part[nt][mt][e] * s;
                            part[nt][mt][e] = 0.0f;
                        }
                    });
                }
            }
        } else {
            mfma_tile<WP>(x_smem[buf], w_smem[buf], wm, wn, acc);
        }
    });
#pragma unroll
    for (int nt = 0; nt < FRAG_N; ++nt)
#pragma unroll
        for (int mt = 0; mt < FRAG_M; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint64_t i = i0 + wm * WAVE_M + mt * MFMA + r16, j = j_lane + nt * MFMA + e;
                const float v = acc[nt][mt][e];
                if (i < p.m && j < p.n) store_y(p, i, j, Scale::BLOCKS ? v : v * p.scale);
            }
}
#endif

// The output tile of block (x, y): rows [y TILE_M, ...), columns [x TILE_N, ...).
template <typename W, typename Scale>
MW_DEV void gemm_mfma(const LinearParams& p) {
#if defined(MW_MFMA_UNSUPPORTED)
    (void)p;
    __trap();  // MFMA targets only: runtime/src/gpu/ops/gemm.rs sends gemm_mfma to them alone
#else
    gemm_mfma_tile<W, Scale>(p, uint64_t(blockIdx.y) * TILE_M, uint64_t(blockIdx.x) * TILE_N);
#endif
}

// The `experts` op's grouped GEMM: block (x, y) takes row tile y of the experts' sorted rows
// (mw_linear::expert_tile) and that expert's matrix, its params in registers (CDNA has the room)
// built after the early return (mw_linear::expert_tile_params), so its loads stay global.
template <typename W, typename Scale>
MW_DEV void gemm_mfma_experts(const ExpertsGemvParams& q) {
#if defined(MW_MFMA_UNSUPPORTED)
    (void)q;
    __trap();
#else
    ExpertTile t;
    if (!expert_tile<TILE_M>(q, t)) return;
    gemm_mfma_tile<W, Scale>(expert_tile_params(q, t), expert_tile_row<TILE_M>(t), uint64_t(blockIdx.x) * TILE_N);
#endif
}

}  // namespace mw_gemm_mfma

#define MW_GEMM_MFMA(wname, W, Scale, sname)                                                         \
    MW_KERNEL_BOUNDS(gemm_mfma_##wname##sname, LinearParams, mw_gemm_mfma::THREADS) {                 \
        mw_gemm_mfma::gemm_mfma<W, Scale>(p);                                                        \
    }                                                                                                \
    MW_KERNEL_BOUNDS(gemm_mfma_experts_##wname##sname, ExpertsGemvParams, mw_gemm_mfma::THREADS) {    \
        mw_gemm_mfma::gemm_mfma_experts<W, Scale>(p);                                                \
    }
MW_LINEAR_FOR_EACH_TC_KERNEL(MW_GEMM_MFMA)

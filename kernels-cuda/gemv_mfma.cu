// gemv_mfma.cu: the batched decode `linear` on AMD's matrix cores (v_mfma_f32_16x16x16_bf16:
// CDNA2 gfx90a, CDNA3 gfx94x, gfx950), gemv_tc.cu's counterpart: y[m, n] = x[m, k] . W_real[n, k]^T
// for m <= 16 rows (tokens) with gemv_tc.cu's contract, accuracy and split-K, on 64-lane
// wavefronts.
//
// gemv_mfma_<w>_r16            W_real = weight * p.lin.scale, applied to each finished sum
// gemv_mfma_<w>_block_<s>_r16  W_real[j][l] = weight[j][l] * scales[j / br][l / bc] (f32 or bf16
//                              block scales; per-channel is br = 1, bc = k): each k-block's sums
//                              accumulated apart and scaled when it ends
//                              <w> one of bf16, f16, e4m3fn, e4m3fnuz, e5m2, e5m2fnuz; x f32 [m, k]
//                              (16-bit x widened first by linear_x_f32_<t>); y [m, n] f32, bf16 or
//                              f16
// gemv_mfma_experts_<w>[_block_<s>]_r16
//                              the `experts` op's grouped form, as gemv_tc.cu's gemv_tc_experts_*
//
// Why: gemv.cu's 16-row tile is FP32 FMAs, 16 per weight element plus the widening. At an
// MI300X's 5.3 TB/s, 16 rows of fp8 weights ask for about 85 T FMA/s, beyond its vector units'
// 82 T even with packed FP32 (163 TFLOPS, AMD's datasheet), so those, not HBM, would bound it.
// Here the products run on the matrix cores (16 x 3 parts x 2 flops per fp8 byte is 96 flops a
// byte, 0.5 PFLOPS at 5.3 TB/s of the 1.3 dense bf16 PFLOPS) and x is staged once per block for
// 128 output features.
//
// Layout. Block (bx, split) owns output features [bx FEATURES, +FEATURES) and the columns
// [split split_cols, +split_cols) of k; wavefront w the 32 features (two 16-feature MFMA tiles)
// from bx FEATURES + 32 w. The weights are the MFMA's A operand (rows = features), x's parts its B
// (columns = tokens; the MFMA's 16 columns are the row tile, tokens past m are zero), and D[f][i]
// the sums. The MFMA's k order is free as long as A and B agree (mfma.cuh: lane l, r = l % 16,
// q = l / 16, holds A[r][4q + e], B[4q + e][r], D[4q + e][r]), so weights go from global memory
// straight into registers: per step of STEP_K = 4 VEC columns from l (VEC = 16 / sizeof(w): 64
// columns of fp8, 32 of 16-bit), lane (r, q) loads the VEC columns [l + VEC q, +VEC) of row r of
// each tile, one 16-byte word, fully used. Slice s (s < VEC / 4, one MFMA per part pair) gives
// k slots 4q .. 4q + 3 to the lane's columns l + VEC q + 4 s .. + 3, so B's fragment is x[token
// r][the same four columns]: four consecutive bf16 of one shared row per part, read 8 at a time
// (two slices) by one 16-byte LDS read. The lane's sums D[4q + e][r] are features 4q + e of the
// tile for token r. x tiles of TILE_K = 128 columns are double-buffered in shared memory as
// [part][token][ROW] bf16, ROW = TILE_K + 8: token rows 272 bytes apart, 16 mod 128, so the eight
// 16-byte reads of lanes r = 0..7 (one column) fall in distinct banks. Each thread loads its
// words of the next x tile into registers while the wavefronts run the current one, splits them
// into the other buffer, and one barrier per tile swaps the two. A lane loads all its weight words
// of the next tile (TILES x STEPS words: 4 of fp8, 8 of 16-bit; 4 to 8 KB per wavefront in
// flight) while the current tile's MFMAs run.
//
// Split-K, the partials and their deterministic merge: gemv_tc.cu's (linear.cuh,
// finish_split_gemv); the launcher plans both kernels alike (runtime/src/gpu/ops/linear.rs,
// gemv_tc_plan: the same FEATURES, TILE_K and STEP_K).
//
// Accuracy: gemv_tc.cu's. Each output is a sum of X_PARTS W_PARTS k exact products in f32 by the
// matrix core (order and rounding unspecified by the ISA), then the k-block scaling and the runs'
// sum: tests/gpu_linear.rs holds both kernels to one bound.
//
// Preconditions (checked by the launcher, which routes every other case to gemv.cu): gemv_tc.cu's
// (k a multiple of 16 / sizeof(W); x and the weight 16-byte aligned; block scales with bc >= k or
// bc a multiple of 64; n and k below 2^32) and an MFMA target (mfma.cuh); elsewhere, NVIDIA
// included, the kernels trap: they are compiled there only so every image has the same names.
//
// Not measured: no AMD GPU has run this; its logic runs at warp 64 in the SIMT emulator against
// mfma.cuh's emulation of the instruction. Taken where Gpu::set_gemv_tensor_core_rows asks for it,
// as gemv_tc.cu. Not yet: the 4x4x4 (16-block) MFMA for a few tokens, 32 x 32 tiles.
//
// Launch: grid (ceil(n / FEATURES), splits), THREADS threads (4 wavefronts), static shared memory
// only (26 KB).
#include "linear.cuh"
#include "mfma.cuh"

namespace mw_gemv_mfma {

using namespace mw_linear;

constexpr int WAVE = 64;
constexpr int WAVES = 4;
constexpr int THREADS = WAVES * WAVE;

#if !defined(MW_MFMA_UNSUPPORTED)
static_assert(MW_WARP == WAVE, "MFMA runs on 64-lane wavefronts");

constexpr int R = 16;                           // tokens: the MFMA's 16 columns
constexpr int MFMA = 16;                        // M = N = K of the instruction
constexpr int TILES = 2;                        // 16-feature MFMA tiles per wavefront
constexpr int FEATURES = WAVES * TILES * MFMA;  // output features per block
constexpr int TILE_K = 128;                     // columns of x per shared buffer
constexpr int ROW = TILE_K + 8;                 // bf16 per shared row of x (16 bytes of padding)

// Per weight dtype: a lane's columns of a row per step (one 16-byte word: VEC), the step (the
// four lanes of a row: 64 columns of fp8, 32 of 16-bit), steps per x tile, and the 16-byte reads
// of x per part in a step (two MFMA slices each).
template <typename W>
struct Traits {
    static constexpr int VEC = 16 / int(sizeof(W));
    static constexpr int STEP_K = 4 * VEC;
    static constexpr int STEPS = TILE_K / STEP_K;
    static constexpr int HALVES = VEC / 8;
};

// The lane's weight words of one x tile: [MFMA tile][step].
template <typename W>
struct TileWords {
    Words w[TILES][Traits<W>::STEPS];
};

// The lane's weight rows, set up once: the address of its first column in row r of each tile
// (rows past n read row 0 instead: their sums are never stored).
template <typename W>
struct LaneRows {
    const W* at[TILES];
    MW_DEV LaneRows(const LinearParams& p, uint64_t j0) {
        const int lane = threadIdx.x % WAVE, r = lane % 16, q = lane / 16;
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt) {
            const uint64_t j = j0 + mt * MFMA + r;
            at[mt] = reinterpret_cast<const W*>(p.weight) + (j < p.n ? j : 0) * p.k + Traits<W>::VEC * q;
        }
    }
};

// Loads the lane's weight words of the x tile at column l0 (zero past k: k is a multiple of VEC,
// so a word is wholly inside or outside). A row past n reads row 0 (LaneRows), which the lane's
// sums of it never reach y, so only k bounds a load; a tile wholly inside k, every tile but a
// run's last at k, loads with no per-lane condition.
template <typename W>
MW_DEV void load_tile(const LinearParams& p, const LaneRows<W>& rows, uint64_t l0, TileWords<W>& t) {
    using T = Traits<W>;
    const int q = (threadIdx.x % WAVE) / 16;
    const bool whole = l0 + TILE_K <= p.k;  // uniform over the block
#pragma unroll
    for (int s = 0; s < T::STEPS; ++s) {
        const uint64_t l = l0 + s * T::STEP_K;
        const bool inside = whole || l + T::VEC * q < p.k;
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt)
            t.w[mt][s] = inside ? *reinterpret_cast<const Words*>(rows.at[mt] + l) : Words{{0, 0, 0, 0}};
    }
}

// sums += the wavefront's features x the 16 tokens over step s of a tile: columns col .. col +
// STEP_K of the shared x buffer xs, the lane's weight words t.w[.][s].
template <typename W>
MW_DEV void mfma_step(const bf16* xs, int col, const TileWords<W>& t, int s, float (&sums)[TILES][4]) {
    using T = Traits<W>;
    constexpr int WP = W_PARTS<W>;
    const int lane = threadIdx.x % WAVE, r = lane % 16, q = lane / 16;
#pragma unroll
    for (int half = 0; half < T::HALVES; ++half) {
        // x[token r][col + VEC q + 8 half .. +8) of each part: B of slices 2 half, 2 half + 1.
        Words b[X_PARTS];
#pragma unroll
        for (int xp = 0; xp < X_PARTS; ++xp)
            b[xp] = *reinterpret_cast<const Words*>(xs + (xp * R + r) * ROW + col + T::VEC * q + 8 * half);
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt) {
            uint32_t w[2][4] = {};  // [part][bf16x2 of elements 8 half ..]; part 1: f16 only
            widen_half<W>(t.w[mt][s], half, w[0], w[1]);
#pragma unroll
            for (int v = 0; v < 2; ++v)
#pragma unroll
                for (int wp = 0; wp < WP; ++wp) {
                    const uint32_t a[2] = {w[wp][2 * v], w[wp][2 * v + 1]};
#pragma unroll
                    for (int xp = 0; xp < X_PARTS; ++xp) {
                        const uint32_t bq[2] = {b[xp].e[2 * v], b[xp].e[2 * v + 1]};
                        mw::mfma_16x16x16_bf16(sums[mt], a, bq);
                    }
                }
        }
    }
}

// The lane's sums for linear.cuh's finish_split_gemv: f(i, j, acc[mt][e]) for each inside y,
// token i = lane % 16, feature j = j0 + 16 mt + 4 (lane / 16) + e (the MFMA's D, features as
// rows).
struct LaneSums {
    const LinearParams& p;
    uint64_t j0;
    const float (&acc)[TILES][4];
    template <typename F>
    MW_DEV void operator()(F&& f) const {
        const int lane = threadIdx.x % WAVE;
        const uint64_t i = lane % 16, j_lane = j0 + 4 * (lane / 16);
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint64_t j = j_lane + mt * MFMA + e;
                if (i < p.m && j < p.n) f(i, j, acc[mt][e]);
            }
    }
};
#endif

// Block (bx, split) of the GEMV q (blockIdx for gemv_mfma_*; the expert's tile for
// gemv_mfma_experts_*).
template <typename W, typename Scale>
MW_DEV void gemv_mfma(const GemvTcParams& q, uint32_t bx, uint32_t split) {
#if defined(MW_MFMA_UNSUPPORTED)
    (void)q;
    (void)bx;
    (void)split;
    __trap();  // MFMA targets only: runtime/src/gpu/ops/linear.rs sends gemv_mfma to them alone
#else
    using T = Traits<W>;
    const LinearParams& p = q.lin;
    MW_SHARED(bf16[2][X_PARTS * R * ROW], xs);
    const int lane = threadIdx.x % WAVE, wave = threadIdx.x / WAVE;
    const uint64_t j0 = uint64_t(bx) * FEATURES + wave * (TILES * MFMA);
    const uint64_t l_begin = uint64_t(split) * q.split_cols;
    const uint64_t l_end = p.k < l_begin + q.split_cols ? p.k : l_begin + q.split_cols;
    // Columns per k-block: bc, or the whole run for per-channel scales and blocks as wide as k
    // (the launcher makes split_cols a multiple of bc where bc < k, and bc a multiple of 64).
    const uint32_t block_cols = Scale::BLOCKS && p.block_cols < p.k ? p.block_cols : q.split_cols;

    float acc[TILES][4], part[TILES][4];
#pragma unroll
    for (int mt = 0; mt < TILES; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][e] = part[mt][e] = 0.0f;

    StagedX<R, TILE_K, THREADS> staged;
    TileWords<W> cur, next;
    const LaneRows<W> rows(p, j0);
    staged.load(p, l_begin);
    load_tile<W>(p, rows, l_begin, cur);
    staged.template store<ROW>(xs[0]);
    __syncthreads();
    // Block scales: the run of scales of each of the lane's features (4 per tile; row 0's for a
    // feature past n, whose scale is then 0), and the current block column (no division in the
    // loop).
    const void* scale_rows[TILES][4] = {};
    bool scale_live[TILES][4] = {};
    uint32_t block_col = 0;
    if constexpr (Scale::BLOCKS) {
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint64_t j = j0 + mt * MFMA + 4 * (lane / 16) + e;
                scale_live[mt][e] = j < p.n;
                scale_rows[mt][e] = Scale::row(p, p.scales, j < p.n ? j : 0);
            }
        block_col = uint32_t(l_begin) / p.block_cols;
    }
    const uint64_t tiles = (l_end - l_begin + TILE_K - 1) / TILE_K;
    uint32_t in_block = 0;  // columns of the current k-block done
    for (uint64_t tile = 0; tile < tiles; ++tile) {
        const int buf = int(tile % 2);
        const uint64_t l0 = l_begin + tile * TILE_K;
        const bool more = tile + 1 < tiles;
        if (more) {
            staged.load(p, l0 + TILE_K);
            load_tile<W>(p, rows, l0 + TILE_K, next);
        }
#pragma unroll
        for (int s = 0; s < T::STEPS; ++s) {
            const uint64_t l = l0 + s * T::STEP_K;
            if (l < l_end) {  // uniform over the block
                if constexpr (Scale::BLOCKS) {
                    mfma_step<W>(xs[buf], s * T::STEP_K, cur, s, part);
                    in_block += T::STEP_K;
                    if (in_block >= block_cols || l + T::STEP_K >= l_end) {
                        // The k-block ends: acc += part * its scale, feature by feature.
                        in_block = 0;
#pragma unroll
                        for (int mt = 0; mt < TILES; ++mt)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                // Loaded for every lane (row 0's where past n) and then zeroed:
                                // a select, where a conditional load masks the wavefront.
                                const float s = Scale::in_row(scale_rows[mt][e], block_col);
                                const float sc = scale_live[mt][e] ? s : 0.0f;
                                acc[mt][e] += part[mt][e] * sc;
                                part[mt][e] = 0.0f;
                            }
                        ++block_col;
                    }
                } else {
                    mfma_step<W>(xs[buf], s * T::STEP_K, cur, s, acc);
                }
            }
        }
        // The other buffer was last read in the previous tile, before the barrier that ended it.
        if (more) {
            staged.template store<ROW>(xs[buf ^ 1]);
            cur = next;
        }
        __syncthreads();
    }
    finish_split_gemv(q, Scale::BLOCKS ? 1.0f : p.scale, LaneSums{p, j0, acc});
#endif
}

// The `experts` op's grouped form: each block one tile of FEATURES output features of one active
// expert, on that expert's rows (linear.cuh's expert_gemv; the params in registers, so the
// weights' pointers stay global).
template <typename W, typename Scale>
MW_DEV void gemv_mfma_experts(const ExpertsGemvParams& e) {
    ExpertBlock b;
    if (!expert_block(e, b)) return;
    gemv_mfma<W, Scale>(expert_gemv(e, b), b.block, 0);
}

}  // namespace mw_gemv_mfma

#define MW_GEMV_MFMA(wname, W, Scale, sname)                                                         \
    MW_KERNEL_BOUNDS(gemv_mfma_##wname##sname##_r16, GemvTcParams, mw_gemv_mfma::THREADS) {           \
        mw_gemv_mfma::gemv_mfma<W, Scale>(p, blockIdx.x, blockIdx.y);                                \
    }                                                                                                \
    MW_KERNEL_BOUNDS(gemv_mfma_experts_##wname##sname##_r16, ExpertsGemvParams, mw_gemv_mfma::THREADS) { \
        mw_gemv_mfma::gemv_mfma_experts<W, Scale>(p);                                                \
    }
MW_LINEAR_FOR_EACH_TC_KERNEL(MW_GEMV_MFMA)

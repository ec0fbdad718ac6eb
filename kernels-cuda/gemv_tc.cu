// gemv_tc.cu: the batched decode `linear` on tensor cores: y[m, n] = x[m, k] . W_real[n, k]^T for
// m <= R rows (R in {8, 16}: one or two n8 fragments of tokens), the same contract and accuracy as
// gemm_tc.cu (x split into three bf16 parts, weights exact in bf16: f32 accuracy), the same
// results as gemv.cu's batched tiles within that bound.
//
// gemv_tc_<w>_r<R>            W_real = weight * p.lin.scale, applied to each finished sum
// gemv_tc_<w>_block_<s>_r<R>  W_real[j][l] = weight[j][l] * scales[j / br][l / bc] (f32 or bf16
//                             block scales; per-channel is br = 1, bc = k): each k-block's sums
//                             accumulated apart and scaled when it ends
//                             <w> one of bf16, f16, e4m3fn, e4m3fnuz, e5m2, e5m2fnuz; x f32 [m, k]
//                             (16-bit x widened first by linear_x_f32_<t>); y [m, n] f32, bf16 or f16
// gemv_tc_experts_<w>[_block_<s>]_r<R>
//                             the `experts` op's grouped form (ExpertsGemvParams, params/linear.h;
//                             runtime/src/gpu/ops/experts.rs at 5 to 16 rows where
//                             Gpu::set_gemv_tensor_core_rows asks): block b of the grid serves the
//                             active expert of slot b / blocks_per_expert, output features
//                             [(b % blocks_per_expert) FEATURES, +FEATURES), on the rows the route
//                             sorted to it (at most R), in one run of k; blocks past the active
//                             experts return at once. x f32 (the sorted rows), y f32.
//
// Why (gemv.cu's header): the SIMT GEMV's 16-row tile reads 4 R bytes of f32 x through L1 per fp8
// weight byte and issues about 500 instructions per 16-byte word, so it reaches at most a tenth
// or so of the memory wall. Here x is staged once per block in shared memory for 128 output
// features, and each B fragment a lane reads serves the 32 features of its warp: 3 parts x 2
// bytes x 16 tokens / 32 features = 3 bytes of shared reads per fp8 weight byte (1.5 per bf16
// byte). Issue (sm_90a SASS, nvcc 13.0, the tile loop in instructions per 16-byte weight word a
// lane loads; gemv.cu's budget is about 128 at the H200's copy peak): e4m3fn 107 at 16 rows, 88
// at 8, 115 with f32 block scales; bf16 60, 82 with block scales. Of e4m3fn's 107, 35 widen the
// weights to bf16 (cvt to f16x2, to f32, one PRMT per pair), 12 are mma and about 20 split x.
//
// Layout. Block (bx, split) owns output features [bx FEATURES, +FEATURES) and the columns
// [split split_cols, +split_cols) of k; warp w the 32 features (two m16 tiles) from bx FEATURES +
// 32 w. Weights are the mma's A operand (rows = features) and go from global memory straight into
// registers: the mma's k order is free as long as A and B agree, so lane (g, t) (g = lane / 4,
// t = lane % 4) loads, per step of STEP_K = 4 VEC columns from l (VEC = 16 / sizeof(w): 64
// columns of fp8, 32 of 16-bit), the VEC columns [l + VEC t, +VEC) of rows g and g + 8 of each
// m16 tile: one 16-byte word each, fully used. Slice s (s < VEC / 4, one m16n8k16 each) takes the
// lane's columns 4 s .. 4 s + 3: its k slots 2 t, 2 t + 1 are columns l + VEC t + 4 s + {0, 1},
// slots 2 t + 8, 2 t + 9 columns l + VEC t + 4 s + {2, 3} (mma.cuh's fragment table), so B's
// fragment for token column g is x[token][l + VEC t + 4 s .. +3]: four consecutive bf16 of each
// part, read by one 16-byte LDS per two slices. x tiles of TILE_K = 128 columns are
// double-buffered in shared memory as [part][token][ROW] bf16, ROW = TILE_K plus padding that
// puts the two token rows of each 8-lane LDS.128 phase 16 (fp8) or 64 (16-bit) bytes apart mod
// 128, so its eight 16-byte reads fall in distinct banks. Each thread loads its words of the next
// x tile into registers while the warps run the current one, splits them into the other buffer,
// and one barrier per tile swaps the two. The weight words of the next step are loaded while the
// current step's mma run (two register sets: 8 words per lane, 4 KB per warp in flight).
//
// Split-K: n = 4096 gives 32 blocks of 128 features, too few for an H200, so the launcher
// (runtime/src/gpu/ops/linear.rs, gemv_tc_plan) cuts k into `splits` runs of split_cols columns
// (a multiple of TILE_K, and of bc for block scales, so k-blocks never straddle a split). With
// splits > 1 each block writes its sums to partials[split][i][j], and the last block of its
// features to arrive (an atomic counter per bx, returned to zero) adds the splits' sums in split
// order and stores y: deterministic whichever block arrives last (linear.cuh's
// finish_split_gemv, shared with gemv_mfma.cu). The partials cost 8 splits m / (k sizeof(w)) of
// the weight traffic; the launcher keeps that at or below a quarter.
//
// Accuracy: each output is a sum of X_PARTS W_PARTS k exact products (W_PARTS = 2 for f16: w_hi +
// w_lo, as gemm_tc.cu) in f32 by the mma, then k-block scaling (ceil(k / bc) + 1 roundings) and
// the split sum (splits roundings): tests/gpu_linear.rs holds the kernels to that bound.
//
// Preconditions (checked by the launcher, which routes every other case to gemv.cu): k a
// multiple of 16 / sizeof(W); x and the weight 16-byte aligned; block scales with bc >= k or bc a
// multiple of 64; n and k below 2^32; mma hardware (sm_80 or newer, or the SIMT emulator at
// warp 32). Not in the HIP images (mma.sync fragments; build/hip.rs).
//
// Launch: grid (ceil(n / FEATURES), splits), THREADS threads, static shared memory only (the
// grouped form: blocks_per_expert = ceil(n / FEATURES) blocks per expert that can be active). Taken
// where Gpu::set_gemv_tensor_core_rows asks for it (benches/gpu compares it with gemv.cu's tiles;
// not yet measured on a GPU).
#include "linear.cuh"
#include "mma.cuh"

namespace mw_gemv_tc {

using namespace mw_linear;

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * MW_WARP;
constexpr int TILES = 2;                      // m16 tiles of output features per warp
constexpr int FEATURES = WARPS * TILES * 16;  // output features per block
constexpr int TILE_K = 128;                   // columns of x per shared buffer

// Per weight dtype: a lane's columns of a row per step (one 16-byte word: VEC), the step (four
// lanes' words: 64 columns of fp8, 32 of 16-bit; VEC / 4 m16n8k16 slices), the shared row of x
// (padded so that the lanes of an LDS.128 phase, two token rows of four lanes, hit distinct
// banks: rows 16 bytes apart mod 128 where a lane reads 32 bytes, 64 where it reads 16), and the
// bf16 parts per element.
template <typename W>
struct Traits {
    static constexpr int VEC = 16 / int(sizeof(W));
    static constexpr int STEP_K = 4 * VEC;
    static constexpr int STEPS = TILE_K / STEP_K;
    static constexpr int HALVES = VEC / 8;  // 16-byte reads of x per part and fragment per step
    static constexpr int ROW = TILE_K + (VEC == 16 ? 8 : 32);
    static constexpr int PARTS = 1;  // bf16 and fp8 values are bf16 values
    static_assert(STEPS % 2 == 0, "the weight register sets alternate by step within a tile");
};
template <>
struct Traits<f16> : Traits<bf16> {
    static constexpr int PARTS = 2;  // w = bf16 hi + bf16 lo, exactly (gemm_tc.cu)
};

// The lane's weight words of one step: [m16 tile][row g, row g + 8].
struct StepWords {
    Words w[TILES][2];
};

// The lane's weight rows, set up once: the address of its first column in each of its four rows
// (rows past n read row j0's instead: their sums are never stored) and whether the row exists.
template <typename W>
struct LaneRows {
    const W* at[TILES][2];
    bool live[TILES][2];
    MW_DEV LaneRows(const LinearParams& p, uint64_t j0) {
        const int lane = threadIdx.x % MW_WARP, g = lane >> 2, t = lane % 4;
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint64_t j = j0 + mt * 16 + g + 8 * r;
                live[mt][r] = j < p.n;
                at[mt][r] = reinterpret_cast<const W*>(p.weight) + (j < p.n ? j : 0) * p.k + Traits<W>::VEC * t;
            }
    }
};

// Loads the lane's weight words for the step at column l (zero outside the matrix: k is a multiple
// of VEC, so a word is wholly inside or outside). GLOBAL: through linear.cuh's load_weight_words
// (load_words), for the grouped form, whose expert's weight pointer nvcc no longer knows to be
// global (the plain kernels' loads are LDG already; the nc form there made ptxas spill two f16
// block-scaled tiles).
template <typename W, bool GLOBAL>
MW_DEV void load_step(const LinearParams& p, const LaneRows<W>& rows, uint64_t l, StepWords& s) {
    const int t = threadIdx.x % 4;
    const bool inside = l + Traits<W>::VEC * t < p.k;
#pragma unroll
    for (int mt = 0; mt < TILES; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
            s.w[mt][r] = (inside && rows.live[mt][r])
                             ? load_words<GLOBAL>(reinterpret_cast<const Words*>(rows.at[mt][r] + l))
                             : Words{{0, 0, 0, 0}};
}

// The x tile of R tokens, staged in registers by the block's threads (linear.cuh).
template <int R>
using XStage = StagedX<R, TILE_K, THREADS>;

// sums += the warp's features x the R tokens over one step: columns col .. col + STEP_K of the
// shared x buffer xs, the lane's weight words w.
template <typename W, int R>
MW_DEV void mma_step(const bf16* xs, int col, const StepWords& w, float (&sums)[TILES][R / 8][4]) {
    using T = Traits<W>;
    constexpr int H = R / 8;
    const int lane = threadIdx.x % MW_WARP, g = lane >> 2, t = lane % 4;
#pragma unroll
    for (int half = 0; half < T::HALVES; ++half) {
        // x[token 8 h + g][col + VEC t + 8 half .. +8) of each part: B of slices 2 half, 2 half + 1.
        Words b[X_PARTS][H];
#pragma unroll
        for (int q = 0; q < X_PARTS; ++q)
#pragma unroll
            for (int h = 0; h < H; ++h)
                b[q][h] = *reinterpret_cast<const Words*>(xs + (q * R + 8 * h + g) * T::ROW + col + T::VEC * t + 8 * half);
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt) {
            uint32_t hi[2][4], lo[2][4] = {};  // lo: f16 weights only
            widen_half<W>(w.w[mt][0], half, hi[0], lo[0]);
            widen_half<W>(w.w[mt][1], half, hi[1], lo[1]);
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const uint32_t a_hi[4] = {hi[0][2 * u], hi[1][2 * u], hi[0][2 * u + 1], hi[1][2 * u + 1]};
#pragma unroll
                for (int h = 0; h < H; ++h)
#pragma unroll
                    for (int q = 0; q < X_PARTS; ++q) {
                        const uint32_t bq[2] = {b[q][h].e[2 * u], b[q][h].e[2 * u + 1]};
                        mw::mma_m16n8k16_bf16(sums[mt][h], a_hi, bq, sums[mt][h]);
                        if constexpr (T::PARTS == 2) {
                            const uint32_t a_lo[4] = {lo[0][2 * u], lo[1][2 * u], lo[0][2 * u + 1], lo[1][2 * u + 1]};
                            mw::mma_m16n8k16_bf16(sums[mt][h], a_lo, bq, sums[mt][h]);
                        }
                    }
            }
        }
    }
}

// The lane's sums for linear.cuh's finish_split_gemv: f(i, j, acc[mt][h][e]) for each inside y,
// feature j = j0 + 16 mt + g + 8 (e / 2), token i = 8 h + 2 t + e % 2 (the mma's C fragments,
// features as rows).
template <int H>
struct LaneSums {
    const LinearParams& p;
    uint64_t j0;
    const float (&acc)[TILES][H][4];
    template <typename F>
    MW_DEV void operator()(F&& f) const {
        const int lane = threadIdx.x % MW_WARP, g = lane >> 2, t = lane % 4;
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt)
#pragma unroll
            for (int h = 0; h < H; ++h)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const uint64_t i = 8 * h + 2 * t + e % 2, j = j0 + mt * 16 + g + 8 * (e / 2);
                    if (i < p.m && j < p.n) f(i, j, acc[mt][h][e]);
                }
    }
};

// Block (bx, split) of the GEMV q (blockIdx for gemv_tc_*; the expert's tile for
// gemv_tc_experts_*, with GLOBAL weight loads: load_step).
template <typename W, typename Scale, int R, bool GLOBAL = false>
MW_DEV void gemv_tc(const GemvTcParams& q, uint32_t bx, uint32_t split) {
    using T = Traits<W>;
    constexpr int H = R / 8;
    const LinearParams& p = q.lin;
    MW_SHARED(bf16[2][X_PARTS * R * T::ROW], xs);
    const int lane = threadIdx.x % MW_WARP, warp = threadIdx.x / MW_WARP, g = lane >> 2;
    const uint64_t j0 = uint64_t(bx) * FEATURES + warp * (TILES * 16);
    const uint64_t l_begin = uint64_t(split) * q.split_cols;
    const uint64_t l_end = p.k < l_begin + q.split_cols ? p.k : l_begin + q.split_cols;
    // Columns per k-block: bc, or the whole split for per-channel scales and blocks as wide as k
    // (the launcher makes split_cols a multiple of bc where bc < k, and bc a multiple of 64).
    const uint32_t block_cols = Scale::BLOCKS && p.block_cols < p.k ? p.block_cols : q.split_cols;

    float acc[TILES][H][4], part[TILES][H][4];
#pragma unroll
    for (int mt = 0; mt < TILES; ++mt)
#pragma unroll
        for (int h = 0; h < H; ++h)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][h][e] = part[mt][h][e] = 0.0f;

    XStage<R> staged;
    StepWords w[2];
    staged.load(p, l_begin);
    const LaneRows<W> rows(p, j0);
    load_step<W, GLOBAL>(p, rows, l_begin, w[0]);
    staged.template store<T::ROW>(xs[0]);
    __syncthreads();
    const uint64_t tiles = (l_end - l_begin + TILE_K - 1) / TILE_K;
    uint32_t in_block = 0;  // columns of the current k-block done
    // Block scales: each lane row's run of scales, and the current block column (no division in
    // the loop).
    const void* scale_rows[TILES][2] = {};
    uint32_t block_col = 0;
    if constexpr (Scale::BLOCKS) {
#pragma unroll
        for (int mt = 0; mt < TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint64_t j = j0 + mt * 16 + g + 8 * r;
                scale_rows[mt][r] = Scale::row(p, p.scales, j < p.n ? j : 0);
            }
        block_col = uint32_t(l_begin) / p.block_cols;
    }
    for (uint64_t tile = 0; tile < tiles; ++tile) {
        const int buf = int(tile % 2);
        const uint64_t l0 = l_begin + tile * TILE_K;
        const bool more = tile + 1 < tiles;
        if (more) staged.load(p, l0 + TILE_K);
#pragma unroll
        for (int s = 0; s < T::STEPS; ++s) {
            const uint64_t l = l0 + s * T::STEP_K;
            if (l < l_end) {  // uniform over the block
                if (l + T::STEP_K < l_end) load_step<W, GLOBAL>(p, rows, l + T::STEP_K, w[(s + 1) % 2]);
                if constexpr (Scale::BLOCKS) {
                    mma_step<W, R>(xs[buf], s * T::STEP_K, w[s % 2], part);
                    in_block += T::STEP_K;
                    if (in_block >= block_cols || l + T::STEP_K >= l_end) {
                        // The k-block ends: acc += part * its scale, row by row.
                        in_block = 0;
#pragma unroll
                        for (int mt = 0; mt < TILES; ++mt)
#pragma unroll
                            for (int r = 0; r < 2; ++r) {
                                const float sc = rows.live[mt][r] ? Scale::in_row(scale_rows[mt][r], block_col) : 0.0f;
#pragma unroll
                                for (int h = 0; h < H; ++h)
#pragma unroll
                                    for (int e = 0; e < 2; ++e) {
                                        acc[mt][h][2 * r + e] += part[mt][h][2 * r + e] * sc;
                                        part[mt][h][2 * r + e] = 0.0f;
                                    }
                            }
                        ++block_col;
                    }
                } else {
                    mma_step<W, R>(xs[buf], s * T::STEP_K, w[s % 2], acc);
                }
            }
        }
        // The other buffer was last read in the previous tile, before the barrier that ended it.
        if (more) staged.template store<T::ROW>(xs[buf ^ 1]);
        __syncthreads();
    }

    finish_split_gemv(q, Scale::BLOCKS ? 1.0f : p.scale, LaneSums<H>{p, j0, acc});
}

// The `experts` op's grouped form: each block one tile of FEATURES output features of one active
// expert, on that expert's rows. Its params in registers (linear.cuh's expert_gemv), built after
// the early return: read back from a shared copy (shared_expert_gemv) at each use, they cost 260
// more LDS in the 16-row bf16 kernel on sm_90a (283 against 24) and made its stores generic. On sm_80,
// where the software fp8 decode needs more registers, the shared copy stays: in registers the e5m2
// block-scaled 16-row kernels spilled at 255.
template <typename W, typename Scale, int R>
MW_DEV void gemv_tc_experts(const ExpertsGemvParams& e) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    MW_SHARED(GemvTcParams, q_smem);
    uint32_t bx;
    if (!shared_expert_gemv(e, q_smem, bx)) return;
    gemv_tc<W, Scale, R, true>(q_smem, bx, 0);
#else
    ExpertBlock b;
    if (!expert_block(e, b)) return;
    gemv_tc<W, Scale, R, true>(expert_gemv(e, b), b.block, 0);
#endif
}

}  // namespace mw_gemv_tc

// On sm_80 (fp8 decoded in software) ptxas capped the block-scaled 16-row kernels at 168
// registers (3 blocks per SM) and spilled inside the tile loop; asking for 2 blocks (up to 255
// registers) keeps them in registers (106 to 245). sm_90a needs no cap (95 to 183, no spills).
// The grouped gemv_tc_experts_* ask for 2 blocks everywhere: left alone, ptxas capped the fnuz
// block-scaled 16-row ones at 168 registers on sm_90a and spilled (their plain forms take 182;
// 2 blocks of 128 threads at up to 255 registers is what 182 gives anyway).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define MW_GEMV_TC_KERNEL(name, Params) MW_KERNEL_OCCUPANCY(name, Params, mw_gemv_tc::THREADS, 2)
#else
#define MW_GEMV_TC_KERNEL(name, Params) MW_KERNEL_BOUNDS(name, Params, mw_gemv_tc::THREADS)
#endif
#define MW_GEMV_TC(wname, W, Scale, sname, R)                                                        \
    MW_GEMV_TC_KERNEL(gemv_tc_##wname##sname##_r##R, GemvTcParams) {                                 \
        mw_gemv_tc::gemv_tc<W, Scale, R>(p, blockIdx.x, blockIdx.y);                                 \
    }                                                                                                \
    MW_KERNEL_OCCUPANCY(gemv_tc_experts_##wname##sname##_r##R, ExpertsGemvParams, mw_gemv_tc::THREADS, 2) { \
        mw_gemv_tc::gemv_tc_experts<W, Scale, R>(p);                                                 \
    }
#define MW_GEMV_TC_TILES(wname, W, Scale, sname)                                                     \
    MW_GEMV_TC(wname, W, Scale, sname, 8)                                                            \
    MW_GEMV_TC(wname, W, Scale, sname, 16)
MW_LINEAR_FOR_EACH_TC_KERNEL(MW_GEMV_TC_TILES)

// gemm.cu: the prefill / large-batch `linear`: y[m, n] = x[m, k] . W_real[n, k]^T for m > 16 rows.
//
// gemm_<w>            W_real = weight * p.scale (1 unscaled, else the per-tensor scale), applied to
//                     each finished sum
// gemm_<w>_block_<s>  W_real[j][l] = weight[j][l] * scales[j / br][l / bc] (f32 or bf16 block
//                     scales; per-channel scales are br = 1, bc = k), applied to each element as
//                     the weight tile is dequantised into shared memory
//                     weight [n, k] of dtype <w> (the 7 float types); x f32 [m, k] (bf16 / f16
//                     activations are widened first by linear_x_f32_<t> of gemv.cu); y [m, n] f32,
//                     bf16 or f16 (p.y_dtype)
// gemm_experts_<w>[_block_<s>]
//                     the `experts` op's grouped form (ExpertsGemvParams, params/linear.h): row
//                     tile y of every expert's sorted rows in order of expert, with that expert's
//                     matrix (linear.cuh's expert_tile), for the shapes gemm_tc.cu does not take
//
// Algorithm: a CUDA-core tiled GEMM in f32. Block (x, y) owns the TILE_N x TILE_M outputs
// j in [x TILE_N, ...), i in [y TILE_M, ...); GEMM_THREADS threads as a 16 x 16 grid, each with a
// THREAD_M x THREAD_N register tile of f32 accumulators. Per TILE_K step the block stages x's
// TILE_M x TILE_K tile and the weight's TILE_N x TILE_K tile (widened to f32, block scales applied)
// in shared memory, k-major, zero-filled outside the matrices, then every thread does TILE_K rank-1
// updates of its register tile. x stays f32: the model's prefill runs f32 activations and must
// match transformers' f32 logits, which rounding x to bf16 for tensor cores would not.
//
// Not yet: a tensor-core path (mma.sync m16n8k16 on bf16/f16 activations with fp8/16-bit weights
// widened exactly, wgmma + TMA on sm_90a) for bf16 prefill; 16-byte global loads and double
// buffering (cp.async) of the tiles. This kernel is the executable spec those will be tested
// against.
//
// Accuracy: each term x * w (* s) meets at most k + 2 roundings, so |y - y_exact| <=
// gamma(k + 2) sum_l |x w s| before y's own rounding.
//
// Launch: runtime/src/gpu/ops/gemm.rs; grid (ceil(n / TILE_N), ceil(m / TILE_M)), block
// GEMM_THREADS, no dynamic shared memory. Tests: tests/gpu_linear.rs (m > 16 cases).
#include "linear.cuh"

namespace mw_gemm {

using namespace mw_linear;

constexpr int TILE_M = 64;
constexpr int TILE_N = 64;
constexpr int TILE_K = 16;
constexpr int GEMM_THREADS = 256;
constexpr int THREAD_M = TILE_M / 16;
constexpr int THREAD_N = TILE_N / 16;

// The output tile of rows [i0, i0 + TILE_M) and columns [j0, j0 + TILE_N).
template <typename W, typename Scale>
MW_DEV void gemm_tile(const LinearParams& p, uint64_t i0, uint64_t j0) {
    MW_SHARED(float[TILE_K][TILE_M], x_smem);
    MW_SHARED(float[TILE_K][TILE_N], w_smem);
    const int t = threadIdx.x;
    const int tm = t / 16, tn = t % 16;
    const W* weight = reinterpret_cast<const W*>(p.weight);
    float acc[THREAD_M][THREAD_N];
#pragma unroll
    for (int a = 0; a < THREAD_M; ++a)
#pragma unroll
        for (int b = 0; b < THREAD_N; ++b) acc[a][b] = 0.0f;

    for (uint64_t l0 = 0; l0 < p.k; l0 += TILE_K) {
        // Stage the tiles: element e of TILE_M x TILE_K (resp. TILE_N x TILE_K), k fastest so
        // consecutive threads read consecutive columns of a row.
        for (int e = t; e < TILE_M * TILE_K; e += GEMM_THREADS) {
            const int row = e / TILE_K, col = e % TILE_K;
            const uint64_t i = i0 + row, l = l0 + col;
            x_smem[col][row] = (i < p.m && l < p.k) ? p.x[i * p.k + l] : 0.0f;
        }
        for (int e = t; e < TILE_N * TILE_K; e += GEMM_THREADS) {
            const int row = e / TILE_K, col = e % TILE_K;
            const uint64_t j = j0 + row, l = l0 + col;
            float w = 0.0f;
            if (j < p.n && l < p.k) {
                w = mw::to_f32(weight[j * p.k + l]);
                if constexpr (Scale::BLOCKS) w *= Scale::at(p, j, l);
            }
            w_smem[col][row] = w;
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < TILE_K; ++c) {
            float x_reg[THREAD_M], w_reg[THREAD_N];
#pragma unroll
            for (int a = 0; a < THREAD_M; ++a) x_reg[a] = x_smem[c][tm + 16 * a];
#pragma unroll
            for (int b = 0; b < THREAD_N; ++b) w_reg[b] = w_smem[c][tn + 16 * b];
#pragma unroll
            for (int a = 0; a < THREAD_M; ++a)
#pragma unroll
                for (int b = 0; b < THREAD_N; ++b) acc[a][b] += x_reg[a] * w_reg[b];
        }
        __syncthreads();  // the tiles are rewritten by the next step
    }
#pragma unroll
    for (int a = 0; a < THREAD_M; ++a) {
        const uint64_t i = i0 + tm + 16 * a;
#pragma unroll
        for (int b = 0; b < THREAD_N; ++b) {
            const uint64_t j = j0 + tn + 16 * b;
            if (i < p.m && j < p.n) store_y(p, i, j, Scale::BLOCKS ? acc[a][b] : acc[a][b] * p.scale);
        }
    }
}

// The output tile of block (x, y): rows [y TILE_M, ...), columns [x TILE_N, ...).
template <typename W, typename Scale>
MW_DEV void gemm(const LinearParams& p) {
    gemm_tile<W, Scale>(p, uint64_t(blockIdx.y) * TILE_M, uint64_t(blockIdx.x) * TILE_N);
}

// The `experts` op's grouped GEMM: block (x, y) takes row tile y of the experts' sorted rows
// (mw_linear::expert_tile) and that expert's matrix. Its params stay in registers (64 of them, no
// spills), built after the early return (mw_linear::expert_tile_params): a shared copy, as the
// tensor-core tiles take (shared_expert_tile), put the source of the copy in scratch memory on AMD
// and sent every load through flat.
template <typename W, typename Scale>
MW_DEV void gemm_experts(const ExpertsGemvParams& q) {
    ExpertTile t;
    if (!expert_tile<TILE_M>(q, t)) return;
    gemm_tile<W, Scale>(expert_tile_params(q, t), expert_tile_row<TILE_M>(t), uint64_t(blockIdx.x) * TILE_N);
}

}  // namespace mw_gemm

#define MW_GEMM(wname, W, Scale, sname)                                                              \
    MW_KERNEL_BOUNDS(gemm_##wname##sname, LinearParams, mw_gemm::GEMM_THREADS) {                     \
        mw_gemm::gemm<W, Scale>(p);                                                                  \
    }                                                                                                \
    MW_KERNEL_BOUNDS(gemm_experts_##wname##sname, ExpertsGemvParams, mw_gemm::GEMM_THREADS) {        \
        mw_gemm::gemm_experts<W, Scale>(p);                                                          \
    }
#define MW_GEMM_PLAIN(wname, W, _) MW_GEMM(wname, W, mw_linear::NoBlocks, )
#define MW_GEMM_BLOCK_F32(wname, W, _) MW_GEMM(wname, W, mw_linear::Blocks<float>, _block_f32)
#define MW_GEMM_BLOCK_BF16(wname, W, _) MW_GEMM(wname, W, mw_linear::Blocks<bf16>, _block_bf16)
MW_LINEAR_FOR_EACH_WEIGHT(MW_GEMM_PLAIN, )
MW_LINEAR_FOR_EACH_WEIGHT(MW_GEMM_BLOCK_F32, )
MW_LINEAR_FOR_EACH_WEIGHT(MW_GEMM_BLOCK_BF16, )

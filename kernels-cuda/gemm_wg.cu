// gemm_wg.cu: the prefill / large-batch `linear` on Hopper's warpgroup tensor-core instruction
// (wgmma, sm_90a): y[m, n] = x[m, k] . W_real[n, k]^T with gemm_tc.cu's contract, kernel names,
// scale kinds, preconditions and accuracy (its header is the spec: x in three bf16 parts, weights
// exact in one or two bf16 parts, f32 sums), only on wgmma instead of mma.sync.
//
// gemm_wg_<w>            W_real = weight * p.scale, applied to each finished sum
// gemm_wg_<w>_block_<s>  W_real[j][l] = weight[j][l] * scales[j / br][l / bc]: each k-block's sums
//                        are accumulated apart (the first wgmma of a block overwrites them) and
//                        scaled into the total when the block ends
//                        <w> one of bf16, f16, e4m3fn, e4m3fnuz, e5m2, e5m2fnuz; x f32 [m, k]; y f32,
//                        bf16 or f16
//
// Algorithm: block (x, y) owns the TILE_N x TILE_M outputs j in [x TILE_N, ...), i in [y TILE_M,
// ...): two warpgroups, each 64 rows of x by all TILE_N features, one m64n128k16 accumulator set
// (64 f32 per thread). Per TILE_K step every thread loads its 16-byte words of the next x and
// weight tiles into registers (TileWords of linear.cuh), the warps load their A fragments (the x
// parts, ldmatrix_x4 from swizzled [row][TILE_K] tiles as gemm_tc.cu's: linear.cuh's swizzled32)
// and issue X_PARTS x W_PARTS wgmmas per 16 columns against the weight parts in shared memory;
// while those run, the threads
// split / widen the staged words into the other buffer, fence them for the async proxy, wait for
// the wgmmas, and meet at the barrier. Weight tiles are in wgmma's no-swizzle K-major layout
// (wgmma.cuh): 8 x 8 core matrices of 128 bytes, the TILE_K / 8 of each 8 rows side by side, so
// each thread's 8 consecutive bf16 of a row are one 16-byte store. Both buffers are dynamic
// shared memory (64 KB; 80 KB for f16 weights): the weight tiles [2][W_PARTS][TILE_N TILE_K]
// first, then the x tiles [2][X_PARTS][TILE_M TILE_K].
//
// Preconditions (checked by the launcher, runtime/src/gpu/ops/gemm.rs, which sends only
// gemm_tc.cu's shapes here and only on sm_90 with the warpgroup path on: Gpu::set_gemm_warpgroup):
// gemm_tc.cu's, with block scales' bc >= k or a multiple of TILE_K (32, as gemm_tc.cu's).
//
// Not yet: TMA copies and a producer warpgroup (the operands are converted on the way in, so a raw
// copy would need a conversion pass in shared memory), a swizzled weight layout, deeper pipelining.
// Not measured on a GPU: the emulator (wgmma.cuh) checks the arithmetic, the descriptor layout as
// the PTX ISA gives it and the shared-memory races of the asynchrony; the device test of
// tests/gpu_linear.rs and the bench line of benches/gpu/gemm.rs check it on an H100 / H200.
//
// Launch: grid (ceil(n / TILE_N), ceil(m / TILE_M)), THREADS threads, SHARED_BYTES<W> of dynamic
// shared memory (runtime/src/gpu/ops/gemm.rs mirrors the constants).
#include "linear.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace mw_gemm_wg {

using namespace mw_linear;

constexpr int WARPGROUPS = 2;
constexpr int THREADS = WARPGROUPS * 4 * MW_WARP;
constexpr int TILE_M = 64 * WARPGROUPS;
constexpr int TILE_N = mw::WGMMA_N;
constexpr int TILE_K = 32;
constexpr int CHUNK = 8;  // bf16 per core-matrix row (16 bytes)
static_assert(TILE_K == SWIZZLE_COLS, "x tiles of linear.cuh's swizzled32 layout");

template <typename W>
using Staged = TileWords<W, TILE_M, TILE_N, TILE_K, THREADS>;
template <typename W>
constexpr int SHARED_BYTES = 2 * (W_PARTS<W> * TILE_N + X_PARTS * TILE_M) * TILE_K * 2;
static_assert(SHARED_BYTES<bf16> == 64 * 1024 && SHARED_BYTES<f16> == 80 * 1024,
              "runtime/src/gpu/ops/gemm.rs's wg_shared_bytes");

// The element offset of (row, col) in a [TILE_N][TILE_K] weight tile in core-matrix order.
MW_DEV int core_at(int row, int col) {
    return (row / 8 * (TILE_K / CHUNK) + col / CHUNK) * (8 * CHUNK) + row % 8 * CHUNK + col % CHUNK;
}

// Splits / widens the staged words into the x tiles x_smem + part TILE_M TILE_K and the weight
// tiles w_smem + part TILE_N TILE_K, then fences the stores for the tensor cores' reads.
template <typename W>
MW_DEV void store_tile(const Staged<W>& s, bf16* x_smem, bf16* w_smem) {
#pragma unroll
    for (int r = 0; r < Staged<W>::X_WORDS; ++r) {
        const int at = swizzled32(Staged<W>::x_row(r), Staged<W>::x_col(r));  // 4 columns in one chunk
        Pair parts[X_PARTS];
        split_x4(s.x[r], parts);
#pragma unroll
        for (int q = 0; q < X_PARTS; ++q) *reinterpret_cast<Pair*>(x_smem + q * TILE_M * TILE_K + at) = parts[q];
    }
#pragma unroll
    for (int r = 0; r < Staged<W>::W_WORDS; ++r) {
        const int row = Staged<W>::w_row(r), col = Staged<W>::w_col(r);
#pragma unroll
        for (int half = 0; half < Staged<W>::PER_WORD / CHUNK; ++half) {
            Words hi, lo;
            widen_half<W>(s.w[r], half, hi.e, lo.e);
            const int at = core_at(row, col + CHUNK * half);
            *reinterpret_cast<Words*>(w_smem + at) = hi;
            if constexpr (W_PARTS<W> == 2) *reinterpret_cast<Words*>(w_smem + TILE_N * TILE_K + at) = lo;
        }
    }
    mw::fence_proxy_async();
}

// d (+)= the warp's rows of the x tile . the weight tile^T over one TILE_K step: the warpgroup's
// wgmmas, issued and committed (not waited for). `fresh`: the first wgmma overwrites d.
template <int WP>
MW_DEV void issue_tile(const bf16* x_smem, const bf16* w_smem, int warp_row, bool fresh, float (&d)[TILE_N / 2]) {
    // Byte strides of the weight tile's core matrices: to the next 8 columns, to the next 8 rows.
    constexpr uint32_t CORE_LBO = 8 * CHUNK * 2;
    constexpr uint32_t CORE_SBO = TILE_K / CHUNK * CORE_LBO;
    const int lane = threadIdx.x % MW_WARP;
    uint32_t a[TILE_K / 16][X_PARTS][4];
#pragma unroll
    for (int kk = 0; kk < TILE_K / 16; ++kk)
#pragma unroll
        for (int q = 0; q < X_PARTS; ++q)
            mw::ldmatrix_x4(a[kk][q], x_smem + q * TILE_M * TILE_K + swizzled32(warp_row + lane % 16, 16 * kk + 8 * (lane / 16)));
    mw::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < TILE_K / 16; ++kk)
#pragma unroll
        for (int qw = 0; qw < WP; ++qw) {
            // Columns 16 kk .. 16 kk + 15: core matrices 2 kk and 2 kk + 1 of each 8 rows.
            const uint64_t desc = mw::smem_desc(w_smem + qw * TILE_N * TILE_K + core_at(0, 16 * kk), CORE_LBO, CORE_SBO);
#pragma unroll
            for (int qx = 0; qx < X_PARTS; ++qx)
                mw::wgmma_m64n128k16_bf16(d, a[kk][qx], desc, !(fresh && kk == 0 && qw == 0 && qx == 0));
        }
    mw::wgmma_commit();
}

template <typename W, typename Scale>
MW_DEV void gemm_wg(const LinearParams& p) {
#if defined(MW_WGMMA_UNSUPPORTED)
    (void)p;
    __trap();  // sm_90a only: runtime/src/gpu/ops/gemm.rs sends gemm_wg to sm_90 devices alone
#else
    constexpr int WP = W_PARTS<W>;
    MW_DYNAMIC_SHARED(bf16, smem);
    bf16* const w_tiles = smem;                            // [2][WP][TILE_N * TILE_K]
    bf16* const x_tiles = smem + 2 * WP * TILE_N * TILE_K;  // [2][X_PARTS][TILE_M * TILE_K]
    const int lane = threadIdx.x % MW_WARP, warp = threadIdx.x / MW_WARP;
    const int warp_row = 16 * warp;  // warpgroup warp / 4 holds rows 64 (warp / 4) + 16 (warp % 4) ..
    const int g = lane >> 2, tq = lane % 4;
    const uint64_t i0 = uint64_t(blockIdx.y) * TILE_M, j0 = uint64_t(blockIdx.x) * TILE_N;
    const uint64_t tiles = (p.k + TILE_K - 1) / TILE_K;
    // Tiles per scale k-block (the launcher ensures block_cols >= k or a multiple of TILE_K).
    const uint64_t block_tiles = (Scale::BLOCKS && p.block_cols < p.k) ? p.block_cols / TILE_K : tiles;

    float acc[TILE_N / 2], part[TILE_N / 2];
#pragma unroll
    for (int e = 0; e < TILE_N / 2; ++e) acc[e] = part[e] = 0.0f;

    Staged<W> staged;
    staged.load(p, i0, j0, 0);
    store_tile<W>(staged, x_tiles, w_tiles);
    __syncthreads();
    for (uint64_t tile = 0; tile < tiles; ++tile) {
        const int buf = int(tile % 2);
        const bool more = tile + 1 < tiles;
        if (more) staged.load(p, i0, j0, (tile + 1) * TILE_K);
        const bf16* x_smem = x_tiles + buf * X_PARTS * TILE_M * TILE_K;
        const bf16* w_smem = w_tiles + buf * WP * TILE_N * TILE_K;
        const bool block_start = tile % block_tiles == 0, block_end = !more || (tile + 1) % block_tiles == 0;
        if constexpr (Scale::BLOCKS) {
            mw::wgmma_fence_operand(part);
            issue_tile<WP>(x_smem, w_smem, warp_row, block_start, part);
        } else {
            mw::wgmma_fence_operand(acc);
            issue_tile<WP>(x_smem, w_smem, warp_row, false, acc);
        }
        // The other buffer was last read by the previous step's wgmmas, waited for before its barrier.
        if (more) {
            store_tile<W>(staged, x_tiles + (buf ^ 1) * X_PARTS * TILE_M * TILE_K,
                          w_tiles + (buf ^ 1) * WP * TILE_N * TILE_K);
        }
        mw::wgmma_wait<0>();
        if constexpr (Scale::BLOCKS) {
            mw::wgmma_fence_operand(part);
            if (block_end) {
                // The k-block ends: acc += part * its scale, column by column: the lane's
                // columns j0 + 2 tq + e + 8 c.
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    for_each_column_scale<Scale, TILE_N / 8>(p, j0 + 2 * tq + e, 8, tile * TILE_K, [&](int c, float s) {
                        acc[4 * c + e] += part[4 * c + e] * s;
                        acc[4 * c + 2 + e] += part[4 * c + 2 + e] * s;
                    });
                }
            }
        } else {
            mw::wgmma_fence_operand(acc);
        }
        __syncthreads();
    }
#pragma unroll
    for (int e = 0; e < TILE_N / 2; ++e) {
        const uint64_t i = i0 + warp_row + g + 8 * ((e / 2) % 2);
        const uint64_t j = j0 + 8 * (e / 4) + 2 * tq + e % 2;
        if (i < p.m && j < p.n) store_y(p, i, j, Scale::BLOCKS ? acc[e] : acc[e] * p.scale);
    }
#endif
}

}  // namespace mw_gemm_wg

#define MW_GEMM_WG(wname, W, Scale, sname)                                                           \
    MW_KERNEL_BOUNDS(gemm_wg_##wname##sname, LinearParams, mw_gemm_wg::THREADS) {                     \
        mw_gemm_wg::gemm_wg<W, Scale>(p);                                                            \
    }
MW_LINEAR_FOR_EACH_TC_KERNEL(MW_GEMM_WG)

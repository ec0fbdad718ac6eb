// gemv.cu: the decode `linear`: y[m, n] = x[m, k] . W_real[n, k]^T for m <= GEMV_MAX_ROWS (16)
// rows (one token per sequence of a decode batch), the op that decides whether decode runs at the
// memory wall: every weight byte is read once per step, for all m rows together.
//
// gemv_<w>_r<R>            W_real = weight * p.scale (1 unscaled, else the per-tensor scale),
//                          applied to each sum
// gemv_<w>_block_<s>_r<R>  W_real[j][l] = weight[j][l] * scales[j / br][l / bc] (block scales of
//                          dtype <s>: f32 or bf16; per-channel scales are br = 1, bc = k), applied
//                          to the partial sum of each 16-byte chunk (vector path: the chunk's
//                          block column tracked by a ChunkColumns cursor, no division per chunk)
//                          or to each element (scalar path)
//                          weight [n, k] of dtype <w>: f32, f16, bf16, e4m3fn, e4m3fnuz, e5m2,
//                          e5m2fnuz; x f32 [m, k] (bf16 / f16 activations are widened first by
//                          linear_x_f32_<t>); y [m, n] f32, bf16 or f16 (p.y_dtype); R in {1, 4,
//                          16}: the kernel takes m <= R rows (the launcher picks the smallest R)
// gate_up_silu_<w>[_block_<s>]_r<R>
//                          the MLP's gate and up projections fused with their SiLU product (the
//                          `gate_up_silu` op): out[i][j] = silu(x_i . Gate_real_j) * (x_i . Up_real_j),
//                          gate and up [n, k] of the same dtype <w>, scaled alike (as above, the
//                          plain kernels with one scale each); out f32 [m, n]; m <= R rows, R in
//                          {1, 4} (the 16-row form was issue-bound and spilled in its loop)
// qkv_<w>[_block_<s>]_r1   three gemv_<w>[_block_<s>]_r1 over one x row in one launch (the `qkv`
//                          op at batch 1: attention's q, k and v projections): the grid is cut into
//                          three runs of blocks, one per product, each running the gemv algorithm
//                          below over its own weight, scales, n and y (QkvParams); the same results
//                          as three gemv launches with those grids. One row only: the selected
//                          part's params live in registers, and the r4 / r16 forms spilled (up to
//                          108 bytes on sm_90a), so more rows go to three gemv launches
// gemv_j4_<w>[_block_<s>]_r4
//                          gemv_<w>[_block_<s>]_r4's products, each warp on four consecutive
//                          output features at once, so each x element loaded serves four weight
//                          elements (row_dots over four rows of one matrix): the batched form
//                          that reads x through L1 a quarter as often per weight byte (below).
//                          Not at 16 rows: its 4 x 16 sums per lane spilled 48 to 132 bytes.
//                          Taken by the launcher where Gpu::set_gemv_warp_rows(4) asks for it
//                          (benches/gpu compares the two; not yet measured on a GPU)
// experts_gemv_<w>[_block_<s>]_r<R>, experts_gate_up_<w>[_block_<s>]_r<R>
//                          the `experts` op routed on the device (Mixtral's sparse MLP at decode,
//                          runtime/src/gpu/ops/experts.rs): gemv_..._r<R> (R in {1, 4, 16}) and
//                          gate_up_silu_..._r<R> (R in {1, 4}) of each expert on the rows routed
//                          to it. experts_route (rows.cu) sorted the picked rows by expert; a block
//                          reads which expert it serves (active[1 + blockIdx.x / blocks_per_expert])
//                          and that expert's row range from device memory, takes its matrices from
//                          the params (selected field by field, as qkv's parts), and runs the gemv
//                          (gate_up_silu) algorithm over the expert's share of the grid; blocks
//                          past the active experts return at once. An expert's rows are at most R
//                          (a row picks an expert once), so each weight byte of a picked expert is
//                          read once for all its rows and the others are not read at all, with
//                          nothing read back to the host: the decode step stays one graph.
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
// gate_up_silu is the same warp-per-j algorithm (row_dots below) over two matrices at once: the
// warp loads GEMV_UNROLL 16-byte words of gate row j and of up row j per lane (both in flight
// together), widens each x element once for both products, reduces both sums, and lane 0 applies
// the scales and silu(g) * u (mw::silu_times, as silu_mul) and stores. Each weight byte and x is
// read once; gate and up never exist in memory. The launcher takes it for m <= 4 and
// composes linear + linear + silu_mul above.
//
// fp8 weights: e4m3fn and e5m2 are widened by the hardware's cvt.rn.f16x2.{e4m3x2,e5m2x2} on
// sm_89 and later (common.cuh, MW_OCP_FP8_HW; tests/cuda_build.rs checks the SASS), the fnuz
// formats on CDNA3 by kernels-hip/hip.h, everything else in software. Per 16-byte word of e4m3fn
// weights the r1 chunk loop issues about 59 instructions on sm_90a with the hardware decode and
// 86 with per-channel or block scales (159 and 270 with the software decode and a 64-bit
// division per chunk; counted in the nvcc 13.0 SASS), bf16 about 29. The budget: at its copy
// peak an H200 reads about one 16-byte word per SM cycle, and an SM issues 4 warp instructions
// per cycle, each for 32 lanes' words, so a loop above about 128 instructions per word cannot keep
// up. The 16-row tile issues about 500 per e4m3fn word (16 x 16 multiply-adds and 16 rows of x):
// above 4 rows the GEMV is bound by issue, not memory, and belongs on tensor cores.
//
// x through L1: a lane reads, per row of x, sizeof(f32) / sizeof(w) bytes of x for each weight byte
// (x is f32, hot in L1: every warp reads the same x). At R rows that is 4 R bytes per fp8 weight
// byte and 2 R per bf16 one. An SM's L1 delivers about 128 bytes per cycle, and at the H200's copy
// peak an SM takes about 18 weight bytes per cycle, so the L1 caps the weight stream at 128 / (4 R)
// bytes per cycle for fp8: about 32 at R = 1 (above the 18 needed), 8 at R = 4 (44% of it), 2 at R
// = 16; bf16 64, 16 (89%) and 4. So the batched tiles are bound by L1 as much as by issue: gemv_j4
// cuts the x bytes per weight byte by four at R = 4 (fp8 then as R = 1 is now); the 16-row tile's
// cure is the tensor cores (x staged once in shared memory for many output features: gemv_tc.cu,
// opt-in by Gpu::set_gemv_tensor_core_rows). These are estimates from the instruction stream, not
// measurements: benches/gpu's batch lines measure them. The 4-row chunk loops on sm_90a (nvcc
// 13.0), in instructions per 16-byte weight word and x's 16-byte loads per weight word: e4m3fn
// gemv_r4 153 and 16, gemv_j4 124 and 4; with f32 block scales 165 and 16, 143 and 4; bf16 110 and
// 8, 92 and 2. gemv_j4 holds 64 to 128 registers against 56 to 88 (widening its weights four at a
// time, chunk_dots at NW >= 4, took it from up to 168, for about 4% more instructions), so fewer of
// its warps fit on an SM, each with the same bytes in flight: which form wins is the measurement's.
//
// Accuracy: f32 products and sums; fp8 / 16-bit / bf16 scales widen exactly. Each term
// x * w (* s) meets at most k + 8 roundings (two products, the chunk sum, the lane's running sum,
// the warp tree), so |y - y_exact| <= gamma(k + 8) sum_l |x w s| before y's own rounding.
// gate_up_silu: g and u each within that bound, then silu(g) * u in f32 (expf within 2 ulps, a
// division, an addition, a multiply).
//
// Tests: tests/gpu_linear.rs against cpu::Reference (emulated in CI), gate_up_silu included.
// Bench: benches/gemv.rs on the CPU; benches/gpu.rs on a GPU (gemv and gate_up_silu).
#include "linear.cuh"

namespace mw_gemv {

using namespace mw_linear;

constexpr int GEMV_WARPS = 4;
constexpr int GEMV_THREADS = GEMV_WARPS * MW_WARP;
constexpr int GEMV_UNROLL = 4;

// One chunk of VEC weights (row j, columns l0 .. l0 + VEC - 1) of each of the NW matrices against
// the R rows of x: each x element is loaded once for all NW products. The chunk's sums are added
// to `dot` (ADD) or replace it. SCALED: each matrix's widened weights are first multiplied by its
// w_scale[a] (the chunk's block scale; see SCALE_WEIGHTS). At NW >= 4 (gemv_j4) the weights are
// widened four elements at a time (NW x 4 live registers, not NW x VEC); each sum takes the same
// terms in the same order either way.
template <typename W, int R, int NW, bool ADD = false, bool SCALED = false>
MW_DEV void chunk_dots(const Words (&w)[NW], const LinearParams& p, uint64_t l0, float (&dot)[NW][R],
                       const float* w_scale = nullptr) {
    constexpr int VEC = 16 / sizeof(W);
    if constexpr (NW >= 4) {
        if constexpr (!ADD) {
#pragma unroll
            for (int a = 0; a < NW; ++a) {
#pragma unroll
                for (int r = 0; r < R; ++r) dot[a][r] = 0.0f;
            }
        }
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q) {
            float wq[NW][4];
#pragma unroll
            for (int a = 0; a < NW; ++a) {
                widen_quad<W>(w[a], q, wq[a]);
                if constexpr (SCALED) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) wq[a][e] *= w_scale[a];
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (uint64_t(r) < p.m) {
                    const float4 xv = reinterpret_cast<const float4*>(p.x + r * p.k + l0)[q];
#pragma unroll
                    for (int a = 0; a < NW; ++a) {
                        dot[a][r] += xv.x * wq[a][0] + xv.y * wq[a][1] + xv.z * wq[a][2] + xv.w * wq[a][3];
                    }
                }
            }
        }
    } else {
        float wf[NW][VEC];
#pragma unroll
        for (int a = 0; a < NW; ++a) {
            widen_words<W>(w[a], wf[a]);
            if constexpr (SCALED) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) wf[a][e] *= w_scale[a];
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if constexpr (!ADD) {
#pragma unroll
                for (int a = 0; a < NW; ++a) dot[a][r] = 0.0f;
            }
            if (uint64_t(r) < p.m) {
                const float4* x4 = reinterpret_cast<const float4*>(p.x + r * p.k + l0);
#pragma unroll
                for (int q = 0; q < VEC / 4; ++q) {
                    const float4 xv = x4[q];
#pragma unroll
                    for (int a = 0; a < NW; ++a) {
                        dot[a][r] += xv.x * wf[a][4 * q] + xv.y * wf[a][4 * q + 1] + xv.z * wf[a][4 * q + 2] +
                                     xv.w * wf[a][4 * q + 3];
                    }
                }
            }
        }
    }
}

// How a chunk's block scale is applied: to the VEC widened weights (true) or to the R sums of the
// chunk (false), whichever multiplies less. Scaling the weights also needs no second set of NW x R
// sums beside the accumulators, which at 16 rows pushed ptxas to spill inside the chunk loop.
template <typename W, int R>
constexpr bool SCALE_WEIGHTS = 16 / int(sizeof(W)) <= R;

// One chunk of block-scaled weights (16 bytes of each of the NW matrices, columns l0 ..) into
// acc: each matrix's scale of the chunk's block column (`cols`, then moved on to the lane's next
// chunk) from its row of scales `s_rows[a]`, applied as SCALE_WEIGHTS says.
template <typename W, typename Scale, int R, int NW>
MW_DEV void scaled_chunk(const Words (&w)[NW], const LinearParams& p, uint64_t l0, const void* const (&s_rows)[NW],
                         ChunkColumns& cols, float (&acc)[NW][R]) {
    float s[NW];
#pragma unroll
    for (int a = 0; a < NW; ++a) s[a] = Scale::in_row(s_rows[a], cols.col);
    cols.advance();
    if constexpr (SCALE_WEIGHTS<W, R>) {
        chunk_dots<W, R, NW, true, true>(w, p, l0, acc, s);
    } else {
        float dot[NW][R];
        chunk_dots<W, R, NW>(w, p, l0, dot);
#pragma unroll
        for (int a = 0; a < NW; ++a) {
#pragma unroll
            for (int r = 0; r < R; ++r) acc[a][r] += dot[a][r] * s[a];
        }
    }
}

// Whether the rows of p's shape in every one of `weights` (and x) can stream in 16-byte words.
template <typename W, typename Scale, int NW>
MW_DEV bool vector_path(const LinearParams& p, const void* const (&weights)[NW]) {
    constexpr int VEC = 16 / sizeof(W);
    bool vec = (p.k * sizeof(W)) % 16 == 0 && aligned16(p.x) && (!Scale::BLOCKS || p.block_cols % VEC == 0);
#pragma unroll
    for (int a = 0; a < NW; ++a) vec = vec && aligned16(weights[a]);
    return vec;
}

// This lane's share of sum_l x[r][l] * W_real[j_a][l] for the R rows of x and row j_a = rows[a] of
// each of the NW matrices `weights` of p's shape (x, m, k, block shape), with block scales
// `scales` applied (per-tensor scales not): acc[a][r], to be reduced over the warp. `vec` from
// vector_path. The whole GEMV algorithm of the header comment; gate_up_silu (gate and up at one j)
// and gemv_j4 (four rows of one matrix) run it.
template <typename W, typename Scale, int R, int NW>
MW_DEV void row_dots(const LinearParams& p, const void* const (&weights)[NW], const void* const (&scales)[NW],
                     bool vec, ChunkColumns cols, const uint64_t (&rows)[NW], int lane, float (&acc)[NW][R]) {
    constexpr int VEC = 16 / sizeof(W);
    // GEMV_UNROLL words in flight per lane, whatever NW: as many bytes as gemv's one row.
    constexpr int UNROLL = GEMV_UNROLL / NW;
    static_assert(UNROLL >= 1 && GEMV_UNROLL % NW == 0, "GEMV_UNROLL loads shared by the matrices");
    const uint64_t chunks = vec ? p.k / VEC : 0;
    const W* w_rows[NW];
    [[maybe_unused]] const void* s_rows[NW];
#pragma unroll
    for (int a = 0; a < NW; ++a) {
        w_rows[a] = reinterpret_cast<const W*>(weights[a]) + rows[a] * p.k;
        if constexpr (Scale::BLOCKS) s_rows[a] = Scale::row(p, scales[a], rows[a]);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[a][r] = 0.0f;
    }
    for (uint64_t c0 = lane; c0 < chunks; c0 += uint64_t(MW_WARP) * UNROLL) {
        Words w_reg[UNROLL][NW];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint64_t c = c0 + uint64_t(u) * MW_WARP;
            if (c < chunks) {
#pragma unroll
                for (int a = 0; a < NW; ++a) w_reg[u][a] = reinterpret_cast<const Words*>(w_rows[a])[c];
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint64_t c = c0 + uint64_t(u) * MW_WARP;
            if (c >= chunks) break;
            if constexpr (Scale::BLOCKS) {
                scaled_chunk<W, Scale, R>(w_reg[u], p, c * VEC, s_rows, cols, acc);
            } else {
                // Unscaled chunks go straight into the sums (no second set of NW x R registers).
                chunk_dots<W, R, NW, true>(w_reg[u], p, c * VEC, acc);
            }
        }
    }
    // Scalar elements: all of them off the vector path, else the tail past the last chunk.
    for (uint64_t l = chunks * VEC + lane; l < p.k; l += MW_WARP) {
#pragma unroll
        for (int a = 0; a < NW; ++a) {
            float wl = mw::to_f32(w_rows[a][l]);
            if constexpr (Scale::BLOCKS) wl *= Scale::at(p, scales[a], rows[a], l);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (uint64_t(r) < p.m) acc[a][r] += p.x[r * p.k + l] * wl;
            }
        }
    }
}

// The GEMV over `blocks` blocks of which this is block `block` (the whole grid for gemv; a share
// of it for qkv): row_dots' algorithm for one matrix, kept in this form (one word per load, its
// own loop) because it is the form ptxas allocates without spills for every instantiation
// (routing it through row_dots<..., 1> spilled 8 to 32 bytes in the plain fp8 kernels on sm_80).
template <typename W, typename Scale, int R>
MW_DEV void gemv_blocks(const LinearParams& p, uint32_t block, uint32_t blocks) {
    constexpr int VEC = 16 / sizeof(W);
    const int lane = threadIdx.x % MW_WARP;
    const uint64_t warps = uint64_t(blocks) * GEMV_WARPS;
    const bool vec = (p.k * sizeof(W)) % 16 == 0 && aligned16(p.weight) && aligned16(p.x) &&
                     (!Scale::BLOCKS || p.block_cols % VEC == 0);
    const uint64_t chunks = vec ? p.k / VEC : 0;
    // Block scales: the block column of this lane's first chunk (the same in every row).
    [[maybe_unused]] ChunkColumns first_cols;
    if constexpr (Scale::BLOCKS) {
        if (vec) first_cols = ChunkColumns(lane, p.block_cols / VEC, MW_WARP);
    }
    for (uint64_t j = uint64_t(block) * GEMV_WARPS + threadIdx.x / MW_WARP; j < p.n; j += warps) {
        const W* w_row = reinterpret_cast<const W*>(p.weight) + j * p.k;
        const Words* w_words = reinterpret_cast<const Words*>(w_row);
        [[maybe_unused]] const void* s_row[1] = {nullptr};
        [[maybe_unused]] ChunkColumns cols = first_cols;
        if constexpr (Scale::BLOCKS) s_row[0] = Scale::row(p, p.scales, j);
        float acc[1][R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[0][r] = 0.0f;
        for (uint64_t c0 = lane; c0 < chunks; c0 += uint64_t(MW_WARP) * GEMV_UNROLL) {
            Words w_reg[GEMV_UNROLL][1];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const uint64_t c = c0 + uint64_t(u) * MW_WARP;
                if (c < chunks) w_reg[u][0] = w_words[c];
            }
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const uint64_t c = c0 + uint64_t(u) * MW_WARP;
                if (c >= chunks) break;
                if constexpr (Scale::BLOCKS) {
                    scaled_chunk<W, Scale, R>(w_reg[u], p, c * VEC, s_row, cols, acc);
                } else {
                    float dot[1][R];
                    chunk_dots<W, R, 1>(w_reg[u], p, c * VEC, dot);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[0][r] += dot[0][r];
                }
            }
        }
        // Scalar elements: all of them off the vector path, else the tail past the last chunk.
        for (uint64_t l = chunks * VEC + lane; l < p.k; l += MW_WARP) {
            float wl = mw::to_f32(w_row[l]);
            if constexpr (Scale::BLOCKS) wl *= Scale::at(p, j, l);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (uint64_t(r) < p.m) acc[0][r] += p.x[r * p.k + l] * wl;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float total = mw::warp_sum(acc[0][r]);
            if (lane == 0 && uint64_t(r) < p.m) store_y(p, r, j, Scale::BLOCKS ? total : total * p.scale);
        }
    }
}

template <typename W, typename Scale, int R>
MW_DEV void gemv(const LinearParams& p) {
    gemv_blocks<W, Scale, R>(p, blockIdx.x, gridDim.x);
}

// gemv_j4: the same products, each warp on J4 consecutive rows of W at once (rows j .. j + 3 of
// group j / 4; past the last row the warp recomputes row n - 1 and stores nothing), so each x
// element a lane loads serves four weight elements (row_dots over four rows of one matrix): a
// quarter of the x traffic through L1 per weight byte (see the header), the same weight bytes in
// flight per lane (GEMV_UNROLL words: one of each row).
constexpr int J4 = 4;
template <typename W, typename Scale, int R>
MW_DEV void gemv_j4(const LinearParams& p) {
    static_assert(J4 == 4, "the arrays below list J4 entries");
    const void* const weights[J4] = {p.weight, p.weight, p.weight, p.weight};
    const void* const scales[J4] = {p.scales, p.scales, p.scales, p.scales};
    const int lane = threadIdx.x % MW_WARP;
    const uint64_t warps = uint64_t(gridDim.x) * GEMV_WARPS;
    const bool vec = vector_path<W, Scale>(p, weights);
    [[maybe_unused]] ChunkColumns first_cols;
    if constexpr (Scale::BLOCKS) {
        if (vec) first_cols = ChunkColumns(lane, p.block_cols / (16 / sizeof(W)), MW_WARP);
    }
    const uint64_t groups = (p.n + J4 - 1) / J4;
    for (uint64_t group = uint64_t(blockIdx.x) * GEMV_WARPS + threadIdx.x / MW_WARP; group < groups;
         group += warps) {
        uint64_t rows[J4];
#pragma unroll
        for (int a = 0; a < J4; ++a) rows[a] = group * J4 + a < p.n ? group * J4 + a : p.n - 1;
        float acc[J4][R];
        row_dots<W, Scale, R>(p, weights, scales, vec, first_cols, rows, lane, acc);
#pragma unroll
        for (int a = 0; a < J4; ++a) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float total = mw::warp_sum(acc[a][r]);
                if (lane == 0 && uint64_t(r) < p.m && group * J4 + a < p.n)
                    store_y(p, r, group * J4 + a, Scale::BLOCKS ? total : total * p.scale);
            }
        }
    }
}

// Each block runs the GEMV of its part over that part's blocks. The part's params are selected
// field by field (a copy under block-uniform conditions), never indexed by a runtime value, so
// they stay in registers.
template <typename W, typename Scale, int R>
MW_DEV void qkv(const QkvParams& p) {
    const uint32_t b = blockIdx.x;
    const uint32_t b01 = p.blocks[0] + p.blocks[1];
    LinearParams part = p.part[0];
    uint32_t first = 0, count = p.blocks[0];
    if (b >= b01) {
        part = p.part[2];
        first = b01;
        count = gridDim.x - b01;
    } else if (b >= p.blocks[0]) {
        part = p.part[1];
        first = p.blocks[0];
        count = p.blocks[1];
    }
    gemv_blocks<W, Scale, R>(part, b - first, count);
}

// p.gate carries the shape, x, the gate weight and scales, and out as its f32 y. Over `blocks`
// blocks of which this is block `block` (the whole grid for gate_up_silu, an expert's share of it
// for experts_gate_up).
template <typename W, typename Scale, int R>
MW_DEV void gate_up_silu_blocks(const GateUpParams& p, uint32_t block, uint32_t blocks) {
    const LinearParams& g = p.gate;
    const void* const weights[2] = {g.weight, p.up};
    const void* const scales[2] = {g.scales, p.up_scales};
    const int lane = threadIdx.x % MW_WARP;
    const uint64_t warps = uint64_t(blocks) * GEMV_WARPS;
    const bool vec = vector_path<W, Scale>(g, weights);
    float* out = reinterpret_cast<float*>(g.y);
    [[maybe_unused]] ChunkColumns first_cols;
    if constexpr (Scale::BLOCKS) {
        if (vec) first_cols = ChunkColumns(lane, g.block_cols / (16 / sizeof(W)), MW_WARP);
    }
    for (uint64_t j = uint64_t(block) * GEMV_WARPS + threadIdx.x / MW_WARP; j < g.n; j += warps) {
        const uint64_t rows[2] = {j, j};
        float acc[2][R];
        row_dots<W, Scale, R>(g, weights, scales, vec, first_cols, rows, lane, acc);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float gate = mw::warp_sum(acc[0][r]);
            const float up = mw::warp_sum(acc[1][r]);
            if (lane == 0 && uint64_t(r) < g.m) {
                out[r * g.n + j] = Scale::BLOCKS ? mw::silu_times(gate, up)
                                                 : mw::silu_times(gate * g.scale, up * p.up_scale);
            }
        }
    }
}

template <typename W, typename Scale, int R>
MW_DEV void gate_up_silu(const GateUpParams& p) {
    gate_up_silu_blocks<W, Scale, R>(p, blockIdx.x, gridDim.x);
}

// ---- experts: each expert's GEMV on the rows routed to it (experts_route of rows.cu) ----------

template <typename W, typename Scale, int R>
MW_DEV void experts_gemv(const ExpertsGemvParams& q) {
    ExpertBlock b;
    if (!expert_block(q, b)) return;
    gemv_blocks<W, Scale, R>(expert_params(q.base, b.first, b.count, pick_matrix(q.mat, b.expert)), b.block,
                             q.blocks_per_expert);
}

template <typename W, typename Scale, int R>
MW_DEV void experts_gate_up(const ExpertsGateUpParams& q) {
    ExpertBlock b;
    if (!expert_block(q, b)) return;
    const ExpertMatrix up = pick_matrix(q.up, b.expert);
    const GateUpParams p{expert_params(q.base, b.first, b.count, pick_matrix(q.gate, b.expert)), up.weight, up.scales,
                         up.scale, 0};
    gate_up_silu_blocks<W, Scale, R>(p, b.block, q.blocks_per_expert);
}

}  // namespace mw_gemv

// gemv at each row tile, qkv for one row, gate_up_silu for one and four, gemv_j4 for four, for one
// weight dtype and scale kind.
#define MW_GEMV_ROWS(family, Params, wname, W, Scale, sname)                                           \
    MW_KERNEL_BOUNDS(family##_##wname##sname##_r1, Params, mw_gemv::GEMV_THREADS) {                  \
        mw_gemv::family<W, Scale, 1>(p);                                                             \
    }                                                                                                \
    MW_KERNEL_BOUNDS(family##_##wname##sname##_r4, Params, mw_gemv::GEMV_THREADS) {                  \
        mw_gemv::family<W, Scale, 4>(p);                                                             \
    }                                                                                                \
    MW_KERNEL_BOUNDS(family##_##wname##sname##_r16, Params, mw_gemv::GEMV_THREADS) {                 \
        mw_gemv::family<W, Scale, 16>(p);                                                            \
    }
#define MW_GEMV_KINDS(wname, W, Scale, sname)                                                        \
    MW_GEMV_ROWS(gemv, LinearParams, wname, W, Scale, sname)                                         \
    MW_KERNEL_BOUNDS(qkv_##wname##sname##_r1, QkvParams, mw_gemv::GEMV_THREADS) {                    \
        mw_gemv::qkv<W, Scale, 1>(p);                                                                \
    }                                                                                                \
    MW_KERNEL_BOUNDS(gate_up_silu_##wname##sname##_r1, GateUpParams, mw_gemv::GEMV_THREADS) {        \
        mw_gemv::gate_up_silu<W, Scale, 1>(p);                                                       \
    }                                                                                                \
    MW_KERNEL_BOUNDS(gate_up_silu_##wname##sname##_r4, GateUpParams, mw_gemv::GEMV_THREADS) {        \
        mw_gemv::gate_up_silu<W, Scale, 4>(p);                                                       \
    }                                                                                                \
    MW_KERNEL_BOUNDS(gemv_j4_##wname##sname##_r4, LinearParams, mw_gemv::GEMV_THREADS) {             \
        mw_gemv::gemv_j4<W, Scale, 4>(p);                                                            \
    }                                                                                                \
    MW_GEMV_ROWS(experts_gemv, ExpertsGemvParams, wname, W, Scale, sname)                            \
    MW_KERNEL_BOUNDS(experts_gate_up_##wname##sname##_r1, ExpertsGateUpParams, mw_gemv::GEMV_THREADS) { \
        mw_gemv::experts_gate_up<W, Scale, 1>(p);                                                    \
    }                                                                                                \
    MW_KERNEL_BOUNDS(experts_gate_up_##wname##sname##_r4, ExpertsGateUpParams, mw_gemv::GEMV_THREADS) { \
        mw_gemv::experts_gate_up<W, Scale, 4>(p);                                                    \
    }
#define MW_GEMV_PLAIN(wname, W, _) MW_GEMV_KINDS(wname, W, mw_linear::NoBlocks, )
#define MW_GEMV_BLOCK_F32(wname, W, _) MW_GEMV_KINDS(wname, W, mw_linear::Blocks<float>, _block_f32)
#define MW_GEMV_BLOCK_BF16(wname, W, _) MW_GEMV_KINDS(wname, W, mw_linear::Blocks<bf16>, _block_bf16)
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

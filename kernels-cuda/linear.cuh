// linear.cuh: what the `linear` kernel files (gemv*.cu, gemm*.cu) share: weight elements widened
// from 16-byte words, the scale of a weight element, the store of y in its dtype, and the
// selection of an expert's rows and matrix by the `experts` kernels.
#pragma once
#include "common.cuh"
#include "params/linear.h"

namespace mw_linear {

// 16 bytes moved as one access.
struct alignas(16) Words {
    uint32_t e[4];
};

// 16 bytes of read-only global memory (weights) at `ptr` (16-byte aligned), loaded as global
// whatever the compiler can prove of the pointer: one chosen among an expert table (pick_matrix)
// reaches the load as a generic pointer, which nvcc loads with a generic LD where a kernel
// parameter's pointer gets LDG (`__ldg`: ld.global.nc, the read-only path; the weights do not
// change while a kernel runs).
MW_DEV Words load_weight_words(const void* ptr) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(ptr));
    return Words{{v.x, v.y, v.z, v.w}};
}

// A 16-byte word of weights: through load_weight_words where GLOBAL (gemv_tc_experts, whose
// pointers come out of pick_matrix), else a plain load. (gemv.cu's experts_* kernels load their
// weights with generic LD.E.128 on NVIDIA for the same reason; through this, ptxas spilled 8 to 20
// bytes at their register caps in 11 of them on sm_90a and 7 on sm_80 that had none, so they are
// left as they are until measured.)
template <bool GLOBAL>
MW_DEV Words load_words(const Words* ptr) {
    if constexpr (GLOBAL) {
        return load_weight_words(ptr);
    } else {
        return *ptr;
    }
}

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
        return block_row(scales, uint32_t(j) / p.block_rows, grid_cols(p));
    }
    // Block columns per block row, ceil(k / block_cols).
    MW_DEV static uint32_t grid_cols(const LinearParams& p) {
        const uint32_t k = uint32_t(p.k);
        return k / p.block_cols + (k % p.block_cols != 0);
    }
    // Block row r's run of scales in a grid of `grid_cols` columns over `scales`.
    MW_DEV static const void* block_row(const void* scales, uint32_t r, uint32_t grid_cols) {
        return reinterpret_cast<const S*>(scales) + uint64_t(r) * grid_cols;
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

// bf16x2 of two f32 that hold bf16 values (their low halves zero: truncation is exact); one PRMT
// on the GPU.
MW_DEV uint32_t pack_exact(float lo, float hi) {
#if defined(__CUDA_ARCH__)
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
#else
    return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
#endif
}

// bf16x2 of two f32, each rounded to nearest even (NaN stays NaN): one cvt on sm_80 and later.
MW_DEV uint32_t pack_rn(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));  // a (hi) to the upper half
    return d;
#else
    return uint32_t(mw::from_f32<bf16>(lo).bits) | uint32_t(mw::from_f32<bf16>(hi).bits) << 16;
#endif
}

// The three bf16 parts of two f32 activations, as bf16x2 (x0 in the low halves): h = bf16(x),
// m = bf16(x - h), l = bf16(x - h - m), each difference exact in f32, so |x - (h + m + l)| <=
// 2^-24 |x| (gemm_tc.cu's contract); a non-finite h keeps m = l = 0.
MW_DEV void split_x2(float x0, float x1, uint32_t (&parts)[3]) {
    const uint32_t h = pack_rn(x0, x1);
    const float h0 = __uint_as_float(h << 16), h1 = __uint_as_float(h & 0xffff0000u);
    const float r0 = finite(h0) ? x0 - h0 : 0.0f, r1 = finite(h1) ? x1 - h1 : 0.0f;
    const uint32_t m = pack_rn(r0, r1);
    parts[0] = h;
    parts[1] = m;
    parts[2] = pack_rn(r0 - __uint_as_float(m << 16), r1 - __uint_as_float(m & 0xffff0000u));
}

// Whether W is f16, whose values need two bf16 parts (every other 16-bit or fp8 value is a bf16).
template <typename W>
constexpr bool IS_F16 = false;
template <>
constexpr bool IS_F16<f16> = true;

// The tensor-core kernels' exact bf16 operands: x in X_PARTS parts (split_x2), a weight of type W
// in W_PARTS<W> (f16 = bf16 hi + bf16 lo exactly; bf16 and fp8 are bf16 values).
constexpr int X_PARTS = 3;
template <typename W>
constexpr int W_PARTS = IS_F16<W> ? 2 : 1;

// The tensor-core GEMMs' shared tiles of SWIZZLE_COLS bf16 columns (gemm_tc.cu, gemm_wg.cu): the
// element offset of (row, col) in a [rows][32] tile whose four 16-byte chunks per row are
// XOR-swizzled by (row / 2) % 4, so the eight 16-byte rows an ldmatrix phase reads lie in
// distinct banks; four columns from a multiple of 4 stay adjacent.
constexpr int SWIZZLE_COLS = 32;
MW_DEV int swizzled32(int row, int col) { return row * 32 + (((col / 8) ^ ((row / 2) % 4)) * 8) + col % 8; }

// Two bf16x2 registers, stored as one 8-byte access.
struct alignas(8) Pair {
    uint32_t e[2];
};

// split_x2 of the four f32 of a 16-byte word of x: parts[q] holds part q of the four, in order.
MW_DEV void split_x4(const Words& x, Pair (&parts)[3]) {
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
        uint32_t pair[3];
        split_x2(__uint_as_float(x.e[e]), __uint_as_float(x.e[e + 1]), pair);
#pragma unroll
        for (int q = 0; q < 3; ++q) parts[q].e[e / 2] = pair[q];
    }
}

// Elements 8 half .. 8 half + 7 of 16 bytes of W (half < 16 / sizeof(W) / 8) as four bf16x2,
// exactly: hi, and for f16 also lo = w - hi (every fp8 and bf16 value is a bf16; an f16 is the sum
// of two, gemm_tc.cu).
template <typename W>
MW_DEV void widen_half(const Words& w, int half, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
    if constexpr (sizeof(W) == 1) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            float f[4];
            mw::to_f32x4<W>(w.e[2 * half + q], f);
            hi[2 * q] = pack_exact(f[0], f[1]);
            hi[2 * q + 1] = pack_exact(f[2], f[3]);
        }
    } else if constexpr (!IS_F16<W>) {
        static_assert(sizeof(W) == 2, "bf16, f16 or fp8 weights");
#pragma unroll
        for (int q = 0; q < 4; ++q) hi[q] = w.e[q];
    } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float a = element<W>(w, 2 * q), b = element<W>(w, 2 * q + 1);
            hi[q] = pack_rn(a, b);
            const float a_hi = __uint_as_float(hi[q] << 16), b_hi = __uint_as_float(hi[q] & 0xffff0000u);
            lo[q] = pack_rn(finite(a) ? a - a_hi : 0.0f, finite(b) ? b - b_hi : 0.0f);
        }
    }
}

// One k step of the tensor-core GEMMs' tiles in registers: the 16-byte words of the f32 x tile
// [TM][TK] (rows i0.., columns l0..) and of the weight tile [TN][TK] (rows j0..) that thread
// threadIdx.x of THREADS loads. Word r is c = threadIdx.x + r THREADS, at row c / (TK / per word),
// column (c % (TK / per word)) per word; words outside x or the weight are zero (k is a multiple
// of every word's elements, so a word lies wholly inside or outside).
template <typename W, int TM, int TN, int TK, int THREADS>
struct TileWords {
    static constexpr int X_WORDS = TM * TK / 4 / THREADS;
    static constexpr int PER_WORD = 16 / int(sizeof(W));
    static constexpr int W_WORDS = TN * TK / PER_WORD / THREADS;
    static_assert(X_WORDS * 4 * THREADS == TM * TK, "x tile in whole words per thread");
    static_assert(W_WORDS * PER_WORD * THREADS == TN * TK, "weight tile in whole words per thread");
    Words x[X_WORDS];
    Words w[W_WORDS];

    MW_DEV static int x_row(int r) { return int(threadIdx.x + r * THREADS) / (TK / 4); }
    MW_DEV static int x_col(int r) { return int(threadIdx.x + r * THREADS) % (TK / 4) * 4; }
    MW_DEV static int w_row(int r) { return int(threadIdx.x + r * THREADS) / (TK / PER_WORD); }
    MW_DEV static int w_col(int r) { return int(threadIdx.x + r * THREADS) % (TK / PER_WORD) * PER_WORD; }

    MW_DEV void load(const LinearParams& p, uint64_t i0, uint64_t j0, uint64_t l0) {
#pragma unroll
        for (int r = 0; r < X_WORDS; ++r) {
            const uint64_t i = i0 + x_row(r), l = l0 + x_col(r);
            x[r] = (i < p.m && l < p.k) ? *reinterpret_cast<const Words*>(p.x + i * p.k + l) : Words{{0, 0, 0, 0}};
        }
        const W* weight = reinterpret_cast<const W*>(p.weight);
#pragma unroll
        for (int r = 0; r < W_WORDS; ++r) {
            const uint64_t j = j0 + w_row(r), l = l0 + w_col(r);
            w[r] = (j < p.n && l < p.k) ? *reinterpret_cast<const Words*>(weight + j * p.k + l) : Words{{0, 0, 0, 0}};
        }
    }
};

// Splits / widens staged words `s` (a TileWords over [rows][SWIZZLE_COLS] tiles) into shared
// tiles in the swizzled32 layout: x's X_PARTS bf16 parts into x_smem[0..X_PARTS) (split_x4) and the
// weight's W_PARTS<W> parts into w_smem[0..W_PARTS<W>) (the value as bf16, exact but for f16, whose
// remainder is the second part). gemm_tc.cu and gemm_mfma.cu.
template <typename W, typename Staged, int X_ELEMS, int W_ELEMS>
MW_DEV void store_split_tiles(const Staged& s, bf16 (*x_smem)[X_ELEMS], bf16 (*w_smem)[W_ELEMS]) {
#pragma unroll
    for (int r = 0; r < Staged::X_WORDS; ++r) {
        const int at = swizzled32(Staged::x_row(r), Staged::x_col(r));  // 4 columns in one chunk
        Pair parts[X_PARTS];
        split_x4(s.x[r], parts);
#pragma unroll
        for (int q = 0; q < X_PARTS; ++q) *reinterpret_cast<Pair*>(x_smem[q] + at) = parts[q];
    }
#pragma unroll
    for (int r = 0; r < Staged::W_WORDS; ++r) {
        const int row = Staged::w_row(r), col = Staged::w_col(r);
#pragma unroll
        for (int e = 0; e < Staged::PER_WORD; ++e) {
            const float w = element<W>(s.w[r], e);
            const bf16 hi = mw::from_f32<bf16>(w);  // exact unless W is f16
            const int at = swizzled32(row, col + e);
            w_smem[0][at] = hi;
            if constexpr (W_PARTS<W> == 2) {
                w_smem[1][at] = mw::from_f32<bf16>(finite(w) ? w - mw::to_f32(hi) : 0.0f);
            }
        }
    }
}

// The block scales of a lane's output columns first + step c (c < COLS) for the k-block holding
// column l: apply(c, s), s = 0 for a column beyond n. The block rows advance by a cursor: four
// divisions per call, not three per column. The tensor-core GEMMs' folds of a k-block's sums
// (gemm_tc.cu, gemm_wg.cu, gemm_mfma.cu) call it once per fragment column offset.
template <typename Scale, int COLS, typename Apply>
MW_DEV void for_each_column_scale(const LinearParams& p, uint64_t first, uint32_t step, uint64_t l, Apply apply) {
    const uint32_t grid_cols = Scale::grid_cols(p), block_col = uint32_t(l) / p.block_cols;
    ChunkColumns rows(uint32_t(first), p.block_rows, step);
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        const void* row = Scale::block_row(p.scales, rows.col, grid_cols);
        apply(c, first + uint64_t(c) * step < p.n ? Scale::in_row(row, block_col) : 0.0f);
        rows.advance();
    }
}

// The k loop of the split-operand GEMMs (gemm_tc.cu, gemm_mfma.cu) over tiles of TK columns:
// each thread loads its 16-byte words of the next x and weight tiles into registers (`Staged`, a
// TileWords) while `step(buf, tile, block_end)` runs the block's products over the shared buffers
// x_smem[buf], w_smem[buf], then splits / widens them into the other buffer (store_split_tiles),
// one barrier per tile. block_end: the tile ends a k-block of Scale's block scales (every tile
// ends one where bc >= k; the launchers ensure bc >= k or a multiple of TK) or is the last.
template <typename W, typename Scale, typename Staged, int TK, int X_ELEMS, int W_ELEMS, typename Step>
MW_DEV void split_tile_loop(const LinearParams& p, uint64_t i0, uint64_t j0, bf16 (*x_smem)[X_PARTS][X_ELEMS],
                            bf16 (*w_smem)[W_PARTS<W>][W_ELEMS], Step step) {
    const uint64_t tiles = (p.k + TK - 1) / TK;
    const uint64_t block_tiles = (Scale::BLOCKS && p.block_cols < p.k) ? p.block_cols / TK : tiles;
    Staged staged;
    staged.load(p, i0, j0, 0);
    store_split_tiles<W>(staged, x_smem[0], w_smem[0]);
    __syncthreads();
    for (uint64_t tile = 0; tile < tiles; ++tile) {
        const int buf = int(tile % 2);
        const bool more = tile + 1 < tiles;
        if (more) staged.load(p, i0, j0, (tile + 1) * TK);
        step(buf, tile, !more || (tile + 1) % block_tiles == 0);
        // The other buffer was last read in the previous step, before the barrier that ended it.
        if (more) store_split_tiles<W>(staged, x_smem[buf ^ 1], w_smem[buf ^ 1]);
        __syncthreads();
    }
}

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

// The batched tensor-core GEMVs' x tile (gemv_tc.cu, gemv_mfma.cu): rows [0, R) and columns
// [l0, l0 + TK) of the f32 x, loaded into registers by THREADS threads, whole 16-byte words each
// (word r of a thread is c = threadIdx.x + r THREADS: row c / (TK / 4), column 4 (c % (TK / 4))),
// while the block works on the other shared buffer; then split into the three bf16 parts of a
// shared buffer [part][R][ROW].
template <int R, int TK, int THREADS>
struct StagedX {
    static constexpr int WORDS = R * TK / 4 / THREADS;
    static_assert(WORDS * 4 * THREADS == R * TK, "x tile in whole words per thread");
    Words x[WORDS];

    MW_DEV static int row(int r) { return int(threadIdx.x + r * THREADS) / (TK / 4); }
    MW_DEV static int col(int r) { return int(threadIdx.x + r * THREADS) % (TK / 4) * 4; }

    // x[0 .. R)[l0 .. l0 + TK), zero beyond m and k (k is a multiple of 4 here).
    MW_DEV void load(const LinearParams& p, uint64_t l0) {
#pragma unroll
        for (int r = 0; r < WORDS; ++r) {
            const uint64_t i = uint64_t(row(r)), l = l0 + col(r);
            x[r] = (i < p.m && l < p.k) ? *reinterpret_cast<const Words*>(p.x + i * p.k + l) : Words{{0, 0, 0, 0}};
        }
    }

    // h = bf16(x), m = bf16(x - h), l = bf16(x - h - m) (split_x4) into xs [X_PARTS][R][ROW].
    template <int ROW>
    MW_DEV void store(bf16* xs) const {
#pragma unroll
        for (int r = 0; r < WORDS; ++r) {
            Pair parts[X_PARTS];
            split_x4(x[r], parts);
#pragma unroll
            for (int q = 0; q < X_PARTS; ++q)
                *reinterpret_cast<Pair*>(xs + (q * R + row(r)) * ROW + col(r)) = parts[q];
        }
    }
};

// The end of the split-K batched GEMVs (gemv_tc.cu, gemv_mfma.cu): `sums(f)` calls f(i, j, v)
// for each of the thread's sums inside y (token i, feature j; a functor of the kernel's fragment
// layout). With one run of k (q.splits <= 1) y[i][j] = v scale. Otherwise each block writes its
// sums to q.partials[blockIdx.y][i][j], and the last block of its features to arrive
// (q.arrivals[blockIdx.x], returned to zero for the next launch) adds the runs' sums in run order
// and stores y: the same y whichever block is last.
template <typename Sums>
MW_DEV void finish_split_gemv(const GemvTcParams& q, float scale, const Sums& sums) {
    const LinearParams& p = q.lin;
    __shared__ bool last_smem;
    if (q.splits <= 1) {
        sums([&](uint64_t i, uint64_t j, float v) { store_y(p, i, j, v * scale); });
        return;
    }
    sums([&](uint64_t i, uint64_t j, float v) { q.partials[(uint64_t(blockIdx.y) * p.m + i) * p.n + j] = v; });
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_smem = atomicAdd(q.arrivals + blockIdx.x, 1u) + 1u == q.splits;
    __syncthreads();
    if (!last_smem) return;
    __threadfence();
    sums([&](uint64_t i, uint64_t j, float) {
        float v = 0.0f;
        for (uint32_t s = 0; s < q.splits; ++s) v += __ldcg(q.partials + (uint64_t(s) * p.m + i) * p.n + j);
        store_y(p, i, j, v * scale);
    });
    if (threadIdx.x == 0) atomicExch(q.arrivals + blockIdx.x, 0u);
}

// ---- experts: one kernel over the rows experts_route (rows.cu) sorted by expert -------------

// mat[e], read under block-uniform compares rather than indexed by the runtime e (which would copy
// the params array to local memory).
MW_DEV ExpertMatrix pick_matrix(const ExpertMatrix (&mat)[MW_MAX_EXPERTS], uint32_t e) {
    ExpertMatrix m = mat[0];
#pragma unroll
    for (uint32_t i = 1; i < MW_MAX_EXPERTS; ++i) {
        if (e == i) m = mat[i];
    }
    return m;
}

// `base` moved to an expert's `count` rows from sorted row `first` and given its matrix.
MW_DEV LinearParams expert_params(const LinearParams& base, uint32_t first, uint32_t count, const ExpertMatrix& mat) {
    LinearParams p = base;
    p.weight = mat.weight;
    p.scales = mat.scales;
    p.scale = mat.scale;
    p.m = count;
    p.x = base.x + uint64_t(first) * base.k;
    p.y = reinterpret_cast<float*>(base.y) + uint64_t(first) * base.n;
    return p;
}

// The block of a grouped GEMV (gemv.cu's experts_*, gemv_tc.cu's gemv_tc_experts, gemv_mfma.cu's
// gemv_mfma_experts): blockIdx.x / blocks_per_expert is its slot in the route's active list, and
// blockIdx.x % blocks_per_expert its place among that expert's blocks. False for a block past the
// active experts or an expert without rows.
struct ExpertBlock {
    uint32_t expert, first, count, block;
};
template <typename Q>
MW_DEV bool expert_block(const Q& q, ExpertBlock& out) {
    const uint32_t slot = blockIdx.x / q.blocks_per_expert;
    if (slot >= q.active[0]) return false;
    const uint32_t e = q.active[1 + slot];
    if (e >= q.experts || e >= MW_MAX_EXPERTS) return false;
    const uint32_t first = q.offsets[e], last = q.offsets[e + 1];
    out = ExpertBlock{e, first, last - first, blockIdx.x % q.blocks_per_expert};
    return last > first;
}

// The matrix-unit GEMV of a grouped GEMV's block `b` (gemv_tc_experts, gemv_mfma_experts; from
// expert_block): its expert's GEMV on its rows (at most the kernel's R: an expert has at most one
// pick per row) in one run of k, the block's tile of output features b.block. One run: the
// experts' blocks fill the device, so no split-K and no partials.
MW_DEV GemvTcParams expert_gemv(const ExpertsGemvParams& q, const ExpertBlock& b) {
    GemvTcParams out;
    out.lin = expert_params(q.base, b.first, b.count, pick_matrix(q.mat, b.expert));
    out.partials = nullptr;
    out.arrivals = nullptr;
    out.split_cols = uint32_t(q.base.k);
    out.splits = 1;
    return out;
}

// expert_gemv written to `q_smem`, the block's shared copy, for gemv_tc_experts on sm_80 (false as
// expert_block; a barrier inside, reached by the whole block or by none of it): held in registers
// beside the 16-row tile's accumulators and the software fp8 decode, the params made ptxas spill
// there. On sm_90a and the emulator, and in gemv_mfma_experts, they stay in registers, computed
// after the early return: read back from shared memory at each use they cost an LDS per use
// (nvcc) and lose the pointers' global address space (generic LD/ST on NVIDIA, flat on AMD).
MW_DEV bool shared_expert_gemv(const ExpertsGemvParams& q, GemvTcParams& q_smem, uint32_t& bx) {
    ExpertBlock b;
    if (!expert_block(q, b)) return false;
    if (threadIdx.x == 0) q_smem = expert_gemv(q, b);
    bx = b.block;
    __syncthreads();
    return true;
}

// The grouped GEMM's row tile (gemm.cu, gemm_tc.cu, gemm_mfma.cu: *_experts): blockIdx.y counts
// the TILE_M-row tiles of every expert's rows in order of expert (ceil(rows_e / TILE_M) each, none
// for an expert without rows); false for a block past the last tile. Else `out` names the tile's
// expert, that expert's rows (`first`, `count` among the sorted rows) and the tile's place among
// them. Sum over e of ceil(rows_e / TILE_M) <= ceil(pairs / TILE_M) + active - 1, the grid's rows
// of tiles.
struct ExpertTile {
    uint32_t expert, first, count, tile;
};
template <int TILE_M>
MW_DEV bool expert_tile(const ExpertsGemvParams& q, ExpertTile& out) {
    uint32_t tile = blockIdx.y, e = 0, first = 0, count = 0;
    for (; e < q.experts && e < MW_MAX_EXPERTS; ++e) {
        first = q.offsets[e];
        count = q.offsets[e + 1] - first;
        const uint32_t tiles = (count + TILE_M - 1) / TILE_M;
        if (tile < tiles) break;
        tile -= tiles;
    }
    out = ExpertTile{e, first, count, tile};
    return e < q.experts && e < MW_MAX_EXPERTS;
}

// The GEMM of tile `t` (from expert_tile): its expert's matrix on its rows. gemm_experts and
// gemm_mfma_experts build it in registers after their early return: on AMD, params read back from
// LDS, or computed before the return and merged with its path, lose the pointers' global address
// space, and every load and store of the tile goes through flat.
MW_DEV LinearParams expert_tile_params(const ExpertsGemvParams& q, const ExpertTile& t) {
    return expert_params(q.base, t.first, t.count, pick_matrix(q.mat, t.expert));
}

// The first row of tile `t` among its expert's rows.
template <int TILE_M>
MW_DEV uint64_t expert_tile_row(const ExpertTile& t) {
    return uint64_t(t.tile) * TILE_M;
}

// expert_tile_params written to `p_smem`, the block's shared copy, for gemm_tc_experts (false as
// expert_tile; a barrier inside, reached by the whole block or by none of it): the tensor-core
// tiles read them where they use them rather than hold them in registers beside their accumulators
// (the plain GEMMs read theirs from the constant bank).
template <int TILE_M>
MW_DEV bool shared_expert_tile(const ExpertsGemvParams& q, LinearParams& p_smem, uint64_t& i0) {
    ExpertTile t;
    if (!expert_tile<TILE_M>(q, t)) return false;
    if (threadIdx.x == 0) p_smem = expert_tile_params(q, t);
    i0 = expert_tile_row<TILE_M>(t);
    __syncthreads();
    return true;
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

// The kernels of the tensor-core files (gemm_tc.cu, gemv_tc.cu, gemm_wg.cu, gemm_mfma.cu): every
// float weight type but f32 x {plain, block f32 scales, block bf16 scales}: INSTANTIATE(suffix, W,
// Scale, sname), sname the kernel name's scale suffix (empty, _block_f32, _block_bf16).
#define MW_LINEAR_TC_SCALES(wname, W, INSTANTIATE)                                                   \
    INSTANTIATE(wname, W, mw_linear::NoBlocks, )                                                     \
    INSTANTIATE(wname, W, mw_linear::Blocks<float>, _block_f32)                                      \
    INSTANTIATE(wname, W, mw_linear::Blocks<bf16>, _block_bf16)
#define MW_LINEAR_FOR_EACH_TC_KERNEL(INSTANTIATE)                                                    \
    MW_LINEAR_TC_SCALES(f16, f16, INSTANTIATE)                                                       \
    MW_LINEAR_TC_SCALES(bf16, bf16, INSTANTIATE)                                                     \
    MW_LINEAR_TC_SCALES(e4m3fn, e4m3fn, INSTANTIATE)                                                 \
    MW_LINEAR_TC_SCALES(e4m3fnuz, e4m3fnuz, INSTANTIATE)                                             \
    MW_LINEAR_TC_SCALES(e5m2, e5m2, INSTANTIATE)                                                     \
    MW_LINEAR_TC_SCALES(e5m2fnuz, e5m2fnuz, INSTANTIATE)

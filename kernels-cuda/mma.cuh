// mma.cuh: the tensor-core instructions the kernels use, as functions. Include after common.cuh.
//
// mw::mma_m16n8k16_bf16(d, a, b, c)   mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
// mw::mma_m16n8k16_f16(d, a, b, c)    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
//     D (16x8, f32) = A (16x16, row) * B (16x8, col) + C (16x8, f32), one warp. Fragments per
//     lane, after the PTX ISA, section 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with
//     floating point type" (g = lane >> 2, t = lane % 4; a register holds two 16-bit elements,
//     the lower-numbered one in its low half):
//       a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//       a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//       b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//       c[0], c[1] = C[g][2t, 2t+1]      c[2], c[3] = C[g+8][2t, 2t+1]      (d likewise)
// mw::ldmatrix_x4(r, row_ptr)         ldmatrix.sync.aligned.m8n8.x4.shared.b16
// mw::ldmatrix_x4_trans(r, row_ptr)   ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16
//     Four 8x8 matrices of 16-bit elements from shared memory, one warp, after the PTX ISA,
//     section "Warp-level matrix load instruction: ldmatrix" (9.7.14.5.15): lanes 8m..8m+7 give
//     the addresses of rows 0..7 of matrix m (16 bytes each, 16-byte aligned); lane l receives in
//     r[m] the elements M_m[l >> 2][2 (l % 4)] (low half) and M_m[l >> 2][2 (l % 4) + 1] (high),
//     or with .trans M_m[2 (l % 4)][l >> 2] and M_m[2 (l % 4) + 1][l >> 2]. So ldmatrix_x4 with
//     lane l pointing at row (l % 16), column 8 (l / 16) of a row-major 16x16 A tile yields its
//     A fragment, and ldmatrix_x4_trans over a row-major [k][n] 16x16 B tile (lane l at row
//     (l % 8) + 8 ((l / 8) % 2), column 8 (l / 16)) yields the B fragments of its two 8-column
//     halves in r[0..1] and r[2..3].
//
// On nvcc they are the PTX instructions (mma sm_80 and newer, ldmatrix sm_75; older targets
// trap). Under MEMWALL_SIMT
// each is a warp collective of the SIMT layer over all 32 lanes (a lane missing, a partial warp
// or a misaligned row address fails the launch) that gathers the lanes' fragments into matrices
// by the layouts above and scatters the result back the same way. The emulated mma multiplies
// exactly and sums in f64 with one rounding to f32: at least as accurate as the hardware, whose
// accumulation order and rounding PTX leaves unspecified, so a kernel's tolerance must come from
// the hardware's bound (f32 accumulation of K products), never from the emulator's results.
#pragma once

namespace mw {

#if defined(MEMWALL_SIMT)

static_assert(MW_WARP == 32, "mma.sync and ldmatrix are warp-32 (NVIDIA) instructions");

struct MmaSlot {
    uint32_t a[4];
    uint32_t b[2];
    float c[4];
    float d[4];
};

template <bool F16>
inline float mma_element(uint32_t reg, int half) {
    const uint16_t bits = uint16_t(half ? reg >> 16 : reg & 0xffffu);
    if constexpr (F16) {
        return to_f32(f16{bits});
    } else {
        return to_f32(bf16{bits});
    }
}

// Lane `lane`'s A fragment (registers a[0..3]) into the 16 x 16 matrix `m`, by the layout above
// (wgmma.cuh's warps hold theirs alike).
template <bool F16>
inline void mma_gather_a(const uint32_t (&a)[4], int lane, float (&m)[16][16]) {
    const int g = lane >> 2, t = lane % 4;
    for (int h = 0; h < 2; ++h) {
        m[g][2 * t + h] = mma_element<F16>(a[0], h);
        m[g + 8][2 * t + h] = mma_element<F16>(a[1], h);
        m[g][2 * t + 8 + h] = mma_element<F16>(a[2], h);
        m[g + 8][2 * t + 8 + h] = mma_element<F16>(a[3], h);
    }
}

template <bool F16>
inline bool mma_resolve(void* const* slots, ::mw_simt::lanemask group, char* err, size_t cap) {
    if (group != MW_FULL_MASK) {
        snprintf(err, cap, "mma.sync needs all 32 lanes of the warp; lanes 0x%08x took part", unsigned(group));
        return false;
    }
    float a[16][16], b[16][8], c[16][8];
    for (int lane = 0; lane < 32; ++lane) {
        const MmaSlot& s = *static_cast<const MmaSlot*>(slots[lane]);
        const int g = lane >> 2, t = lane % 4;
        mma_gather_a<F16>(s.a, lane, a);
        for (int h = 0; h < 2; ++h) {
            b[2 * t + h][g] = mma_element<F16>(s.b[0], h);
            b[2 * t + 8 + h][g] = mma_element<F16>(s.b[1], h);
            c[g][2 * t + h] = s.c[h];
            c[g + 8][2 * t + h] = s.c[2 + h];
        }
    }
    for (int lane = 0; lane < 32; ++lane) {
        MmaSlot& s = *static_cast<MmaSlot*>(slots[lane]);
        const int g = lane >> 2, t = lane % 4;
        for (int i = 0; i < 4; ++i) {
            const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
            double acc = c[row][col];
            for (int k = 0; k < 16; ++k) acc += double(a[row][k]) * double(b[k][col]);
            s.d[i] = float(acc);
        }
    }
    return true;
}

template <bool F16>
inline void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    MmaSlot s{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, {c[0], c[1], c[2], c[3]}, {0, 0, 0, 0}};
    ::mw_simt::warp_collective(F16 ? "mma.sync.m16n8k16.f16" : "mma.sync.m16n8k16.bf16", &mma_resolve<F16>,
                               MW_FULL_MASK, &s);
    for (int i = 0; i < 4; ++i) d[i] = s.d[i];
}

struct LdmatrixSlot {
    const void* row;
    uint32_t r[4];
};

template <bool TRANS>
inline bool ldmatrix_resolve(void* const* slots, ::mw_simt::lanemask group, char* err, size_t cap) {
    if (group != MW_FULL_MASK) {
        snprintf(err, cap, "ldmatrix needs all 32 lanes of the warp; lanes 0x%08x took part", unsigned(group));
        return false;
    }
    const uint16_t* rows[32];
    for (int lane = 0; lane < 32; ++lane) {
        rows[lane] = static_cast<const uint16_t*>(static_cast<const LdmatrixSlot*>(slots[lane])->row);
        if (reinterpret_cast<uintptr_t>(rows[lane]) % 16 != 0) {
            snprintf(err, cap, "ldmatrix: lane %d's row address %p is not 16-byte aligned", lane,
                     static_cast<const void*>(rows[lane]));
            return false;
        }
    }
    for (int lane = 0; lane < 32; ++lane) {
        LdmatrixSlot& s = *static_cast<LdmatrixSlot*>(slots[lane]);
        const int g = lane >> 2, t = lane % 4;
        for (int m = 0; m < 4; ++m) {
            const uint16_t* const* mrows = rows + 8 * m;  // row i of matrix m: lane 8m + i's address
            const uint32_t lo = TRANS ? mrows[2 * t][g] : mrows[g][2 * t];
            const uint32_t hi = TRANS ? mrows[2 * t + 1][g] : mrows[g][2 * t + 1];
            s.r[m] = lo | hi << 16;
        }
    }
    return true;
}

template <bool TRANS>
inline void ldmatrix_x4_any(uint32_t r[4], const void* row) {
    LdmatrixSlot s{row, {0, 0, 0, 0}};
    ::mw_simt::warp_collective(TRANS ? "ldmatrix.x4.trans" : "ldmatrix.x4", &ldmatrix_resolve<TRANS>, MW_FULL_MASK,
                               &s);
    for (int i = 0; i < 4; ++i) r[i] = s.r[i];
}

MW_DEV void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    mma_m16n8k16<false>(d, a, b, c);
}
MW_DEV void mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    mma_m16n8k16<true>(d, a, b, c);
}
MW_DEV void ldmatrix_x4(uint32_t r[4], const void* smem_row) { ldmatrix_x4_any<false>(r, smem_row); }
MW_DEV void ldmatrix_x4_trans(uint32_t r[4], const void* smem_row) { ldmatrix_x4_any<true>(r, smem_row); }

#else  // nvcc / NVRTC

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MW_MMA_UNSUPPORTED 1
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
#define MW_LDMATRIX_UNSUPPORTED 1
#endif

MW_DEV void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
#if defined(MW_MMA_UNSUPPORTED)
    __trap();  // bf16 mma.sync needs sm_80
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
#endif
}

MW_DEV void mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
#if defined(MW_MMA_UNSUPPORTED)
    __trap();  // m16n8k16 needs sm_80
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
#endif
}

MW_DEV void ldmatrix_x4(uint32_t r[4], const void* smem_row) {
#if defined(MW_LDMATRIX_UNSUPPORTED)
    __trap();  // ldmatrix needs sm_75
#else
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}

MW_DEV void ldmatrix_x4_trans(uint32_t r[4], const void* smem_row) {
#if defined(MW_LDMATRIX_UNSUPPORTED)
    __trap();  // ldmatrix needs sm_75
#else
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}

#endif

}  // namespace mw

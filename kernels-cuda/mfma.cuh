// mfma.cuh: AMD's matrix-core instruction the kernels use, as a function. Include after common.cuh.
//
// mw::mfma_16x16x16_bf16(d, a, b)   v_mfma_f32_16x16x16_bf16 (LLVM's mfma.f32.16x16x16bf16.1k):
//     D (16x16, f32) = A (16x16) * B (16x16) + D, one wavefront of 64 lanes (CDNA2 gfx90a, CDNA3
//     gfx940 / gfx941 / gfx942, CDNA3+ gfx950). Four bf16 per lane for A and for B (two registers,
//     the lower-numbered element in the low half of the first), four f32 of D. Lane l, with
//     r = l % 16 and q = l / 16 (0..3), holds
//       a[e] = A[r][4q + e]       b[e] = B[4q + e][r]       d[e] = D[4q + e][r]       (e = 0..3)
//     so A's rows and B's columns run along the lanes and k along each lane's four elements; a
//     lane's D elements are four consecutive rows of one column. This is the layout of AMD's
//     matrix instruction calculator for the instruction (CDNA3 ISA, "Matrix Arithmetic
//     Instructions"), and the one rocWMMA and the AMD lab notes on matrix cores describe ("each
//     thread holds data along the column of C").
//
// On clang -x hip for the targets above: `__builtin_amdgcn_mfma_f32_16x16x16bf16_1k` (cbsz, abid
// and blgp 0: no broadcast). Other AMD targets and nvcc / NVRTC (where gemm_mfma.cu is compiled
// only so every image has the same kernel names): MW_MFMA_UNSUPPORTED, a trap; the runtime sends
// gemm_mfma to the targets above alone (runtime/src/gpu/ops/gemm.rs, `has_mfma`).
//
// In the SIMT layer at warp 64 (the HIP image, and the selftest64 image with selftest_mfma.cu) it
// is a wavefront collective over all 64 lanes (a lane missing fails the launch) that gathers the
// lanes' fragments into matrices by the layout above and scatters D back the same way. It
// multiplies exactly and sums in f64 with one rounding to f32: at least as accurate as the
// hardware, whose accumulation order and rounding the ISA leaves unspecified, so a kernel's
// tolerance must come from the hardware's bound (f32 accumulation of K products), never from the
// emulator's results. In the warp-32 SIMT image it is unsupported, as on NVIDIA.
#pragma once

namespace mw {

#if defined(MEMWALL_SIMT) && MW_WARP == 64

struct MfmaSlot {
    uint32_t a[2];
    uint32_t b[2];
    float d[4];
};

// Element e (0..3) of a lane's four bf16 in two registers.
inline float mfma_element(const uint32_t (&r)[2], int e) {
    const uint32_t reg = r[e / 2];
    return to_f32(bf16{uint16_t(e % 2 ? reg >> 16 : reg & 0xffffu)});
}

inline bool mfma_resolve(void* const* slots, ::mw_simt::lanemask group, char* err, size_t cap) {
    if (group != MW_FULL_MASK) {
        snprintf(err, cap, "v_mfma_f32_16x16x16_bf16 needs all 64 lanes of the wavefront; lanes 0x%016llx took part",
                 static_cast<unsigned long long>(group));
        return false;
    }
    float a[16][16], b[16][16], c[16][16];
    for (int lane = 0; lane < 64; ++lane) {
        const MfmaSlot& s = *static_cast<const MfmaSlot*>(slots[lane]);
        const int r = lane % 16, q = lane / 16;
        for (int e = 0; e < 4; ++e) {
            a[r][4 * q + e] = mfma_element(s.a, e);
            b[4 * q + e][r] = mfma_element(s.b, e);
            c[4 * q + e][r] = s.d[e];
        }
    }
    for (int lane = 0; lane < 64; ++lane) {
        MfmaSlot& s = *static_cast<MfmaSlot*>(slots[lane]);
        const int r = lane % 16, q = lane / 16;
        for (int e = 0; e < 4; ++e) {
            const int row = 4 * q + e;
            double acc = c[row][r];
            for (int k = 0; k < 16; ++k) acc += double(a[row][k]) * double(b[k][r]);
            s.d[e] = float(acc);
        }
    }
    return true;
}

MW_DEV void mfma_16x16x16_bf16(float (&d)[4], const uint32_t (&a)[2], const uint32_t (&b)[2]) {
    MfmaSlot s{{a[0], a[1]}, {b[0], b[1]}, {d[0], d[1], d[2], d[3]}};
    ::mw_simt::warp_collective("v_mfma_f32_16x16x16_bf16", &mfma_resolve, MW_FULL_MASK, &s);
    for (int e = 0; e < 4; ++e) d[e] = s.d[e];
}

#elif defined(__HIP_DEVICE_COMPILE__) && !defined(MEMWALL_SIMT) &&                                  \
    (defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) ||      \
     defined(__gfx950__))

typedef short mfma_bf16x4 __attribute__((ext_vector_type(4)));
typedef float mfma_f32x4 __attribute__((ext_vector_type(4)));

MW_DEV void mfma_16x16x16_bf16(float (&d)[4], const uint32_t (&a)[2], const uint32_t (&b)[2]) {
    mfma_bf16x4 av, bv;
    __builtin_memcpy(&av, a, sizeof av);
    __builtin_memcpy(&bv, b, sizeof bv);
    mfma_f32x4 c = {d[0], d[1], d[2], d[3]};
    c = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(av, bv, c, 0, 0, 0);
    d[0] = c[0];
    d[1] = c[1];
    d[2] = c[2];
    d[3] = c[3];
}

#else

#define MW_MFMA_UNSUPPORTED 1

#endif

}  // namespace mw

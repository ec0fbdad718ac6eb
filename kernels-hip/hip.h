// hip.h: the HIP vendor header. kernels-cuda/common.cuh includes it first when the kernels are
// compiled as HIP (clang `-x hip`, `__HIP__` defined: build/hip.rs), so the kernel files of
// kernels-cuda/ compile unchanged for AMD CDNA2 (gfx90a) and CDNA3 (gfx942). It holds only what
// differs from CUDA:
// - MW_WARP, the wavefront width of the target (64 on CDNA; the compiler's per-target constant);
// - the CUDA warp intrinsics the kernels call, as their HIP equivalents: `__shfl_xor_sync`,
//   `__shfl_sync` and `__ballot_sync` over the whole wavefront (every call site in kernels-cuda/
//   passes MW_FULL_MASK, so the mask carries no information and is dropped); `__ballot` returns
//   the 64-bit lane mask common.cuh types as mw_lanemask at MW_WARP 64;
// - `__ldcg` (load through L2, never a stale L1 line: data another block of the launch wrote) as
//   relaxed atomic loads at agent scope, which the compiler emits as L1-bypassing (sc1 / glc)
//   global loads on CDNA; the float4 flavour is four such loads (it reads split partials once
//   per row, off the hot loop);
// - on CDNA3 (gfx940 / gfx941 / gfx942) the fp8 decoders of the two fnuz formats, over the
//   hardware conversions (MW_FNUZ_FP8_HW, below); everywhere else common.cuh decodes in software.
// Under the `emulate` feature the same definitions are compiled for the SIMT layer's HIP image
// (MEMWALL_SIMT_HIP: simt/image_hip.cpp), which runs them at warp 64 in the GPU test suites.
// Everything else (threadIdx, __syncthreads, atomics, __ldg, __threadfence, the math functions)
// is HIP's own, from the Debian HIP headers (libamdhip64-dev) and ROCm's device libraries.
//
// Not here, by design: inline PTX (`asm`) sits behind `__CUDA_ARCH__` in common.cuh, which HIP
// does not define, so the portable paths run; kernels that need mma.sync / ldmatrix are left out
// of the HIP images (build/hip.rs lists the files and why).
#pragma once

#if defined(MEMWALL_SIMT_HIP)
// The SIMT layer's HIP image (simt/image_hip.cpp): simt/simt.h supplies HIP's built-ins (__shfl,
// __shfl_xor, __ballot over 64 lanes, __hip_atomic_load) in place of the HIP headers, and the
// definitions below run on the CPU exactly as written.
#define MW_WARP 64
#include "../simt/simt.h"
#else
#include <hip/hip_runtime.h>
#endif
#include <stdint.h>

#if defined(MEMWALL_SIMT_HIP)
#elif defined(__HIP_DEVICE_COMPILE__)
#if !defined(__AMDGCN_WAVEFRONT_SIZE__)
#error "HIP device compile without __AMDGCN_WAVEFRONT_SIZE__: an unknown clang"
#endif
#define MW_WARP __AMDGCN_WAVEFRONT_SIZE__
#else
// Host pass (not built: build/hip.rs compiles device code only). CDNA is wave64.
#define MW_WARP 64
#endif

#define __shfl_xor_sync(mask, v, lane_mask) ((void)(mask), __shfl_xor((v), (lane_mask), MW_WARP))
#define __shfl_sync(mask, v, src_lane) ((void)(mask), __shfl((v), (src_lane), MW_WARP))
#define __ballot_sync(mask, pred) ((void)(mask), __ballot(pred))

__device__ __forceinline__ float __ldcg(const float* p) {
    return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ float4 __ldcg(const float4* p) {
    const float* f = reinterpret_cast<const float*>(p);
    return make_float4(__ldcg(f), __ldcg(f + 1), __ldcg(f + 2), __ldcg(f + 3));
}

// ---- fp8 (fnuz) conversions on CDNA3 ---------------------------------------------------------
//
// gfx940 / gfx941 / gfx942 convert fp8 to f32 in hardware: v_cvt_f32_fp8 / v_cvt_f32_bf8 (one
// byte of a register, picked by byte_sel) and v_cvt_pk_f32_fp8 / v_cvt_pk_f32_bf8 (two bytes: the
// low or high 16-bit half). On these targets "fp8" is e4m3fnuz (bias 8) and "bf8" is e5m2fnuz
// (bias 16): AMD's own HIP header, amd_hip_fp8.h (ROCm clr; HIP_FP8_CVT_FAST_PATH is set exactly
// for gfx940/941/942), decodes __hip_fp8_e4m3_fnuz / __hip_fp8_e5m2_fnuz with these builtins there
// and with its software cast_from_f8<float, negative_zero_nan = true> elsewhere; the HIP reference
// "Low precision floating point types" lists gfx940/gfx941/gfx942 as FNUZ-only, no OCP; and LLVM
// reuses the same opcodes for the OCP formats on gfx950 and gfx12 (llvm-project PR #106160, the
// MLIR amdgpu.ext_packed_fp8 lowering), which is why the gate below names the CDNA3 targets and is
// not "the builtin exists" (clang-19 defines no fp8 feature macro; `-dM -E` for gfx942 shows only
// __gfx942__, and clang-19's __has_builtin is true for gfx1200 as well, where the same builtin
// reads OCP e4m3fn). e4m3fn / e5m2 (OCP) stay software on every target.
//
// Why the result equals common.cuh's software decode, code by code (256 codes each; the same
// bits for the 255 that are numbers):
// - normals and subnormals: every fnuz value is sign x m x 2^e with |value| in [2^-17, 57344],
//   exactly representable as an f32 normal, and a conversion to a wider format is exact: the
//   hardware returns the same f32 the software shift-and-rebias computes. The fp8 subnormals
//   (exponent field 0: 2^-10 .. 7 x 2^-10 for e4m3fnuz, 2^-17 .. 3 x 2^-17 for e5m2fnuz) are
//   decoded, not flushed (AMD's CDNA3 instruction model, rocjitsu in ROCm/rocm-systems, executes
//   v_cvt_f32_fp8 with an fnuz decoder whose tests pin 0x01 -> 2^-10 and 0x7f -> 240), and
//   the f32 denormal mode could not flush them either way: no result is an f32 subnormal, and
//   the mode is "keep" anyway (build/hip.rs compiles with HIP's default, no
//   -fgpu-flush-denormals-to-zero, so every kernel descriptor has .amdhsa_float_denorm_mode_32 3,
//   which tests/hip_build.rs checks);
// - zero: 0x00 -> +0.0 in both; fnuz has no -0 (0x80 is not a zero);
// - 0x80, the one NaN -> a NaN in both (the software returns the quiet NaN 0x7fc00000; the bits
//   of the hardware's NaN are not documented and may differ in sign or payload, so the kernels'
//   contract is "NaN in, NaN out", which both meet); fnuz has no infinities, so there are no other
//   special codes.
// This cannot be executed here (no AMD GPU, and clang-19 does not constant-fold the intrinsics);
// tests/hip_build.rs checks that the gfx942 code objects use the instructions for the fnuz kernels
// only, both 16-bit halves in the packed path, and that gfx90a has none of them.
#if defined(__HIP_DEVICE_COMPILE__) && !defined(MEMWALL_SIMT_HIP) &&                                \
    (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
#if !__has_builtin(__builtin_amdgcn_cvt_f32_fp8) || !__has_builtin(__builtin_amdgcn_cvt_pk_f32_fp8)
#error "CDNA3 compile without the fp8 conversion builtins: an unknown clang"
#endif
#define MW_FNUZ_FP8_HW 1

namespace mw_vendor {

// The fp8 code in the low byte of `code` (the others zero) as f32.
__device__ __forceinline__ float e4m3fnuz_to_f32(uint32_t code) {
    return __builtin_amdgcn_cvt_f32_fp8(int(code), 0);
}
__device__ __forceinline__ float e5m2fnuz_to_f32(uint32_t code) {
    return __builtin_amdgcn_cvt_f32_bf8(int(code), 0);
}

// The four fp8 codes of `word` (code k in byte k, little endian) as f32: two packed conversions,
// the low half (bytes 0, 1) and the high half (bytes 2, 3), the first of each pair in element 0.
__device__ __forceinline__ void e4m3fnuz_x4_to_f32(uint32_t word, float (&out)[4]) {
    const auto lo = __builtin_amdgcn_cvt_pk_f32_fp8(int(word), false);
    const auto hi = __builtin_amdgcn_cvt_pk_f32_fp8(int(word), true);
    out[0] = lo[0];
    out[1] = lo[1];
    out[2] = hi[0];
    out[3] = hi[1];
}
__device__ __forceinline__ void e5m2fnuz_x4_to_f32(uint32_t word, float (&out)[4]) {
    const auto lo = __builtin_amdgcn_cvt_pk_f32_bf8(int(word), false);
    const auto hi = __builtin_amdgcn_cvt_pk_f32_bf8(int(word), true);
    out[0] = lo[0];
    out[1] = lo[1];
    out[2] = hi[0];
    out[3] = hi[1];
}

}  // namespace mw_vendor
#endif

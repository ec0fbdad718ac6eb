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
//   per row, off the hot loop).
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

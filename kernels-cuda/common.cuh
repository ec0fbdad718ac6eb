// common.cuh: the one header every kernel file of kernels-cuda/ includes first.
//
// It makes one source compile four ways:
// - nvcc (fatbins for every target, build.rs) and NVRTC (at first use, when no nvcc was found at
//   build time): the CUDA built-ins are native;
// - host C++ with MEMWALL_SIMT defined (the `emulate` feature): simt/simt.h supplies the built-ins
//   (threadIdx, __syncthreads, warp shuffles, atomics, ...) and runs each block's threads as
//   fibers, so CI runs these kernels without a GPU;
// - HIP (clang -x hip, __HIP__ defined: build/hip.rs): kernels-hip/hip.h, the vendor header, maps
//   the CUDA warp intrinsics onto the wavefront and sets MW_WARP to its width (64 on CDNA). The
//   SIMT layer's HIP image (MEMWALL_SIMT_HIP, simt/image_hip.cpp) goes through hip.h too, over
//   the layer's HIP built-ins at warp 64, so the HIP path's logic runs in CI.
//
// It defines:
// - MW_KERNEL(name, Params) / MW_KERNEL_BOUNDS(name, Params, max_threads): a kernel taking its
//   params struct by value as `p`; `extern "C"` so the runtime finds it by name.
//   MW_KERNEL_OCCUPANCY(name, Params, max_threads, min_blocks) also asks ptxas for min_blocks
//   resident blocks per SM (its register cap: 65536 / (max_threads min_blocks)); the SIMT layer
//   takes it as MW_KERNEL_BOUNDS.
// - MW_DYNAMIC_SHARED(T, name): a T* to the block's dynamic shared memory (16-byte aligned).
// - MW_SHARED(T, name): a block's static shared array of type T (`float[16][64]`), 16-byte
//   aligned: `__shared__` on the GPUs; under the SIMT layer a reference into the block's arrays
//   (simt.h block_shared: plain `__shared__` there is thread-local storage, which comes out of
//   every thread's stack, so arrays of more than a few bytes use MW_SHARED).
// - MW_WARP: threads per warp, a compile-time constant per target (32 on NVIDIA; 64 on CDNA for the
//   HIP build). Never write a literal 32.
// - the storage types bf16, f16, e4m3fn, e4m3fnuz, e5m2, e5m2fnuz (raw bits; the fp8 flavour is
//   part of the type because the same byte means different numbers) and exact conversions
//   mw::to_f32(x), mw::from_f32<T>(f) (round to nearest even; fp8 saturating, as the runtime);
//   mw::to_f32x4<T>(word, out) for four fp8 elements packed in a 32-bit word. On CDNA3 the fnuz
//   decoders are the hardware conversions of kernels-hip/hip.h (MW_FNUZ_FP8_HW), elsewhere the
//   software below, which is what the CPU-run tests execute.
// - mw::silu_times (the MLP's SiLU product), warp and block reductions, and mw::report for
//   data-dependent errors (the status word of runtime/src/gpu/status.rs).
#pragma once

#if defined(MEMWALL_SIMT) && !defined(MEMWALL_SIMT_HIP)
#include "../simt/simt.h"
#elif defined(__HIP__) || defined(MEMWALL_SIMT_HIP)
#include "../kernels-hip/hip.h"
#elif defined(__CUDACC_RTC__)
// NVRTC has no C library headers.
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef signed char int8_t;
typedef int int32_t;
typedef long long int64_t;
#else
#include <stdint.h>
#endif

#ifndef MW_WARP
#define MW_WARP 32
#endif

#if MW_WARP == 64
typedef unsigned long long mw_lanemask;
#define MW_FULL_MASK 0xffffffffffffffffull
#else
typedef unsigned int mw_lanemask;
#define MW_FULL_MASK 0xffffffffu
#endif

#define MW_DEV __device__ __forceinline__

// T itself: lets MW_SHARED name an array type (`float[16][64]`) before the declarator.
template <typename T>
using mw_shared_type = T;

#if defined(MEMWALL_SIMT)
#define MW_KERNEL_BOUNDS(name, Params, max_threads)                                                  \
    static void name##_mw_body(const Params p);                                                      \
    static const ::mw_simt::Registrar name##_mw_registrar(                                           \
        #name, sizeof(Params), (max_threads), [](const void* raw) {                                  \
            Params copy;                                                                             \
            memcpy(&copy, raw, sizeof(Params));                                                      \
            name##_mw_body(copy);                                                                    \
        });                                                                                          \
    static void name##_mw_body(const Params p)
#define MW_KERNEL(name, Params) MW_KERNEL_BOUNDS(name, Params, 0)
#define MW_KERNEL_OCCUPANCY(name, Params, max_threads, min_blocks) MW_KERNEL_BOUNDS(name, Params, max_threads)
#define MW_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::mw_simt::dynamic_shared())
#define MW_SHARED(T, name)                                                                           \
    static char name##_mw_site;                                                                      \
    mw_shared_type<T>& name = ::mw_simt::block_shared_ref<mw_shared_type<T>>(&name##_mw_site)
// Registers each field's offset and size so a Rust test checks its mirror of the struct.
#define MW_LAYOUT(Struct, ...) MW_SIMT_LAYOUT(Struct, __VA_ARGS__)
#else
#define MW_KERNEL_BOUNDS(name, Params, max_threads)                                                  \
    extern "C" __global__ void __launch_bounds__(max_threads) name(const Params p)
#define MW_KERNEL_OCCUPANCY(name, Params, max_threads, min_blocks)                                   \
    extern "C" __global__ void __launch_bounds__(max_threads, min_blocks) name(const Params p)
#define MW_KERNEL(name, Params) extern "C" __global__ void name(const Params p)
#define MW_DYNAMIC_SHARED(T, name)                                                                   \
    extern __shared__ __align__(16) unsigned char mw_dynamic_smem[];                                 \
    T* name = reinterpret_cast<T*>(mw_dynamic_smem)
#define MW_SHARED(T, name) __shared__ __align__(16) mw_shared_type<T> name
#define MW_LAYOUT(Struct, ...)
#endif

// Status codes: mirrored in runtime/src/gpu/status.rs.
#define MW_TOKEN_OUT_OF_RANGE 1u
#define MW_SLOT_OUT_OF_RANGE 2u
#define MW_CONTEXT_OVERFLOW 3u
#define MW_INDEX_OUT_OF_RANGE 4u
#define MW_BLOCK_OUT_OF_RANGE 5u
#define MW_DUPLICATE_INDEX 6u
#define MW_OP_EMBEDDING 1u
#define MW_OP_KV_STORE 2u
#define MW_OP_ATTENTION 3u
#define MW_OP_GATHER_ROWS 4u
#define MW_OP_SCATTER_ADD_ROWS 5u
#define MW_OP_EXPERTS 6u
// The most experts the device-routed experts kernels name (params/linear.h, params/rows.h):
// Mixtral has 8; a model with more takes the host-routed path.
#define MW_MAX_EXPERTS 16

// Element storage types: raw bits.
struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };
struct e4m3fn { uint8_t bits; };
struct e4m3fnuz { uint8_t bits; };
struct e5m2 { uint8_t bits; };
struct e5m2fnuz { uint8_t bits; };

namespace mw {

// ---- conversions -----------------------------------------------------------------------------

MW_DEV float to_f32(float x) { return x; }
MW_DEV float to_f32(bf16 x) { return __uint_as_float(uint32_t(x.bits) << 16); }

MW_DEV float to_f32(f16 x) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#else
    // Exact: the 10 mantissa and 5 exponent bits move into an f32, then one multiplication by a
    // power of two rebiases (2^(127-15)); subnormals come out right because f32 keeps them. Inf
    // and NaN (payload kept) by a select: clang for AMD masks the wavefront around a branch.
    const uint32_t h = x.bits;
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    const uint32_t special = sign | 0x7f800000u | ((em & 0x3ffu) << 13);
    const uint32_t finite = sign | __float_as_uint(__uint_as_float(em << 13) * 5.192296858534828e33f);
    return __uint_as_float(em >= 0x7c00u ? special : finite);
#endif
}

// The OCP formats (e4m3fn, e5m2) on NVIDIA sm_89 and later: `cvt.rn.f16x2.{e4m3x2,e5m2x2}` widens
// two codes to f16 in one instruction (SASS F2FP.F16.E4M3.UNPACK_B / .E5M2.), the code in the low
// byte of its 16-bit operand into the low half, and `cvt.f32.f16` (HADD2.F32) widens each f16
// exactly: 3 instructions per two codes where the software decode below takes about 16. Exact,
// and equal to that software decode for all 256 codes: every e4m3fn value (3 mantissa bits,
// 2^-9 .. 448) and every e5m2 value (an f16 with its low 8 bits cut, +-inf included) is an f16;
// -0 stays -0, and a NaN code gives a NaN (its payload may differ, which no result depends on).
// The CPU-run tests execute the software decode only: tests/cuda_build.rs checks that these
// instructions are in the sm_89+ OCP fp8 GEMV kernels (and nowhere for sm_80), and the GPU
// suites compare them with the reference.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(MEMWALL_SIMT)
#define MW_OCP_FP8_HW 1
// fmt##x2_to_f32: the codes in bytes 0 and 1 of `pair` into lo, hi. fmt##x4_to_f32: the four
// codes of `word` (byte k into out[k]); the 32-bit word is split into halves in PTX, so ptxas
// reads them in place (R, R.H1) with no shifts.
#define MW_OCP_FP8_TO_F32(fmt)                                                                      \
    MW_DEV void fmt##x2_to_f32(uint32_t pair, float& lo, float& hi) {                               \
        asm("{\n\t.reg .b16 c0, c1, h0, h1;\n\t.reg .b32 h;\n\tmov.b32 {c0, c1}, %2;\n\t"             \
            "cvt.rn.f16x2." #fmt "x2 h, c0;\n\tmov.b32 {h0, h1}, h;\n\t"                            \
            "cvt.f32.f16 %0, h0;\n\tcvt.f32.f16 %1, h1;\n\t}"                                        \
            : "=f"(lo), "=f"(hi) : "r"(pair));                                                      \
    }                                                                                               \
    MW_DEV void fmt##x4_to_f32(uint32_t word, float (&out)[4]) {                                    \
        asm("{\n\t.reg .b16 c0, c1, h0, h1, h2, h3;\n\t.reg .b32 lo, hi;\n\t"                        \
            "mov.b32 {c0, c1}, %4;\n\tcvt.rn.f16x2." #fmt "x2 lo, c0;\n\t"                            \
            "cvt.rn.f16x2." #fmt "x2 hi, c1;\n\tmov.b32 {h0, h1}, lo;\n\tmov.b32 {h2, h3}, hi;\n\t"    \
            "cvt.f32.f16 %0, h0;\n\tcvt.f32.f16 %1, h1;\n\tcvt.f32.f16 %2, h2;\n\t"                    \
            "cvt.f32.f16 %3, h3;\n\t}"                                                                \
            : "=f"(out[0]), "=f"(out[1]), "=f"(out[2]), "=f"(out[3]) : "r"(word));                  \
    }
MW_OCP_FP8_TO_F32(e4m3)
MW_OCP_FP8_TO_F32(e5m2)
#undef MW_OCP_FP8_TO_F32
#endif

// fp8: the 7 magnitude bits shifted into an f32 (exponent bits onto its low exponent bits,
// mantissa onto its top mantissa bits), times 2^(127 - bias): exact for normals and subnormals.
// The software decoders pick NaN and inf by selects off NVIDIA: clang for AMD masks the wavefront
// around each side of a branch (gfx942: gemv_e5m2_r1 1506 -> 1106 instructions, e4m3fn 1106 ->
// 977); nvcc keeps the early return, which it predicates (its code for the select alone was up to
// 17% longer on sm_80), and then folds the select away.
// 0x1p120f = 2^120 (e4m3fn, bias 7), 2^119 (e4m3fnuz, bias 8), 2^112 (e5m2), 2^111 (e5m2fnuz).
MW_DEV float fp8_magnitude(uint32_t bits7, int shift, float rebias) {
    return __uint_as_float(bits7 << shift) * rebias;
}
MW_DEV float with_sign(uint8_t b, float mag) { return __uint_as_float(__float_as_uint(mag) | (uint32_t(b & 0x80u) << 24)); }

MW_DEV float to_f32(e4m3fn x) {
#if defined(MW_OCP_FP8_HW)
    float f, unused;
    e4m3x2_to_f32(x.bits, f, unused);
    return f;
#else
    const uint32_t m = x.bits & 0x7fu;
    const float nan = __uint_as_float(0x7fc00000u);  // S.1111.111 is NaN; no infinities
#if defined(__CUDA_ARCH__)
    if (m == 0x7fu) return nan;
#endif
    const float v = with_sign(x.bits, fp8_magnitude(m, 20, 1.329227995784916e36f /* 2^120 */));
    return m == 0x7fu ? nan : v;
#endif
}

// The two fnuz formats: software everywhere but CDNA3, whose hardware conversions hip.h wraps
// (MW_FNUZ_FP8_HW; hip.h argues they give these same values for all 256 codes).
MW_DEV float to_f32(e4m3fnuz x) {
#if defined(MW_FNUZ_FP8_HW)
    return mw_vendor::e4m3fnuz_to_f32(x.bits);
#else
    const float nan = __uint_as_float(0x7fc00000u);  // 0x80, the one NaN; no -0
#if defined(__CUDA_ARCH__)
    if (x.bits == 0x80u) return nan;
#endif
    const float v = with_sign(x.bits, fp8_magnitude(x.bits & 0x7fu, 20, 6.64613997892458e35f /* 2^119 */));
    return x.bits == 0x80u ? nan : v;
#endif
}
MW_DEV float to_f32(e5m2 x) {
#if defined(MW_OCP_FP8_HW)
    float f, unused;
    e5m2x2_to_f32(x.bits, f, unused);
    return f;
#else
    const uint32_t m = x.bits & 0x7fu;
    const float magnitude = fp8_magnitude(m, 21, 5.192296858534828e33f /* 2^112 */);
#if defined(__CUDA_ARCH__)
    if (m >= 0x7cu) {  // exponent all ones: inf (mantissa 0) or NaN
        float special = m == 0x7cu ? __uint_as_float(0x7f800000u) : __uint_as_float(0x7fc00000u);
        return with_sign(x.bits, special);
    }
    return with_sign(x.bits, magnitude);
#else
    const float special = m == 0x7cu ? __uint_as_float(0x7f800000u) : __uint_as_float(0x7fc00000u);
    return with_sign(x.bits, m >= 0x7cu ? special : magnitude);
#endif
#endif
}
MW_DEV float to_f32(e5m2fnuz x) {
#if defined(MW_FNUZ_FP8_HW)
    return mw_vendor::e5m2fnuz_to_f32(x.bits);
#else
    const float nan = __uint_as_float(0x7fc00000u);
#if defined(__CUDA_ARCH__)
    if (x.bits == 0x80u) return nan;
#endif
    const float v = with_sign(x.bits, fp8_magnitude(x.bits & 0x7fu, 21, 2.596148429267414e33f /* 2^111 */));
    return x.bits == 0x80u ? nan : v;
#endif
}

// Four fp8 elements of one 32-bit word (element k in byte k: little endian), widened: to_f32 per
// byte, or the vendor's packed conversion (two bytes per instruction) where it has one.
template <typename T>
MW_DEV void to_f32x4(uint32_t word, float (&out)[4]) {
    static_assert(sizeof(T) == 1, "fp8 elements");
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = to_f32(T{uint8_t(word >> (8 * k))});
}
#if defined(MW_OCP_FP8_HW)
template <>
MW_DEV void to_f32x4<e4m3fn>(uint32_t word, float (&out)[4]) {
    e4m3x4_to_f32(word, out);
}
template <>
MW_DEV void to_f32x4<e5m2>(uint32_t word, float (&out)[4]) {
    e5m2x4_to_f32(word, out);
}
#endif
#if defined(MW_FNUZ_FP8_HW)
template <>
MW_DEV void to_f32x4<e4m3fnuz>(uint32_t word, float (&out)[4]) {
    mw_vendor::e4m3fnuz_x4_to_f32(word, out);
}
template <>
MW_DEV void to_f32x4<e5m2fnuz>(uint32_t word, float (&out)[4]) {
    mw_vendor::e5m2fnuz_x4_to_f32(word, out);
}
#endif

template <typename T> MW_DEV T from_f32(float f);
template <> MW_DEV float from_f32<float>(float f) { return f; }
template <> MW_DEV bf16 from_f32<bf16>(float f) {
    const uint32_t u = __float_as_uint(f);
    const uint32_t quiet = (u >> 16) | 0x40u;  // NaN: quiet, sign kept
#if defined(__CUDA_ARCH__)
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t(quiet)};
    return bf16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};  // round to nearest even
#else
    // A select: clang for AMD masks the wavefront around each side of the branch above (about a
    // third of gemv_mfma's tile loop was such masking); nvcc's code for the select was longer.
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return bf16{uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded)};
#endif
}
template <> MW_DEV f16 from_f32<f16>(float f) {
#if defined(__CUDA_ARCH__)
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return f16{h};
#else
    uint32_t u = __float_as_uint(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u)};
    if (a >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520: inf
    if (a < 0x38800000u) {
        // Below the smallest normal (2^-14): a multiple of 2^-24; the f32 addition of 0.5 rounds
        // the scaled value to nearest even in its low mantissa bits.
        float scaled = __uint_as_float(a) + 0.5f;
        return f16{uint16_t(sign | (__float_as_uint(scaled) - 0x3f000000u))};
    }
    uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
    return f16{uint16_t(sign | ((rounded - 0x38000000u) >> 13))};
#endif
}

// ---- activations -------------------------------------------------------------------------------

// silu(g) * u = g / (1 + exp(-g)) * u, with expf (not the fast __expf): silu_mul (elementwise.cu)
// and the fused gate_up_silu (gemv.cu) round alike.
MW_DEV float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// ---- reductions --------------------------------------------------------------------------------

MW_DEV float warp_sum(float v) {
#pragma unroll
    for (int o = MW_WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(MW_FULL_MASK, v, o);
    return v;
}
MW_DEV float warp_max(float v) {
#pragma unroll
    for (int o = MW_WARP / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(MW_FULL_MASK, v, o));
    return v;
}

// The sum over a block of THREADS threads (a multiple of MW_WARP), returned to every thread.
// Contains two barriers: every thread of the block must call it.
template <int THREADS>
MW_DEV float block_sum(float v) {
    static_assert(THREADS % MW_WARP == 0 && THREADS / MW_WARP <= MW_WARP, "block of whole warps");
    constexpr int WARPS = THREADS / MW_WARP;
    __shared__ float partial_smem[WARPS];
    const int lane = threadIdx.x % MW_WARP, warp = threadIdx.x / MW_WARP;
    v = warp_sum(v);
    if (lane == 0) partial_smem[warp] = v;
    __syncthreads();
    float total = lane < WARPS ? partial_smem[lane] : 0.0f;
    total = warp_sum(total);
    __syncthreads();  // partial_smem may be reused by the caller's next reduction
    return total;
}

// ---- status ------------------------------------------------------------------------------------

// Records a data-dependent error in the backend's status word; the first report wins.
MW_DEV void report(unsigned int* status, unsigned int op, unsigned int kind, uint64_t row, uint32_t value,
                   uint64_t limit) {
    if (atomicCAS(status, 0u, (op << 8) | kind) == 0u) {
        status[1] = (unsigned int)row;
        status[2] = value;
        status[3] = (unsigned int)limit;
    }
}

}  // namespace mw

// simt.h: the CUDA built-ins for kernel sources compiled as host C++ (MEMWALL_SIMT).
//
// kernels-cuda/common.cuh includes this header when MEMWALL_SIMT is defined; the image TU
// (simt/image_cuda.cpp) compiles every kernel file against it with g++ -std=c++20. Each built-in
// has the meaning the CUDA C++ Programming Guide gives it:
//
// - The threads of a block are fibers run one at a time on the calling OS thread (simt.cpp).
//   A fiber runs until it blocks: at __syncthreads (released when every thread of the block that
//   has not exited arrived), at a warp collective (__shfl*_sync, votes, __syncwarp, the tensor-core
//   wrappers of kernels-cuda/mma.cuh: complete when every lane of the mask arrived), at
//   __nanosleep (a yield), or by returning. Between two such points the runnable fibers run in the
//   launch's schedule: forward, reverse, or a seeded random permutation drawn afresh at every
//   point, so a missing barrier gives a wrong result under at least one schedule.
// - Faults are launch errors naming the block and threads, never a crash: a barrier or collective
//   nobody can complete (deadlock), a collective whose mask names a lane that exited, lanes of one
//   warp waiting at different collectives, __trap(), an invalid shuffle width.
// - `__shared__` is `static thread_local`: blocks run one at a time on the launching thread, so
//   one copy per OS thread is one copy per block. Kernels declare only scalars and small arrays
//   that way; arrays go through MW_SHARED (block_shared below), which keeps them off the static
//   TLS that glibc takes from every thread's stack. Dynamic shared memory (MW_DYNAMIC_SHARED) is a
//   buffer of exactly the launch's size (so AddressSanitizer sees an overflow), filled with 0xff
//   (NaN as f32) at the start of every block.
// - Atomics are plain read-modify-writes: no two fibers ever run at the same time.
// - A shuffle that reads a lane outside the collective (not in the mask, or beyond the block)
//   returns all-ones bits (NaN, -1): the value is undefined on a GPU, and a poison shows its use.
//
// Everything lives in namespace mw_simt, inside an inline namespace per image (MW_SIMT_IMAGE:
// `cuda`, later `hip` with MW_WARP 64), so two images link into one binary. The CUDA names are
// macros onto those functions (`#define __syncthreads ::mw_simt::syncthreads`) or, for the
// names without underscores (min, max, atomicAdd, float4, ...), using-declarations at global
// scope; the image TU wraps the kernel sources in an anonymous namespace, so their own names
// never meet another image's at link time.
#ifndef MEMWALL_SIMT_SIMT_H
#define MEMWALL_SIMT_SIMT_H

// Every C and C++ header a kernel may use is included here, before the CUDA macros are defined
// (glibc and libstdc++ spell attributes such as __noinline__ that the macros below redefine) and
// outside the anonymous namespace the kernel sources are compiled in.
#include <assert.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifndef MW_WARP
#define MW_WARP 32
#endif
#if MW_WARP != 32 && MW_WARP != 64
#error "MW_WARP must be 32 or 64"
#endif
#ifndef MW_SIMT_IMAGE
#define MW_SIMT_IMAGE cuda
#endif

#define MW_SIMT_CAT2(a, b) a##b
#define MW_SIMT_CAT(a, b) MW_SIMT_CAT2(a, b)
#define MW_SIMT_STR2(a) #a
#define MW_SIMT_STR(a) MW_SIMT_STR2(a)
#define MW_SIMT_NS MW_SIMT_CAT(image_, MW_SIMT_IMAGE)

namespace mw_simt {
inline namespace MW_SIMT_NS {

#if MW_WARP == 64
using lanemask = unsigned long long;
#else
using lanemask = unsigned int;
#endif
constexpr int kWarp = MW_WARP;
constexpr lanemask kFullMask = ~lanemask(0);
constexpr lanemask lane_bit(unsigned lane) { return lanemask(1) << lane; }

// ---- vector types (alignment as CUDA's vector_types.h) ------------------------------------------

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

#define MW_SIMT_VEC1(name, T, al) \
    struct alignas(al) name {     \
        T x;                      \
    };                            \
    inline constexpr name make_##name(T x) { return name{x}; }
#define MW_SIMT_VEC2(name, T, al) \
    struct alignas(al) name {     \
        T x, y;                   \
    };                            \
    inline constexpr name make_##name(T x, T y) { return name{x, y}; }
#define MW_SIMT_VEC3(name, T)                                                    \
    struct name {                                                                \
        T x, y, z;                                                               \
    };                                                                           \
    inline constexpr name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define MW_SIMT_VEC4(name, T, al)                                                        \
    struct alignas(al) name {                                                            \
        T x, y, z, w;                                                                    \
    };                                                                                   \
    inline constexpr name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

MW_SIMT_VEC1(char1, signed char, 1)
MW_SIMT_VEC2(char2, signed char, 2)
MW_SIMT_VEC4(char4, signed char, 4)
MW_SIMT_VEC1(uchar1, unsigned char, 1)
MW_SIMT_VEC2(uchar2, unsigned char, 2)
MW_SIMT_VEC4(uchar4, unsigned char, 4)
MW_SIMT_VEC2(short2, short, 4)
MW_SIMT_VEC4(short4, short, 8)
MW_SIMT_VEC2(ushort2, unsigned short, 4)
MW_SIMT_VEC4(ushort4, unsigned short, 8)
MW_SIMT_VEC1(int1, int, 4)
MW_SIMT_VEC2(int2, int, 8)
MW_SIMT_VEC3(int3, int)
MW_SIMT_VEC4(int4, int, 16)
MW_SIMT_VEC1(uint1, unsigned int, 4)
MW_SIMT_VEC2(uint2, unsigned int, 8)
MW_SIMT_VEC4(uint4, unsigned int, 16)
MW_SIMT_VEC1(float1, float, 4)
MW_SIMT_VEC2(float2, float, 8)
MW_SIMT_VEC3(float3, float)
MW_SIMT_VEC4(float4, float, 16)
MW_SIMT_VEC2(longlong2, long long, 16)
MW_SIMT_VEC2(ulonglong2, unsigned long long, 16)
MW_SIMT_VEC2(double2, double, 16)
inline constexpr uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }
#undef MW_SIMT_VEC1
#undef MW_SIMT_VEC2
#undef MW_SIMT_VEC3
#undef MW_SIMT_VEC4

// ---- the launch, as the running fiber sees it -----------------------------------------------------

// Set by the scheduler (simt.cpp) before a fiber runs. Plain data, so no TLS wrapper calls.
struct FiberView {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
    unsigned char* dynamic_shared;
    size_t dynamic_shared_bytes;
    // Counts the blocks this OS thread has started: per-block state kept outside the fibers
    // (the emulated wgmma's pending groups) starts afresh when it changes.
    unsigned long long block_serial;
};
extern thread_local FiberView tl_view;

inline uint3 thread_idx() { return tl_view.thread_idx; }
inline uint3 block_idx() { return tl_view.block_idx; }
inline dim3 block_dim() { return tl_view.block_dim; }
inline dim3 grid_dim() { return tl_view.grid_dim; }
inline unsigned char* dynamic_shared() { return tl_view.dynamic_shared; }
inline size_t dynamic_shared_bytes() { return tl_view.dynamic_shared_bytes; }
inline unsigned long long block_serial() { return tl_view.block_serial; }

// The block's static shared array declared at `site` (MW_SHARED of kernels-cuda/common.cuh), of
// `bytes` bytes: placed by the first thread of the block to reach the declaration, found by its
// site by the others, filled with 0xff (NaN as f32) when placed, freed when the next block starts.
// At most kMaxStaticShared bytes per block, as on the GPUs (48 KB of static shared memory on
// NVIDIA, 64 KB of LDS on AMD). Not thread-local storage: glibc carves a process's static TLS
// out of every thread's stack, and the kernels' arrays, one copy per kernel, would leave the
// threads of the test harness, rayon and NVRTC little of their 2 MiB.
constexpr size_t kMaxStaticShared = 64 * 1024;
void* block_shared(const void* site, size_t bytes);
template <typename T>
T& block_shared_ref(const void* site) {
    return *static_cast<T*>(block_shared(site, sizeof(T)));
}

// Ends the launch with an error naming the block and thread (printf-style message). Never returns.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void trap() { fail("__trap() called"); }

// Block-wide barrier; returns the number of threads that arrived with a nonzero predicate.
int barrier(int predicate);
inline void syncthreads() { (void)barrier(0); }
inline int syncthreads_count(int p) { return barrier(p != 0); }
// Every thread that has not exited arrived; _and is whether they all had a nonzero predicate.
int barrier_arrived();
inline int syncthreads_and(int p) {
    int count = barrier(p != 0);
    return count == barrier_arrived();
}
inline int syncthreads_or(int p) { return barrier(p != 0) != 0; }

// Lets the other fibers run; the caller stays runnable (__nanosleep: spin-wait loops progress).
void yield();
inline void nanosleep(unsigned int) { yield(); }

// The lanes of the caller's warp that exist (the block may end inside the warp) and have not
// exited. On a GPU it is the lanes converged at this point; here, the lanes still alive.
lanemask activemask();

// ---- warp collectives --------------------------------------------------------------------------

// A warp collective: every lane of `mask` (the caller added) posts `slot` (its own operands and
// result, on its stack) and blocks; when all have arrived, `resolve` runs once over the slots
// (slots[lane] is null for a lane outside the group) and the lanes continue. Lanes of one warp
// must meet at the same resolver. `resolve` returns false after writing a message to `err`.
using Resolver = bool (*)(void* const* slots, lanemask group, char* err, size_t err_cap);
void warp_collective(const char* what, Resolver resolve, lanemask mask, void* slot);

inline unsigned lane_id() {
    const dim3 bd = tl_view.block_dim;
    const uint3 t = tl_view.thread_idx;
    return (t.x + bd.x * (t.y + bd.y * t.z)) % unsigned(kWarp);
}

struct ShflSlot {
    uint64_t value;
    uint64_t result;
    long long arg;
    int width;
};
enum class ShflMode { idx, up, down, bfly };

// The source lane of `lane` after the PTX ISA's shfl.sync (section "Data Movement and Conversion
// Instructions: shfl.sync"): segments of `width` lanes; idx wraps within the segment, up stays at
// or above the segment's first lane, down and bfly at or below its last; an invalid source yields
// the lane's own value. Generalised from 32 to kWarp lanes.
template <ShflMode M>
inline unsigned shfl_source(unsigned lane, long long arg, int width) {
    const long long first = lane & ~unsigned(width - 1), last = first + width - 1;
    long long j = 0;
    switch (M) {
    case ShflMode::idx: j = first | (arg & (width - 1)); break;
    case ShflMode::up: j = (long long)lane - arg; return j >= first ? unsigned(j) : lane;
    case ShflMode::down: j = (long long)lane + arg; break;
    case ShflMode::bfly: j = (long long)lane ^ arg; break;
    }
    return j >= 0 && j <= last ? unsigned(j) : lane;
}

template <ShflMode M>
bool resolve_shfl(void* const* slots, lanemask group, char*, size_t) {
    for (unsigned lane = 0; lane < unsigned(kWarp); ++lane) {
        if (!(group & lane_bit(lane))) continue;
        auto* s = static_cast<ShflSlot*>(slots[lane]);
        const unsigned src = shfl_source<M>(lane, s->arg, s->width);
        if (src == lane) {
            s->result = s->value;
        } else if (group & lane_bit(src)) {
            s->result = static_cast<ShflSlot*>(slots[src])->value;
        } else {
            s->result = ~uint64_t(0);  // undefined on a GPU: poison
        }
    }
    return true;
}

inline const char* shfl_name(ShflMode m) {
    switch (m) {
    case ShflMode::idx: return "__shfl_sync";
    case ShflMode::up: return "__shfl_up_sync";
    case ShflMode::down: return "__shfl_down_sync";
    case ShflMode::bfly: return "__shfl_xor_sync";
    }
    return "shfl";
}

// The types CUDA's __shfl*_sync accept (the half types aside).
template <typename T>
constexpr bool shfl_type = std::is_same_v<T, int> || std::is_same_v<T, unsigned int> || std::is_same_v<T, long> ||
                           std::is_same_v<T, unsigned long> || std::is_same_v<T, long long> ||
                           std::is_same_v<T, unsigned long long> || std::is_same_v<T, float> ||
                           std::is_same_v<T, double>;

template <ShflMode M, typename T>
inline T shfl_any(lanemask mask, T var, long long arg, int width) {
    static_assert(shfl_type<T>, "__shfl*_sync takes int, unsigned, long, long long, float or double");
    if (width < 1 || width > kWarp || (width & (width - 1)) != 0) {
        fail("%s: width %d is not a power of two in [1, %d]", shfl_name(M), width, kWarp);
    }
    ShflSlot s{0, 0, arg, width};
    memcpy(&s.value, &var, sizeof(T));
    warp_collective(shfl_name(M), &resolve_shfl<M>, mask, &s);
    T out;
    memcpy(&out, &s.result, sizeof(T));
    return out;
}

template <typename T>
inline T shfl_sync(lanemask mask, T var, int src_lane, int width = kWarp) {
    return shfl_any<ShflMode::idx>(mask, var, src_lane, width);
}
template <typename T>
inline T shfl_up_sync(lanemask mask, T var, unsigned int delta, int width = kWarp) {
    return shfl_any<ShflMode::up>(mask, var, delta, width);
}
template <typename T>
inline T shfl_down_sync(lanemask mask, T var, unsigned int delta, int width = kWarp) {
    return shfl_any<ShflMode::down>(mask, var, delta, width);
}
template <typename T>
inline T shfl_xor_sync(lanemask mask, T var, int lane_mask, int width = kWarp) {
    return shfl_any<ShflMode::bfly>(mask, var, lane_mask, width);
}

struct VoteSlot {
    int predicate;
    lanemask ballot;
    lanemask group;
};
// One resolver for every vote: each lane gets the group's ballot and the group itself (the lanes
// that voted: those of the masks that exist in the block).
inline bool resolve_vote(void* const* slots, lanemask group, char*, size_t) {
    lanemask ballot = 0;
    for (unsigned lane = 0; lane < unsigned(kWarp); ++lane) {
        if ((group & lane_bit(lane)) && static_cast<VoteSlot*>(slots[lane])->predicate) ballot |= lane_bit(lane);
    }
    for (unsigned lane = 0; lane < unsigned(kWarp); ++lane) {
        if (!(group & lane_bit(lane))) continue;
        static_cast<VoteSlot*>(slots[lane])->ballot = ballot;
        static_cast<VoteSlot*>(slots[lane])->group = group;
    }
    return true;
}
inline VoteSlot vote(const char* what, lanemask mask, int predicate) {
    VoteSlot s{predicate != 0, 0, 0};
    warp_collective(what, &resolve_vote, mask, &s);
    return s;
}
inline lanemask ballot_sync(lanemask mask, int predicate) { return vote("__ballot_sync", mask, predicate).ballot; }
inline int any_sync(lanemask mask, int predicate) { return vote("__any_sync", mask, predicate).ballot != 0; }
inline int all_sync(lanemask mask, int predicate) {
    const VoteSlot s = vote("__all_sync", mask, predicate);
    return s.ballot == s.group;
}
inline bool resolve_syncwarp(void* const*, lanemask, char*, size_t) { return true; }
inline void syncwarp(lanemask mask = kFullMask) { warp_collective("__syncwarp", &resolve_syncwarp, mask, nullptr); }

// ---- atomics: plain read-modify-writes (fibers never run at the same time) ----------------------

#define MW_SIMT_ATOMIC(name, T, expr)     \
    inline T name(T* address, T val) {   \
        T old = *address;                 \
        *address = (expr);                \
        return old;                       \
    }
MW_SIMT_ATOMIC(atomicAdd, int, int(unsigned(old) + unsigned(val)))
MW_SIMT_ATOMIC(atomicAdd, unsigned int, old + val)
MW_SIMT_ATOMIC(atomicAdd, unsigned long long, old + val)
MW_SIMT_ATOMIC(atomicAdd, float, old + val)
MW_SIMT_ATOMIC(atomicAdd, double, old + val)
MW_SIMT_ATOMIC(atomicSub, int, int(unsigned(old) - unsigned(val)))
MW_SIMT_ATOMIC(atomicSub, unsigned int, old - val)
MW_SIMT_ATOMIC(atomicExch, int, val)
MW_SIMT_ATOMIC(atomicExch, unsigned int, val)
MW_SIMT_ATOMIC(atomicExch, unsigned long long, val)
MW_SIMT_ATOMIC(atomicExch, float, val)
MW_SIMT_ATOMIC(atomicMax, int, old > val ? old : val)
MW_SIMT_ATOMIC(atomicMax, unsigned int, old > val ? old : val)
MW_SIMT_ATOMIC(atomicMax, long long, old > val ? old : val)
MW_SIMT_ATOMIC(atomicMax, unsigned long long, old > val ? old : val)
MW_SIMT_ATOMIC(atomicMin, int, old < val ? old : val)
MW_SIMT_ATOMIC(atomicMin, unsigned int, old < val ? old : val)
MW_SIMT_ATOMIC(atomicMin, long long, old < val ? old : val)
MW_SIMT_ATOMIC(atomicMin, unsigned long long, old < val ? old : val)
MW_SIMT_ATOMIC(atomicAnd, int, old & val)
MW_SIMT_ATOMIC(atomicAnd, unsigned int, old & val)
MW_SIMT_ATOMIC(atomicAnd, unsigned long long, old & val)
MW_SIMT_ATOMIC(atomicOr, int, old | val)
MW_SIMT_ATOMIC(atomicOr, unsigned int, old | val)
MW_SIMT_ATOMIC(atomicOr, unsigned long long, old | val)
MW_SIMT_ATOMIC(atomicXor, int, old ^ val)
MW_SIMT_ATOMIC(atomicXor, unsigned int, old ^ val)
MW_SIMT_ATOMIC(atomicXor, unsigned long long, old ^ val)
MW_SIMT_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
MW_SIMT_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#undef MW_SIMT_ATOMIC
#define MW_SIMT_CAS(T)                              \
    inline T atomicCAS(T* address, T compare, T val) { \
        T old = *address;                           \
        if (old == compare) *address = val;         \
        return old;                                 \
    }
MW_SIMT_CAS(int)
MW_SIMT_CAS(unsigned int)
MW_SIMT_CAS(unsigned long long)
MW_SIMT_CAS(unsigned short)
#undef MW_SIMT_CAS
// Fibers switch only inside the layer's calls; a compiler barrier keeps program order.
inline void threadfence() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

// ---- bit casts, integer intrinsics --------------------------------------------------------------

inline float uint_as_float(unsigned int u) { return __builtin_bit_cast(float, u); }
inline unsigned int float_as_uint(float f) { return __builtin_bit_cast(unsigned int, f); }
inline float int_as_float(int i) { return __builtin_bit_cast(float, i); }
inline int float_as_int(float f) { return __builtin_bit_cast(int, f); }
inline double longlong_as_double(long long i) { return __builtin_bit_cast(double, i); }
inline long long double_as_longlong(double d) { return __builtin_bit_cast(long long, d); }
inline int clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int popc(unsigned int x) { return __builtin_popcount(x); }
inline int popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int ffs(int x) { return __builtin_ffs(x); }
inline int ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int brev(unsigned int x) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned int umulhi(unsigned int a, unsigned int b) { return unsigned((uint64_t(a) * b) >> 32); }
inline int mulhi(int a, int b) { return int((int64_t(a) * b) >> 32); }
inline unsigned long long umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

// ---- float intrinsics (the host's correctly rounded functions stand in for the fast ones) ------

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }  // NaN -> 0
inline float fdividef(float a, float b) { return a / b; }
inline float fast_expf(float x) { return expf(x); }
inline float fast_exp10f(float x) { return powf(10.0f, x); }
inline float fast_logf(float x) { return logf(x); }
inline float fast_log2f(float x) { return log2f(x); }
inline float fast_sinf(float x) { return sinf(x); }
inline float fast_cosf(float x) { return cosf(x); }
inline float fast_tanf(float x) { return tanf(x); }
inline float fast_powf(float a, float b) { return powf(a, b); }
inline void fast_sincosf(float x, float* s, float* c) {
    *s = sinf(x);
    *c = cosf(x);
}
inline float fadd_rn(float a, float b) { return a + b; }
inline float fsub_rn(float a, float b) { return a - b; }
inline float fmul_rn(float a, float b) { return a * b; }
inline float fdiv_rn(float a, float b) { return a / b; }
inline float fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float frcp_rn(float a) { return 1.0f / a; }
inline float fsqrt_rn(float a) { return sqrtf(a); }
inline int float2int_rn(float x) { return int(nearbyintf(x)); }
inline int float2int_rz(float x) { return int(truncf(x)); }
inline int float2int_rd(float x) { return int(floorf(x)); }
inline int float2int_ru(float x) { return int(ceilf(x)); }
inline unsigned int float2uint_rn(float x) { return unsigned(nearbyintf(x)); }
inline unsigned int float2uint_rz(float x) { return unsigned(truncf(x)); }
inline long long float2ll_rn(float x) { return (long long)nearbyintf(x); }
inline float int2float_rn(int x) { return float(x); }
inline float uint2float_rn(unsigned int x) { return float(x); }
inline float ll2float_rn(long long x) { return float(x); }

template <typename T>
inline T ldg(const T* p) {
    return *p;
}
template <typename T>
inline void st(T* p, T v) {
    *p = v;
}

// min / max over any two arithmetic types (CUDA's overloads: the usual conversions, NaN-ignoring
// for floating point like fminf / fmaxf).
template <typename A, typename B, std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>, int> = 0>
inline constexpr std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<C>) {
        return std::fmin(C(a), C(b));
    } else {
        return C(a) < C(b) ? C(a) : C(b);
    }
}
template <typename A, typename B, std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>, int> = 0>
inline constexpr std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<C>) {
        return std::fmax(C(a), C(b));
    } else {
        return C(a) < C(b) ? C(b) : C(a);
    }
}

// ---- registry -----------------------------------------------------------------------------------

// One kernel of the image (MW_KERNEL): `fn` runs one thread of it, reading the params bytes.
struct Registrar {
    Registrar(const char* name, size_t params_size, unsigned max_threads, void (*fn)(const void*));
};
struct FieldInfo {
    const char* name;
    size_t offset;
    size_t size;
};
// One params struct (MW_LAYOUT): its size and each field's offset and size.
struct LayoutRegistrar {
    LayoutRegistrar(const char* strct, size_t struct_size, const FieldInfo* fields, size_t count);
};

}  // namespace MW_SIMT_NS
}  // namespace mw_simt

// MW_SIMT_LAYOUT(Struct, a, b, ...): registers sizeof(Struct) and each field's offsetof and sizeof.
// MW_SIMT_FOR_EACH(m, S, a, b, ...) expands m(S, a) m(S, b) ...; C++20 __VA_OPT__ recursion, each
// MW_SIMT_EXPAND level rescanning the rest (4^4 = 256 levels, far more fields than any params).
#define MW_SIMT_PARENS ()
#define MW_SIMT_EXPAND(...) MW_SIMT_EXPAND3(MW_SIMT_EXPAND3(MW_SIMT_EXPAND3(MW_SIMT_EXPAND3(__VA_ARGS__))))
#define MW_SIMT_EXPAND3(...) MW_SIMT_EXPAND2(MW_SIMT_EXPAND2(MW_SIMT_EXPAND2(MW_SIMT_EXPAND2(__VA_ARGS__))))
#define MW_SIMT_EXPAND2(...) MW_SIMT_EXPAND1(MW_SIMT_EXPAND1(MW_SIMT_EXPAND1(MW_SIMT_EXPAND1(__VA_ARGS__))))
#define MW_SIMT_EXPAND1(...) __VA_ARGS__
#define MW_SIMT_FOR_EACH(m, S, ...) __VA_OPT__(MW_SIMT_EXPAND(MW_SIMT_FOR_EACH_STEP(m, S, __VA_ARGS__)))
#define MW_SIMT_FOR_EACH_STEP(m, S, first, ...) \
    m(S, first) __VA_OPT__(MW_SIMT_FOR_EACH_AGAIN MW_SIMT_PARENS(m, S, __VA_ARGS__))
#define MW_SIMT_FOR_EACH_AGAIN() MW_SIMT_FOR_EACH_STEP
#define MW_SIMT_FIELD(S, f) ::mw_simt::FieldInfo{#f, offsetof(S, f), sizeof(S::f)},
#define MW_SIMT_LAYOUT(S, ...)                                                                   \
    static const ::mw_simt::FieldInfo MW_SIMT_CAT(mw_simt_fields_, S)[] = {                      \
        MW_SIMT_FOR_EACH(MW_SIMT_FIELD, S, __VA_ARGS__)};                                        \
    static const ::mw_simt::LayoutRegistrar MW_SIMT_CAT(mw_simt_layout_, S)(                     \
        #S, sizeof(S), MW_SIMT_CAT(mw_simt_fields_, S),                                          \
        sizeof(MW_SIMT_CAT(mw_simt_fields_, S)) / sizeof(::mw_simt::FieldInfo));

// ---- the CUDA names -------------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __constant__ const
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local

#define threadIdx (::mw_simt::thread_idx())
#define blockIdx (::mw_simt::block_idx())
#define blockDim (::mw_simt::block_dim())
#define gridDim (::mw_simt::grid_dim())
#define warpSize MW_WARP

#define __syncthreads ::mw_simt::syncthreads
#define __syncthreads_count ::mw_simt::syncthreads_count
#define __syncthreads_and ::mw_simt::syncthreads_and
#define __syncthreads_or ::mw_simt::syncthreads_or
#define __syncwarp ::mw_simt::syncwarp
#if defined(MEMWALL_SIMT_HIP)
// The HIP image (image_hip.cpp): kernels-hip/hip.h maps the CUDA warp intrinsics the kernels call
// onto HIP's wave-wide ones, as on an AMD GPU; these are HIP's, over the whole wavefront (HIP's
// __shfl* take no mask: every lane of the wave that exists takes part).
#define __shfl(var, src_lane, ...) ::mw_simt::shfl_sync(::mw_simt::kFullMask, (var), (src_lane) __VA_OPT__(,) __VA_ARGS__)
#define __shfl_xor(var, lane_mask, ...) \
    ::mw_simt::shfl_xor_sync(::mw_simt::kFullMask, (var), (lane_mask) __VA_OPT__(,) __VA_ARGS__)
#define __shfl_up(var, delta, ...) ::mw_simt::shfl_up_sync(::mw_simt::kFullMask, (var), (delta) __VA_OPT__(,) __VA_ARGS__)
#define __shfl_down(var, delta, ...) \
    ::mw_simt::shfl_down_sync(::mw_simt::kFullMask, (var), (delta) __VA_OPT__(,) __VA_ARGS__)
#define __ballot(pred) ::mw_simt::ballot_sync(::mw_simt::kFullMask, (pred))
#define __HIP_MEMORY_SCOPE_AGENT 3
// HIP's scoped atomic load: fibers never run at the same time, so a plain load is atomic; the
// order and scope are checked to be the ones a kernel may pass.
template <typename T>
inline T __hip_atomic_load(const T* p, int order, int scope) {
    if (order != __ATOMIC_RELAXED && order != __ATOMIC_ACQUIRE && order != __ATOMIC_SEQ_CST) {
        ::mw_simt::fail("__hip_atomic_load: memory order %d", order);
    }
    if (scope != __HIP_MEMORY_SCOPE_AGENT) ::mw_simt::fail("__hip_atomic_load: scope %d", scope);
    return *p;
}
#else
#define __shfl_sync ::mw_simt::shfl_sync
#define __shfl_up_sync ::mw_simt::shfl_up_sync
#define __shfl_down_sync ::mw_simt::shfl_down_sync
#define __shfl_xor_sync ::mw_simt::shfl_xor_sync
#define __ballot_sync ::mw_simt::ballot_sync
#endif
#define __any_sync ::mw_simt::any_sync
#define __all_sync ::mw_simt::all_sync
#define __activemask ::mw_simt::activemask
#define __nanosleep ::mw_simt::nanosleep
#define __trap ::mw_simt::trap
// Device assert: a failed assertion fails the launch (on a GPU it prints and traps).
#undef assert
#if defined(NDEBUG)
#define assert(e) ((void)0)
#else
#define assert(e) ((e) ? (void)0 : ::mw_simt::fail("assertion `%s` failed (%s:%d)", #e, __FILE__, __LINE__))
#endif
#define __threadfence ::mw_simt::threadfence
#define __threadfence_block ::mw_simt::threadfence
#define __threadfence_system ::mw_simt::threadfence

#define __float_as_uint ::mw_simt::float_as_uint
#define __uint_as_float ::mw_simt::uint_as_float
#define __float_as_int ::mw_simt::float_as_int
#define __int_as_float ::mw_simt::int_as_float
#define __double_as_longlong ::mw_simt::double_as_longlong
#define __longlong_as_double ::mw_simt::longlong_as_double
#define __clz ::mw_simt::clz
#define __clzll ::mw_simt::clzll
#define __popc ::mw_simt::popc
#define __popcll ::mw_simt::popcll
#define __ffs ::mw_simt::ffs
#define __ffsll ::mw_simt::ffsll
#define __brev ::mw_simt::brev
#define __umulhi ::mw_simt::umulhi
#define __mulhi ::mw_simt::mulhi
#define __umul64hi ::mw_simt::umul64hi
#define __saturatef ::mw_simt::saturatef
#define __fdividef ::mw_simt::fdividef
#define __expf ::mw_simt::fast_expf
#define __exp10f ::mw_simt::fast_exp10f
#define __logf ::mw_simt::fast_logf
#define __log2f ::mw_simt::fast_log2f
#define __sinf ::mw_simt::fast_sinf
#define __cosf ::mw_simt::fast_cosf
#define __tanf ::mw_simt::fast_tanf
#define __powf ::mw_simt::fast_powf
#define __sincosf ::mw_simt::fast_sincosf
#define __fadd_rn ::mw_simt::fadd_rn
#define __fsub_rn ::mw_simt::fsub_rn
#define __fmul_rn ::mw_simt::fmul_rn
#define __fdiv_rn ::mw_simt::fdiv_rn
#define __fmaf_rn ::mw_simt::fmaf_rn
#define __frcp_rn ::mw_simt::frcp_rn
#define __fsqrt_rn ::mw_simt::fsqrt_rn
#define __float2int_rn ::mw_simt::float2int_rn
#define __float2int_rz ::mw_simt::float2int_rz
#define __float2int_rd ::mw_simt::float2int_rd
#define __float2int_ru ::mw_simt::float2int_ru
#define __float2uint_rn ::mw_simt::float2uint_rn
#define __float2uint_rz ::mw_simt::float2uint_rz
#define __float2ll_rn ::mw_simt::float2ll_rn
#define __int2float_rn ::mw_simt::int2float_rn
#define __uint2float_rn ::mw_simt::uint2float_rn
#define __ll2float_rn ::mw_simt::ll2float_rn
#define __ldg ::mw_simt::ldg
#define __ldca ::mw_simt::ldg
#if !defined(MEMWALL_SIMT_HIP)  // kernels-hip/hip.h defines it
#define __ldcg ::mw_simt::ldg
#endif
#define __ldcs ::mw_simt::ldg
#define __ldlu ::mw_simt::ldg
#define __ldcv ::mw_simt::ldg
#define __stcg ::mw_simt::st
#define __stcs ::mw_simt::st
#define __stwb ::mw_simt::st
#define __stwt ::mw_simt::st

// The names without underscores, visible from the kernels' anonymous namespace.
using mw_simt::atomicAdd;
using mw_simt::atomicAnd;
using mw_simt::atomicCAS;
using mw_simt::atomicDec;
using mw_simt::atomicExch;
using mw_simt::atomicInc;
using mw_simt::atomicMax;
using mw_simt::atomicMin;
using mw_simt::atomicOr;
using mw_simt::atomicSub;
using mw_simt::atomicXor;
using mw_simt::max;
using mw_simt::min;
using mw_simt::rsqrt;
using mw_simt::rsqrtf;
using mw_simt::dim3;
using mw_simt::uint3;
#define MW_SIMT_USING_VEC(T) \
    using mw_simt::T;        \
    using mw_simt::make_##T;
MW_SIMT_USING_VEC(char1)
MW_SIMT_USING_VEC(char2)
MW_SIMT_USING_VEC(char4)
MW_SIMT_USING_VEC(uchar1)
MW_SIMT_USING_VEC(uchar2)
MW_SIMT_USING_VEC(uchar4)
MW_SIMT_USING_VEC(short2)
MW_SIMT_USING_VEC(short4)
MW_SIMT_USING_VEC(ushort2)
MW_SIMT_USING_VEC(ushort4)
MW_SIMT_USING_VEC(int1)
MW_SIMT_USING_VEC(int2)
MW_SIMT_USING_VEC(int3)
MW_SIMT_USING_VEC(int4)
MW_SIMT_USING_VEC(uint1)
MW_SIMT_USING_VEC(uint2)
MW_SIMT_USING_VEC(uint4)
MW_SIMT_USING_VEC(float1)
MW_SIMT_USING_VEC(float2)
MW_SIMT_USING_VEC(float3)
MW_SIMT_USING_VEC(float4)
MW_SIMT_USING_VEC(longlong2)
MW_SIMT_USING_VEC(ulonglong2)
MW_SIMT_USING_VEC(double2)
#undef MW_SIMT_USING_VEC
using mw_simt::make_uint3;

#endif  // MEMWALL_SIMT_SIMT_H

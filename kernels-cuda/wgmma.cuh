// wgmma.cuh: the Hopper warpgroup matrix multiply (wgmma, sm_90a) as functions. Include after
// mma.cuh. After the PTX ISA, section 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-
// Accumulate Instructions". A warpgroup is four consecutive warps from a warp index divisible by 4.
//
// mw::wgmma_m64n128k16_bf16(d, a, desc_b, accumulate)
//     wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 with A from registers and B from shared
//     memory: D (64 x 128, f32) = A (64 x 16) * B (16 x 128) + (accumulate ? D : 0). Warp w of the
//     warpgroup holds rows 16 w .. 16 w + 15 of A and of D in the fragment layouts of
//     mma.m16n8k16 (mma.cuh; g = lane >> 2, t = lane % 4), D's repeated along n:
//       a[0] = A[16w + g][2t, 2t+1]   a[1] = A[16w + g + 8][2t, 2t+1]   a[2], a[3]: columns + 8
//       d[4c + e] = D[16w + g + 8 (e / 2)][8c + 2t + e % 2]   (c = 0 .. 15, e = 0 .. 3)
//     B ("column-major": k contiguous, imm-trans-b 0) is read through desc_b (mw::smem_desc).
// mw::smem_desc(tile, lbo, sbo)
//     The matrix descriptor of a K-major bf16 operand in the no-swizzle layout: 8 x 8 core matrices
//     of 128 contiguous bytes (8 rows of one n each, 16 bytes of 8 consecutive k), the one holding
//     B[k][n] at tile + (k / 8) lbo + (n / 8) sbo bytes ("leading dimension byte offset": the next
//     core matrix along k; "stride dimension byte offset": along n). Fields: shared address >> 4 in
//     bits 0-13, lbo >> 4 in 16-29, sbo >> 4 in 32-45, base offset 0 (49-51), swizzle 0 (62-63).
// mw::wgmma_fence()      wgmma.fence: earlier register writes (A fragments, accumulators) are
//                        ordered before the wgmmas after it; once before each batch of wgmmas.
// mw::wgmma_commit()     wgmma.commit_group: the wgmmas issued since the last commit form a group.
// mw::wgmma_wait<N>()    wgmma.wait_group N: until at most N committed groups are pending. A
//                        pending wgmma's accumulators and A registers must not be touched, nor the
//                        shared memory it reads written.
// mw::wgmma_fence_operand(d)  an empty asm that takes and gives back every accumulator, so the
//                        compiler keeps its own reads and writes of d on their side of a wait.
// mw::fence_proxy_async()     fence.proxy.async.shared::cta: this thread's ordinary shared-memory
//                        stores become visible to the tensor cores' (async proxy) reads; each
//                        writing thread, before the barrier that precedes the wgmma.
//
// On nvcc the wgmma functions are the PTX instructions in sm_90a code (__CUDA_ARCH_FEAT_SM90_ALL);
// any other target traps (the launcher sends them only to sm_90 devices).
//
// Under MEMWALL_SIMT each wgmma is a warp collective over its warp alone: a warp's 16 rows of D
// depend on its rows of A and on all of B, so the warpgroup's four warps may resolve apart. The
// product is computed at issue, exactly, summed in f64 with one rounding to f32 (as mma.cuh). The
// descriptor is decoded as above, its address an offset into the block's dynamic shared memory
// (mw::smem_desc takes pointers there only; anything else, a field out of the block's bytes, a
// swizzle or base offset, or lanes giving different descriptors fails the launch). The B elements
// each wgmma read stay with its warp's group until wgmma_wait<N> retires the group, which fails
// the launch if those shared bytes changed meanwhile: the write-after-read race that asynchrony
// allows a kernel. Not emulated: touching d or a while pending (the kernels wait first), the proxy
// fence, and the fence before a batch.
#pragma once

namespace mw {

#if defined(MEMWALL_SIMT)

static_assert(MW_WARP == 32, "wgmma is an NVIDIA warpgroup (4 x 32 lanes) instruction");

constexpr int WGMMA_N = 128;

// The shared address of a pointer into the block's dynamic shared memory (an offset from its base).
inline uint32_t smem_address(const void* p) {
    const unsigned char* base = ::mw_simt::dynamic_shared();
    const unsigned char* at = static_cast<const unsigned char*>(p);
    if (base == nullptr || at < base || size_t(at - base) >= ::mw_simt::dynamic_shared_bytes()) {
        ::mw_simt::fail("smem_desc: %p is not in the block's dynamic shared memory", p);
    }
    return uint32_t(at - base);
}

MW_DEV uint64_t smem_desc(const void* tile, uint32_t lbo, uint32_t sbo) {
    const uint32_t addr = smem_address(tile);
    if (addr % 16 != 0 || lbo % 16 != 0 || sbo % 16 != 0 || addr >= (1u << 18) || lbo >= (1u << 18) ||
        sbo >= (1u << 18)) {
        ::mw_simt::fail("smem_desc: address %u, lbo %u, sbo %u are not 16-byte multiples below 2^18", addr, lbo, sbo);
    }
    return uint64_t(addr >> 4) | uint64_t(lbo >> 4) << 16 | uint64_t(sbo >> 4) << 32;
}

// The descriptor bits no field uses: 14-15, 30-31, 46-48, 52-61.
constexpr uint64_t WGMMA_RESERVED = 3ull << 14 | 3ull << 30 | 7ull << 46 | 0x3ffull << 52;

// B's 16 x 128 bf16 bits as the descriptor gives them (false with a message when it is invalid).
inline bool wgmma_read_b(uint64_t desc, uint16_t (&b)[16][WGMMA_N], char* err, size_t cap) {
    const size_t start = size_t(desc & 0x3fff) << 4, lbo = size_t(desc >> 16 & 0x3fff) << 4,
                 sbo = size_t(desc >> 32 & 0x3fff) << 4;
    if ((desc >> 49 & 7) != 0 || (desc >> 62) != 0 || (desc & WGMMA_RESERVED) != 0) {
        snprintf(err, cap, "wgmma: descriptor %#llx has a swizzle, base offset or reserved bits (not emulated)",
                 static_cast<unsigned long long>(desc));
        return false;
    }
    const unsigned char* base = ::mw_simt::dynamic_shared();
    const size_t bytes = ::mw_simt::dynamic_shared_bytes();
    for (int k = 0; k < 16; ++k) {
        for (int n = 0; n < WGMMA_N; ++n) {
            const size_t at = start + (k / 8) * lbo + (n / 8) * sbo + (n % 8) * 16 + (k % 8) * 2;
            if (at + 2 > bytes) {
                snprintf(err, cap, "wgmma: B[%d][%d] at shared byte %zu is past the block's %zu", k, n, at, bytes);
                return false;
            }
            memcpy(&b[k][n], base + at, 2);
        }
    }
    return true;
}

// The B elements a wgmma read, kept until its group retires.
struct WgmmaRead {
    unsigned long long group;
    uint64_t desc;
    uint16_t b[16][WGMMA_N];
};

// One warp's wgmma state: groups committed, reads of the groups not yet retired.
struct WgmmaWarp {
    unsigned long long committed = 0;
    std::vector<WgmmaRead> reads;
};

// The running block's warps' state (the block's fibers run on this OS thread).
inline WgmmaWarp& wgmma_warp(unsigned warp) {
    static thread_local unsigned long long serial = 0;
    static thread_local std::vector<WgmmaWarp> warps;
    if (serial != ::mw_simt::block_serial()) {
        serial = ::mw_simt::block_serial();
        warps.clear();
    }
    if (warps.size() <= warp) warps.resize(warp + 1);
    return warps[warp];
}

inline unsigned warp_in_block() {
    const dim3 bd = ::mw_simt::block_dim();
    const uint3 t = ::mw_simt::thread_idx();
    return (t.x + bd.x * (t.y + bd.y * t.z)) / unsigned(MW_WARP);
}

struct WgmmaSlot {
    uint32_t a[4];
    uint64_t desc;
    float* d;
    bool accumulate;
    unsigned warp;
};

inline bool wgmma_resolve(void* const* slots, ::mw_simt::lanemask group, char* err, size_t cap) {
    if (group != MW_FULL_MASK) {
        snprintf(err, cap, "wgmma needs all 32 lanes of each warp; lanes 0x%08x took part", unsigned(group));
        return false;
    }
    const WgmmaSlot& first = *static_cast<const WgmmaSlot*>(slots[0]);
    for (int lane = 1; lane < 32; ++lane) {
        const WgmmaSlot& s = *static_cast<const WgmmaSlot*>(slots[lane]);
        if (s.desc != first.desc || s.accumulate != first.accumulate) {
            snprintf(err, cap, "wgmma: lane %d's descriptor or scale-d differs from lane 0's", lane);
            return false;
        }
    }
    WgmmaRead read{0, first.desc, {}};
    if (!wgmma_read_b(first.desc, read.b, err, cap)) return false;
    float a[16][16];
    for (int lane = 0; lane < 32; ++lane) mma_gather_a<false>(static_cast<const WgmmaSlot*>(slots[lane])->a, lane, a);
    for (int lane = 0; lane < 32; ++lane) {
        const WgmmaSlot& s = *static_cast<const WgmmaSlot*>(slots[lane]);
        const int g = lane >> 2, t = lane % 4;
        for (int i = 0; i < WGMMA_N / 2; ++i) {
            const int row = g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * t + i % 2;
            double acc = s.accumulate ? double(s.d[i]) : 0.0;
            for (int k = 0; k < 16; ++k) acc += double(a[row][k]) * double(to_f32(bf16{read.b[k][col]}));
            s.d[i] = float(acc);
        }
    }
    WgmmaWarp& w = wgmma_warp(first.warp);
    read.group = w.committed;
    w.reads.push_back(read);
    return true;
}

struct WgmmaGroupSlot {
    unsigned warp;
    int pending;  // wait: the groups that may stay pending; commit: -1
};

inline bool wgmma_group_resolve(void* const* slots, ::mw_simt::lanemask group, char* err, size_t cap) {
    if (group != MW_FULL_MASK) {
        snprintf(err, cap, "wgmma commit / wait needs all 32 lanes; lanes 0x%08x took part", unsigned(group));
        return false;
    }
    const WgmmaGroupSlot& s = *static_cast<const WgmmaGroupSlot*>(slots[0]);
    WgmmaWarp& w = wgmma_warp(s.warp);
    if (s.pending < 0) {
        ++w.committed;
        return true;
    }
    // Retire the groups older than the newest `pending` committed ones: their reads must still hold.
    const unsigned long long retire = w.committed > unsigned(s.pending) ? w.committed - unsigned(s.pending) : 0;
    for (const WgmmaRead& r : w.reads) {
        if (r.group >= retire) continue;
        static thread_local uint16_t now[16][WGMMA_N];
        if (!wgmma_read_b(r.desc, now, err, cap)) return false;
        if (memcmp(now, r.b, sizeof(now)) != 0) {
            snprintf(err, cap,
                     "shared memory a wgmma of group %llu read (descriptor %#llx) was written before the "
                     "group completed",
                     r.group, static_cast<unsigned long long>(r.desc));
            return false;
        }
    }
    std::erase_if(w.reads, [retire](const WgmmaRead& r) { return r.group < retire; });
    return true;
}

MW_DEV void wgmma_m64n128k16_bf16(float (&d)[WGMMA_N / 2], const uint32_t a[4], uint64_t desc_b, bool accumulate) {
    WgmmaSlot s{{a[0], a[1], a[2], a[3]}, desc_b, d, accumulate, warp_in_block()};
    ::mw_simt::warp_collective("wgmma.mma_async.m64n128k16.bf16", &wgmma_resolve, MW_FULL_MASK, &s);
}

MW_DEV void wgmma_fence() {}

MW_DEV void wgmma_commit() {
    WgmmaGroupSlot s{warp_in_block(), -1};
    ::mw_simt::warp_collective("wgmma.commit_group", &wgmma_group_resolve, MW_FULL_MASK, &s);
}

template <int N>
MW_DEV void wgmma_wait() {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0 to 7");
    WgmmaGroupSlot s{warp_in_block(), N};
    ::mw_simt::warp_collective("wgmma.wait_group", &wgmma_group_resolve, MW_FULL_MASK, &s);
}

template <int SIZE>
MW_DEV void wgmma_fence_operand(float (&)[SIZE]) {}

MW_DEV void fence_proxy_async() {}

#else  // nvcc / NVRTC

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MW_WGMMA_UNSUPPORTED 1
#endif

constexpr int WGMMA_N = 128;

MW_DEV uint64_t smem_desc(const void* tile, uint32_t lbo, uint32_t sbo) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
    return uint64_t((addr & 0x3ffff) >> 4) | uint64_t(lbo >> 4) << 16 | uint64_t(sbo >> 4) << 32;
}

MW_DEV void wgmma_m64n128k16_bf16(float (&d)[WGMMA_N / 2], const uint32_t a[4], uint64_t desc_b, bool accumulate) {
#if defined(MW_WGMMA_UNSUPPORTED)
    __trap();  // wgmma needs sm_90a
#else
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %68, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %69, p, 1, 1, 0;\n"
        "}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(int(accumulate)), "l"(desc_b));
#endif
}

MW_DEV void wgmma_fence() {
#if defined(MW_WGMMA_UNSUPPORTED)
    __trap();
#else
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

MW_DEV void wgmma_commit() {
#if defined(MW_WGMMA_UNSUPPORTED)
    __trap();
#else
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
MW_DEV void wgmma_wait() {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0 to 7");
#if defined(MW_WGMMA_UNSUPPORTED)
    __trap();
#else
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

template <int SIZE>
MW_DEV void wgmma_fence_operand(float (&d)[SIZE]) {
#pragma unroll
    for (int i = 0; i < SIZE; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

MW_DEV void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

#endif

}  // namespace mw

// simt.cpp: the runtime of the SIMT layer (simt.h): the kernel registry, fibers and their
// scheduler, and the exported C ABI (runtime/src/gpu/emu.rs `SimtImage`).
//
// It is compiled once per image, inside the image's unity TU (image_cuda.cpp includes it), with
// MW_WARP and MW_SIMT_IMAGE set there; the exported names carry the image
// (memwall_simt_cuda_launch, ...).
//
// A launch runs its blocks one after another on the calling OS thread. A block's threads are
// fibers: each has its own stack (mmap'd once per OS thread with a guard page below it, reused
// by every later block and launch on that thread) and a saved stack pointer; a switch saves the
// callee-saved registers on the old stack and pops them from the new one (x86-64 assembly below;
// ucontext elsewhere). The scheduler (`run_block`) runs in rounds: it takes the fibers that are
// runnable, orders them by the launch's schedule, and runs each until it blocks or exits; a
// barrier releases when every thread that has not exited waits at it, a warp collective when
// every lane of its mask posted its slot.
// The C++ headers first: simt.h defines CUDA's names as macros (__noinline__ among them, which
// libstdc++ spells in attributes).
#include <stdarg.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "simt.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define MW_SIMT_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#else
#define MW_SIMT_ASAN 0
#endif

#define MW_SIMT_EXPORT(name) MW_SIMT_CAT(MW_SIMT_CAT(MW_SIMT_CAT(memwall_simt_, MW_SIMT_IMAGE), _), name)

// ---- context switch --------------------------------------------------------------------------

#if defined(__x86_64__)
// switch(save, load): pushes the callee-saved registers of the System V ABI (rbp, rbx, r12-r15),
// stores rsp to *save, loads rsp from `load`, pops the same registers from there and returns
// into whatever that stack was doing. MXCSR and the x87 control word are also callee-saved, but
// kernels never change them, so they are not switched.
// start: where a new fiber's first switch returns to; calls r13(r12) with an aligned stack.
extern "C" void MW_SIMT_EXPORT(fiber_switch)(void** save, void* load);
extern "C" void MW_SIMT_EXPORT(fiber_start)();
asm(".text\n"
    ".p2align 4\n"
    ".globl " MW_SIMT_STR(MW_SIMT_EXPORT(fiber_switch)) "\n"
    ".hidden " MW_SIMT_STR(MW_SIMT_EXPORT(fiber_switch)) "\n"
    ".type " MW_SIMT_STR(MW_SIMT_EXPORT(fiber_switch)) ", @function\n"
    MW_SIMT_STR(MW_SIMT_EXPORT(fiber_switch)) ":\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size " MW_SIMT_STR(MW_SIMT_EXPORT(fiber_switch)) ", .-" MW_SIMT_STR(MW_SIMT_EXPORT(fiber_switch)) "\n"
    ".p2align 4\n"
    ".globl " MW_SIMT_STR(MW_SIMT_EXPORT(fiber_start)) "\n"
    ".hidden " MW_SIMT_STR(MW_SIMT_EXPORT(fiber_start)) "\n"
    ".type " MW_SIMT_STR(MW_SIMT_EXPORT(fiber_start)) ", @function\n"
    MW_SIMT_STR(MW_SIMT_EXPORT(fiber_start)) ":\n"
    "    movq %r12, %rdi\n"
    "    callq *%r13\n"
    "    ud2\n"
    ".size " MW_SIMT_STR(MW_SIMT_EXPORT(fiber_start)) ", .-" MW_SIMT_STR(MW_SIMT_EXPORT(fiber_start)) "\n");
#endif

namespace mw_simt {
inline namespace MW_SIMT_NS {

thread_local FiberView tl_view;

namespace {

// ---- registry ----------------------------------------------------------------------------------

struct Kernel {
    const char* name;
    size_t params_size;
    unsigned max_threads;
    void (*fn)(const void*);
};
struct Field {
    const char* strct;
    const char* field;
    size_t offset, size, struct_size;
};
std::vector<Kernel>& kernels() {
    static std::vector<Kernel> v;
    return v;
}
std::vector<Field>& fields() {
    static std::vector<Field> v;
    return v;
}

// ---- stacks ------------------------------------------------------------------------------------

#if MW_SIMT_ASAN
constexpr size_t kStackBytes = 512 * 1024;  // instrumented frames are several times larger
#else
constexpr size_t kStackBytes = 128 * 1024;
#endif

// One fiber stack: kStackBytes usable above a PROT_NONE guard page, so an overflow faults.
struct Stack {
    void* map = nullptr;
    size_t map_bytes = 0;
    char* lo = nullptr;
    bool dirty = false;  // a fiber was abandoned on it (ASan: poisoned frames remain)
    // Bytes left unused at the top: the stacks are mapped at the same offset within a page, so
    // without it every fiber's hot frames would fall into the same cache sets.
    size_t color = 0;

    Stack() = default;
    Stack(const Stack&) = delete;
    Stack& operator=(const Stack&) = delete;
    ~Stack() {
        if (!map) return;
#if MW_SIMT_ASAN
        // gcc 12's ASan leaves the shadow of an unmapped range as it was: clear the poison of
        // abandoned frames so that a later mapping at this address does not inherit it.
        __asan_unpoison_memory_region(lo, kStackBytes);
#endif
        munmap(map, map_bytes);
    }
    bool allocate() {
        const size_t page = size_t(sysconf(_SC_PAGESIZE));
        map_bytes = kStackBytes + page;
        map = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (map == MAP_FAILED) {
            map = nullptr;
            return false;
        }
        if (mprotect(map, page, PROT_NONE) != 0) return false;
        lo = static_cast<char*>(map) + page;
#if MW_SIMT_ASAN
        // The mmap interceptor of gcc 12's ASan does not clear the shadow: a range unmapped with
        // poisoned frames on it (another OS thread's abandoned fibers) would come back poisoned.
        __asan_unpoison_memory_region(lo, kStackBytes);
#endif
        return true;
    }
};

// ---- fibers and the per-OS-thread scheduler state ---------------------------------------------------

enum class State : unsigned char { ready, barrier, warp, exited };

struct Fiber {
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t ctx;
#endif
    Stack* stack = nullptr;
    uint3 tid{};
    unsigned linear = 0;
    State state = State::ready;
    int predicate = 0;  // barrier: posted predicate, then the count
    // warp collective
    const char* what = nullptr;
    Resolver resolve = nullptr;
    lanemask mask = 0;
    void* slot = nullptr;
#if MW_SIMT_ASAN
    void* fake_stack = nullptr;
#endif
};

// Frees a 16-byte aligned `new[]` (dynamic shared memory, MW_SHARED arrays).
struct FreeAligned {
    void operator()(unsigned char* p) const { ::operator delete[](p, std::align_val_t(16)); }
};

// One MW_SHARED array of the block running: its declaration's site and its bytes, exactly its
// size (so AddressSanitizer sees an overflow) and 16-byte aligned.
struct SharedArray {
    const void* site;
    std::unique_ptr<unsigned char[], FreeAligned> bytes;
};

struct Sched {
    std::vector<std::unique_ptr<Stack>> stacks;
    std::vector<Fiber> fibers;
    std::vector<unsigned> order;
    Fiber* current = nullptr;
#if defined(__x86_64__)
    void* main_sp = nullptr;
#else
    ucontext_t main_ctx;
#endif
#if MW_SIMT_ASAN
    void* main_fake_stack = nullptr;
    const void* main_bottom = nullptr;
    size_t main_size = 0;
#endif
    bool active = false;
    // the launch
    const Kernel* kernel = nullptr;
    const void* params = nullptr;
    unsigned nthreads = 0;
    uint64_t schedule = 0;
    uint64_t rng = 0;
    size_t dynamic_bytes = 0;
    // the block
    std::vector<SharedArray> shared_arrays;  // MW_SHARED: placed in the order first reached
    size_t shared_bytes = 0;
    unsigned arrived = 0;  // barrier: the threads released by the last barrier
    bool failed = false;
    std::string error;
};

Sched& sched() {
    static thread_local Sched s;
    return s;
}

uint64_t splitmix64(uint64_t& state) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

std::string vformat(const char* fmt, va_list ap) {
    char buf[1024];
    vsnprintf(buf, sizeof buf, fmt, ap);
    return buf;
}
std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string strf(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::string s = vformat(fmt, ap);
    va_end(ap);
    return s;
}

std::string block_name() {
    const uint3 b = tl_view.block_idx;
    return strf("block (%u,%u,%u)", b.x, b.y, b.z);
}
std::string thread_name(const Fiber& f) { return strf("thread (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z); }

// Records the first error of the launch.
void set_error(Sched& s, std::string msg) {
    if (!s.failed) {
        s.failed = true;
        s.error = std::move(msg);
    }
}

// ---- switching -----------------------------------------------------------------------------------

[[noreturn]] void fiber_entry(Fiber* f);

#if !defined(__x86_64__)
void fiber_entry_ucontext() { fiber_entry(sched().current); }
#endif

// Prepares `f` to start at fiber_entry on its stack.
void fiber_init(Fiber& f) {
    Stack& st = *f.stack;
#if MW_SIMT_ASAN
    if (st.dirty) {
        __asan_unpoison_memory_region(st.lo, kStackBytes);
        st.dirty = false;
    }
#endif
#if defined(__x86_64__)
    // After the six pops and the `ret` into fiber_start, rsp must be 16-byte aligned so that its
    // `call` enters fiber_entry with rsp = 8 mod 16, as the ABI wants.
    const uintptr_t top = (reinterpret_cast<uintptr_t>(st.lo) + kStackBytes - st.color) & ~uintptr_t(15);
    auto* ret_slot = reinterpret_cast<uint64_t*>(top - 24);  // 8 mod 16
    ret_slot[0] = reinterpret_cast<uint64_t>(&MW_SIMT_EXPORT(fiber_start));
    uint64_t* sp = ret_slot - 6;
    sp[0] = 0;                                            // r15
    sp[1] = 0;                                            // r14
    sp[2] = reinterpret_cast<uint64_t>(&fiber_entry);     // r13: what fiber_start calls
    sp[3] = reinterpret_cast<uint64_t>(&f);               // r12: its argument
    sp[4] = 0;                                            // rbx
    sp[5] = 0;                                            // rbp: ends frame-pointer unwinding
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = st.lo;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, &fiber_entry_ucontext, 0);
#endif
}

// Scheduler -> fiber; returns when the fiber blocks, exits or fails.
void run_fiber(Sched& s, Fiber& f) {
    s.current = &f;
    tl_view.thread_idx = f.tid;
#if MW_SIMT_ASAN
    __sanitizer_start_switch_fiber(&s.main_fake_stack, f.stack->lo, kStackBytes);
#endif
#if defined(__x86_64__)
    MW_SIMT_EXPORT(fiber_switch)(&s.main_sp, f.sp);
#else
    swapcontext(&s.main_ctx, &f.ctx);
#endif
#if MW_SIMT_ASAN
    __sanitizer_finish_switch_fiber(s.main_fake_stack, nullptr, nullptr);
#endif
    s.current = nullptr;
}

// Fiber -> scheduler. `final`: the fiber never runs again (exited or failed).
void to_scheduler(Sched& s, Fiber& f, bool final) {
#if MW_SIMT_ASAN
    __sanitizer_start_switch_fiber(final ? nullptr : &f.fake_stack, s.main_bottom, s.main_size);
#else
    (void)final;
#endif
#if defined(__x86_64__)
    MW_SIMT_EXPORT(fiber_switch)(&f.sp, s.main_sp);
#else
    swapcontext(&f.ctx, &s.main_ctx);
#endif
#if MW_SIMT_ASAN
    __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

void fiber_entry(Fiber* f) {
    Sched& s = sched();
#if MW_SIMT_ASAN
    // The stack we came from is the scheduler's: remember it for the switches back.
    __sanitizer_finish_switch_fiber(nullptr, &s.main_bottom, &s.main_size);
#endif
    s.kernel->fn(s.params);
    f->state = State::exited;
    to_scheduler(s, *f, true);
    __builtin_trap();  // an exited fiber is never resumed
}

Fiber& current_fiber(const char* what) {
    Fiber* f = sched().current;
    if (!f) {
        fprintf(stderr, "memwall simt: %s called outside a kernel\n", what);
        abort();
    }
    return *f;
}

// ---- warp collectives ------------------------------------------------------------------------------

// The lanes of warp `warp` that exist in a block of `nthreads` threads.
lanemask warp_lanes(unsigned nthreads, unsigned warp) {
    const unsigned first = warp * unsigned(kWarp);
    const unsigned n = nthreads - first;
    return n >= unsigned(kWarp) ? kFullMask : lane_bit(n) - 1;
}

std::string lanes_text(lanemask m) {
    std::string out;
    for (unsigned lane = 0; lane < unsigned(kWarp);) {
        if (!(m & lane_bit(lane))) {
            ++lane;
            continue;
        }
        unsigned end = lane;
        while (end + 1 < unsigned(kWarp) && (m & lane_bit(end + 1))) ++end;
        if (!out.empty()) out += ",";
        out += end == lane ? strf("%u", lane) : strf("%u-%u", lane, end);
        lane = end + 1;
    }
    return out.empty() ? "none" : out;
}

// Tries to complete the collective fiber `f` waits at. Returns false after setting an error.
bool try_complete(Sched& s, Fiber& f) {
    const unsigned warp = f.linear / unsigned(kWarp), first = warp * unsigned(kWarp);
    const lanemask exist = warp_lanes(s.nthreads, warp);
    lanemask group = (f.mask | lane_bit(f.linear - first)) & exist;
    for (lanemask seen = 0; seen != group;) {
        const lanemask fresh = group & ~seen;
        seen = group;
        for (unsigned lane = 0; lane < unsigned(kWarp); ++lane) {
            if (!(fresh & lane_bit(lane))) continue;
            Fiber& g = s.fibers[first + lane];
            if (g.state == State::exited) {
                set_error(s, strf("%s: warp %u: %s waits in %s with mask 0x%llx, which names lane %u, "
                                    "which exited",
                                    block_name().c_str(), warp, thread_name(f).c_str(), f.what,
                                    (unsigned long long)f.mask, lane));
                return false;
            }
            if (g.state != State::warp) return true;  // not there yet
            if (g.resolve != f.resolve) {
                set_error(s, strf("%s: warp %u: lanes meet at different collectives: %s in %s, %s in %s",
                                    block_name().c_str(), warp, thread_name(f).c_str(), f.what,
                                    thread_name(g).c_str(), g.what));
                return false;
            }
            group |= g.mask & exist;
        }
    }
    void* slots[kWarp] = {};
    for (unsigned lane = 0; lane < unsigned(kWarp); ++lane) {
        if (group & lane_bit(lane)) slots[lane] = s.fibers[first + lane].slot;
    }
    char msg[512] = {};
    if (!f.resolve(slots, group, msg, sizeof msg)) {
        set_error(s, strf("%s: warp %u lanes %s: %s: %s", block_name().c_str(), warp, lanes_text(group).c_str(),
                            f.what, msg));
        return false;
    }
    for (unsigned lane = 0; lane < unsigned(kWarp); ++lane) {
        if (group & lane_bit(lane)) s.fibers[first + lane].state = State::ready;
    }
    return true;
}

// After `f` exited: no lane of its warp may wait for it.
bool check_exit(Sched& s, Fiber& f) {
    const unsigned warp = f.linear / unsigned(kWarp), first = warp * unsigned(kWarp);
    const unsigned lane = f.linear - first;
    const unsigned end = std::min(first + unsigned(kWarp), s.nthreads);
    for (unsigned i = first; i < end; ++i) {
        Fiber& g = s.fibers[i];
        if (g.state == State::warp && (g.mask & lane_bit(lane))) {
            set_error(s, strf("%s: warp %u: %s exited while %s waits in %s with mask 0x%llx, which names it",
                                block_name().c_str(), warp, thread_name(f).c_str(), thread_name(g).c_str(), g.what,
                                (unsigned long long)g.mask));
            return false;
        }
    }
    return true;
}

std::string deadlock_report(Sched& s) {
    std::string at_barrier, at_warp;
    unsigned n_barrier = 0, n_exited = 0;
    for (Fiber& f : s.fibers) {
        if (f.state == State::barrier) {
            if (++n_barrier <= 4) at_barrier += (at_barrier.empty() ? "" : ", ") + thread_name(f);
        } else if (f.state == State::exited) {
            ++n_exited;
        }
    }
    if (n_barrier > 4) at_barrier += strf(" and %u more", n_barrier - 4);
    // Warp waiters, grouped per warp and collective: "warp 0 lanes 1-31 in __shfl_sync (mask ...)".
    for (unsigned first = 0; first < s.nthreads; first += unsigned(kWarp)) {
        const unsigned end = std::min(first + unsigned(kWarp), s.nthreads);
        for (unsigned i = first; i < end; ++i) {
            const Fiber& f = s.fibers[i];
            if (f.state != State::warp) continue;
            bool seen = false;
            for (unsigned j = first; j < i && !seen; ++j) {
                seen = s.fibers[j].state == State::warp && s.fibers[j].what == f.what && s.fibers[j].mask == f.mask;
            }
            if (seen) continue;
            lanemask lanes = 0;
            for (unsigned j = i; j < end; ++j) {
                const Fiber& g = s.fibers[j];
                if (g.state == State::warp && g.what == f.what && g.mask == f.mask) lanes |= lane_bit(j - first);
            }
            if (!at_warp.empty()) at_warp += "; ";
            at_warp += strf("warp %u lanes %s in %s (mask 0x%llx)", first / unsigned(kWarp), lanes_text(lanes).c_str(),
                            f.what, (unsigned long long)f.mask);
        }
    }
    return strf("%s: deadlock: %u threads wait at __syncthreads (%s) while %s cannot complete; %u exited",
                block_name().c_str(), n_barrier, at_barrier.empty() ? "none" : at_barrier.c_str(), at_warp.c_str(),
                n_exited);
}

// The order of this round's runnable fibers.
void order_round(Sched& s) {
    s.order.clear();
    for (Fiber& f : s.fibers) {
        if (f.state == State::ready) s.order.push_back(f.linear);
    }
    if (s.schedule == 1) {
        for (size_t i = 0, j = s.order.size(); i + 1 < j; ++i, --j) std::swap(s.order[i], s.order[j - 1]);
    } else if (s.schedule >= 2) {
        for (size_t i = s.order.size(); i > 1; --i) {
            const size_t j = size_t(splitmix64(s.rng) % i);
            std::swap(s.order[i - 1], s.order[j]);
        }
    }
}

// Runs one block to completion; false after an error.
bool run_block(Sched& s) {
    const dim3 bd = tl_view.block_dim;
    for (unsigned i = 0; i < s.nthreads; ++i) {
        Fiber& f = s.fibers[i];
        f.stack = s.stacks[i].get();
        f.linear = i;
        f.tid = uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
        f.state = State::ready;
        f.what = nullptr;
        f.resolve = nullptr;
        f.slot = nullptr;
        fiber_init(f);
    }
    if (s.dynamic_bytes) memset(tl_view.dynamic_shared, 0xff, s.dynamic_bytes);
    s.shared_arrays.clear();
    s.shared_bytes = 0;
    ++tl_view.block_serial;
    for (;;) {
        order_round(s);
        if (s.order.empty()) {
            unsigned at_barrier = 0, exited = 0;
            bool at_warp = false;
            for (Fiber& f : s.fibers) {
                at_barrier += f.state == State::barrier;
                exited += f.state == State::exited;
                at_warp |= f.state == State::warp;
            }
            if (exited == s.nthreads) return true;
            if (at_warp) {
                set_error(s, deadlock_report(s));
                return false;
            }
            // Every thread that has not exited waits at the barrier: release it.
            int count = 0;
            for (Fiber& f : s.fibers) count += f.state == State::barrier && f.predicate;
            for (Fiber& f : s.fibers) {
                if (f.state == State::barrier) {
                    f.state = State::ready;
                    f.predicate = count;
                }
            }
            s.arrived = at_barrier;
            continue;
        }
        for (unsigned idx : s.order) {
            Fiber& f = s.fibers[idx];
            run_fiber(s, f);
            if (s.failed) return false;
            if (f.state == State::warp && !try_complete(s, f)) return false;
            if (f.state == State::exited && !check_exit(s, f)) return false;
        }
    }
}

void abandon_stacks(Sched& s) {
    for (unsigned i = 0; i < s.nthreads && i < s.stacks.size(); ++i) s.stacks[i]->dirty = true;
}

}  // namespace

// ---- the API kernels call (simt.h) -----------------------------------------------------------------

void fail(const char* fmt, ...) {
    Sched& s = sched();
    Fiber& f = current_fiber("fail");
    va_list ap;
    va_start(ap, fmt);
    std::string msg = vformat(fmt, ap);
    va_end(ap);
    set_error(s, block_name() + " " + thread_name(f) + ": " + msg);
    to_scheduler(s, f, true);
    __builtin_trap();  // a failed fiber is never resumed
}

void* block_shared(const void* site, size_t bytes) {
    Sched& s = sched();
    for (const SharedArray& a : s.shared_arrays) {
        if (a.site == site) return a.bytes.get();
    }
    if (s.shared_bytes + bytes > kMaxStaticShared) {
        fail("MW_SHARED arrays of %zu bytes in all exceed the %zu bytes of static shared memory",
             s.shared_bytes + bytes, kMaxStaticShared);
    }
    SharedArray a{site, std::unique_ptr<unsigned char[], FreeAligned>(static_cast<unsigned char*>(
                            ::operator new[](std::max<size_t>(bytes, 1), std::align_val_t(16))))};
    memset(a.bytes.get(), 0xff, bytes);
    s.shared_bytes += bytes;
    s.shared_arrays.push_back(std::move(a));
    return s.shared_arrays.back().bytes.get();
}

int barrier(int predicate) {
    Sched& s = sched();
    Fiber& f = current_fiber("__syncthreads");
    f.state = State::barrier;
    f.predicate = predicate;
    to_scheduler(s, f, false);
    return f.predicate;
}

int barrier_arrived() { return int(sched().arrived); }

void yield() {
    Sched& s = sched();
    Fiber& f = current_fiber("__nanosleep");
    to_scheduler(s, f, false);
}

lanemask activemask() {
    Sched& s = sched();
    Fiber& f = current_fiber("__activemask");
    const unsigned warp = f.linear / unsigned(kWarp), first = warp * unsigned(kWarp);
    lanemask m = 0;
    const unsigned end = std::min(first + unsigned(kWarp), s.nthreads);
    for (unsigned i = first; i < end; ++i) {
        if (s.fibers[i].state != State::exited) m |= lane_bit(i - first);
    }
    return m;
}

void warp_collective(const char* what, Resolver resolve, lanemask mask, void* slot) {
    Sched& s = sched();
    Fiber& f = current_fiber(what);
    f.state = State::warp;
    f.what = what;
    f.resolve = resolve;
    f.mask = mask;
    f.slot = slot;
    to_scheduler(s, f, false);
}

Registrar::Registrar(const char* name, size_t params_size, unsigned max_threads, void (*fn)(const void*)) {
    kernels().push_back(Kernel{name, params_size, max_threads, fn});
}

LayoutRegistrar::LayoutRegistrar(const char* strct, size_t struct_size, const FieldInfo* f, size_t count) {
    for (size_t i = 0; i < count; ++i) fields().push_back(Field{strct, f[i].name, f[i].offset, f[i].size, struct_size});
}

namespace {

// ---- the launch ------------------------------------------------------------------------------------

constexpr uint32_t kMaxThreads = 1024;
constexpr uint32_t kMaxDynamicShared = 227 * 1024;

std::string check_launch(const Kernel& k, const uint32_t grid[3], const uint32_t block[3], uint32_t dynamic_bytes,
                         size_t params_size) {
    if (params_size != k.params_size) {
        return strf("params of %zu bytes, the kernel's params struct has %zu", params_size, k.params_size);
    }
    const uint32_t grid_max[3] = {0x7fffffffu, 65535u, 65535u}, block_max[3] = {1024u, 1024u, 64u};
    for (int i = 0; i < 3; ++i) {
        if (grid[i] == 0 || grid[i] > grid_max[i] || block[i] == 0 || block[i] > block_max[i]) {
            return strf("launch grid (%u,%u,%u) block (%u,%u,%u) outside the limits grid (1..%u,1..%u,1..%u) "
                          "block (1..%u,1..%u,1..%u)",
                          grid[0], grid[1], grid[2], block[0], block[1], block[2], grid_max[0], grid_max[1],
                          grid_max[2], block_max[0], block_max[1], block_max[2]);
        }
    }
    const uint64_t threads = uint64_t(block[0]) * block[1] * block[2];
    if (threads > kMaxThreads) return strf("block of %llu threads exceeds %u", (unsigned long long)threads, kMaxThreads);
    if (k.max_threads && threads > k.max_threads) {
        return strf("block of %llu threads exceeds the kernel's launch bounds (%u)", (unsigned long long)threads,
                      k.max_threads);
    }
    if (dynamic_bytes > kMaxDynamicShared) {
        return strf("%u bytes of dynamic shared memory exceed %u", dynamic_bytes, kMaxDynamicShared);
    }
    return {};
}

std::string launch(const Kernel& k, const uint32_t grid[3], const uint32_t block[3], uint32_t dynamic_bytes,
                   const void* params, uint64_t schedule) {
    Sched& s = sched();
    s.kernel = &k;
    s.params = params;
    s.nthreads = block[0] * block[1] * block[2];
    s.schedule = schedule;
    s.rng = schedule;
    s.dynamic_bytes = dynamic_bytes;
    s.failed = false;
    s.error.clear();
    while (s.stacks.size() < s.nthreads) {
        auto st = std::make_unique<Stack>();
        st->color = (s.stacks.size() * 17 % 64) * 64 + s.stacks.size() % 8 * 4096;
        if (!st->allocate()) return strf("cannot map a %zu-byte fiber stack", kStackBytes);
        s.stacks.push_back(std::move(st));
    }
    s.fibers.resize(s.nthreads);
    // Exactly the launch's bytes (at least one), so AddressSanitizer sees a read past the end.
    std::unique_ptr<unsigned char[], FreeAligned> dynamic(
        static_cast<unsigned char*>(::operator new[](std::max<size_t>(dynamic_bytes, 1), std::align_val_t(16))));
    tl_view.block_dim = dim3(block[0], block[1], block[2]);
    tl_view.grid_dim = dim3(grid[0], grid[1], grid[2]);
    tl_view.dynamic_shared = dynamic.get();
    tl_view.dynamic_shared_bytes = dynamic_bytes;

    // Blocks in order (forward), in reverse order, or rotated by the seed (random).
    const uint64_t nblocks = uint64_t(grid[0]) * grid[1] * grid[2];
    const uint64_t start = schedule >= 2 ? splitmix64(s.rng) % nblocks : 0;
    for (uint64_t i = 0; i < nblocks; ++i) {
        const uint64_t b = schedule == 1 ? nblocks - 1 - i : (start + i) % nblocks;
        tl_view.block_idx = uint3{unsigned(b % grid[0]), unsigned(b / grid[0] % grid[1]),
                                  unsigned(b / (uint64_t(grid[0]) * grid[1]))};
        if (!run_block(s)) {
            abandon_stacks(s);
            return s.error;
        }
    }
    return {};
}

void write_error(char* err, size_t cap, const std::string& msg) {
    if (err && cap) snprintf(err, cap, "%s", msg.c_str());
}

}  // namespace
}  // namespace MW_SIMT_NS
}  // namespace mw_simt

// ---- the C ABI (runtime/src/gpu/emu.rs SimtImage) ----------------------------------------------------

extern "C" int MW_SIMT_EXPORT(launch)(const char* name, size_t name_len, const uint32_t grid[3],
                                      const uint32_t block[3], uint32_t dynamic_shared_bytes, const void* params,
                                      size_t params_size, uint64_t schedule, char* err, size_t err_cap) {
    using namespace mw_simt;
    if (!name || !grid || !block || (params_size && !params)) {
        write_error(err, err_cap, "null argument to launch");
        return 1;
    }
    const std::string wanted(name, name_len);
    const Kernel* kernel = nullptr;
    for (const Kernel& k : kernels()) {
        if (wanted == k.name) {
            if (kernel) {
                write_error(err, err_cap, strf("kernel `%s` is registered twice", k.name));
                return 1;
            }
            kernel = &k;
        }
    }
    if (!kernel) {
        write_error(err, err_cap,
                    strf("unknown kernel `%s` (the %s image has %zu kernels)", wanted.c_str(),
                           MW_SIMT_STR(MW_SIMT_IMAGE), kernels().size()));
        return 1;
    }
    std::string msg = check_launch(*kernel, grid, block, dynamic_shared_bytes, params_size);
    if (msg.empty()) {
        Sched& s = sched();
        if (s.active) {
            msg = "launch from inside a kernel";
        } else {
            s.active = true;
            try {
                msg = launch(*kernel, grid, block, dynamic_shared_bytes, params, schedule);
            } catch (const std::bad_alloc&) {
                msg = "out of memory";
            }
            s.active = false;
        }
    }
    if (msg.empty()) return 0;
    write_error(err, err_cap, msg);
    return 1;
}

extern "C" uint32_t MW_SIMT_EXPORT(warp_size)(void) { return MW_WARP; }

extern "C" size_t MW_SIMT_EXPORT(kernel_count)(void) { return mw_simt::kernels().size(); }

extern "C" const char* MW_SIMT_EXPORT(kernel_name)(size_t i) {
    return i < mw_simt::kernels().size() ? mw_simt::kernels()[i].name : nullptr;
}

extern "C" size_t MW_SIMT_EXPORT(layout_count)(void) { return mw_simt::fields().size(); }

extern "C" int MW_SIMT_EXPORT(layout)(size_t i, const char** strct, const char** field, size_t* offset, size_t* size,
                                      size_t* struct_size) {
    if (i >= mw_simt::fields().size() || !strct || !field || !offset || !size || !struct_size) return 1;
    const auto& f = mw_simt::fields()[i];
    *strct = f.strct;
    *field = f.field;
    *offset = f.offset;
    *size = f.size;
    *struct_size = f.struct_size;
    return 0;
}

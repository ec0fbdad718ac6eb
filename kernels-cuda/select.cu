// select.cu: picking from rows of logits: argmax (greedy decoding), the Mixtral router's top-k,
// and seeded sampling with temperature, top-k and top-p.
//
// argmax_f32       out[r] = argmax_c logits[r][c]: lowest index among equals (-0 equals +0), NaN
//                  never wins, a row of only NaN gives 0
// router_topk_f32  ids[r][0..k), weights[r][0..k): the k most probable experts under
//                  p = softmax(logits[r]) (probability descending, then index ascending),
//                  weights p / sum of the chosen p; NaN and -inf logits have p = 0, +inf logits
//                  share p equally, a row with nothing above -inf picks experts 0..k-1 at 1/k
// sample_f32       temperature 0: argmax. Else p = softmax(logits[r] / T) in f64 (special values
//                  as the router); candidates p > 0 in rank order (probability descending, then
//                  index ascending); the first top_k (0: all); then the shortest prefix whose
//                  renormalised cumulative probability reaches top_p (at least one); out[r] = the
//                  first candidate whose cumulative probability exceeds u = sample_uniform(seeds[r],
//                  steps[r], 0) (the counter-based uniform of runtime/src/ops.rs, bit for bit)
//                  logits f32 [rows, cols], ids / out u32, weights f32
//
// These are the definitions of runtime/src/cpu/reference/select.rs.
//
// Launch (runtime/src/gpu/ops/select.rs): argmax and sample take one block of SELECT_THREADS per
// row (grid-stride over rows); router_topk one thread per row (rows of a few experts).
// - argmax: each thread keeps the best 64-bit key of its strided elements, key = (an order-
//   preserving u32 of the value) << 32 | (~index), so larger keys rank first and ties go to the
//   lower index; a warp and block max of the keys.
// - router_topk: per row, in f64: max, exp, sum, then k selections, each the best candidate
//   ranked strictly after the previous pick (no mask needed), then the renormalisation, summing
//   the chosen in rank order like the reference.
// - sample: no sort. Candidates rank by the key of the logit (the softmax is monotone, so this is
//   the probability order; it differs from ranking the f64 probabilities only where distinct
//   logits round to the same probability, far below any cut that matters). Masses are fixed-point
//   u64 (p * 2^62, rounded), so every sum is exact and order-free: deterministic. Three radix
//   searches over the 64-bit keys (8 passes of 8 bits; each pass a 256-bin histogram of counts or
//   masses in shared memory, then one thread walks the bins from the top) find the top_k-th
//   candidate, the element where the cumulative mass reaches top_p of the kept mass, and the
//   element where it exceeds u of the final mass. Each pass re-reads the row (L2-resident: 513 KB
//   for a 128256 vocabulary) and recomputes exp; 24 passes plus three reductions per row.
//
// Accuracy: argmax and router ids are exact. Router weights: f64 softmax, one rounding to f32.
// Sample: the masses carry at most n * 2^-63 absolute error (n = cols) against the f64
// probabilities, so a draw differs from the reference's only when u (or top_p) lies within about
// that distance (plus the reference's own f64 rounding) of a cumulative boundary.
//
// Tests: tests/gpu_select.rs against cpu::Reference.
#include "common.cuh"
#include "params/select.h"

namespace mw_select {

constexpr int SELECT_THREADS = 256;
constexpr int SELECT_WARPS = SELECT_THREADS / MW_WARP;
constexpr int RADIX_BINS = 256;
// Fixed-point scale of the sampling masses: 2^62.
constexpr double MASS_ONE = 4611686018427387904.0;

// +infinity as f64 (NVRTC has no mw_select::inf64() macro).
MW_DEV double inf64() { return double(__uint_as_float(0x7f800000u)); }

// An order-preserving u32 of a float (larger float, larger code); -0 is taken as +0.
MW_DEV uint32_t order_bits(float v) {
    if (v == 0.0f) v = 0.0f;
    const uint32_t u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// The rank key of element i with value v: larger keys rank first; never 0 for a real element.
MW_DEV uint64_t rank_key(float v, uint64_t i) {
    return (uint64_t(order_bits(v)) << 32) | uint64_t(0xffffffffu - uint32_t(i));
}
MW_DEV uint32_t key_index(uint64_t key) { return 0xffffffffu - uint32_t(key & 0xffffffffu); }

MW_DEV uint64_t shfl_xor_u64(uint64_t v, int o) {
    const uint32_t lo = __shfl_xor_sync(MW_FULL_MASK, uint32_t(v), o);
    const uint32_t hi = __shfl_xor_sync(MW_FULL_MASK, uint32_t(v >> 32), o);
    return (uint64_t(hi) << 32) | lo;
}

// Block-wide reductions over SELECT_THREADS threads, returned to every thread; each holds two
// barriers, so every thread of the block must call it.
MW_DEV uint64_t shfl_xor(uint64_t v, int o) { return shfl_xor_u64(v, o); }
MW_DEV double shfl_xor(double v, int o) { return __shfl_xor_sync(MW_FULL_MASK, v, o); }

template <typename T, typename Op>
MW_DEV T block_reduce(T v, Op op, T* scratch_smem) {
    const int lane = threadIdx.x % MW_WARP, warp = threadIdx.x / MW_WARP;
#pragma unroll
    for (int o = MW_WARP / 2; o > 0; o /= 2) v = op(v, shfl_xor(v, o));
    if (lane == 0) scratch_smem[warp] = v;
    __syncthreads();
    T total = scratch_smem[0];
    for (int w = 1; w < SELECT_WARPS; ++w) total = op(total, scratch_smem[w]);
    __syncthreads();  // scratch_smem is reused by the next reduction
    return total;
}

struct MaxU64 {
    MW_DEV uint64_t operator()(uint64_t a, uint64_t b) const { return a > b ? a : b; }
};
struct SumU64 {
    MW_DEV uint64_t operator()(uint64_t a, uint64_t b) const { return a + b; }
};
struct SumF64 {
    MW_DEV double operator()(double a, double b) const { return a + b; }
};
// The larger of two values, NaN losing to anything.
struct MaxF64 {
    MW_DEV double operator()(double a, double b) const { return (a != a || b > a) ? b : a; }
};

struct Shared {
    uint64_t u64[SELECT_WARPS];
    double f64[SELECT_WARPS];
    uint64_t bins[RADIX_BINS];
    uint64_t pick[2];  // the prefix found so far and the metric above it
};

// argmax of one row, every thread of the block calling.
MW_DEV uint32_t row_argmax(const float* row, uint64_t cols, Shared& s) {
    uint64_t best = 0;
    for (uint64_t c = threadIdx.x; c < cols; c += SELECT_THREADS) {
        const float v = row[c];
        if (v == v) best = MaxU64{}(best, rank_key(v, c));
    }
    best = block_reduce(best, MaxU64{}, s.u64);
    return best == 0 ? 0u : key_index(best);
}

// The splitmix64 finaliser and sample_uniform of runtime/src/ops.rs.
MW_DEV uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
MW_DEV double sample_uniform(uint64_t seed, uint64_t step, uint64_t row) {
    const uint64_t golden = 0x9e3779b97f4a7c15ull;
    const uint64_t h = mix(mix(mix(seed + golden) ^ (step + golden)) ^ (row + golden));
    return double(h >> 11) * (1.0 / 9007199254740992.0 /* 2^53 */);
}

// The softmax weights of one sampling row: w(c) = exp(z_c - zmax), z = logit / T, or for a row
// with +inf logits, 1 for those and 0 for the rest; NaN and -inf weigh 0.
struct Weights {
    const float* row;
    double t;  // the temperature
    double zmax;
    double total;
    bool inf_row;
    MW_DEV double w(uint64_t c) const {
        const double z = double(row[c]) / t;
        if (z != z) return 0.0;
        if (inf_row) return z == zmax ? 1.0 : 0.0;
        return exp(z - zmax);
    }
    MW_DEV uint64_t mass(uint64_t c) const { return uint64_t(w(c) / total * MASS_ONE + 0.5); }
};

// The largest key t among candidates (w > 0) with key >= floor such that the metric (COUNT: 1 per
// candidate, else the mass) summed over those with key >= t reaches `target` (>= 1): the element
// at which the cumulative metric, in rank order, first reaches target.
template <bool COUNT>
MW_DEV uint64_t radix_search(const Weights& wt, uint64_t cols, uint64_t floor, uint64_t target, Shared& s) {
    uint64_t prefix = 0, above = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < RADIX_BINS; b += SELECT_THREADS) s.bins[b] = 0;
        __syncthreads();
        for (uint64_t c = threadIdx.x; c < cols; c += SELECT_THREADS) {
            const double w = wt.w(c);
            if (!(w > 0.0)) continue;
            const uint64_t key = rank_key(wt.row[c], c);
            if (key < floor) continue;
            if (shift < 56 && (key >> (shift + 8)) != prefix) continue;
            atomicAdd(reinterpret_cast<unsigned long long*>(&s.bins[(key >> shift) & 0xffu]),
                      (unsigned long long)(COUNT ? 1ull : wt.mass(c)));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = RADIX_BINS - 1;
            for (; d > 0; --d) {
                if (above + s.bins[d] >= target) break;
                above += s.bins[d];
            }
            s.pick[0] = (prefix << 8) | uint64_t(d);
            s.pick[1] = above;
        }
        __syncthreads();
        prefix = s.pick[0];
        above = s.pick[1];
        __syncthreads();  // s.pick is rewritten by the next pass
    }
    return prefix;
}

}  // namespace mw_select

MW_KERNEL_BOUNDS(argmax_f32, ArgmaxParams, mw_select::SELECT_THREADS) {
    __shared__ mw_select::Shared s;
    for (uint64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const uint32_t best = mw_select::row_argmax(p.logits + r * p.cols, p.cols, s);
        if (threadIdx.x == 0) p.out[r] = best;
    }
}

MW_KERNEL(router_topk_f32, RouterParams) {
    const uint64_t r = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (r >= p.rows) return;
    const float* row = p.logits + r * p.experts;
    uint32_t* ids = p.ids + r * p.k;
    float* weights = p.weights + r * p.k;
    double zmax = -mw_select::inf64();
    for (uint64_t e = 0; e < p.experts; ++e) {
        const double z = row[e];
        if (z == z && z > zmax) zmax = z;
    }
    if (zmax == -mw_select::inf64()) {
        for (uint64_t c = 0; c < p.k; ++c) {
            ids[c] = uint32_t(c);
            weights[c] = float(1.0 / double(p.k));
        }
        return;
    }
    // The weight of expert e (exp(z - zmax), or the share of a +inf logit); NaN weighs 0.
    auto weight = [&](uint64_t e) {
        const double z = row[e];
        if (z != z) return 0.0;
        if (zmax == mw_select::inf64()) return z == mw_select::inf64() ? 1.0 : 0.0;
        return exp(z - zmax);
    };
    double total = 0.0;
    for (uint64_t e = 0; e < p.experts; ++e) total += weight(e);
    // Pick c: the best expert ranked strictly after pick c - 1 (probability descending, index
    // ascending); the chosen probabilities are written first, renormalised after.
    double prev_p = mw_select::inf64(), chosen = 0.0;
    uint64_t prev_i = 0;
    for (uint64_t c = 0; c < p.k; ++c) {
        double best_p = -1.0;
        uint64_t best_i = 0;
        for (uint64_t e = 0; e < p.experts; ++e) {
            const double pe = weight(e) / total;
            const bool after = c == 0 || pe < prev_p || (pe == prev_p && e > prev_i);
            if (after && pe > best_p) {
                best_p = pe;
                best_i = e;
            }
        }
        ids[c] = uint32_t(best_i);
        weights[c] = float(best_p);
        chosen += best_p;
        prev_p = best_p;
        prev_i = best_i;
    }
    for (uint64_t c = 0; c < p.k; ++c) weights[c] = float(double(weight(ids[c]) / total) / chosen);
}

MW_KERNEL_BOUNDS(sample_f32, SampleParams, mw_select::SELECT_THREADS) {
    using namespace mw_select;
    __shared__ Shared s;
    for (uint64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const float* row = p.logits + r * p.cols;
        uint32_t token = 0;
        bool greedy = p.temperature == 0.0f;
        Weights wt{row, double(p.temperature), 0.0, 1.0, false};
        if (!greedy) {
            double zmax = -mw_select::inf64();
            for (uint64_t c = threadIdx.x; c < p.cols; c += SELECT_THREADS) zmax = MaxF64{}(zmax, double(row[c]) / wt.t);
            zmax = block_reduce(zmax, MaxF64{}, s.f64);
            greedy = !(zmax > -mw_select::inf64());
            wt.zmax = zmax;
            wt.inf_row = zmax == mw_select::inf64();
        }
        if (greedy) {
            token = row_argmax(row, p.cols, s);
        } else {
            double total = 0.0;
            uint64_t count = 0;
            for (uint64_t c = threadIdx.x; c < p.cols; c += SELECT_THREADS) {
                const double w = wt.w(c);
                total += w;
                count += w > 0.0 ? 1 : 0;
            }
            wt.total = block_reduce(total, SumF64{}, s.f64);
            count = block_reduce(count, SumU64{}, s.u64);
            uint64_t floor = 0;
            if (p.top_k > 0 && p.top_k < count) floor = radix_search<true>(wt, p.cols, 0, p.top_k, s);
            // The mass of the candidates kept so far.
            auto kept_mass = [&](uint64_t fl) {
                uint64_t m = 0;
                for (uint64_t c = threadIdx.x; c < p.cols; c += SELECT_THREADS) {
                    if (wt.w(c) > 0.0 && rank_key(row[c], c) >= fl) m += wt.mass(c);
                }
                return block_reduce(m, SumU64{}, s.u64);
            };
            if (p.top_p < 1.0f) {
                const uint64_t mass = kept_mass(floor);
                double want = double(p.top_p) * double(mass);
                uint64_t target = uint64_t(want);
                if (double(target) < want) ++target;
                if (target < 1) target = 1;
                if (target > mass) target = mass;
                if (target > 0) floor = radix_search<false>(wt, p.cols, floor, target, s);
            }
            const uint64_t mass = kept_mass(floor);
            const double u = sample_uniform(p.seeds[r], p.steps[r], 0);
            uint64_t target = uint64_t(u * double(mass)) + 1;
            if (target > mass) target = mass;
            if (target > 0) {
                token = key_index(radix_search<false>(wt, p.cols, floor, target, s));
            } else {
                token = row_argmax(row, p.cols, s);
            }
        }
        if (threadIdx.x == 0) p.out[r] = token;
        __syncthreads();  // s is reused by the next row
    }
}

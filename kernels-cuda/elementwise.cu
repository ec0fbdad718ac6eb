// elementwise.cu: the small per-element and per-row ops of the Llama and Mixtral graphs.
//
// add_assign_f32        x[i] += y[i], i < n (the residual connection; x, y f32, any n >= 1)
// silu_mul_f32          out[i] = silu(gate[i]) * up[i] = gate / (1 + exp(-gate)) * up (f32)
// rms_norm_f32_<w>      y[r][c] = x[r][c] / sqrt(mean_c(x[r][c]^2) + eps) * weight[c]
// rms_norm_f32_<w>_warp the same, one warp per row (small rows)
//                       x, y f32 [rows, cols]; weight [cols] of dtype <w>: f32, f16, bf16, e4m3fn,
//                       e4m3fnuz, e5m2, e5m2fnuz
// rope_f32              x [rows, heads, head_dim] f32 rotated in place (Hugging Face pairing of
//                       i with i + head_dim / 2): with a = positions[r] * inv_freq[i],
//                       x[i]' = x[i] cos a - x[i + h] sin a, x[i + h]' = x[i + h] cos a + x[i] sin a
//                       (h = head_dim / 2 <= MW_ROPE_MAX_HALF); positions u32 [rows]
//
// Layout: dense row-major. The element ops see [rows, cols] as n = rows * cols elements.
//
// Launch (runtime/src/gpu/ops/elementwise.rs sizes every grid; every kernel grid-strides, so any
// grid is correct):
// - add_assign, silu_mul: 1-D grid-stride over float4 groups when every pointer is 16-byte aligned
//   (then a scalar tail), else over elements.
// - rms_norm: one block of NORM_THREADS per row, or (the _warp variant, for rows of at most
//   NORM_WARP_MAX_COLS) one warp per row, NORM_ROWS_PER_BLOCK warps per block. Two passes over the
//   row: the sum of squares in f32 (a block_sum / warp_sum), then the scaled row; the second pass
//   hits L1/L2. float4 loads of x and y (and 4-element loads of the weight) when cols % 4 == 0 and
//   the pointers are aligned, else scalar.
// - rope: block (x: the h pairs rounded up to a warp, y: rows); block b.y takes a chunk of
//   heads. Each thread computes the sine and cosine of its pair's angle once per row and applies
//   them to every head of its chunk.
//
// Accuracy: rms_norm finishes each row's mean in f64 (one reciprocal square root per row).
// rope takes inv_freq in f64 from the host (`Rope::inv_freq`), forms the angle pos * inv_freq in
// f64 exactly as the reference does, reduces it modulo pi/2 in f64 (a two-term Cody-Waite split,
// good for every u32 position) and evaluates sine and cosine as f64 polynomials, so positions of
// 128K and beyond lose nothing to the angle; the rotation itself is f32. silu_mul uses expf (not
// the fast __expf).
//
// Tests: tests/gpu_elementwise.rs against cpu::Reference (emulated in CI; on a GPU with
// `cargo test --features cuda -- --ignored`), tolerances derived there.
#include "common.cuh"
#include "params/elementwise.h"

namespace mw_elem {

// N elements of T loaded or stored as one access of N * sizeof(T) bytes (16 at most).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T e[N];
};

MW_DEV bool aligned_to(const void* ptr, unsigned long long bytes) {
    return (reinterpret_cast<unsigned long long>(ptr) & (bytes - 1)) == 0;
}

// Elements 4g .. 4g + 3 of w widened to f32, read as one access of 4 * sizeof(W) bytes (w aligned
// to that). The raw bits move as one integer and are split with shifts: a struct of four bytes
// would go through local memory on some targets.
template <typename W>
MW_DEV void load4(const W* w, uint64_t g, float (&out)[4]) {
    if constexpr (sizeof(W) == 4) {
        const Vec<float, 4> v = reinterpret_cast<const Vec<float, 4>*>(w)[g];
#pragma unroll
        for (int k = 0; k < 4; ++k) out[k] = mw::to_f32(v.e[k]);
    } else if constexpr (sizeof(W) == 2) {
        const unsigned long long bits = reinterpret_cast<const unsigned long long*>(w)[g];
#pragma unroll
        for (int k = 0; k < 4; ++k) out[k] = mw::to_f32(W{uint16_t(bits >> (16 * k))});
    } else {
        static_assert(sizeof(W) == 1, "f32, 16-bit or fp8 elements");
        mw::to_f32x4<W>(reinterpret_cast<const uint32_t*>(w)[g], out);
    }
}

constexpr int ELEMENT_VEC = 4;

// ---- add_assign, silu_mul ----------------------------------------------------------------------

}  // namespace mw_elem

MW_KERNEL(add_assign_f32, AddAssignParams) {
    using namespace mw_elem;
    const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
    const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const bool vec = aligned_to(p.x, 16) && aligned_to(p.y, 16);
    const uint64_t n4 = vec ? p.n / ELEMENT_VEC : 0;
    Vec<float, ELEMENT_VEC>* x4 = reinterpret_cast<Vec<float, ELEMENT_VEC>*>(p.x);
    const Vec<float, ELEMENT_VEC>* y4 = reinterpret_cast<const Vec<float, ELEMENT_VEC>*>(p.y);
    for (uint64_t i = first; i < n4; i += stride) {
        Vec<float, ELEMENT_VEC> a = x4[i];
        const Vec<float, ELEMENT_VEC> b = y4[i];
#pragma unroll
        for (int k = 0; k < ELEMENT_VEC; ++k) a.e[k] += b.e[k];
        x4[i] = a;
    }
    for (uint64_t i = n4 * ELEMENT_VEC + first; i < p.n; i += stride) p.x[i] += p.y[i];
}

MW_KERNEL(silu_mul_f32, SiluMulParams) {
    using namespace mw_elem;
    const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
    const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const bool vec = aligned_to(p.out, 16) && aligned_to(p.gate, 16) && aligned_to(p.up, 16);
    const uint64_t n4 = vec ? p.n / ELEMENT_VEC : 0;
    Vec<float, ELEMENT_VEC>* out4 = reinterpret_cast<Vec<float, ELEMENT_VEC>*>(p.out);
    const Vec<float, ELEMENT_VEC>* gate4 = reinterpret_cast<const Vec<float, ELEMENT_VEC>*>(p.gate);
    const Vec<float, ELEMENT_VEC>* up4 = reinterpret_cast<const Vec<float, ELEMENT_VEC>*>(p.up);
    for (uint64_t i = first; i < n4; i += stride) {
        const Vec<float, ELEMENT_VEC> g = gate4[i], u = up4[i];
        Vec<float, ELEMENT_VEC> o;
#pragma unroll
        for (int k = 0; k < ELEMENT_VEC; ++k) o.e[k] = mw::silu_times(g.e[k], u.e[k]);
        out4[i] = o;
    }
    for (uint64_t i = n4 * ELEMENT_VEC + first; i < p.n; i += stride) p.out[i] = mw::silu_times(p.gate[i], p.up[i]);
}

// ---- rms_norm ----------------------------------------------------------------------------------

namespace mw_elem {

// Threads of the one-block-per-row variant.
constexpr int NORM_THREADS = 256;
// Rows (warps) per block of the warp-per-row variant.
constexpr int NORM_ROWS_PER_BLOCK = 4;
constexpr int NORM_WARP_THREADS = NORM_ROWS_PER_BLOCK * MW_WARP;

// Whether a row can move as float4 (and the weight as 4-element groups).
template <typename W>
MW_DEV bool norm_vectorised(const RmsNormParams& p) {
    return p.cols % 4 == 0 && aligned_to(p.x, 16) && aligned_to(p.y, 16) && aligned_to(p.weight, 4 * sizeof(W));
}

// This thread's share of sum(x[c]^2): columns first, first + step, ... (in groups of 4 if VEC4).
template <bool VEC4>
MW_DEV float sum_squares(const float* x_row, uint64_t cols, uint32_t first, uint32_t step) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (VEC4) {
        const Vec<float, 4>* x4 = reinterpret_cast<const Vec<float, 4>*>(x_row);
        for (uint64_t c = first; c < cols / 4; c += step) {
            const Vec<float, 4> v = x4[c];
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[k] += v.e[k] * v.e[k];
        }
    } else {
        for (uint64_t c = first; c < cols; c += step) acc[0] += x_row[c] * x_row[c];
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// 1 / sqrt(sum_sq / cols + eps), finished in f64 and rounded once to f32.
MW_DEV float inv_rms(float sum_sq, uint64_t cols, float eps) {
    return float(1.0 / sqrt(double(sum_sq) / double(cols) + double(eps)));
}

// y[c] = x[c] * inv * weight[c] for this thread's columns.
template <typename W, bool VEC4>
MW_DEV void scale_row(float* y_row, const float* x_row, const W* w, uint64_t cols, float inv, uint32_t first,
                      uint32_t step) {
    if (VEC4) {
        const Vec<float, 4>* x4 = reinterpret_cast<const Vec<float, 4>*>(x_row);
        Vec<float, 4>* y4 = reinterpret_cast<Vec<float, 4>*>(y_row);
        for (uint64_t c = first; c < cols / 4; c += step) {
            const Vec<float, 4> xv = x4[c];
            float wv[4];
            load4(w, c, wv);
            Vec<float, 4> out;
#pragma unroll
            for (int k = 0; k < 4; ++k) out.e[k] = xv.e[k] * inv * wv[k];
            y4[c] = out;
        }
    } else {
        for (uint64_t c = first; c < cols; c += step) y_row[c] = x_row[c] * inv * mw::to_f32(w[c]);
    }
}

// One block of NORM_THREADS per row.
template <typename W, bool VEC4>
MW_DEV void rms_norm_block(const RmsNormParams& p) {
    const W* w = static_cast<const W*>(p.weight);
    for (uint64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const float* x_row = p.x + r * p.cols;
        const float ss = mw::block_sum<NORM_THREADS>(sum_squares<VEC4>(x_row, p.cols, threadIdx.x, NORM_THREADS));
        scale_row<W, VEC4>(p.y + r * p.cols, x_row, w, p.cols, inv_rms(ss, p.cols, p.eps), threadIdx.x,
                           NORM_THREADS);
    }
}

// One warp per row, blockDim.x / MW_WARP rows per block.
template <typename W, bool VEC4>
MW_DEV void rms_norm_warp(const RmsNormParams& p) {
    const W* w = static_cast<const W*>(p.weight);
    const uint32_t lane = threadIdx.x % MW_WARP;
    const uint64_t rows_per_block = blockDim.x / MW_WARP;
    // The row loop is uniform over a warp, so every lane reaches each warp_sum.
    for (uint64_t r = uint64_t(blockIdx.x) * rows_per_block + threadIdx.x / MW_WARP; r < p.rows;
         r += uint64_t(gridDim.x) * rows_per_block) {
        const float* x_row = p.x + r * p.cols;
        const float ss = mw::warp_sum(sum_squares<VEC4>(x_row, p.cols, lane, MW_WARP));
        scale_row<W, VEC4>(p.y + r * p.cols, x_row, w, p.cols, inv_rms(ss, p.cols, p.eps), lane, MW_WARP);
    }
}

}  // namespace mw_elem

#define MW_RMS_NORM(wname, W)                                                                              \
    MW_KERNEL_BOUNDS(rms_norm_f32_##wname, RmsNormParams, mw_elem::NORM_THREADS) {                          \
        if (mw_elem::norm_vectorised<W>(p)) {                                                              \
            mw_elem::rms_norm_block<W, true>(p);                                                           \
        } else {                                                                                           \
            mw_elem::rms_norm_block<W, false>(p);                                                          \
        }                                                                                                  \
    }                                                                                                      \
    MW_KERNEL_BOUNDS(rms_norm_f32_##wname##_warp, RmsNormParams, mw_elem::NORM_WARP_THREADS) {              \
        if (mw_elem::norm_vectorised<W>(p)) {                                                              \
            mw_elem::rms_norm_warp<W, true>(p);                                                            \
        } else {                                                                                           \
            mw_elem::rms_norm_warp<W, false>(p);                                                           \
        }                                                                                                  \
    }

MW_RMS_NORM(f32, float)
MW_RMS_NORM(f16, f16)
MW_RMS_NORM(bf16, bf16)
MW_RMS_NORM(e4m3fn, e4m3fn)
MW_RMS_NORM(e4m3fnuz, e4m3fnuz)
MW_RMS_NORM(e5m2, e5m2)
MW_RMS_NORM(e5m2fnuz, e5m2fnuz)

#undef MW_RMS_NORM

// ---- rope --------------------------------------------------------------------------------------

namespace mw_elem {

// The most threads of a rope block: the pairs of a head (<= MW_ROPE_MAX_HALF, rounded up to a warp)
// times the rows a block takes.
constexpr int ROPE_THREADS = 256;
static_assert(MW_ROPE_MAX_HALF <= ROPE_THREADS, "one thread per pair of the longest head");

// sin and cos of a >= 0, rounded to f32. a = k pi/2 + r with k = rint(a 2/pi) and r in about
// [-pi/4, pi/4]: r = (a - k PIO2_HI) - k PIO2_LO, each step one fma (the product exact inside it),
// where PIO2_HI + PIO2_LO is pi/2 to about 2^-107; for k < 2^32 (any u32 position times an
// inverse frequency <= 1) r is within a few 2^-53 of the true remainder. sin r and cos r are their
// Taylor series to r^15 and r^16: the first omitted terms, (pi/4)^17 / 17! ~ 5e-17 and
// (pi/4)^18 / 18! ~ 2e-18, sit below half an f64 ulp of the results.
MW_DEV void sin_cos(double a, float* sin_out, float* cos_out) {
    const double TWO_OVER_PI = 0.63661977236758134308;
    const double PIO2_HI = 1.5707963267948966192;     // pi/2 rounded to f64
    const double PIO2_LO = 6.1232339957367658e-17;    // pi/2 - PIO2_HI
    const double k = rint(a * TWO_OVER_PI);
    const double r = fma(-k, PIO2_LO, fma(-k, PIO2_HI, a));
    const double r2 = r * r;
    // Horner in r^2 with the 1/n! coefficients.
    double s = 1.0 / 1307674368000.0;  // 1/15!
    s = fma(s, -r2, 1.0 / 6227020800.0);  // 1/13!
    s = fma(s, -r2, 1.0 / 39916800.0);    // 1/11!
    s = fma(s, -r2, 1.0 / 362880.0);      // 1/9!
    s = fma(s, -r2, 1.0 / 5040.0);        // 1/7!
    s = fma(s, -r2, 1.0 / 120.0);         // 1/5!
    s = fma(s, -r2, 1.0 / 6.0);           // 1/3!
    s = fma(s, -r2, 1.0);                 // sin r / r
    const double sin_r = r * s;
    double c = 1.0 / 20922789888000.0;    // 1/16!
    c = fma(c, -r2, 1.0 / 87178291200.0); // 1/14!
    c = fma(c, -r2, 1.0 / 479001600.0);   // 1/12!
    c = fma(c, -r2, 1.0 / 3628800.0);     // 1/10!
    c = fma(c, -r2, 1.0 / 40320.0);       // 1/8!
    c = fma(c, -r2, 1.0 / 720.0);         // 1/6!
    c = fma(c, -r2, 1.0 / 24.0);          // 1/4!
    c = fma(c, -r2, 1.0 / 2.0);           // 1/2!
    const double cos_r = fma(c, -r2, 1.0);
    // Quadrant: sin(k pi/2 + r), cos(k pi/2 + r).
    const unsigned long long quadrant = (unsigned long long)k & 3u;
    double sn, cs;
    if (quadrant == 0) {
        sn = sin_r;
        cs = cos_r;
    } else if (quadrant == 1) {
        sn = cos_r;
        cs = -sin_r;
    } else if (quadrant == 2) {
        sn = -sin_r;
        cs = -cos_r;
    } else {
        sn = -cos_r;
        cs = sin_r;
    }
    *sin_out = float(sn);
    *cos_out = float(cs);
}

}  // namespace mw_elem

MW_KERNEL_BOUNDS(rope_f32, RopeParams, mw_elem::ROPE_THREADS) {
    const uint32_t i = threadIdx.x;
    if (i >= p.half) return;  // no barriers below
    const double freq = p.inv_freq[i];
    const uint64_t head_dim = 2 * uint64_t(p.half);
    const uint64_t h0 = uint64_t(blockIdx.y) * p.heads_per_block;
    const uint64_t h_end = h0 + p.heads_per_block < p.heads ? h0 + p.heads_per_block : p.heads;
    for (uint64_t r = uint64_t(blockIdx.x) * blockDim.y + threadIdx.y; r < p.rows;
         r += uint64_t(gridDim.x) * blockDim.y) {
        float sn, cs;
        mw_elem::sin_cos(double(p.positions[r]) * freq, &sn, &cs);
        float* row = p.x + r * p.heads * head_dim;
        for (uint64_t h = h0; h < h_end; ++h) {
            float* head = row + h * head_dim;
            const float a = head[i], b = head[i + p.half];
            head[i] = a * cs - b * sn;
            head[i + p.half] = b * cs + a * sn;
        }
    }
}

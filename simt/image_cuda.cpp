// image_cuda.cpp: the kernels of kernels-cuda/ as one host image (the `emulate` feature).
//
// One translation unit: the SIMT runtime (warp 32, exported as memwall_simt_cuda_*) and every
// kernels-cuda/*.cu, listed by build/simt.rs in the generated simt_cuda_kernels.inc. One TU keeps
// every kernel's registrar in the object the linker pulls in for the C ABI, and lets the kernel
// sources sit in an anonymous namespace: their names (mw::warp_sum, templates, params structs)
// stay internal, so a HIP image built from sources with the same names links beside this one.
#define MW_SIMT_IMAGE cuda
#define MW_WARP 32
#include "simt.cpp"

namespace {
#include "simt_cuda_kernels.inc"
}  // namespace

// image_hip.cpp: the HIP build of the kernels as one host image (the `emulate` feature), exported
// as memwall_simt_hip_*: the kernel files build/hip.rs compiles for AMD (every kernels-cuda/*.cu
// but selftest*.cu and the files in its HIP_LEFT_OUT), listed by build/simt.rs in the generated
// simt_hip_kernels.inc, at warp 64 and through kernels-hip/hip.h (MEMWALL_SIMT_HIP), as on
// CDNA. So the wave64 logic of the kernels and the vendor header runs in CI.
#define MW_SIMT_IMAGE hip
#define MW_WARP 64
#define MEMWALL_SIMT_HIP 1
#include "simt.cpp"

namespace {
#include "simt_hip_kernels.inc"
}  // namespace

// image_selftest64.cpp: the SIMT layer at warp 64 (the width of AMD CDNA, which the HIP sources
// use) with kernels-cuda/selftest.cu and selftest_mfma.cu only, exported as
// memwall_simt_selftest64_*: the wave64 paths of the layer (64-bit lane masks, shuffles and
// ballots over 64 lanes) and mfma.cuh's emulated MFMA are tested by tests/simt.rs on their own.
#define MW_SIMT_IMAGE selftest64
#define MW_WARP 64
#include "simt.cpp"

namespace {
#include "../kernels-cuda/selftest.cu"
#include "../kernels-cuda/selftest_mfma.cu"
}  // namespace

// image_selftest64.cpp: the SIMT layer at warp 64 (the width of AMD CDNA, which the HIP sources
// will use) with kernels-cuda/selftest.cu only, exported as memwall_simt_selftest64_*: the
// wave64 paths of the layer (64-bit lane masks, shuffles and ballots over 64 lanes) are tested
// by tests/simt.rs before any HIP kernel exists.
#define MW_SIMT_IMAGE selftest64
#define MW_WARP 64
#include "simt.cpp"

namespace {
#include "../kernels-cuda/selftest.cu"
}  // namespace

// Internal pieces of the MXFP4 ops shared by their validation, GPU launchers
// and CPU references (spec §13).
#pragma once

#include <cstdint>

namespace flashmix {

constexpr int64_t kMxfp4GroupCols = 32;    // K elements per ue8m0 scale
constexpr int64_t kMxfp4Fp8BlockDim = 128;  // rows and columns of an FP8 weight block (spec §11.2)
// The largest shift of a group's top sub-block: 6 * 2^6 = 384 <= 448 (spec §13.2).
constexpr int kMxfp4Fp8TopShift = 6;
constexpr uint8_t kUe8m0NaN = 255;
// Shifts below this give e2m1 * 2^d < 2^-25, which e4m3 rounds to +-0 like
// any smaller shift: clamping there keeps 2^d a normal float.
constexpr int kMxfp4MinShift = -30;

}  // namespace flashmix
